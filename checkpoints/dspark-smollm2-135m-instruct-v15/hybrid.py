"""Hybrid drafting: a prompt-lookup n-gram proposal next to the DSpark block, and each round the one with the
larger expected accepted length per second is verified.

The n-gram proposal (:func:`ngram_continuation`) copies what followed an earlier occurrence of the text's last
n tokens, as Transformers' prompt lookup does. It is a point mass (``q = one-hot``), so the ordinary speculative
rule verifies it losslessly: accept with probability ``p(x)``, on rejection draw from ``p`` with ``x`` removed.

Pricing (:class:`HybridChooser`), on one scale with the verify-cost table of the cost truncation:
- n-gram, first ``l`` tokens: ``tau = 1 + sum_{j<=l} prod_{i<=j} g_m(i)``, where ``g_m(i)`` is the acceptance of
  slot i of proposals from an m-token match, measured on earlier rounds (:class:`SlotAcceptance`);
  ``Theta = tau / T_verify(1 + l)``;
- DSpark, ``D`` slots: ``tau = 1 + sum_{j<=D} s_j`` with ``s`` the moving average of the block's calibrated
  survival on earlier rounds (measured acceptance for drafters without a confidence head);
  ``Theta = tau / (T_draft(D) + T_verify(1 + D))``.
Two stages: before the drafter runs, :meth:`HybridChooser.skip_drafter` compares the two on earlier rounds (draft
cost included) and skips the drafter when the n-gram wins; otherwise, after drafting,
:meth:`HybridChooser.prefer_ngram` compares again with the block's survival re-anchored on this round's ``c_1``
(:func:`anchored_survival`; ``c_1`` reads only the anchor). Neither stage reads a token sampled in this round (the
n-gram continuation is a deterministic function of the context), so the output stays distributed as the target's:
a choice that read ``c_2``, which reads the sampled ``x_1``, would bias it as in Appendix A.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .stats import expected_acceptance_length

__all__ = [
    "check_lookup_settings", "HybridChooser", "NgramProposal", "Proposal", "SlotAcceptance", "anchored_survival", "ngram_continuation", "one_hot_logits",
]  # fmt: skip


def check_lookup_settings(num_tokens, max_ngram) -> tuple[int, int]:
    """``(prompt_lookup_num_tokens, max_matching_ngram_size)`` as ints, or a ValueError naming both."""
    if int(num_tokens) != num_tokens or num_tokens < 1 or int(max_ngram) != max_ngram or max_ngram < 1:
        raise ValueError(
            "prompt_lookup_num_tokens and max_matching_ngram_size must be positive integers (prompt_lookup_num_tokens >= 1, "
            f"max_matching_ngram_size >= 1), got {num_tokens} and {max_ngram}"
        )
    return int(num_tokens), int(max_ngram)


@dataclass
class NgramProposal:
    tokens: torch.LongTensor  # [n] proposed continuation (empty: no match)
    match_length: int  # length of the matched suffix n-gram (0: no match)


def ngram_continuation(
    ids: torch.LongTensor,  # [L] the text so far, the last token included
    max_ngram: int,
    num_tokens: int,
    eos_token_ids: torch.Tensor | None = None,
) -> NgramProposal:
    """Prompt lookup: for the longest suffix n-gram (n <= ``max_ngram``) that occurred earlier in ``ids``, the up to
    ``num_tokens`` tokens that followed it. Among the occurrences, the one with the longest continuation wins, the
    most recent on ties (recent text predicts better than the first occurrence). The proposal ends after an
    end-of-sequence token."""
    if ids.dim() != 1:
        raise ValueError(f"ngram_continuation takes one sequence [L], got shape {tuple(ids.shape)}")
    length = ids.shape[0]
    if num_tokens <= 0 or length < 2:
        return NgramProposal(ids.new_empty(0), 0)
    for n in range(min(max_ngram, length - 1), 0, -1):
        # windows that start at s = 0..L-1-n: each has at least one token after it, and none is the suffix itself
        windows = ids[: length - 1].unfold(0, n, 1)
        starts = (windows == ids[length - n :]).all(-1).nonzero()[:, 0]
        if starts.numel() == 0:
            continue
        available = (length - (starts + n)).clamp(max=num_tokens)
        best = int(starts[(available == available.max()).nonzero()[-1, 0]]) + n
        tokens = ids[best : best + num_tokens]
        if eos_token_ids is not None:
            is_eos = torch.isin(tokens, eos_token_ids.to(tokens.device))
            if bool(is_eos.any()):
                tokens = tokens[: int(is_eos.nonzero()[0, 0]) + 1]  # nothing after EOS can be accepted
        return NgramProposal(tokens, n)
    return NgramProposal(ids.new_empty(0), 0)


def one_hot_logits(tokens: torch.LongTensor, vocab_size: int) -> torch.Tensor:
    """``q`` of a point-mass proposal: [..., V] float32, 0 at the proposed token and -inf elsewhere."""
    q = torch.full((*tokens.shape, vocab_size), float("-inf"), dtype=torch.float32, device=tokens.device)
    return q.scatter_(-1, tokens[..., None], 0.0)


class SlotAcceptance:
    """Per-slot conditional acceptance of a kind of proposal (keyed by n-gram match length), measured on earlier
    rounds: ``(accepted + a) / (reached + a + b)`` with a Beta(a, b) prior, older rounds forgotten at rate
    ``1 - decay`` so the estimate follows the text (a code block copies more than the prose around it)."""

    def __init__(self, num_slots: int, prior: tuple[float, float] = (1.0, 1.0), decay: float = 0.98):
        if num_slots < 1 or min(prior) <= 0 or not 0 < decay <= 1:
            raise ValueError(f"bad SlotAcceptance settings: num_slots={num_slots}, prior={prior}, decay={decay}")
        self.num_slots, self.prior, self.decay = num_slots, prior, decay
        self.accepted: dict[int, list[float]] = {}
        self.reached: dict[int, list[float]] = {}

    def conditional(self, key: int) -> list[float]:
        a, b = self.prior
        acc, seen = self.accepted.get(key, [0.0] * self.num_slots), self.reached.get(key, [0.0] * self.num_slots)
        return [(x + a) / (n + a + b) for x, n in zip(acc, seen)]

    def survival(self, key: int, length: int) -> list[float]:
        out, alive = [], 1.0
        for g in self.conditional(key)[:length]:
            alive *= g
            out.append(alive)
        return out

    def record(self, key: int, verified: int, accepted: int) -> None:
        """One verified proposal: slots ``< accepted`` were accepted, slot ``accepted`` rejected (if verified)."""
        acc = self.accepted.setdefault(key, [0.0] * self.num_slots)
        seen = self.reached.setdefault(key, [0.0] * self.num_slots)
        for i in range(self.num_slots):
            acc[i] *= self.decay
            seen[i] *= self.decay
        for i in range(min(verified, accepted + 1, self.num_slots)):
            seen[i] += 1.0
            acc[i] += 1.0 if i < accepted else 0.0


@dataclass
class Proposal:
    kind: str  # "ngram" | "dspark" | "plain"
    length: int  # tokens to verify (n-gram) or slots to draft (DSpark)
    theta: float  # expected tokens per second of the round


class HybridChooser:
    """Chooses, before anything is sampled, which proposal a round verifies (one row of ``generate()``).

    ``scale(depth)`` multiplies the modelled time of a round that drafts ``depth`` DSpark slots (0: no drafter
    call, which n-gram rounds are), the planner's measured-to-modelled ratio; default 1. A DSpark round is taken
    when none ran for ``probe_interval`` rounds, so its survival estimate does not go stale while the n-gram wins."""

    def __init__(self, cost_table, draft_cost, *, max_ngram: int, num_ngram_tokens: int, scale=None, probe_interval: int = 16):
        self.num_ngram_tokens, self.max_ngram = check_lookup_settings(num_ngram_tokens, max_ngram)
        self.cost_table, self.draft_cost = cost_table, draft_cost
        self.ngram = SlotAcceptance(self.num_ngram_tokens)
        self.scale = scale or (lambda depth: 1.0)
        self.probe_interval = probe_interval
        self.rounds_since_dspark = 0

    def _verify_seconds(self, num_tokens: int) -> float:
        return self.cost_table.step_seconds(1, num_tokens, num_tokens)

    def _plain(self) -> Proposal:
        return Proposal("plain", 0, 1.0 / (self.scale(0) * self._verify_seconds(1)))

    def ngram_option(self, proposal: NgramProposal) -> Proposal:
        """The best prefix of the n-gram proposal (0 tokens: a plain round)."""
        survival = self.ngram.survival(proposal.match_length, len(proposal.tokens))
        scale = self.scale(0)
        best = self._plain()
        for length in range(1, len(survival) + 1):
            theta = expected_acceptance_length(survival[:length]) / (scale * self._verify_seconds(1 + length))
            if theta > best.theta:
                best = Proposal("ngram", length, theta)
        return best

    def dspark_option(self, depth: int, survival: Sequence[float] | None) -> Proposal:
        """A DSpark round drafting ``depth`` slots, priced on the survival estimate of earlier rounds
        (None: nothing known yet, which is taken as worth trying)."""
        if depth <= 0:
            return self._plain()
        if survival is None:
            return Proposal("dspark", depth, float("inf"))
        tau = expected_acceptance_length(survival[:depth])
        seconds = self.draft_cost.draft_seconds(1, depth) + self._verify_seconds(1 + depth)
        return Proposal("dspark", depth, tau / (self.scale(depth) * seconds))

    def skip_drafter(self, ngram: Proposal, depth: int, survival: Sequence[float] | None) -> bool:
        """Stage 1, before the drafter runs: True when the n-gram proposal (or a plain round) is priced at least as
        high as a DSpark round drafting ``depth`` slots on the survival of earlier rounds, draft cost included. A
        DSpark round is due (never skipped) when none ran for ``probe_interval`` rounds."""
        dspark = self.dspark_option(depth, survival)
        if dspark.kind != "dspark":
            return True
        if self.rounds_since_dspark + 1 >= self.probe_interval:
            return False
        return ngram.theta >= dspark.theta

    def prefer_ngram(self, ngram: Proposal, depth: int, survival: Sequence[float]) -> bool:
        """Stage 2, after drafting (its cost is spent): the n-gram proposal against the drafted block priced on
        ``survival``, which may read this round's anchor (``c_1``) but no token sampled in this round."""
        if ngram.kind != "ngram":
            return False
        scale = self.scale(0)
        dspark = (1.0 + sum(survival[:depth])) / (scale * self._verify_seconds(1 + depth))
        return ngram.theta > dspark

    def record_choice(self, kind: str) -> None:
        self.rounds_since_dspark = 0 if kind == "dspark" else self.rounds_since_dspark + 1


def anchored_survival(first: float, history: Sequence[float] | None, depth: int) -> list[float]:
    """The block's expected survival given this round's calibrated ``c_1`` (which reads only the anchor): ``c_1``
    times the conditional survival of slots 2..depth seen on earlier rounds (1 where nothing was seen)."""
    if not history:
        return [first] * depth
    base = max(history[0], 1e-6)
    return [first * min(1.0, history[min(k, len(history) - 1)] / base) for k in range(depth)]
