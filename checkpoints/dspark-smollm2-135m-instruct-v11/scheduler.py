"""Verification-length schedulers (SPEC section 6): pure functions from per-request survival to lengths ``l_r``.

``survival[r]`` is request r's cumulative survival ``a_{r,j} = prod_{i<=j} c_{r,i}`` over its drafted slots
(non-increasing, possibly empty); a scheduler returns ``l_r`` in ``0..len(survival[r])``: request r sends
``1 + l_r`` tokens to the target (its last committed token plus the first ``l_r`` drafts). The objective is
tokens per second, ``Theta = tau / (T_draft + T_verify)`` with ``tau = sum_r (1 + sum_{j<=l_r} a_{r,j})``. With
the paper's cost table (:class:`CostTable`, ``T_verify = 1 / SPS(B)`` at ``B = sum_r (1 + l_r)`` tokens) and no
drafting cost this is exactly the paper's ``Theta = tau * SPS(B)``. :class:`PaddedCostTable` is the cost of a
right-padded verify forward (R rows, as wide as the longest ``1 + l_r``), which is what the engine runs, and
:class:`DraftCost` the drafter's time for R rows and D drafted slots, a cost the paper's GPU setting can ignore and
a CPU cannot (a 7-slot draft LM head costs more than a whole SmolLM2 token).

Lossless admission needs non-anticipation: whether draft j is verified may depend on ``a_{r,j}`` (decided by
the tokens before j) but never on quantities that depend on draft j itself, such as ``a_{r,j+1}``.
:func:`schedule_algorithm1` guarantees it by admitting in descending survival order and stopping at the
first non-improvement; :func:`schedule_full_search`, which looks past that point, breaks it (the Appendix A
counterexample) and exists to show so. :func:`async_capacity` + :func:`schedule_top_k` are the production
form: the budget comes from old confidences, the current step only ranks. :func:`plan_draft_depth` decides how
many slots to draft (0: skip the drafter) before anything is drafted, from survival estimates of earlier steps,
so it cannot depend on the drafts it sizes either.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "CostTable",
    "DraftCost",
    "LevelCut",
    "PaddedCostTable",
    "admission_groups",
    "admission_order",
    "async_capacity",
    "early_stop",
    "level_cuts",
    "plan_draft_depth",
    "schedule_algorithm1",
    "schedule_fixed",
    "schedule_full_search",
    "schedule_threshold",
    "schedule_top_k",
]


def _ceil_lookup(grid: Sequence[int], values: Sequence[float], x: int) -> float:
    """Cost at ``x`` from costs measured on ``grid``: that of the next measured point (a forward is at least as
    slow as a smaller one); past the last point, linear in ``x``."""
    i = bisect.bisect_left(grid, x)
    if i < len(grid):
        return values[i]
    return values[-1] * x / grid[-1]


def _check_grid(name: str, grid: Sequence[int]) -> None:
    if not grid or grid[0] < 1 or any(b <= a for a, b in zip(grid, grid[1:])):
        raise ValueError(f"{name} must be increasing and >= 1, got {tuple(grid)}")


@dataclass(frozen=True)
class CostTable:
    """The paper's cost table, profiled ``SPS(B)``: target forward steps per second at ``B`` tokens in one forward.

    Between profiled points the cost is that of the next profiled size; past the last point it grows linearly."""

    tokens: tuple[int, ...]  # increasing B values that were measured
    steps_per_second: tuple[float, ...]

    def __post_init__(self):
        if not self.tokens or len(self.tokens) != len(self.steps_per_second):
            raise ValueError("a cost table needs one steps-per-second value per profiled token count")
        _check_grid("profiled token counts", self.tokens)
        if any(s <= 0 for s in self.steps_per_second):
            raise ValueError("steps per second must be positive")

    @classmethod
    def from_dict(cls, table: dict) -> "CostTable":
        pairs = sorted((int(b), float(s)) for b, s in table.items())
        return cls(tuple(b for b, _ in pairs), tuple(s for _, s in pairs))

    def sps(self, num_tokens: int) -> float:
        i = bisect.bisect_left(self.tokens, num_tokens)
        if i < len(self.tokens):
            return self.steps_per_second[i]
        return self.steps_per_second[-1] * self.tokens[-1] / num_tokens  # a forward's time grows linearly past the table

    def step_seconds(self, num_rows: int, num_tokens: int, width: int) -> float:
        """Seconds of a verify forward over ``num_tokens`` tokens in all (flattened, as in the paper)."""
        return 1.0 / self.sps(num_tokens)


@dataclass(frozen=True)
class PaddedCostTable:
    """Seconds of one right-padded verify forward of ``R`` rows, each ``width`` tokens wide (``1 + max_r l_r``),
    on top of each row's KV cache: the engine's real verification cost. Profiled on a grid of rows x widths."""

    rows: tuple[int, ...]
    widths: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]  # [len(rows)][len(widths)]
    padded = True  # the schedulers admit level by level (see admission_groups)

    def __post_init__(self):
        _check_grid("profiled row counts", self.rows)
        _check_grid("profiled widths", self.widths)
        if len(self.seconds) != len(self.rows) or any(len(line) != len(self.widths) for line in self.seconds):
            raise ValueError("a padded cost table needs one time per (rows, width) point")
        if any(t <= 0 for line in self.seconds for t in line):
            raise ValueError("forward times must be positive")

    @classmethod
    def from_dict(cls, table: dict) -> "PaddedCostTable":
        """``{rows: {width: seconds}}`` (keys may be strings, as after a JSON round trip)."""
        rows = sorted(int(r) for r in table)
        widths = sorted(int(w) for w in next(iter(table.values())))
        by_rows = {int(r): {int(w): float(t) for w, t in line.items()} for r, line in table.items()}
        return cls(tuple(rows), tuple(widths), tuple(tuple(by_rows[r][w] for w in widths) for r in rows))

    def to_dict(self) -> dict:
        return {r: dict(zip(self.widths, line)) for r, line in zip(self.rows, self.seconds)}

    def forward_seconds(self, num_rows: int, width: int) -> float:
        i = min(bisect.bisect_left(self.rows, num_rows), len(self.rows) - 1)  # past the last row count: scaled below
        return _ceil_lookup(self.widths, self.seconds[i], width) * max(1.0, num_rows / self.rows[-1])

    def step_seconds(self, num_rows: int, num_tokens: int, width: int) -> float:
        return self.forward_seconds(num_rows, width)


@dataclass(frozen=True)
class DraftCost:
    """Seconds of one batched drafter call for ``R`` rows drafting ``D`` slots (backbone + draft LM head over D
    positions + the sequential sampling loop) with :attr:`BASE_CONTEXT` new context positions per row. ``D = 0``
    means no drafter call and costs nothing.

    ``context_seconds[i]``: what each further new context position (one column of the rows' right-padded context)
    adds for ``rows[i]`` rows; empty when not measured (then no catch-up is modelled). After rounds without the
    drafter its next call first reads every position it missed, so its price depends on how long it waited."""

    rows: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]  # [len(rows)][D - 1] for D = 1..max_depth
    context_seconds: tuple[float, ...] = ()

    # new context positions per row a drafting round reads in steady state (the bonus token and an accepted draft)
    BASE_CONTEXT = 2

    def __post_init__(self):
        _check_grid("profiled row counts", self.rows)
        if len(self.seconds) != len(self.rows) or len({len(line) for line in self.seconds}) != 1 or not self.seconds[0]:
            raise ValueError("a draft cost table needs the same number of depths for every profiled row count")
        if any(t < 0 for line in self.seconds for t in line):
            raise ValueError("draft times must be non-negative")
        if self.context_seconds and (len(self.context_seconds) != len(self.rows) or min(self.context_seconds) < 0):
            raise ValueError("context_seconds needs one non-negative time per profiled row count")

    @property
    def max_depth(self) -> int:
        return len(self.seconds[0])

    @classmethod
    def from_dict(cls, table: dict, context_seconds: dict | None = None) -> "DraftCost":
        """``{rows: [seconds at D = 1, 2, ...]}`` and, optionally, ``{rows: seconds per further context position}``."""
        rows = sorted(int(r) for r in table)
        by_rows = {int(r): tuple(float(t) for t in line) for r, line in table.items()}
        context = {int(r): float(t) for r, t in (context_seconds or {}).items()}
        return cls(tuple(rows), tuple(by_rows[r] for r in rows), tuple(context[r] for r in rows) if context else ())

    def to_dict(self) -> dict:
        return {r: list(line) for r, line in zip(self.rows, self.seconds)}

    def _row_index(self, num_rows: int) -> tuple[int, float]:
        """The profiled row count that stands for ``num_rows`` and the linear scale beyond the last one."""
        return min(bisect.bisect_left(self.rows, num_rows), len(self.rows) - 1), max(1.0, num_rows / self.rows[-1])

    def draft_seconds(self, num_rows: int, depth: int, context: int = BASE_CONTEXT) -> float:
        """One call for ``num_rows`` rows drafting ``depth`` slots after reading ``context`` new positions per row
        (the longest row's, as the context is right-padded)."""
        if depth <= 0:
            return 0.0
        if depth > self.max_depth:
            raise ValueError(f"profiled up to {self.max_depth} drafted slots, asked for {depth}")
        i, scale = self._row_index(num_rows)
        return self.seconds[i][depth - 1] * scale + self.catch_up_seconds(num_rows, context)

    def catch_up_seconds(self, num_rows: int, context: int) -> float:
        """What reading ``context`` new positions per row costs beyond :attr:`BASE_CONTEXT` of them."""
        if not self.context_seconds or context <= self.BASE_CONTEXT:
            return 0.0
        i, scale = self._row_index(num_rows)
        return self.context_seconds[i] * scale * (context - self.BASE_CONTEXT)


def _check(survival: Sequence[Sequence[float]]) -> None:
    for r, values in enumerate(survival):
        if any(not 0.0 <= a <= 1.0 for a in values):
            raise ValueError(f"request {r}: survival values must lie in [0, 1], got {list(values)}")
        if any(b > a for a, b in zip(values, values[1:])):
            raise ValueError(f"request {r}: survival must be non-increasing along the block, got {list(values)}")


def admission_order(survival: Sequence[Sequence[float]]) -> list[tuple[int, int]]:
    """Every (request, slot) by descending survival; ties keep slot order, so each request's admitted slots
    always form a prefix."""
    items = [(-a, r, j) for r, values in enumerate(survival) for j, a in enumerate(values)]
    items.sort()  # by -a, then request, then slot: stable on ties
    return [(r, j) for _, r, j in items]


def admission_groups(survival: Sequence[Sequence[float]], cost) -> list[list[tuple[int, int]]]:
    """The steps of the admission path. With the paper's flattened cost (:class:`CostTable`) one token at a time in
    descending survival (:func:`admission_order`). With a right-padded forward (:class:`PaddedCostTable`) the cost
    moves only when the forward widens, so a step is a whole *level*: slot j of every request (zero survival left
    out). Each level only reads survival up to its own slot, so stopping between levels is as non-anticipating as
    stopping between tokens, and the first draft no longer has to pay for the whole width on its own."""
    if not getattr(cost, "padded", False):
        return [[item] for item in admission_order(survival)]
    depth = max((len(values) for values in survival), default=0)
    levels = [[(r, j) for r, values in enumerate(survival) if j < len(values) and values[j] > 0.0] for j in range(depth)]
    return [level for level in levels if level]


def schedule_fixed(drafted: Sequence[int], k: int) -> list[int]:
    """Static length: ``min(k, drafted_r)`` for every request."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return [min(k, n) for n in drafted]


def schedule_threshold(survival: Sequence[Sequence[float]], threshold: float) -> list[int]:
    """Static confidence threshold: the leading slots with ``a_{r,j} >= threshold`` (and ``a > 0``)."""
    _check(survival)
    return [sum(1 for a in values if a >= threshold and a > 0.0) for values in survival]


def early_stop(prefixes: Iterable[tuple[float, float]]) -> tuple[int, tuple[float, float]]:
    """Algorithm 1's stopping rule, its one home: ``prefixes`` yields ``(tau, seconds)`` of the admission path's
    prefixes, the empty one first; returns how many steps are admitted, those before the first that does not raise
    ``Theta = tau / seconds``, and the admitted prefix's ``(tau, seconds)``. It reads the path lazily and no further
    than that step, so a caller that builds the path as it goes never looks past the stop."""
    prefixes = iter(prefixes)
    kept = next(prefixes)
    best, admitted = kept[0] / kept[1], 0
    for tau, seconds in prefixes:
        theta = tau / seconds
        if theta <= best:
            break  # the early stop: nothing beyond this point may influence what was admitted
        best, admitted, kept = theta, admitted + 1, (tau, seconds)
    return admitted, kept


def schedule_algorithm1(survival: Sequence[Sequence[float]], cost, draft_seconds: float = 0.0) -> list[int]:
    """Algorithm 1: walk the admission path (:func:`admission_groups`) while ``Theta`` improves; stop at the first
    non-improvement (:func:`early_stop`).

    ``cost`` is a :class:`CostTable` or :class:`PaddedCostTable`; ``draft_seconds`` is this step's drafting time
    (already spent, so it only scales how much a verified token is worth)."""
    _check(survival)
    num_rows = len(survival)
    groups = admission_groups(survival, cost)

    def prefixes():
        tau, num_tokens, width = float(num_rows), num_rows, 1
        yield tau, draft_seconds + cost.step_seconds(num_rows, num_tokens, width)
        for group in groups:
            tau += sum(survival[r][j] for r, j in group)
            num_tokens, width = num_tokens + len(group), max(width, 2 + max(j for _, j in group))
            yield tau, draft_seconds + cost.step_seconds(num_rows, num_tokens, width)

    lengths = [0] * num_rows
    admitted, _ = early_stop(prefixes())
    for group in groups[:admitted]:
        for r, j in group:
            lengths[r] = j + 1
    return lengths


class LevelCut(NamedTuple):
    """One step's cut by :func:`level_cuts`: the slots admitted, and the step as admitted: its expected committed
    tokens (rows plus the admitted gains) and its seconds (drafting plus the verify forward)."""

    admitted: int
    tau: float
    seconds: float


def level_cuts(
    level_gains: Sequence[Sequence[float]], cost, num_rows: int = 1, draft_seconds: float = 0.0
) -> list[LevelCut]:
    """Algorithm 1 for many steps at once, each given by its level gains (per slot j, the survival of slot j summed
    over the step's ``num_rows`` rows): how many slots each step admits, with :func:`early_stop`, the stopping rule
    of :func:`schedule_algorithm1`, and the admitted prefix's ``(tau, seconds)``. With one row the levels are the
    row's slots, under either kind of cost table (a row's own survival is in slot order); with more rows the table
    must be a :class:`PaddedCostTable`, which prices a step by its rows and width alone, so that Algorithm 1 admits
    whole levels (:func:`admission_groups`) and reads nothing of a step but these sums. The verify times along the
    path are looked up once for all steps. Gains must be non-increasing, as survival is."""
    if num_rows > 1 and not getattr(cost, "padded", False):
        raise ValueError("level cuts of several rows need a right-padded cost table (PaddedCostTable)")
    depth = max((len(g) for g in level_gains), default=0)
    # the tokens are exact for one row; a padded table does not read them
    seconds = [draft_seconds + cost.step_seconds(num_rows, num_rows + n, 1 + n) for n in range(depth + 1)]

    def prefixes(gains):
        tau = float(num_rows)
        yield tau, seconds[0]
        for n, gain in enumerate(gains, start=1):
            if gain <= 0.0:
                return  # an empty level, and every level after it: admission_groups leaves them out
            tau += gain
            yield tau, seconds[n]

    cuts = []
    for gains in level_gains:
        admitted, (tau, spent) = early_stop(prefixes(gains))
        cuts.append(LevelCut(admitted, tau, spent))
    return cuts


def _best_prefix(survival, groups, cost, num_requests, draft_seconds=0.0) -> tuple[int, float]:
    """(number of leading groups of the admission path that maximises Theta, that Theta): the full search, first
    maximum."""
    tau, num_tokens, width = float(num_requests), num_requests, 1
    best, best_n = tau / (draft_seconds + cost.step_seconds(num_requests, num_tokens, width)), 0
    for n, group in enumerate(groups, start=1):
        tau += sum(survival[r][j] for r, j in group)
        num_tokens, width = num_tokens + len(group), max(width, 2 + max(j for _, j in group))
        theta = tau / (draft_seconds + cost.step_seconds(num_requests, num_tokens, width))
        if theta > best:
            best, best_n = theta, n
    return best_n, best


def schedule_full_search(survival: Sequence[Sequence[float]], cost, draft_seconds: float = 0.0) -> list[int]:
    """Look-ahead without the early stop: the best prefix of the admission order over the whole path.

    NOT lossless on the current step's own confidences (Appendix A): kept to demonstrate why Algorithm 1
    stops early, and as the capacity search of the asynchronous variant on old confidences."""
    _check(survival)
    groups = admission_groups(survival, cost)
    lengths = [0] * len(survival)
    for group in groups[: _best_prefix(survival, groups, cost, len(survival), draft_seconds)[0]]:
        for r, j in group:
            lengths[r] = j + 1
    return lengths


def async_capacity(
    stale_survival: Sequence[Sequence[float]], cost, num_requests: int | None = None, draft_seconds: float = 0.0
) -> int:
    """Verification budget K (draft tokens over all requests) from confidences two steps old: the full search
    (crossing cliffs of the cost table) of the best admission prefix. ``num_requests`` is the current R."""
    _check(stale_survival)
    groups = admission_groups(stale_survival, cost)
    num_requests = num_requests if num_requests is not None else len(stale_survival)
    n = _best_prefix(stale_survival, groups, cost, num_requests, draft_seconds)[0]
    return sum(len(group) for group in groups[:n])


def plan_draft_depth(
    estimated_survival: Sequence[Sequence[float]], cost, draft_cost: DraftCost, max_depth: int, cost_scale=None,
    catch_up_per_token: float = 0.0,
) -> int:
    """How many slots to draft this step (0 = do not call the drafter): the depth D whose best admission prefix
    (full search over the estimates, cliffs crossed) gives the highest ``Theta = tau / (T_draft(R, D) + T_verify)``,
    against plain decoding's ``R / T_verify(R, 1)``. ``estimated_survival[r]`` is request r's expected survival per
    slot from earlier steps (at least ``max_depth`` long); nothing of the step being planned enters it.
    ``cost_scale(D)`` (default 1) multiplies the modelled step time of depth D: the engine's ratio of measured to
    modelled step times, which corrects the tables for what they do not see (context length, cache holes).
    ``catch_up_per_token``: seconds per token still to generate that drafting from here on must first spend reading
    the positions the drafter missed (paid once, so spread over the rest of the requests); added to every depth's
    time per token."""
    _check(estimated_survival)
    num_rows = len(estimated_survival)
    if any(len(e) < max_depth for e in estimated_survival):
        raise ValueError(f"every estimate must cover max_depth={max_depth} slots")
    scale = cost_scale or (lambda depth: 1.0)
    best_depth, best = 0, num_rows / (scale(0) * cost.step_seconds(num_rows, num_rows, 1))
    for depth in range(1, max_depth + 1):
        truncated = [list(e[:depth]) for e in estimated_survival]
        groups = admission_groups(truncated, cost)
        _, theta = _best_prefix(truncated, groups, cost, num_rows, draft_cost.draft_seconds(num_rows, depth))
        theta = 1.0 / (scale(depth) / theta + catch_up_per_token)
        if theta > best:
            best_depth, best = depth, theta
    return best_depth


def schedule_top_k(survival: Sequence[Sequence[float]], capacity: int) -> list[int]:
    """The current step of the asynchronous variant: the ``capacity`` highest current survivals, order
    preserving (a prefix per request), never a zero-survival slot; ``capacity`` is a hard cap."""
    _check(survival)
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    lengths = [0] * len(survival)
    for r, j in admission_order(survival)[:capacity]:
        if survival[r][j] <= 0.0:
            break  # sorted: everything after is zero too
        lengths[r] = j + 1
    return lengths
