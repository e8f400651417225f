"""Verification-length schedulers (SPEC section 6): pure functions from per-request survival to lengths ``l_r``.

``survival[r]`` is request r's cumulative survival ``a_{r,j} = prod_{i<=j} c_{r,i}`` over its drafted slots
(non-increasing, possibly empty); a scheduler returns ``l_r`` in ``0..len(survival[r])``: request r sends
``1 + l_r`` tokens to the target (its last committed token plus the first ``l_r`` drafts). The cost table gives
``SPS(B)``, target steps per second at ``B`` verified tokens; the objective is ``Theta = tau * SPS(B)`` with
``tau = sum_r (1 + sum_{j<=l_r} a_{r,j})``.

Lossless admission needs non-anticipation: whether draft j is verified may depend on ``a_{r,j}`` (decided by
the tokens before j) but never on quantities that depend on draft j itself, such as ``a_{r,j+1}``.
:func:`schedule_algorithm1` guarantees it by admitting in descending survival order and stopping at the
first non-improvement; :func:`schedule_full_search`, which looks past that point, breaks it (the Appendix A
counterexample) and exists to show so. :func:`async_capacity` + :func:`schedule_top_k` are the production
form: the budget comes from old confidences, the current step only ranks.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "CostTable",
    "admission_order",
    "async_capacity",
    "schedule_algorithm1",
    "schedule_fixed",
    "schedule_full_search",
    "schedule_threshold",
    "schedule_top_k",
]


@dataclass(frozen=True)
class CostTable:
    """Profiled ``SPS(B)``: target forward steps per second at ``B`` tokens in one forward.

    Between profiled points the cost is that of the next profiled size (a forward is at least as slow as a
    smaller one); past the last point it grows linearly in ``B``."""

    tokens: tuple[int, ...]  # increasing B values that were measured
    steps_per_second: tuple[float, ...]

    def __post_init__(self):
        if not self.tokens or len(self.tokens) != len(self.steps_per_second):
            raise ValueError("a cost table needs one steps-per-second value per profiled token count")
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:])) or self.tokens[0] < 1:
            raise ValueError(f"profiled token counts must be increasing and >= 1, got {self.tokens}")
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
        return self.steps_per_second[-1] * self.tokens[-1] / num_tokens


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


def schedule_fixed(drafted: Sequence[int], k: int) -> list[int]:
    """Static length: ``min(k, drafted_r)`` for every request."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return [min(k, n) for n in drafted]


def schedule_threshold(survival: Sequence[Sequence[float]], threshold: float) -> list[int]:
    """Static confidence threshold: the leading slots with ``a_{r,j} >= threshold`` (and ``a > 0``)."""
    _check(survival)
    return [sum(1 for a in values if a >= threshold and a > 0.0) for values in survival]


def _theta(tau: float, num_tokens: int, cost: CostTable) -> float:
    return tau * cost.sps(num_tokens)


def schedule_algorithm1(survival: Sequence[Sequence[float]], cost: CostTable) -> list[int]:
    """Algorithm 1: admit in descending survival while ``Theta`` improves; stop at the first non-improvement."""
    _check(survival)
    lengths = [0] * len(survival)
    tau, num_tokens = float(len(survival)), len(survival)
    best = _theta(tau, num_tokens, cost)
    for r, j in admission_order(survival):
        theta = _theta(tau + survival[r][j], num_tokens + 1, cost)
        if theta <= best:
            break  # the early stop: nothing beyond this point may influence what was admitted
        tau, num_tokens, best = tau + survival[r][j], num_tokens + 1, theta
        lengths[r] = j + 1
    return lengths


def _best_prefix_of_order(survival, order, cost, num_requests) -> int:
    """Number of leading entries of ``order`` that maximises Theta (full search, first maximum)."""
    tau, num_tokens = float(num_requests), num_requests
    best, best_n = _theta(tau, num_tokens, cost), 0
    for n, (r, j) in enumerate(order, start=1):
        tau, num_tokens = tau + survival[r][j], num_tokens + 1
        theta = _theta(tau, num_tokens, cost)
        if theta > best:
            best, best_n = theta, n
    return best_n


def schedule_full_search(survival: Sequence[Sequence[float]], cost: CostTable) -> list[int]:
    """Look-ahead without the early stop: the best prefix of the admission order over the whole path.

    NOT lossless on the current step's own confidences (Appendix A): kept to demonstrate why Algorithm 1
    stops early, and as the capacity search of the asynchronous variant on old confidences."""
    _check(survival)
    order = admission_order(survival)
    lengths = [0] * len(survival)
    for r, j in order[: _best_prefix_of_order(survival, order, cost, len(survival))]:
        lengths[r] = j + 1
    return lengths


def async_capacity(stale_survival: Sequence[Sequence[float]], cost: CostTable, num_requests: int | None = None) -> int:
    """Verification budget K (draft tokens over all requests) from confidences two steps old: the full search
    (crossing cliffs of the cost table) of the best admission prefix. ``num_requests`` is the current R."""
    _check(stale_survival)
    order = admission_order(stale_survival)
    return _best_prefix_of_order(stale_survival, order, cost, num_requests if num_requests is not None else len(stale_survival))


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
