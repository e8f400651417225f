"""`DSparkEngine`: many concurrent requests, one batched drafter forward and one target forward per step.

Each step: prefill the requests that joined (one right-padded forward), draft a block for every active
request (one drafter forward, the block sampled left to right for all rows at once), let the scheduler pick
each request's verification length ``l_r`` from the calibrated survival and the cost table, verify the
ragged prefixes ``[anchor, d_1..d_{l_r}]`` in one right-padded target forward with per-row masks and
positions, then commit each row's accepted tokens and roll the rejected ones out of the target's KV cache
(:class:`generation.serving.ragged_cache.RaggedCache`). Requests leave at EOS or their token limit; new ones can be
added between steps. Greedy rows reproduce the target's greedy decoding, sampled rows its distribution
(``generation.serving.verification``), under every scheduler: each one is non-anticipating.

The cost-aware schedulers (Algorithm 1, asynchronous) maximise tokens per second with the engine's real costs:
the right-padded verify forward (:class:`PaddedCostTable`) and the drafter call for R rows and D slots
(:class:`DraftCost`), both profiled once per machine and cached on disk. Before drafting, the step's depth D is
planned from each request's survival in earlier steps (:class:`generation.scheduling.depth_planner.DepthPlanner`: probes,
moving averages, and the profiled tables corrected by measured step times); D = 0 skips the drafter, and the draft
LM head and sampling loop run over the first D slots only. A step that skips drafting still records the target
features the drafter needs later. ``draft_cost=False`` schedules as in the paper (full blocks,
``Theta = tau * SPS(B)``).

    engine = DSparkEngine(target, drafter, scheduler="algorithm1")        # profiles the costs once, cached on disk
    outputs = engine.generate([ids_a, ids_b], max_new_tokens=128, temperature=0.7)
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList, StopStringCriteria

from generation.decoding.drafting import draft_block
from generation.decoding.hybrid import SlotAcceptance, anchored_survival, check_lookup_settings, ngram_continuation, one_hot_logits
from generation.decoding.stats import DSparkGenerationStats, DSparkRound
from generation.scheduling.depth_planner import DepthPlanner
from generation.scheduling.profiler import model_key
from generation.scheduling.scheduler import (
    CostTable,
    DraftCost,
    PaddedCostTable,
    async_capacity,
    schedule_algorithm1,
    schedule_fixed,
    schedule_threshold,
    schedule_top_k,
)
from generation.serving.ragged_cache import RaggedCache, four_d_mask_pays
from generation.serving.verification import process_logits, sample_tokens, verify_drafts

__all__ = ["SCHEDULERS", "DSparkEngine", "EngineRequest", "uses_sliding_window"]

SCHEDULERS = ("none", "fixed", "threshold", "algorithm1", "async")


def uses_sliding_window(target) -> bool:
    """Whether ``target`` has sliding-window layers, which the engine's ragged cache cannot serve (the window would
    count its rolled-back columns)."""
    text = target.config.get_text_config()
    layer_types = getattr(text, "layer_types", None) or []
    return bool(getattr(text, "sliding_window", None)) and (not layer_types or "sliding_attention" in layer_types)


def _measured_on(target, drafter) -> tuple:
    """What a depth planner's measurements are of: the models (as the cost tables' cache keys name them) and the
    device; computed only where a planner is made or carried over."""
    return model_key(target), str(target.device), model_key(drafter)


@dataclass
class EngineRequest:
    request_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    eos_token_ids: frozenset[int] = frozenset()
    top_k: int = 0  # 0 = off
    stopping_criteria: StoppingCriteriaList | None = None  # stop strings and custom criteria, checked token by token
    on_tokens: Callable[[int, list[int]], None] | None = None  # streaming: (request_id, newly accepted tokens)
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    stats: DSparkGenerationStats = field(default_factory=DSparkGenerationStats)
    # drafting state: target features of committed tokens the drafter has not seen yet, one chunk per step (joined
    # when the drafter reads them, so that a long plain stretch costs no copy per step)
    pending_features: list[torch.Tensor] = field(default_factory=list)
    # expected survival per block slot, from this request's drafted steps (an exponential moving average)
    survival_estimate: list[float] | None = None

    @property
    def anchor_position(self) -> int:
        """Position of the last committed token (the next block's anchor)."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    @property
    def pending_context(self) -> int:
        """Committed positions the drafter has not read yet."""
        return sum(chunk.shape[0] for chunk in self.pending_features)


class DSparkEngine:
    """Batched speculative decoding with a DSpark drafter and a verification-length scheduler.

    ``scheduler``: ``"none"`` (plain batched decoding, no drafter call), ``"fixed"`` (``num_verify`` drafts per
    request), ``"threshold"`` (survival >= ``threshold``), ``"algorithm1"`` (Algorithm 1 on the cost table) or
    ``"async"`` (capacity from confidences two steps old, then top-K of the current survival).

    Costs of the cost-aware schedulers: ``cost_table`` (a :class:`CostTable` or :class:`PaddedCostTable`) and
    ``draft_cost`` (a :class:`DraftCost`). When ``cost_table`` is None both are profiled on the real models
    (:func:`generation.profile_verify_cost`, :func:`generation.profile_draft_cost`); a given ``cost_table`` without
    ``draft_cost`` (or ``draft_cost=False``) schedules as the paper does: full blocks drafted every step, drafting
    time left out of ``Theta``. ``adapt_costs=False`` keeps the tables as they are (no correction by measured step
    times) and the calibrated survival as the drafter gives it; ``correct_survival=False`` keeps only the survival as
    given (no scaling by the drafts accepted against it, `DepthPlanner.corrected`).

    ``depth_planner``: continue from another engine's ``engine.depth_planner`` on the same models (its tables, the
    survival and cost corrections it measured, its probe back-off), as a server that restarts its engine, or
    serves a new batch, would; ``cost_table``, ``draft_cost``, ``probe_interval``, ``adapt_costs`` and ``correct_survival`` then come from
    it.

    ``prompt_lookup_num_tokens``: hybrid drafting per request (`generation.decoding.hybrid`). After the drafter call, each row
    whose prompt-lookup continuation (at most ``min(prompt_lookup_num_tokens, block_size)`` tokens,
    ``max_matching_ngram_size`` as in Transformers) is expected to yield more accepted tokens than its DSpark block
    verifies the continuation instead (a point mass); the expectation reads the n-gram's measured acceptance per
    slot and match length, and for the block this step's ``c_1`` (the anchor's) times the row's conditional
    survival of earlier steps, never a token sampled in this step. Such rows leave the scheduler's admission; each
    round's ``proposal`` is in the request's stats."""

    def __init__(
        self,
        target,
        drafter=None,
        *,
        scheduler: str = "algorithm1",
        num_verify: int | None = None,
        threshold: float = 0.3,
        cost_table: CostTable | PaddedCostTable | None = None,
        draft_cost: DraftCost | bool | None = None,
        probe_interval: int = 16,
        adapt_costs: bool = True,
        correct_survival: bool = True,
        compact_slack: int = 32,
        depth_planner: DepthPlanner | None = None,
        prompt_lookup_num_tokens: int | None = None,
        max_matching_ngram_size: int = 2,
    ):
        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {scheduler!r}")
        if scheduler != "none" and drafter is None:
            raise ValueError(f"scheduler {scheduler!r} needs a drafter")
        if drafter is not None and getattr(drafter.config, "model_type", None) != "dspark":
            raise ValueError("DSparkEngine drafts with DSpark (or DFlash-as-DSpark) drafters only")
        if uses_sliding_window(target):
            raise ValueError(
                f"DSparkEngine supports full-attention targets only; {target.config.get_text_config().model_type} uses sliding-window attention, "
                "whose window would count the engine's rolled-back cache columns. Use generate(assistant_model=...) "
                "at batch size 1."
            )
        if drafter is not None:
            drafter.check_compatible(target)
            if scheduler in ("threshold", "algorithm1", "async") and drafter.confidence_head is None:
                raise ValueError(f"scheduler {scheduler!r} needs a drafter with a confidence head")
        # plain batched decoding ("none") never calls the drafter
        drafter = drafter if scheduler != "none" else None
        self.target, self.drafter, self.scheduler = target, drafter, scheduler
        self.block_size = drafter.config.block_size if drafter is not None else 0
        self.num_verify = self.block_size if num_verify is None else int(num_verify)
        if not 0 <= self.num_verify <= max(self.block_size, 0):
            raise ValueError(f"num_verify must be in [0, block_size={self.block_size}], got {self.num_verify}")
        self.threshold = float(threshold)
        if depth_planner is not None:
            if not isinstance(depth_planner, DepthPlanner):
                raise ValueError(f"depth_planner must be a DepthPlanner, got {type(depth_planner).__name__}")
            if scheduler not in ("algorithm1", "async"):
                raise ValueError(f"depth_planner plans for the cost-aware schedulers, not {scheduler!r}")
            if depth_planner.block_size != self.block_size:
                raise ValueError(f"depth_planner plans {depth_planner.block_size}-slot blocks, the drafter drafts {self.block_size}")
            if (cost_table is not None and cost_table is not depth_planner.cost_table) or draft_cost not in (None, depth_planner.draft_cost):
                raise ValueError("pass the cost tables or a depth_planner (which holds its own), not both")
            if depth_planner.models is not None and depth_planner.models != _measured_on(target, drafter):
                raise ValueError(
                    f"depth_planner was measured on other models or another device: {depth_planner.models} vs "
                    f"{_measured_on(target, drafter)}"
                )
            cost_table, draft_cost = depth_planner.cost_table, depth_planner.draft_cost
        if scheduler in ("algorithm1", "async") and cost_table is None:
            from generation.scheduling.profiler import profile_draft_cost, profile_verify_cost

            cost_table = profile_verify_cost(target, max_width=self.block_size + 1)
            if draft_cost is None:
                draft_cost = profile_draft_cost(target, drafter)
        if draft_cost is False or scheduler not in ("algorithm1", "async"):
            draft_cost = None
        if draft_cost is not None and not isinstance(draft_cost, DraftCost):
            raise ValueError(f"draft_cost must be a DraftCost, None or False, got {type(draft_cost).__name__}")
        if probe_interval < 1:
            raise ValueError(f"probe_interval must be >= 1, got {probe_interval}")
        if prompt_lookup_num_tokens is not None:
            if drafter is None:
                raise ValueError("prompt_lookup_num_tokens turns on hybrid drafting, which needs a drafter and a scheduler other than 'none'")
            prompt_lookup_num_tokens, max_matching_ngram_size = check_lookup_settings(prompt_lookup_num_tokens, max_matching_ngram_size)
        self.lookup_tokens = min(prompt_lookup_num_tokens, self.block_size) if prompt_lookup_num_tokens else 0
        self.max_ngram = int(max_matching_ngram_size)
        self.ngram_acceptance = SlotAcceptance(self.lookup_tokens) if self.lookup_tokens else None
        self.cost_table, self.draft_cost = cost_table, draft_cost
        # the depth of each step, planned from earlier steps (None: full blocks, as the paper drafts)
        if depth_planner is None and draft_cost is not None:
            depth_planner = DepthPlanner(
                cost_table, draft_cost, self.block_size, probe_interval=probe_interval, adapt_costs=adapt_costs,
                correct_survival=correct_survival,
            )  # fmt: skip
            depth_planner.models = _measured_on(target, drafter)
        self.depth_planner = depth_planner
        self.compact_slack = compact_slack
        self.four_d_mask = four_d_mask_pays(target)  # the verify forward's mask; the profiler times the same
        self.lm_head = target.get_output_embeddings()
        self.input_embeddings = target.get_input_embeddings()
        self.pad_token_id = target.generation_config.pad_token_id or 0
        eos = target.generation_config.eos_token_id
        self.default_eos = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.active: list[EngineRequest] = []
        self._rows: list[EngineRequest | None] = []  # the request of each cache row; None: free, its request left
        self.waiting: list[EngineRequest] = []
        self.finished: dict[int, EngineRequest] = {}
        self.target_cache = RaggedCache()
        self.draft_cache = RaggedCache()
        self._next_id = 0
        self._survival_history: collections.deque = collections.deque(maxlen=2)  # for the asynchronous variant
        self.step_log: list[dict] = []  # per step: active requests, tokens verified, tokens committed
        # wall time of the prefill forwards (each joining request's prompt and first token), which no scheduler changes
        self.prefill_seconds = 0.0

    # ------------------------------------------------------------------------------------------ requests
    def add_request(
        self, prompt_ids: Sequence[int] | torch.Tensor, *, max_new_tokens: int = 128, temperature: float = 0.0,
        top_p: float = 1.0, top_k: int = 0, eos_token_id: int | Sequence[int] | None = None,
        stop_strings: str | Sequence[str] | None = None, tokenizer=None,
        stopping_criteria: Sequence[StoppingCriteria] | None = None, repetition_penalty: float = 1.0, on_tokens=None,
    ) -> int:  # fmt: skip
        """Queue a request (joins at the next step); returns its id.

        Sampling: ``temperature`` (0 = greedy), ``top_k`` (0 = off) and ``top_p``, applied as Transformers' warpers
        are. Stopping, as ``generate()`` does and checked after every committed token, so the output ends exactly
        where plain decoding would: ``eos_token_id`` (one id or a list: stop token ids; default the target's EOS),
        ``stop_strings`` (with the ``tokenizer`` that decodes them) and ``stopping_criteria`` (Transformers'
        ``StoppingCriteria``, called with the prompt and the output so far, ``scores=None``)."""
        if isinstance(prompt_ids, torch.Tensor):
            if prompt_ids.dim() == 2 and prompt_ids.shape[0] != 1:
                raise ValueError("add_request takes one prompt; call it once per request")
            prompt_ids = prompt_ids.reshape(-1).tolist()
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("empty prompt")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"temperature must be >= 0 and top_p in (0, 1], got {temperature}, {top_p}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
        if repetition_penalty != 1.0:
            raise ValueError(
                f"repetition_penalty={repetition_penalty} is not supported by DSparkEngine (it would have to penalise each "
                "draft position by the tokens drafted before it); use generate(assistant_model=drafter), which applies it exactly"
            )
        criteria = StoppingCriteriaList(stopping_criteria or [])
        if stop_strings:
            if tokenizer is None:
                raise ValueError("stop_strings need the tokenizer that decodes the tokens: add_request(..., tokenizer=tok)")
            criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
        eos = self.default_eos if eos_token_id is None else frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        request = EngineRequest(
            self._next_id, prompt_ids, max_new_tokens, float(temperature), float(top_p), eos, int(top_k),
            criteria or None, on_tokens,
        )  # fmt: skip
        self._next_id += 1
        self.waiting.append(request)
        return request.request_id

    def has_work(self) -> bool:
        return bool(self.active or self.waiting)

    def generate(self, prompts: Sequence, progress: bool = False, **settings) -> list[list[int]]:
        """Run ``prompts`` (token id lists or [1, L] tensors) to completion; returns the new tokens of each."""
        from tqdm.auto import tqdm

        ids = [self.add_request(p, **settings) for p in prompts]
        with tqdm(total=len(ids), desc="requests", disable=not progress) as bar:
            while self.has_work():
                done = self.step()
                bar.update(len(done))
        return [self.finished[i].output_ids for i in ids]

    # ------------------------------------------------------------------------------------------ one step
    def _sampling(self, requests):
        """Each row's processing of logits [R, ..., V] (temperature, top-k, top-p) and which rows are greedy."""
        device = self.target.device
        temperature = torch.tensor([r.temperature for r in requests], device=device)
        top_p = torch.tensor([r.top_p for r in requests], device=device)
        top_k = torch.tensor([r.top_k for r in requests], device=device)
        return (lambda logits: process_logits(logits, temperature, top_p, top_k)), temperature <= 0

    def _feature_kwargs(self):
        if self.drafter is None:
            return {}
        return {"output_hidden_states": [i + 1 for i in self.drafter.config.target_layer_ids]}

    @torch.no_grad()
    def _prefill(self) -> list[EngineRequest]:
        """One right-padded forward over the prompts of the requests that joined; samples their first token."""
        new, self.waiting = self.waiting, []
        device = self.target.device
        width = max(len(r.prompt_ids) for r in new)
        lengths = torch.tensor([len(r.prompt_ids) for r in new], device=device)
        ids = torch.tensor([r.prompt_ids + [self.pad_token_id] * (width - len(r.prompt_ids)) for r in new], device=device)
        valid = torch.arange(width, device=device)[None] < lengths[:, None]
        cache = DynamicCache()
        # logits only where a prompt ends: all [rows, width, vocabulary] of them is gigabytes for a large batch
        ends, end_index = torch.unique(lengths - 1, return_inverse=True)
        out = self.target(
            input_ids=ids, attention_mask=valid.long(), position_ids=torch.arange(width, device=device)[None].expand(len(new), -1),
            cache=cache, use_cache=True, logits_to_keep=ends, **self._feature_kwargs(),
        )  # fmt: skip
        rows = torch.arange(len(new), device=device)
        process, greedy = self._sampling(new)
        last = process(out.logits[rows, end_index].float())
        first = sample_tokens(last, greedy).tolist()
        features = self.drafter.context_features(out.hidden_states) if self.drafter is not None else None
        # newcomers take the rows of requests that left first (written in place), the rest are appended
        free = [i for i, r in enumerate(self._rows) if r is None][: len(new)]
        joined = RaggedCache(cache, valid.cpu())
        self.target_cache.replace_rows(free, joined.select_rows(range(len(free))))
        self.target_cache.append_rows(joined.select_rows(range(len(free), len(new))))
        if self.drafter is not None:
            self.draft_cache.replace_rows(free, RaggedCache(valid=torch.zeros(len(free), 0, dtype=torch.bool)))
            self.draft_cache.append_rows(RaggedCache(valid=torch.zeros(len(new) - len(free), 0, dtype=torch.bool)))
        for i, r in enumerate(new):
            if features is not None:
                r.pending_features = [features[i, : len(r.prompt_ids)]]
            if i < len(free):
                self._rows[free[i]] = r
            else:
                self._rows.append(r)
            self.active.append(r)
            self._commit(r, [first[i]])
        return new

    def _drop_free_rows(self) -> None:
        """Drop the rows no request holds, so that every row of the next forward is a live request."""
        keep = [i for i, r in enumerate(self._rows) if r is not None]
        if len(keep) < len(self._rows):
            self.target_cache.keep_rows(keep)
            if self.drafter is not None:
                self.draft_cache.keep_rows(keep)
            self._rows = [self._rows[i] for i in keep]
        self.active = list(self._rows)

    @torch.no_grad()
    def _draft(self, requests, depth: int):
        """One drafter forward for every row, the first ``depth`` slots sampled; returns tokens [R, D], processed
        logits q [R, D, V] and raw confidence logits [R, D] (None without a confidence head)."""
        drafter, device = self.drafter, self.drafter.device
        num_rows, gamma = len(requests), self.block_size
        counts = [r.pending_context for r in requests]
        width = max(counts)
        first = requests[0].pending_features[0]
        feats = torch.zeros(num_rows, width, first.shape[-1], dtype=first.dtype, device=device)
        for i, r in enumerate(requests):
            feats[i, : counts[i]] = torch.cat(r.pending_features).to(device)
        ctx_valid = torch.arange(width)[None] < torch.tensor(counts)[:, None]
        anchors_pos = torch.tensor([r.anchor_position for r in requests])
        ctx_pos = anchors_pos[:, None] - torch.tensor(counts)[:, None] + torch.arange(width)[None]
        block_pos = anchors_pos[:, None] + torch.arange(gamma)[None]
        positions = torch.cat([ctx_pos.clamp(min=0), block_pos], dim=1).to(device)
        mask = torch.cat([self.draft_cache.valid, ctx_valid, torch.ones(num_rows, gamma, dtype=torch.bool)], dim=1)
        mask = mask[:, None, None, :].expand(-1, 1, gamma, -1).to(device)
        anchors = torch.tensor([r.output_ids[-1] for r in requests], device=device)
        out = drafter(
            block_embeds=drafter.embed_block(anchors, self.input_embeddings), context_features=feats,
            position_ids=positions, attention_mask=mask, cache=self.draft_cache.cache,
        )  # fmt: skip
        self.draft_cache.extend(ctx_valid)
        for r in requests:
            r.pending_features = []
        # the whole block goes through the backbone (its slots attend to each other), the LM head only where sampled
        process, greedy = self._sampling(requests)
        block = draft_block(
            drafter, out.last_hidden_state, self.lm_head, anchors, num_slots=depth, greedy=greedy,
            logits_processor=lambda ids, logits: process(logits),
        )  # fmt: skip
        return block.tokens, block.logits, block.confidence_logits

    def _survival(self, confidence_logits, drafted):
        """Calibrated cumulative survival per request over its drafted slots."""
        survival = self.drafter.survival(confidence_logits).tolist()
        return [s[:n] for s, n in zip(survival, drafted)]

    def _plan_depth(self, requests, context: int, remaining: Sequence[int]) -> int:
        """Slots to draft this step, decided before drafting (from earlier steps only); ``context``: the new positions
        per row the drafter would read first; ``remaining``: each row's tokens left."""
        if self.scheduler == "none":
            return 0
        if self.scheduler == "fixed":
            return self.num_verify
        if self.depth_planner is None:
            return self.block_size
        return self.depth_planner.plan([r.survival_estimate for r in requests], context, sum(remaining) / len(remaining))

    @staticmethod
    def _pending_width(requests) -> int:
        """New context positions the drafter reads per row at its next call (right-padded to the longest row's)."""
        return max(r.pending_context for r in requests)

    def _schedule(self, requests, drafted, depth, confidence_logits, ngram_rows, context) -> tuple[list[int], list | None]:
        """Verification lengths of the drafted blocks, and the calibrated survival they were scheduled on (None for
        fixed lengths; empty for rows in ``ngram_rows``, which verify their n-gram instead and get 0 here)."""
        if self.scheduler == "fixed":
            return schedule_fixed([0 if i in ngram_rows else n for i, n in enumerate(drafted)], self.num_verify), None
        survival = self._survival(confidence_logits, drafted)
        if self.depth_planner is not None:
            estimates = self.depth_planner.update_estimates([r.survival_estimate for r in requests], survival)
            for r, e in zip(requests, estimates):
                r.survival_estimate = e
        calibrated = survival = [[] if i in ngram_rows else s for i, s in enumerate(survival)]
        if self.depth_planner is not None:
            survival = self.depth_planner.corrected(survival)
        if self.scheduler == "threshold":
            return schedule_threshold(survival, self.threshold), calibrated
        if self.scheduler == "algorithm1":
            if self.depth_planner is not None:  # the corrected survival, the drafting time spent
                return self.depth_planner.cut(calibrated, depth, context), calibrated
            return schedule_algorithm1(survival, self.cost_table), calibrated  # the paper's costs: drafting left out
        spent = self.draft_cost.draft_seconds(len(requests), depth, context) if self.draft_cost is not None else 0.0
        # asynchronous: the budget comes from the oldest remembered step (two steps back once warm)
        if self._survival_history:
            capacity = async_capacity(self._survival_history[0], self.cost_table, num_requests=len(requests), draft_seconds=spent)
        else:
            capacity = len(requests)
        self._survival_history.append(survival)
        return schedule_top_k(survival, capacity), calibrated

    def _ngram_rows(self, requests, remaining, drafted, confidence_logits) -> dict:
        """Rows that verify their prompt-lookup continuation this step: ``{row: NgramProposal}``. The comparison reads
        the n-gram's measured acceptance and, for the block, this step's ``c_1`` (the anchor's) and earlier steps,
        corrected as the scheduler corrects survival."""
        first = None
        if confidence_logits is not None and confidence_logits.shape[1]:
            first = self.drafter.calibrated_confidence(confidence_logits[:, :1].float())[:, 0].tolist()
        chosen = {}
        for i, r in enumerate(requests):
            room = min(self.lookup_tokens, remaining[i] - 1)
            if room <= 0:
                continue
            eos = torch.tensor(sorted(r.eos_token_ids), dtype=torch.long) if r.eos_token_ids else None
            proposal = ngram_continuation(torch.tensor(r.prompt_ids + r.output_ids), self.max_ngram, room, eos)
            if not len(proposal.tokens):
                continue
            expected_ngram = sum(self.ngram_acceptance.survival(proposal.match_length, len(proposal.tokens)))
            if first is not None and drafted[i]:
                block = anchored_survival(first[i], r.survival_estimate, drafted[i])
            else:  # no confidence head, or no block this step: earlier steps' estimate (none: nothing drafted)
                block = (r.survival_estimate or [0.0])[: drafted[i]] if drafted[i] else []
            if self.depth_planner is not None:  # as the scheduler reads it
                block = self.depth_planner.corrected([block])[0]
            expected_block = sum(block)
            if expected_ngram > expected_block:
                chosen[i] = proposal
        return chosen

    @torch.no_grad()
    def step(self) -> list[EngineRequest]:
        """Advance every request by one draft-and-verify round; returns the requests that finished."""
        done = []
        if self.waiting:
            started = time.perf_counter()
            self._prefill()
            self.prefill_seconds += time.perf_counter() - started
            done += self._retire()
        self._drop_free_rows()
        requests = self.active
        if not requests:
            return done
        device = self.target.device
        num_rows = len(requests)
        started = time.perf_counter()
        remaining = [r.max_new_tokens - len(r.output_ids) for r in requests]
        context = self._pending_width(requests) if self.drafter is not None else 0
        depth = min(self._plan_depth(requests, context, remaining), max(remaining) - 1)
        drafted = [max(0, min(depth, n - 1)) for n in remaining]
        if self.drafter is not None and depth > 0:
            drafts, draft_logits, confidence_logits = self._draft(requests, depth)
        else:
            drafts = torch.zeros(num_rows, 0, dtype=torch.long, device=device)
            draft_logits, confidence_logits = None, None
        if self.depth_planner is not None:
            self.depth_planner.drafted(drafts.shape[1])
        if not drafts.shape[1]:
            drafted = [0] * num_rows
        ngram_rows = self._ngram_rows(requests, remaining, drafted, confidence_logits) if self.ngram_acceptance is not None else {}
        lengths, survival = self._schedule(requests, drafted, depth, confidence_logits, ngram_rows, context) if drafts.shape[1] else ([0] * num_rows, None)
        if ngram_rows:
            drafts, draft_logits = self._with_ngram_rows(drafts, draft_logits, ngram_rows, lengths)
        longest = max(lengths)
        q_len = 1 + longest
        ids = torch.full((num_rows, q_len), self.pad_token_id, dtype=torch.long, device=device)
        ids[:, 0] = torch.tensor([r.output_ids[-1] for r in requests], device=device)
        if longest:
            ids[:, 1:] = drafts[:, :longest].to(device)
        lengths_t = torch.tensor(lengths, device=device)
        new_valid = torch.arange(q_len, device=device)[None] < (1 + lengths_t)[:, None]
        anchors_pos = torch.tensor([r.anchor_position for r in requests], device=device)
        out = self.target(
            input_ids=ids, attention_mask=self.target_cache.attention_mask(new_valid, four_d=self.four_d_mask).to(device),
            position_ids=anchors_pos[:, None] + torch.arange(q_len, device=device)[None], cache=self.target_cache.cache,
            use_cache=True, **self._feature_kwargs(),
        )  # fmt: skip
        process, greedy = self._sampling(requests)
        target_logits = process(out.logits.float())
        accepted, next_token = verify_drafts(
            target_logits, draft_logits[:, :longest] if draft_logits is not None else None, ids[:, 1:], lengths_t, greedy
        )
        # roll back: keep the anchor and the accepted drafts of each row
        keep = torch.arange(q_len, device=device)[None] < (1 + accepted)[:, None]
        self.target_cache.extend(keep.cpu())
        features = self.drafter.context_features(out.hidden_states) if self.drafter is not None else None
        accepted_l, next_l, ids_l = accepted.tolist(), next_token.tolist(), ids.tolist()
        for i, r in enumerate(requests):
            n = accepted_l[i]
            if features is not None:
                r.pending_features.append(features[i, : 1 + n])
            if i in ngram_rows:
                match = ngram_rows[i].match_length
                self.ngram_acceptance.record(match, lengths[i], n)
                r.stats.rounds.append(DSparkRound(drafted=drafted[i], verified=lengths[i], accepted=n, proposal="ngram", match_length=match))
            else:
                z = confidence_logits[i, : lengths[i]].tolist() if confidence_logits is not None else []
                kind = "dspark" if drafted[i] else "plain"
                r.stats.rounds.append(DSparkRound(drafted=drafted[i], verified=lengths[i], accepted=n, confidence_logits=z, proposal=kind))
            self._commit(r, ids_l[i][1 : 1 + n] + [next_l[i]])
        if self.depth_planner is not None:  # rows that verified an n-gram have empty survival here
            self.depth_planner.record_round(
                depth if drafts.shape[1] else 0, lengths, accepted_l, time.perf_counter() - started, survival=survival,
                committed=None if ngram_rows else int(sum(accepted_l)) + num_rows,  # an n-gram's tokens are not drafting's
                context=context,
            )  # fmt: skip
        self.step_log.append({"active": num_rows, "drafted": depth if drafts.shape[1] else 0,
                              "verified": int(sum(lengths)) + num_rows, "committed": int(sum(accepted_l)) + num_rows})  # fmt: skip
        done += self._retire()
        self.target_cache.compact(self.compact_slack)
        self.draft_cache.compact(self.compact_slack)
        return done

    def _with_ngram_rows(self, drafts, draft_logits, ngram_rows, lengths):
        """Drafts and q with the n-gram rows' continuations (point masses) in place of their blocks; sets their lengths."""
        num_rows, depth = drafts.shape
        width = max([depth] + [len(p.tokens) for p in ngram_rows.values()])
        vocab = self.lm_head.weight.shape[0]
        tokens = torch.zeros(num_rows, width, dtype=torch.long, device=drafts.device)
        tokens[:, :depth] = drafts
        q = torch.zeros(num_rows, width, vocab, dtype=torch.float32, device=drafts.device)  # slots past a row's length: unused
        if draft_logits is not None:
            q[:, :depth] = draft_logits.float()
        for i, proposal in ngram_rows.items():
            n = len(proposal.tokens)
            tokens[i, :n] = proposal.tokens.to(drafts.device)
            q[i, :n] = one_hot_logits(tokens[i, :n], vocab)
            lengths[i] = n
        return tokens, q

    def _commit(self, request: EngineRequest, tokens: list[int]) -> None:
        """Append tokens, cut after the first one that ends the request (EOS, a stopping criterion) or at the
        token limit, stream them."""
        room = request.max_new_tokens - len(request.output_ids)
        tokens = tokens[:room]
        for j, t in enumerate(tokens):
            if t in request.eos_token_ids or self._stops(request, tokens[: j + 1]):
                tokens = tokens[: j + 1]
                request.finished = True
                break
        request.output_ids.extend(tokens)
        if len(request.output_ids) >= request.max_new_tokens:
            request.finished = True
        if request.on_tokens is not None and tokens:
            request.on_tokens(request.request_id, tokens)

    @staticmethod
    def _stops(request: EngineRequest, tokens: list[int]) -> bool:
        """Whether the request's stopping criteria fire once ``tokens`` are appended to its output."""
        if request.stopping_criteria is None:
            return False
        ids = torch.tensor([request.prompt_ids + request.output_ids + tokens])
        return bool(request.stopping_criteria(ids, None).any())

    def _retire(self) -> list[EngineRequest]:
        done = [r for r in self.active if r.finished]
        if done:
            # their rows stay until the next step: a request joining then takes one over without copying the cache
            self._rows = [None if r is None or r.finished else r for r in self._rows]
            self.active = [r for r in self.active if not r.finished]
            for r in done:
                r.pending_features = []
                self.finished[r.request_id] = r
        return done
