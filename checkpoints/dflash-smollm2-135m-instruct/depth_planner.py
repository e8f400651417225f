"""How many slots to draft, decided before drafting, from what earlier rounds showed.

`DepthPlanner` is shared by the batched engine (R rows per step) and by ``generate(assistant_model=...)`` with
``dspark_truncation="cost"`` (one row). It keeps a moving average of each row's calibrated survival per slot,
plans the depth D that maximises ``Theta = tau / (T_draft(R, D) + T_verify)`` on those estimates
(`scheduler.plan_draft_depth`, D = 0 skips the drafter; a one-row step is planned over the last drafted blocks
themselves, :meth:`DepthPlanner.plan_over_blocks`, since Algorithm 1 cuts each step where it falls), and
corrects the cost tables online: every round's wall time is divided by what the tables predict, per (load level,
depth). Last, it checks the plan against the outcome: where the rounds that drafted have committed fewer tokens per
second than the plain rounds at the same load level, over enough rounds of each to tell, it does not draft
(:meth:`DepthPlanner.drafting_trails`). A depth chosen before anything is drafted cannot depend on the drafts, so
the plan is lossless whatever it reads from the past.

The calibrated survival is a model too: calibration fits one decoding mode's confidences on one set of prompts,
and a server's requests differ, slot by slot (measured with the v14 drafter on SmolLM2: greedy math accepts 0.62 /
0.39 / 0.21 / 0.15 at slots 1-4 where the calibrated survival promises 0.58 / 0.29 / 0.14 / 0.08, and T = 1 math
0.39 / 0.13 / 0.05 / 0.01 against 0.49 / 0.24 / 0.12 / 0.06). The planner therefore compares, per slot, how often
the verified drafts of earlier rounds reached it with what their survival promised, and scales every survival it
plans with, and the engine schedules with, by those ratios (:meth:`DepthPlanner.corrected`): factors from past
rounds only, the curve kept non-increasing from its first slot on, so an admission still depends only on survival
up to the slot admitted. ``correct_survival=False`` turns this correction off, ``adapt_costs=False`` turns it off
with that of the tables.

Probes keep the estimates fresh: with no estimate yet, or after ``probe_interval - 1`` rounds without drafting,
one slot is drafted; a plain round is taken first at each load level and every ``probe_interval`` planned rounds,
so the point the plan compares with is measured too. A probe after which the tables still skip the drafter doubles
the wait for the next one (up to ``8 * probe_interval``), so a machine where drafting cannot pay spends little on
looking; the first plan that drafts again resets it. Whatever the wait, probes take at most ``PROBE_BUDGET`` of the
time: a probe that costs p plain rounds more than a plain one comes at least p / ``PROBE_BUDGET`` rounds after the
drafter last ran (:meth:`DepthPlanner.probe_price`), which under load, where a probe widens every row's verification
and first reads every position the drafter missed (the prompts of requests that joined, at the least), is the longer
wait. A plan dropped by the throughput check keeps probing at
``probe_interval``: that check rests on noisy token counts, and only drafted rounds can overturn it.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Sequence

from .scheduler import DraftCost, level_cuts, plan_draft_depth, schedule_algorithm1

__all__ = ["DepthPlanner", "blend_survival", "extend_survival", "generate_planner"]

# drafter -> target -> planners of generate(assistant_model=...) calls, dropped with the models
_GENERATE_PLANNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def extend_survival(survival: Sequence[float], depth: int) -> list[float]:
    """A survival curve observed over its first slots, continued to ``depth`` slots at the last observed
    per-slot acceptance (``a_k / a_{k-1}``; the first slot's own survival when only it was seen): the geometric
    model of a drafter whose every slot is accepted alike, which neither rules deeper slots out nor promises them
    the last slot's survival outright."""
    out = list(survival)
    rate = out[-1] / out[-2] if len(out) > 1 and out[-2] > 0 else out[-1]
    while len(out) < depth:
        out.append(out[-1] * min(rate, 1.0))
    return out


def blend_survival(old: list[float] | None, new: Sequence[float], depth: int) -> list[float]:
    """Moving average (weight 1/2) of a survival curve over ``depth`` slots, kept non-increasing. Slots beyond the
    observed ones average in :func:`extend_survival`'s continuation of the observation: kept as they were, an
    estimate that once came out low would stop the planner from drafting deep enough to ever see them again."""
    observed = extend_survival(new, depth)
    merged = observed if not old else [0.5 * a + 0.5 * b for a, b in zip(old, observed)]
    return [min(merged[: k + 1]) for k in range(len(merged))]


class DepthPlanner:
    def __init__(
        self, cost_table, draft_cost: DraftCost, block_size: int, *, probe_interval: int = 16, adapt_costs: bool = True,
        correct_survival: bool = True,
    ):
        if not isinstance(draft_cost, DraftCost):
            raise ValueError(f"draft_cost must be a DraftCost, got {type(draft_cost).__name__}")
        if draft_cost.max_depth < block_size:
            raise ValueError(f"draft_cost covers {draft_cost.max_depth} slots, the drafter drafts {block_size}")
        if probe_interval < 1:
            raise ValueError(f"probe_interval must be >= 1, got {probe_interval}")
        self.cost_table, self.draft_cost, self.block_size = cost_table, draft_cost, block_size
        self.probe_interval, self.adapt_costs, self.correct_survival = probe_interval, adapt_costs, correct_survival
        self.probe_wait = probe_interval  # rounds between one-slot probes while the plan skips the drafter
        self._probed = False  # the last round was such a probe
        self.mean_survival: list[float] | None = None  # over every drafted row, for rows not drafted yet
        self.rounds_since_draft = 0
        self.planned_rounds = 0
        self.cost_ratio: dict[tuple[int, int], float] = {}  # (load level, depth) -> measured / modelled time
        # (load level, drafted) -> [committed tokens, seconds, rounds]; tokens and seconds decay per round
        self.throughput_sums: dict[tuple[int, bool], list[float]] = {}
        self.models: tuple | None = None  # set by the engine that made it: what its measurements are of
        # per slot: verified rounds that reached it, the calibrated survival they promised it (decayed sums)
        self.slot_sums = [[0.0, 0.0] for _ in range(block_size)]
        self._timed_a_draft = False  # the first drafted round is not timed: it pays one-off costs
        # the calibrated survival of the last drafted blocks, each continued to block_size slots (extend_survival)
        self.recent_blocks: collections.deque = collections.deque(maxlen=self.BLOCK_MEMORY)

    def plan(
        self, estimates: Sequence[list[float] | None], context: int = DraftCost.BASE_CONTEXT, tokens_left: float | None = None
    ) -> int:
        """Slots to draft this round for rows with these survival estimates (None: nothing seen for that row);
        ``context``: new positions per row the drafter would read first (the longest row's); ``tokens_left``: tokens
        the rows have yet to generate, on average (None: unbounded).

        The catch-up over the positions the drafter missed is paid once to draft from here on, so the plan spreads it
        over the tokens left: it decides whether drafting for the rest of the requests earns it back (a batch of
        fresh 400-token prompts at R = 32 costs an fp32 drafter on a 2-core CPU 0.8 s, 2.5 plain rounds, first). A
        probe pays all of it for one look, so its price does too."""
        estimates = [e or self.mean_survival for e in estimates]
        if any(e is None for e in estimates):
            return 1  # nothing known yet: one slot is the cheapest look
        estimates = self.corrected(estimates)
        price = self.probe_price(len(estimates), context)
        if self.rounds_since_draft + 1 >= max(self.probe_wait, price / self.PROBE_BUDGET):
            self._probed = True
            return 1  # time to refresh what is known
        level = self.load_level(len(estimates))
        self.planned_rounds += 1
        if self.adapt_costs and ((level, 0) not in self.cost_ratio or self.planned_rounds % self.probe_interval == 0):
            return 0  # measure a plain round at this load, and re-measure it now and then
        catch_up = self.draft_cost.catch_up_seconds(len(estimates), context)
        catch_up_per_token = catch_up / (len(estimates) * max(tokens_left, 1.0)) if tokens_left is not None else 0.0
        if self.plans_over_blocks(len(estimates)):
            depth = self.plan_over_blocks(len(estimates), level, catch_up_per_token)
        else:
            depth = plan_draft_depth(
                estimates, self.cost_table, self.draft_cost, self.block_size, cost_scale=lambda d: self.scale(level, d),
                catch_up_per_token=catch_up_per_token,
            )  # fmt: skip
        if depth > 0:
            self.probe_wait = self.probe_interval
            if self.drafting_trails(level):
                depth = 0
        elif self._probed:  # the look did not change the plan: look less often
            self.probe_wait = min(2 * self.probe_wait, 8 * self.probe_interval)
        self._probed = False
        return depth

    # drafted blocks the plan over blocks reads, and how many steps' worth of them it needs (a step of R rows takes
    # R blocks) before it replaces the plan on the rows' estimates; the most rows a step may have to be planned so:
    # under load at T = 1 on a 2-core CPU, steps of 2 and 4 rows planned over blocks drafted more than on the
    # estimates and gained nothing (benchmarks/results/load_ab_planner_blocks_avx2), one row gained 10 %
    BLOCK_MEMORY = 16
    MIN_BLOCKS = 4
    MAX_BLOCK_ROWS = 1

    def plans_over_blocks(self, num_rows: int) -> bool:
        """Whether a step of ``num_rows`` rows is planned over the recent blocks (:meth:`plan_over_blocks`): up to
        :attr:`MAX_BLOCK_ROWS` rows, once they hold :attr:`MIN_BLOCKS` steps' worth, and for several rows only with a
        right-padded cost table (the engine's), under which a step's cut depends on its rows' survival summed per
        slot alone."""
        if num_rows > self.MAX_BLOCK_ROWS or (num_rows > 1 and not getattr(self.cost_table, "padded", False)):
            return False
        return num_rows * self.MIN_BLOCKS <= len(self.recent_blocks)

    def plan_over_blocks(self, num_rows: int, level: int, catch_up_per_token: float = 0.0) -> int:
        """The depth from the last drafted blocks (:attr:`recent_blocks`, corrected) instead of the rows' average
        survival: each run of ``num_rows`` consecutive blocks stands for a step, and the depth D is the one whose
        steps, each cut by Algorithm 1 on its first D slots as the step itself would cut them
        (:func:`~generation.scheduling.scheduler.level_cuts`, the drafting time spent), commit the most tokens per
        second over all of them, against plain decoding. A plan on the average prices every step as the average
        block: a deep draft pays on the blocks whose survival stays high and is cut short on the others, and only
        the blocks themselves show how often each happens. Times are scaled by the level's measured ratios, with
        ``catch_up_per_token`` added to each depth's time per token, as in `plan_draft_depth`."""
        blocks = self.corrected(self.recent_blocks)
        steps = [blocks[i : i + num_rows] for i in range(len(blocks) - num_rows + 1)]
        # per slot, the survival summed over the step's rows
        gains = [[sum(b[j] for b in step) for j in range(self.block_size)] for step in steps]
        plain = self.cost_table.step_seconds(num_rows, num_rows, 1)
        best_depth, best = 0, num_rows / (self.scale(level, 0) * plain)
        for depth in range(1, self.block_size + 1):
            cuts = level_cuts([g[:depth] for g in gains], self.cost_table, num_rows, self.draft_cost.draft_seconds(num_rows, depth))
            tau, seconds = sum(cut.tau for cut in cuts), sum(cut.seconds for cut in cuts)
            theta = 1.0 / (self.scale(level, depth) * seconds / tau + catch_up_per_token)
            if theta > best:
                best_depth, best = depth, theta
        return best_depth

    # share of the time that probes may take while the plan skips the drafter: a probe costing p plain rounds more
    # than a plain round waits at least p / PROBE_BUDGET rounds after the drafter last ran
    PROBE_BUDGET = 0.02

    def probe_price(self, num_rows: int, context: int = DraftCost.BASE_CONTEXT) -> float:
        """What a one-slot probe of ``num_rows`` rows costs beyond a plain round, in plain rounds: the tables,
        with the drafter's catch-up over ``context`` new positions per row, scaled by the measured round times of
        this load level."""
        level = self.load_level(num_rows)
        plain = self.modelled_seconds(num_rows, 0, [0] * num_rows) * self.scale(level, 0)
        probe = self.modelled_seconds(num_rows, 1, [1] * num_rows, context) * self.scale(level, 1)
        return max(0.0, probe / plain - 1.0)

    def drafted(self, depth: int) -> None:
        """Count the round: whether the drafter ran decides when the next probe is due."""
        self.rounds_since_draft = 0 if depth > 0 else self.rounds_since_draft + 1

    def update_estimates(self, estimates: Sequence[list[float] | None], survival: Sequence[Sequence[float]]) -> list:
        """New per-row estimates after a drafted round (rows with no drafted slot keep theirs); also folds the
        rows' mean into ``mean_survival`` and each drafted block into ``recent_blocks``."""
        updated = [blend_survival(e, s, self.block_size) if s else e for e, s in zip(estimates, survival)]
        observed = [s for s in survival if s]
        self.recent_blocks.extend(extend_survival(s, self.block_size) for s in observed)
        if observed:
            depth = min(len(s) for s in observed)
            mean = [sum(s[k] for s in observed) / len(observed) for k in range(depth)]
            self.mean_survival = blend_survival(self.mean_survival, mean, self.block_size)
        return updated

    def cut(self, survival: Sequence[Sequence[float]], depth: int, context: int = DraftCost.BASE_CONTEXT) -> list[int]:
        """Verification lengths of drafted blocks (their calibrated survival): Algorithm 1 on the survival as
        corrected (:meth:`corrected`), the ``depth``-slot drafting over ``context`` new positions already spent."""
        spent = self.draft_cost.draft_seconds(len(survival), depth, context)
        return schedule_algorithm1(self.corrected(survival), self.cost_table, draft_seconds=spent)

    def record_round(
        self, depth: int, lengths: Sequence[int], accepted: Sequence[int], seconds: float, *,
        survival: Sequence[Sequence[float]] | None = None, committed: int | None = None,
        context: int = DraftCost.BASE_CONTEXT,
    ) -> None:  # fmt: skip
        """Everything a verified round teaches: its drafted rows' acceptance against their ``survival`` (None when
        no row verified the drafter's block; see :meth:`record_acceptance`) and its wall time (see
        :meth:`record_round_time`)."""
        if survival is not None:
            self.record_acceptance(survival, lengths, accepted)
        self.record_round_time(len(lengths), depth, lengths, seconds, committed, context)

    # decay per verified round of the slot sums (a window of about 30 rounds); the promised accepted drafts at
    # which a slot's own evidence weighs as much as the factor of the slot before it (1 before the first slot);
    # the bounds keep one odd stretch of requests from switching drafting off or on outright
    ACCEPTANCE_DECAY = 0.97
    ACCEPTANCE_PRIOR = 4.0
    SURVIVAL_SCALE_BOUNDS = (0.25, 2.0)

    def record_acceptance(self, survival: Sequence[Sequence[float]], lengths: Sequence[int], accepted: Sequence[int]) -> None:
        """Fold a verified round into the slot sums: per row, the calibrated (uncorrected) survival of its
        drafted slots, the drafts it verified and how many of those the target accepted."""
        # rows that verified something else (an n-gram: no survival) say nothing of the drafter's
        rows = [(s, min(n, len(s), len(self.slot_sums)), a) for s, n, a in zip(survival, lengths, accepted)]
        if not (self.adapt_costs and self.correct_survival) or not any(n for _, n, _ in rows):
            return
        decay = self.ACCEPTANCE_DECAY
        for sums in self.slot_sums:
            sums[0] *= decay
            sums[1] *= decay
        for s, n, a in rows:
            for k in range(n):
                self.slot_sums[k][0] += float(a > k)
                self.slot_sums[k][1] += s[k]

    @property
    def survival_scales(self) -> list[float]:
        """Per slot, how often recent verified rounds reached it over how often their survival promised it would,
        shrunk towards the factor of the slot before (:attr:`ACCEPTANCE_PRIOR`): ``(reached + P f_{k-1}) /
        (promised + P)``, with ``f_{-1} = 1``, within :attr:`SURVIVAL_SCALE_BOUNDS`. A slot seldom verified so
        takes the factor of the slots before it."""
        low, high = self.SURVIVAL_SCALE_BOUNDS
        prior, factors = 1.0, []
        for reached, promised in self.slot_sums:
            prior = min(max((reached + self.ACCEPTANCE_PRIOR * prior) / (promised + self.ACCEPTANCE_PRIOR), low), high)
            factors.append(prior)
        return factors

    def corrected(self, survival: Sequence[Sequence[float]]) -> list[list[float]]:
        """Survival curves scaled slot by slot by :attr:`survival_scales`, capped at 1 and kept non-increasing
        (slot k reads the factors and survival of slots up to k only)."""
        scales = self.survival_scales
        out = []
        for s in survival:
            curve, last = [], 1.0
            for a, f in zip(s, scales):
                last = min(last, f * a)
                curve.append(last)
            out.append(curve)
        return out

    # decay per round of the throughput sums (a window of about 20 rounds), and the rounds each side needs before
    # the check may drop a plan: a drafted round commits 1 to D + 1 tokens per row, so a few rounds cannot tell
    # a 20 % gain from a loss; a plain round commits one per row, and its time varies little
    THROUGHPUT_DECAY = 0.95
    EVIDENCE_ROUNDS = {True: 12, False: 2}

    def throughput(self, level: int, drafted: bool) -> float | None:
        """Committed tokens per second of this load level's drafted or plain rounds (decayed sums), None until
        :attr:`EVIDENCE_ROUNDS` rounds are measured."""
        sums = self.throughput_sums.get((level, drafted))
        if sums is None or sums[2] < self.EVIDENCE_ROUNDS[drafted]:
            return None
        return sums[0] / sums[1]

    def drafting_trails(self, level: int) -> bool:
        """Whether the rounds that drafted at this load level committed fewer tokens per second than the plain ones:
        the tables and survival estimates are models, and a plan they favour is dropped when it is losing in fact.
        Probes keep measuring the drafted side."""
        drafted, plain = self.throughput(level, True), self.throughput(level, False)
        return self.adapt_costs and drafted is not None and plain is not None and drafted < plain

    @staticmethod
    def load_level(num_rows: int) -> int:
        return 1 << (num_rows - 1).bit_length()  # 1, 2, 4, 8, ...: rows whose costs behave alike

    def scale(self, level: int, depth: int) -> float:
        if (level, depth) in self.cost_ratio:
            return self.cost_ratio[level, depth]
        known = [r for (lv, _), r in self.cost_ratio.items() if lv == level]
        return sum(known) / len(known) if known else 1.0

    def modelled_seconds(
        self, num_rows: int, depth: int, lengths: Sequence[int], context: int = DraftCost.BASE_CONTEXT
    ) -> float:
        width = 1 + max(lengths, default=0)
        verify = self.cost_table.step_seconds(num_rows, num_rows + sum(lengths), width)
        return self.draft_cost.draft_seconds(num_rows, depth, context) + verify

    def record_round_time(
        self, num_rows: int, depth: int, lengths: Sequence[int], seconds: float, committed: int | None = None,
        context: int = DraftCost.BASE_CONTEXT,
    ) -> None:  # fmt: skip
        """Fold a measured round time into the (load level, depth) ratio of measured to modelled time (the model
        with the drafter's catch-up over ``context`` new positions per row, so the ratio is not of how long the drafter
        had waited) and, given the
        tokens the round ``committed`` (None for a round that verified something else, an n-gram), into the
        level's throughput sums of drafted or plain rounds: a ratio of sums, since a mean of per-round rates
        overweights the rounds that happened to commit much in little time.

        The planner's first drafted round is left out: the drafter's first call builds what it keeps (the Markov
        head's bigram table, the product of its two factors), and a depth drafted as rarely as a probe's would carry
        that one ratio for hundreds of rounds."""
        if not self.adapt_costs or seconds <= 0:
            return
        if depth > 0 and not self._timed_a_draft:
            self._timed_a_draft = True
            return
        level = self.load_level(num_rows)
        key = (level, depth)
        ratio = seconds / self.modelled_seconds(num_rows, depth, lengths, context)
        self.cost_ratio[key] = ratio if key not in self.cost_ratio else 0.7 * self.cost_ratio[key] + 0.3 * ratio
        if committed is not None:
            tokens, total, rounds = self.throughput_sums.get((level, depth > 0), (0.0, 0.0, 0))
            decay = self.THROUGHPUT_DECAY
            self.throughput_sums[level, depth > 0] = [decay * tokens + committed, decay * total + seconds, rounds + 1]


def generate_planner(target, drafter, generation_config=None) -> tuple:
    """``(planner, cost_table)`` for ``generate(assistant_model=drafter)`` with ``dspark_truncation="cost"``: one
    row, the tables from ``generation_config.dspark_cost_table`` / ``dspark_draft_cost`` or profiled on these
    models (once per machine, cached on disk); ``dspark_adapt_costs=False`` keeps them uncorrected. The planner lives on the drafter per target and dtype, so what one
    call learns about the real round times (and the drafter's survival) carries over to the next call."""
    cost_table = getattr(generation_config, "dspark_cost_table", None)
    draft_cost = getattr(generation_config, "dspark_draft_cost", None)
    adapt = bool(getattr(generation_config, "dspark_adapt_costs", True))
    block = drafter.config.block_size
    lookup = getattr(generation_config, "prompt_lookup_num_tokens", None) or 0  # hybrid rounds verify up to this many
    max_width = max(block, int(lookup)) + 1
    key = (target.dtype, block, max_width, cost_table, draft_cost, adapt)  # frozen tables: equal by value across calls
    planners = _GENERATE_PLANNERS.setdefault(drafter, weakref.WeakKeyDictionary()).setdefault(target, {})
    if key not in planners:
        if cost_table is None or draft_cost is None:
            from .profiler import profile_draft_cost, profile_verify_cost

            # generate()'s verify forward gets Transformers' 2-D mask
            cost_table = cost_table or profile_verify_cost(target, rows=(1,), max_width=max_width, four_d_mask=False)
            draft_cost = draft_cost or profile_draft_cost(target, drafter, rows=(1,))
        planners[key] = (DepthPlanner(cost_table, draft_cost, block, adapt_costs=adapt), cost_table)
    return planners[key]
