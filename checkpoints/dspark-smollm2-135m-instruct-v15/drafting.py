"""The one drafting path: how a drafter's logits become draft tokens and the ``q`` verification needs.

:func:`draft_block` samples a DSpark block for R rows at once, slot by slot: the confidence of slot k (Eq. 7,
reading ``h_k`` and the previously sampled token), the Markov step ``U_k + B_k(x_{k-1})`` (Eqs. 4-6) over the
draft vocabulary, the logits processors, and the draw (:func:`draft_token`). ``generate()``'s candidate
generator, the batched engine (and so the profiler that times it) call it; the Eagle3 baseline, which runs one
drafter forward per token, calls :func:`draft_token` for each of its steps.

``q`` is always over the target's vocabulary (``-inf`` outside a draft vocabulary), float32, exactly the
processed distribution each token was drawn from, which lossless verification requires.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["DraftBlock", "draft_block", "draft_token", "sample_categorical"]

# (ids so far [R, L], logits [R, V]) -> processed logits, as Transformers' LogitsProcessorList is called
LogitsProcessor = Callable[[torch.LongTensor, torch.Tensor], torch.Tensor]


def sample_categorical(probs: torch.Tensor) -> torch.LongTensor:
    """One exact draw per row of ``probs`` [..., V] (non-negative, any total) by inverting the CDF.

    One uniform per row instead of the V random numbers ``torch.multinomial`` draws: on a 2-core CPU and a 49k
    vocabulary 0.07 ms against 0.79 ms for one row, 6.0 against 12.6 ms for 16 (``benchmarks/sampler_timing.py``),
    a cost every sampled draft slot pays. The CDF is summed in float64; a zero-probability token is never drawn."""
    flat = probs.reshape(-1, probs.shape[-1])
    cdf = flat.double().cumsum(-1)
    total = cdf[:, -1:]
    u = torch.rand(flat.shape[0], 1, dtype=torch.float64, device=flat.device) * total
    drawn = torch.searchsorted(cdf, u, right=True)[:, 0]
    last_positive = (cdf < total).sum(-1)  # where the CDF reaches its total: the last token with mass
    return torch.minimum(drawn, last_positive).reshape(probs.shape[:-1])


@dataclass
class DraftBlock:
    tokens: torch.LongTensor  # [R, D] drafted target ids (D: slots sampled)
    logits: torch.Tensor | None  # [R, D, V] float32 processed logits q each token was drawn from (None if D = 0)
    confidence_logits: torch.Tensor | None  # [R, D'] raw c_k logits of every slot whose confidence was computed
    lengths: torch.LongTensor  # [R] drafts of each row worth verifying (threshold cut, EOS), <= D


def draft_token(
    drafter,
    step_logits: torch.Tensor,  # [R, Vd] the drafter's logits of one slot over its draft vocabulary
    greedy: bool | torch.Tensor,  # one flag for all rows, or [R] bool
    logits_processor: LogitsProcessor | None = None,
    ids: torch.LongTensor | None = None,  # [R, L] the sequence so far, for the processors
) -> tuple[torch.LongTensor, torch.Tensor]:
    """One draft token per row and the processed target-vocabulary logits it was drawn from: argmax for greedy
    rows, an exact draw from ``softmax(q)`` otherwise. Returns (tokens [R] target ids, q [R, V] float32).

    Without processors ``q`` is ``-inf`` outside the draft vocabulary, so its argmax and its draws are those of
    the draft-vocabulary logits, mapped to target ids: the pick reads 8k logits instead of the whole vocabulary."""
    if not _processes(logits_processor):
        return _pick_unprocessed(drafter, step_logits, greedy), drafter.to_target_vocab(step_logits)
    q = logits_processor(ids, drafter.to_target_vocab(step_logits))
    return _pick(q, greedy), q


def _pick(logits: torch.Tensor, greedy: bool | torch.Tensor) -> torch.LongTensor:
    """Argmax for greedy rows, an exact draw from ``softmax(logits)`` for the others (the column index)."""
    if isinstance(greedy, bool):
        return logits.argmax(-1) if greedy else sample_categorical(logits.softmax(-1))
    # mixed rows (the engine): every row draws, greedy rows take the argmax
    return torch.where(greedy, logits.argmax(-1), sample_categorical(logits.softmax(-1)))


def _pick_unprocessed(drafter, step_logits: torch.Tensor, greedy: bool | torch.Tensor) -> torch.LongTensor:
    """The pick among the draft-vocabulary logits, as target ids (no processors: ``q`` is -inf elsewhere)."""
    return drafter.to_target_ids(_pick(step_logits.float(), greedy))


def _processes(logits_processor: LogitsProcessor | None) -> bool:
    """Whether ``logits_processor`` can change a logit (``generate()`` passes an empty list when nothing is set)."""
    return logits_processor is not None and not (isinstance(logits_processor, list) and len(logits_processor) == 0)


def draft_block(
    drafter,
    hidden_states: torch.Tensor,  # [R, >= D, d] the block's hidden states h (after the drafter's final norm)
    lm_head: torch.nn.Module,  # the target's (frozen) LM head
    anchor_ids: torch.LongTensor,  # [R] the anchor x0 of each row
    *,
    num_slots: int,
    greedy: bool | torch.Tensor,
    logits_processor: LogitsProcessor | None = None,
    prefix_ids: torch.LongTensor | None = None,  # [R, L] sequence so far, anchor included (for the processors)
    threshold: float | None = None,
    eos_token_ids: torch.Tensor | None = None,
) -> DraftBlock:
    """Sample up to ``num_slots`` drafts per row left to right: ``q_k = proc(U_k + B_k(x_{k-1}))`` over the target's
    vocabulary (``-inf`` outside the draft vocabulary), ``x_k ~ q_k`` (argmax when greedy).

    ``threshold`` cuts each row before the first slot whose cumulative survival ``prod_{j<=k} c_j`` (STS-calibrated)
    falls below it; ``c_k`` reads ``h_k`` and the previously *sampled* token, so whether a token is kept never
    depends on that token (the non-anticipation that keeps verification lossless). A row also stops after an
    end-of-sequence token. The loop ends when no row has a slot left, and the LM head is not applied at all when
    every row is cut at slot 1."""
    markov = drafter.markov_head
    num_rows = anchor_ids.shape[0]
    h = hidden_states[:, :num_slots]
    use_confidence = drafter.confidence_head is not None
    prev = anchor_ids
    state = markov.initial_state(h[:, 0]) if markov is not None and num_slots else None
    alive = torch.ones(num_rows, dtype=torch.bool, device=anchor_ids.device)
    lengths = torch.zeros(num_rows, dtype=torch.long, device=anchor_ids.device)
    survival = torch.ones(num_rows, dtype=torch.float64, device=anchor_ids.device)  # prefix_survival, slot by slot
    ids = prefix_ids
    processed = _processes(logits_processor)
    base = None
    tokens, logits, confidences = [], [], []
    for k in range(num_slots):
        if use_confidence:
            z = drafter.confidence_logits(h[:, k], prev)  # [R]
            confidences.append(z)
            if threshold is not None:
                survival = survival * drafter.calibrated_confidence(z, position=k).double()
                alive = alive & (survival >= threshold)
                if not bool(alive.any()):
                    break
        if base is None:  # one LM-head matmul for the block, skipped when slot 1 is already cut everywhere
            base = drafter.draft_base_logits(h, lm_head).float()  # [R, D, Vd]
        step = base[:, k]
        if markov is not None:
            step, state = markov.apply_step_logits(step, drafter.draft_index(prev), h[:, k], state)
        if processed:
            token, q = draft_token(drafter, step, greedy, logits_processor, ids)
        else:  # as draft_token, with the scatter to the target vocabulary left for the whole block at the end
            token, q = _pick_unprocessed(drafter, step, greedy), step.float()
        tokens.append(token)
        logits.append(q)
        lengths = lengths + alive.long()
        if ids is not None:
            ids = torch.cat([ids, token[:, None].to(ids.device)], dim=-1)
        prev = token
        if eos_token_ids is not None:
            alive = alive & ~torch.isin(token, eos_token_ids.to(token.device))  # nothing after EOS can be accepted
            if not bool(alive.any()):
                break
    return DraftBlock(
        tokens=torch.stack(tokens, dim=1) if tokens else anchor_ids.new_empty(num_rows, 0),
        logits=(torch.stack(logits, dim=1) if processed else drafter.to_target_vocab(torch.stack(logits, dim=1))) if tokens else None,
        confidence_logits=torch.stack(confidences, dim=1) if confidences else None,
        lengths=lengths,
    )
