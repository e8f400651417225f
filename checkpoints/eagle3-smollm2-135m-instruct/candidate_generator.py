"""`DSparkCandidateGenerator`: DSpark drafting on Transformers' candidate-generator protocol.

It follows the protocol of the built-in DFlash generator (``requires_model_outputs``,
``model_kwargs_overrides``, the prefill iteration skipped): each round it feeds the target's hidden
states of the tokens accepted in the last verification forward into the drafter's context cache, drafts
one block from the bonus token (the anchor), samples it left to right with the Markov bias and
truncates it with the confidence head (``generation.decoding.drafting.draft_block``, the engine's drafting too). It returns exactly the processed logits each drafted token was
sampled from, so Transformers' speculative sampling stays lossless at temperature > 0.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from .drafting import draft_block
from .hybrid import HybridChooser, anchored_survival, check_lookup_settings, ngram_continuation, one_hot_logits
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
    supports_hybrid = False  # prompt_lookup_num_tokens together with the drafter

    def __init__(self, *, target, drafter, generation_config, input_ids, model_kwargs=None, logits_processor=None):
        check_assisted_inputs(input_ids, model_kwargs, kind=self.kind)
        drafter.check_compatible(target)
        if getattr(generation_config, "prompt_lookup_num_tokens", None) is not None and not self.supports_hybrid:
            raise ValueError(
                f"prompt_lookup_num_tokens cannot be combined with an {self.kind} assistant (hybrid n-gram drafting is "
                "built for DSpark drafters); pass one or the other"
            )
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
        self.generation_config = generation_config
        # Transformers checks stopping criteria after a whole accepted block; EOS and max_length it also cuts
        # inside the block, the others (stop strings, custom criteria) are cut here (`_cut_at_stop`)
        criteria = getattr(generation_config, "_dspark_stopping_criteria", None) or []
        self.stopping_criteria = StoppingCriteriaList(
            c for c in criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))
        )
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

    @torch.no_grad()
    def get_candidates(self, input_ids: torch.LongTensor, model_kwargs=None, model_outputs=None, is_first_iteration: bool = False, **kwargs):
        if is_first_iteration:
            return input_ids, None  # the target's prefill runs first; drafting needs its hidden states
        candidate_ids, candidate_logits = self._propose(input_ids, model_outputs)
        return self._cut_at_stop(input_ids, candidate_ids, candidate_logits)

    def _propose(self, input_ids: torch.LongTensor, model_outputs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """One round's candidates: ``input_ids`` with the proposed tokens appended, and the processed logits each
        was sampled from (None: nothing proposed)."""
        raise NotImplementedError

    def _cut_at_stop(self, input_ids, candidate_ids, candidate_logits):
        """End the proposal on its first token after which a stopping criterion fires, and let the round keep no
        more than that many tokens, so the output ends exactly where plain decoding would stop.

        Assisted decoding keeps the accepted drafts plus one target token; if every draft up to the stop is
        accepted, that extra token would come after the stop, so the round's token budget
        (``generation_config.max_length``, read after verification) is lowered to end on the stop and restored
        in ``update_candidate_strategy``. Lossless under sampling: whether later slots are proposed depends only
        on tokens already proposed, and what is cut lies after the stop."""
        num_proposed = candidate_ids.shape[1] - input_ids.shape[1]
        if not self.stopping_criteria or candidate_logits is None or num_proposed == 0:
            return candidate_ids, candidate_logits
        cur_len = input_ids.shape[1]
        for k in range(1, num_proposed + 1):
            if bool(self.stopping_criteria(candidate_ids[:, : cur_len + k], None).any()):
                self.generation_config.max_length = min(self.max_length, cur_len + k)
                round_ = self._pending_round
                if round_ is not None:
                    round_.verified = min(round_.verified, k)
                    round_.confidence_logits = round_.confidence_logits[:k]
                return candidate_ids[:, : cur_len + k], candidate_logits[:, :k]
        return candidate_ids, candidate_logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        self.generation_config.max_length = self.max_length
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
    corrected by measured round times (`generation.scheduling.depth_planner`); after drafting, Algorithm 1 keeps the
    prefix whose ``tau / (T_draft + T_verify)`` is best, walking slot by slot and stopping at the first slot that
    does not improve it (so the cut at slot k reads survival up to k only). Both read the calibrated survival scaled
    by what earlier rounds' verified drafts yielded against it (`DepthPlanner.corrected`). ``dspark_cost_table`` /
    ``dspark_draft_cost`` pass the tables instead of profiling them.

    ``prompt_lookup_num_tokens`` (with ``max_matching_ngram_size``, default 2, as in Transformers) turns on hybrid
    drafting (`generation.decoding.hybrid`): each round verifies either the prompt-lookup continuation or the DSpark block,
    whichever the same cost tables price higher on what earlier rounds showed (the block on the corrected survival,
    as cost truncation reads it); an n-gram round skips the drafter
    (its context catches up on the next DSpark round). ``drafter.last_stats`` records each round's ``proposal``."""

    supports_hybrid = True

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
        if self.truncation == "cost" and drafter.confidence_head is None:
            raise ValueError("cost truncation needs a drafter with a confidence head (it plans from survival)")
        lookup = getattr(generation_config, "prompt_lookup_num_tokens", None)
        self.hybrid = None
        self.depth_planner = None
        self._planner = None  # set for cost truncation and hybrid drafting: the measured round times correct its tables
        if self.truncation == "cost" or lookup is not None:
            from .depth_planner import generate_planner

            if lookup is not None:
                max_ngram = getattr(generation_config, "max_matching_ngram_size", None)
                lookup, max_ngram = check_lookup_settings(lookup, 2 if max_ngram is None else max_ngram)  # 2: Transformers' default
            planner, self.cost_table = generate_planner(target, drafter, generation_config)
            if self.truncation == "cost":
                self.depth_planner = planner
            if lookup is not None:
                self.hybrid = HybridChooser(
                    self.cost_table, planner.draft_cost, max_ngram=max_ngram, num_ngram_tokens=lookup,
                    scale=lambda depth: planner.scale(1, depth),
                )  # fmt: skip
            self._planner = planner
        self.survival_estimate: list[float] | None = None  # moving average of the block's survival per slot
        self._unseen_features = None  # target features of tokens the drafter has not read (rounds without drafting)
        self._round_timing = None  # (start, depth, new context read) of the round in flight, for the measured-cost ratio (verified: its round)
        self._round_survival = None  # calibrated survival of the verified drafts of the round in flight (with a planner)

    def _propose(self, input_ids: torch.LongTensor, model_outputs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        start = time.perf_counter()
        # Room left for drafts plus the bonus token. When it is gone, this is the last round, so the drafter's
        # context does not need to be brought up to date.
        room = self.max_length - input_ids.shape[1] - 1
        max_tokens = min(self.num_draft_tokens, room)
        if max_tokens <= 0 and (self.hybrid is None or room <= 0):
            return input_ids, None
        if model_outputs is None or getattr(model_outputs, "hidden_states", None) is None:
            raise ValueError("DSpark drafting needs the target's hidden states of the last forward")

        # New context: every token the target processed and kept since the drafter last looked
        # (the prompt after prefill, then the previous round's bonus token plus its accepted drafts).
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
        context = unseen + num_new  # what the drafter reads before it drafts
        depth = max_tokens
        if self.depth_planner is not None and depth > 0:
            depth = min(self.depth_planner.plan([self.survival_estimate], context, tokens_left=room + 1), max_tokens)
        ngram = None
        if self.hybrid is not None:
            proposal = ngram_continuation(
                input_ids[0], self.hybrid.max_ngram, min(self.hybrid.num_ngram_tokens, room), self.eos_token_ids
            )
            ngram = self.hybrid.ngram_option(proposal)
            if self.hybrid.skip_drafter(ngram, depth, self._corrected(self.survival_estimate)):
                self._keep_unseen(features)
                if self.depth_planner is not None:
                    self.depth_planner.drafted(0)
                return self._ngram_round(input_ids, proposal, ngram.length, start, drafted=0, depth=0, context=context)
        if self.depth_planner is not None:
            self.depth_planner.drafted(depth)
        if depth == 0:  # a plain round: keep the features for the next drafter call
            self._keep_unseen(features)
            self._pending_round = DSparkRound(drafted=0, verified=0, proposal="plain", draft_seconds=time.perf_counter() - start)
            self._round_timing = (start, 0, context)
            return input_ids, None
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
            num_slots=depth,
            greedy=not self.do_sample,
            logits_processor=self.logits_processor,
            prefix_ids=input_ids,
            threshold=self.threshold if self.truncation == "threshold" else None,
            eos_token_ids=self.eos_token_ids,
        )
        drafted = verified = int(block.lengths[0])
        confidence = block.confidence_logits[0] if block.confidence_logits is not None else None
        survival = None
        if confidence is not None and confidence.numel() and self._planner is not None:
            survival = self.drafter.survival(confidence).tolist()
        # the choice reads the estimate of earlier rounds, so it is made before this round's survival joins it
        use_ngram = ngram is not None and self.hybrid.prefer_ngram(ngram, depth, self._corrected(self._choice_survival(survival, depth)))
        if survival is not None and drafted:
            self.survival_estimate = self._planner.update_estimates([self.survival_estimate], [survival[:drafted]])[0]
        if use_ngram:
            return self._ngram_round(input_ids, proposal, ngram.length, start, drafted=drafted, depth=depth, context=context)
        if self.hybrid is not None:
            self.hybrid.record_choice("dspark")
        if survival is not None and drafted and self.depth_planner is not None:
            verified = self.depth_planner.cut([survival[:drafted]], depth, context)[0]
        if survival is not None and verified:  # scored against what the target accepts (DepthPlanner.corrected)
            self._round_survival = survival[:verified]
        self._pending_round = DSparkRound(
            drafted=drafted,
            verified=verified,
            confidence_logits=confidence[:verified].tolist() if confidence is not None else [],
            draft_seconds=time.perf_counter() - start,
        )
        if self._planner is not None:
            self._round_timing = (start, depth, context)
        if verified == 0:
            return input_ids, None
        tokens = block.tokens[:, :verified].to(input_ids.device)
        return torch.cat([input_ids, tokens], dim=-1), block.logits[:, :verified]

    def _choice_survival(self, survival: list[float] | None, depth: int) -> list[float]:
        """What stage 2 of the hybrid choice may read of the drafted block: its calibrated ``c_1`` (the anchor's),
        never a later slot, whose confidence reads a token sampled in this round (the Appendix A bias)."""
        if survival is None:  # no confidence head: earlier rounds' measured acceptance
            return list(self.survival_estimate or [1.0] * depth)
        return anchored_survival(survival[0], self.survival_estimate, depth)

    def _ngram_round(self, input_ids, proposal, length: int, start: float, *, drafted: int, depth: int, context: int):
        """Verify the first ``length`` tokens of the n-gram proposal (0: a plain round) as a point mass; ``depth``:
        slots the drafter ran for this round (0: it did not run) after reading ``context`` new positions."""
        self.hybrid.record_choice("ngram" if length else "plain")
        self._pending_round = DSparkRound(
            drafted=drafted, verified=length, proposal="ngram" if length else "plain", match_length=proposal.match_length,
            draft_seconds=time.perf_counter() - start,
        )  # fmt: skip
        self._round_timing = (start, depth, context)
        if length == 0:
            return input_ids, None
        tokens = proposal.tokens[None, :length].to(input_ids.device)
        return torch.cat([input_ids, tokens], dim=-1), one_hot_logits(tokens, self.lm_head.weight.shape[0])

    def _keep_unseen(self, features: torch.Tensor) -> None:
        """A round without a drafter call: its context features wait for the next one."""
        self._unseen_features = features if self._unseen_features is None else torch.cat([self._unseen_features, features], 1)

    def _corrected(self, survival: list[float] | None) -> list[float] | None:
        """``survival`` scaled by what earlier rounds' verified drafts yielded against it (the planner's
        `DepthPlanner.corrected`), as cost truncation and the engine read it."""
        return survival if survival is None else self._planner.corrected([survival])[0]

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        round_ = self._pending_round
        if self._round_timing is not None:  # the round's wall time: drafting, verification and Transformers' own work
            start, depth, context = self._round_timing
            survival = None if self._round_survival is None else [self._round_survival]
            self._planner.record_round(
                depth, [round_.verified], [int(num_matches)], time.perf_counter() - start, survival=survival,
                committed=None if round_.proposal == "ngram" else int(num_matches) + 1, context=context,
            )  # fmt: skip
            self._round_timing = self._round_survival = None
        if self.hybrid is not None and round_ is not None:
            if round_.proposal == "ngram":
                self.hybrid.ngram.record(round_.match_length, round_.verified, int(num_matches))
            elif round_.proposal == "dspark" and round_.verified and self.drafter.confidence_head is None:
                # no calibrated survival to read: the measured acceptance of this block stands in for it
                measured = [1.0 if j < int(num_matches) else 0.0 for j in range(round_.verified)]
                self.survival_estimate = self._planner.update_estimates([self.survival_estimate], [measured])[0]
        super().update_candidate_strategy(input_ids, scores, num_matches)
