"""`DSparkCandidateGenerator`: DSpark drafting on Transformers' candidate-generator protocol.

It follows the protocol of the built-in DFlash generator (``requires_model_outputs``,
``model_kwargs_overrides``, the prefill iteration skipped): each round it feeds the target's hidden
states of the tokens accepted in the last verification forward into the drafter's context cache, drafts
one block from the bonus token (the anchor), samples it left to right with the Markov bias and
truncates it with the confidence head (``generation.drafting.draft_block``, the engine's drafting too). It returns exactly the processed logits each drafted token was
sampled from, so Transformers' speculative sampling stays lossless at temperature > 0.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.candidate_generator import CandidateGenerator

from .drafting import draft_block
from .stats import DSparkGenerationStats, DSparkRound

__all__ = ["DSparkCandidateGenerator", "HiddenStateCandidateGenerator", "check_assisted_inputs"]


def check_assisted_inputs(input_ids: torch.LongTensor, model_kwargs: dict | None, kind: str = "DSpark") -> None:
    """Refuse what assisted decoding with a hidden-state drafter cannot serve correctly."""
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"generate(assistant_model=<{kind} drafter>) supports batch size 1 only (got {input_ids.shape[0]}): "
            "Transformers' assisted decoding verifies one sequence at a time. Serve several requests with "
            "the batched engine, generation.DSparkEngine."
        )
    mask = (model_kwargs or {}).get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError(
            f"generate(assistant_model=<{kind} drafter>) needs an unpadded prompt (its attention_mask has zeros); "
            "pass the prompt without padding."
        )
    cache = (model_kwargs or {}).get("cache")
    if cache is not None and cache.get_seq_length() > 0:
        # Transformers' assisted prefill re-runs the whole prompt on top of it, and the drafter needs the
        # prompt's hidden states anyway.
        raise ValueError(f"generate(assistant_model=<{kind} drafter>) does not take a pre-filled cache; pass an empty one or none")



class HiddenStateCandidateGenerator(CandidateGenerator):
    """What DSpark and Eagle3 drafting share: input checks, the target's embedding / LM head and feature layers,
    sampling settings, the draft cache and the per-round statistics in ``drafter.last_stats``."""

    requires_model_outputs: bool = True
    kind = "DSpark"

    def __init__(self, *, target, drafter, generation_config, input_ids, model_kwargs=None, logits_processor=None):
        check_assisted_inputs(input_ids, model_kwargs, kind=self.kind)
        drafter.check_compatible(target)
        if drafter.dtype != target.dtype:
            warnings.warn(
                f"the drafter runs in {drafter.dtype} and the target in {target.dtype}: lossless either way, but on a CPU "
                "without native bf16 a bf16 model is many times slower; load the drafter with dtype=target.dtype",
                stacklevel=2,
            )
        self.drafter = drafter
        self.lm_head = target.get_output_embeddings()
        self.input_embeddings = target.get_input_embeddings()
        self.model_kwargs_overrides = {"output_hidden_states": [i + 1 for i in drafter.config.target_layer_ids]}
        num_tokens = getattr(generation_config, "dspark_num_draft_tokens", None)
        block = drafter.config.block_size
        self.num_draft_tokens = block if num_tokens is None else int(num_tokens)
        if not 0 <= self.num_draft_tokens <= block:
            raise ValueError(f"dspark_num_draft_tokens must be in [0, {block}], got {self.num_draft_tokens}")
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor if logits_processor is not None and len(logits_processor) else None
        self.eos_token_ids = getattr(generation_config, "_eos_token_tensor", None)
        self.max_length = generation_config.max_length
        self.cache = DynamicCache()
        self.stats = DSparkGenerationStats()
        drafter.last_stats = self.stats
        self._pending_round: DSparkRound | None = None

    @property
    def _pending_round(self) -> DSparkRound | None:
        return self.stats.pending

    @_pending_round.setter
    def _pending_round(self, round_: DSparkRound | None) -> None:
        self.stats.pending = round_

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        if self._pending_round is not None:
            self._pending_round.accepted = int(num_matches)
            self.stats.rounds.append(self._pending_round)
            self._pending_round = None


class DSparkCandidateGenerator(HiddenStateCandidateGenerator):
    """Drafts DSpark blocks for ``target.generate(..., assistant_model=drafter)`` (batch size 1).

    Settings come from the drafter's config and can be overridden per call through custom
    `GenerationConfig` attributes: ``dspark_truncation`` (`"fixed"` | `"threshold"` | `"cost"`),
    ``dspark_confidence_threshold`` (float) and ``dspark_num_draft_tokens`` (int, at most ``block_size``).

    ``"cost"`` is the hardware-aware truncation of the batched engine at one row: before drafting, the depth D
    (0 = no drafter call, a plain round) is planned from the survival of earlier rounds and the profiled costs
    corrected by measured round times (`generation.depth_planner`); after drafting, Algorithm 1 keeps the
    prefix whose ``tau / (T_draft + T_verify)`` is best, walking slot by slot and stopping at the first slot that
    does not improve it (so the cut at slot k reads survival up to k only). ``dspark_cost_table`` /
    ``dspark_draft_cost`` pass the tables instead of profiling them."""

    def __init__(
        self,
        *,
        target,
        drafter,
        generation_config,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any] | None = None,
        logits_processor=None,
    ):
        super().__init__(
            target=target, drafter=drafter, generation_config=generation_config, input_ids=input_ids,
            model_kwargs=model_kwargs, logits_processor=logits_processor,
        )  # fmt: skip
        cfg = drafter.config
        self.truncation = getattr(generation_config, "dspark_truncation", None) or cfg.truncation
        threshold = getattr(generation_config, "dspark_confidence_threshold", None)
        self.threshold = cfg.confidence_threshold if threshold is None else float(threshold)
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"dspark_confidence_threshold is a cumulative survival probability, in [0, 1]; got {self.threshold}")
        if self.truncation not in ("fixed", "threshold", "cost"):
            raise ValueError(f"dspark_truncation must be 'fixed', 'threshold' or 'cost', got {self.truncation!r}")
        if self.truncation == "threshold" and self.threshold > 0 and drafter.confidence_head is None:
            raise ValueError("confidence-threshold truncation needs a drafter with a confidence head")
        self.depth_planner = None
        if self.truncation == "cost":
            if drafter.confidence_head is None:
                raise ValueError("cost truncation needs a drafter with a confidence head (it plans from survival)")
            from .depth_planner import generate_planner

            self.depth_planner, self.cost_table = generate_planner(target, drafter, generation_config)
            self.survival_estimate: list[float] | None = None
        self._unseen_features = None  # target features of tokens the drafter has not read (rounds without drafting)
        self._round_timing = None  # (start, depth, verified) of the round in flight, for the measured-cost ratio

    @torch.no_grad()
    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any] | None = None,
        model_outputs=None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
        **kwargs,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        if is_first_iteration:
            return input_ids, None  # the target's prefill runs first; drafting needs its hidden states
        start = time.perf_counter()
        # Room left for drafts plus the bonus token. When it is gone, this is the last round, so the drafter's
        # context does not need to be brought up to date.
        max_tokens = min(self.num_draft_tokens, self.max_length - input_ids.shape[1] - 1)
        if max_tokens <= 0:
            return input_ids, None
        if model_outputs is None or getattr(model_outputs, "hidden_states", None) is None:
            raise ValueError("DSpark drafting needs the target's hidden states of the last forward")

        # New context: every token the target processed and kept since the drafter last looked
        # (the prompt after prefill, then the old bonus token plus the accepted drafts).
        context_len = self.cache.get_seq_length()
        unseen = 0 if self._unseen_features is None else self._unseen_features.shape[1]
        anchor_pos = input_ids.shape[1] - 1
        num_new = anchor_pos - context_len - unseen
        features = self.drafter.context_features(model_outputs.hidden_states)
        if num_new > features.shape[1] or num_new < 1:
            raise ValueError(
                f"DSpark drafter context is out of sync: {num_new} new tokens but the target returned hidden states "
                f"for {features.shape[1]}. Do not pass a pre-filled cache to generate() with a DSpark assistant."
            )
        features = features[:, :num_new]
        if self.depth_planner is not None:
            depth = min(self.depth_planner.plan([self.survival_estimate]), max_tokens)
            self.depth_planner.drafted(depth)
            if depth == 0:  # a plain round: keep the features for the next drafter call
                self._unseen_features = features if self._unseen_features is None else torch.cat([self._unseen_features, features], 1)
                self._pending_round = DSparkRound(drafted=0, verified=0, draft_seconds=time.perf_counter() - start)
                self._round_timing = (start, 0, 0)
                return input_ids, None
            max_tokens = depth
        if self._unseen_features is not None:
            features, self._unseen_features = torch.cat([self._unseen_features, features], 1), None
        device = self.drafter.device
        anchor = input_ids[:, -1]
        positions = torch.arange(context_len, anchor_pos + self.drafter.config.block_size, device=device)[None]
        out = self.drafter(
            block_embeds=self.drafter.embed_block(anchor, self.input_embeddings),
            context_features=features.to(device),
            position_ids=positions,
            cache=self.cache,
        )
        block = draft_block(
            self.drafter,
            out.last_hidden_state,
            self.lm_head,
            anchor,
            num_slots=max_tokens,
            greedy=not self.do_sample,
            logits_processor=self.logits_processor,
            prefix_ids=input_ids,
            threshold=self.threshold if self.truncation == "threshold" else None,
            eos_token_ids=self.eos_token_ids,
        )
        drafted = verified = int(block.lengths[0])
        confidence = block.confidence_logits[0] if block.confidence_logits is not None else None
        if self.depth_planner is not None and drafted:
            verified = self._cost_cut(confidence[:drafted], depth)
        self._pending_round = DSparkRound(
            drafted=drafted,
            verified=verified,
            confidence_logits=confidence[:verified].tolist() if confidence is not None else [],
            draft_seconds=time.perf_counter() - start,
        )
        if self.depth_planner is not None:
            self._round_timing = (start, depth, verified)
        if verified == 0:
            return input_ids, None
        tokens = block.tokens[:, :verified].to(input_ids.device)
        return torch.cat([input_ids, tokens], dim=-1), block.logits[:, :verified]

    def _cost_cut(self, confidence_logits: torch.Tensor, depth: int) -> int:
        """Algorithm 1 on this row's drafted slots (early stop: slot k is cut on survival up to k); the estimate
        the next round's depth is planned from is updated with this round's survival."""
        from .scheduler import schedule_algorithm1

        survival = torch.cumprod(self.drafter.calibrated_confidence(confidence_logits.float()[None]).double(), dim=-1)[0].tolist()
        self.survival_estimate = self.depth_planner.update_estimates([self.survival_estimate], [survival])[0]
        spent = self.depth_planner.draft_cost.draft_seconds(1, depth)
        return schedule_algorithm1([survival], self.cost_table, draft_seconds=spent)[0]

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        if self._round_timing is not None:  # the round's wall time: drafting, verification and Transformers' own work
            start, depth, verified = self._round_timing
            self.depth_planner.record_round_time(1, depth, [verified], time.perf_counter() - start)
            self._round_timing = None
        super().update_candidate_strategy(input_ids, scores, num_matches)
