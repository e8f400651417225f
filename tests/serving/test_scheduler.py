"""Verification-length schedulers as pure functions: prefix admission, zero survival, cliffs, the budget cap,
and the Appendix A counterexample (a look-ahead scheduler biases the output; Algorithm 1 and the asynchronous
variant do not)."""

import random

import pytest

from generation.scheduling.scheduler import (
    CostTable,
    DraftCost,
    PaddedCostTable,
    admission_groups,
    async_capacity,
    level_cuts,
    plan_draft_depth,
    schedule_algorithm1,
    schedule_fixed,
    schedule_full_search,
    schedule_threshold,
    schedule_top_k,
)


def random_survival(rng, num_requests, gamma=7):
    out = []
    for _ in range(num_requests):
        a, values = 1.0, []
        for _ in range(rng.randint(0, gamma)):
            a *= rng.choice([0.0, rng.random(), 1.0, rng.uniform(0.8, 1.0)])
            values.append(a)
        out.append(values)
    return out


def random_cost(rng, max_tokens=64):
    sps, table = 1.0, {}
    for b in range(1, max_tokens + 1):
        sps *= rng.choice([1.0, 1.0, 0.98, 0.7])  # flat stretches and cliffs
        table[b] = sps
    return CostTable.from_dict(table)


def random_padded_cost(rng, max_width=8):
    table, t = {}, 0.01
    for w in range(1, max_width + 1):
        t *= rng.choice([1.0, 1.02, 1.5])
        table[w] = t
    return PaddedCostTable.from_dict({1: table, 16: {w: 3 * v for w, v in table.items()}})


SCHEDULERS = {
    "algorithm1": lambda s, c: schedule_algorithm1(s, c),
    "algorithm1_padded": lambda s, c: schedule_algorithm1(s, random_padded_cost(random.Random(len(s)))),
    "algorithm1_draft_seconds": lambda s, c: schedule_algorithm1(s, c, draft_seconds=0.5),
    "full_search": lambda s, c: schedule_full_search(s, c),
    "threshold": lambda s, c: schedule_threshold(s, 0.3),
    "top_k": lambda s, c: schedule_top_k(s, async_capacity(s, c)),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_admitted_tokens_are_a_prefix_of_the_highest_survivals_and_never_zero(name):
    rng = random.Random(0)
    for _ in range(300):
        survival = random_survival(rng, rng.randint(1, 8))
        lengths = SCHEDULERS[name](survival, random_cost(rng))
        assert len(lengths) == len(survival)
        admitted = [a for values, n in zip(survival, lengths) for a in values[:n]]
        rejected = [a for values, n in zip(survival, lengths) for a in values[n:]]
        assert all(0 <= n <= len(values) for values, n in zip(survival, lengths))
        assert all(a > 0 for a in admitted), "a zero-survival token was admitted"
        if name not in ("threshold", "algorithm1_padded") and admitted and rejected:
            assert min(admitted) >= max(rejected), "admission must follow the global survival order"


def test_level_cuts_are_algorithm1_on_each_step():
    rng = random.Random(3)
    for _ in range(200):
        blocks = random_survival(rng, rng.randint(1, 16))
        draft = rng.choice([0.0, 0.005, 0.5])
        for cost in (random_cost(rng), random_padded_cost(rng)):  # one row: either table
            expected = [schedule_algorithm1([b], cost, draft_seconds=draft)[0] for b in blocks]
            cuts = level_cuts(blocks, cost, draft_seconds=draft)
            assert [cut.admitted for cut in cuts] == expected
            for cut, b, n in zip(cuts, blocks, expected):  # the step as admitted: its tau and its price
                assert cut.tau == pytest.approx(1 + sum(b[:n]))
                assert cut.seconds == pytest.approx(draft + cost.step_seconds(1, 1 + n, 1 + n))
        cost, steps = random_padded_cost(rng), [random_survival(rng, rng.randint(2, 6)) for _ in range(4)]
        gains = [[sum(b[j] for b in rows if j < len(b)) for j in range(max(map(len, rows), default=0))] for rows in steps]
        for rows, g in zip(steps, gains):
            lengths = schedule_algorithm1(rows, cost, draft_seconds=draft)
            (cut,) = level_cuts([g], cost, len(rows), draft)
            assert cut.admitted == max(lengths)
            assert cut.tau == pytest.approx(len(rows) + sum(sum(b[:n]) for b, n in zip(rows, lengths)))
            assert cut.seconds == pytest.approx(draft + cost.step_seconds(len(rows), len(rows) + sum(lengths), 1 + max(lengths)))
    with pytest.raises(ValueError, match="padded"):
        level_cuts([[0.5, 0.2]], random_cost(rng), num_rows=2)


def test_fixed_length():
    assert schedule_fixed([7, 2, 0], 3) == [3, 2, 0]
    with pytest.raises(ValueError):
        schedule_fixed([1], -1)


def test_algorithm1_stops_before_a_cliff_that_the_full_search_crosses():
    survival = [[0.95 ** (j + 1) for j in range(7)]]
    cost = CostTable.from_dict({1: 1.0, 2: 1.0, 3: 0.6, 8: 0.6})  # flat, a cliff at B = 3, flat again
    assert schedule_algorithm1(survival, cost) == [1]  # Theta: 1 -> 1.95 -> 1.71 (stop)
    assert schedule_full_search(survival, cost) == [7]  # 6.73 * 0.6 = 4.04 beyond the cliff
    assert async_capacity(survival, cost) == 7


def test_budget_is_a_hard_cap():
    rng = random.Random(1)
    for _ in range(300):
        survival = random_survival(rng, rng.randint(1, 8))
        k = rng.randint(0, 20)
        assert sum(schedule_top_k(survival, k)) <= k
    assert schedule_top_k([[0.9, 0.8], [0.95, 0.1]], 3) == [2, 1]


def test_cost_table_lookup_and_validation():
    cost = CostTable.from_dict({1: 10.0, 4: 8.0, 16: 5.0})
    assert [cost.sps(b) for b in (1, 2, 4, 5, 16)] == [10.0, 8.0, 8.0, 5.0, 5.0]
    assert cost.sps(32) == pytest.approx(2.5)  # linear beyond the table
    with pytest.raises(ValueError):
        CostTable((2, 1), (1.0, 1.0))
    with pytest.raises(ValueError, match="non-increasing"):
        schedule_algorithm1([[0.5, 0.6]], cost)


def test_padded_cost_admits_level_by_level():
    survival = [[0.9, 0.5, 0.1], [0.6, 0.3], [0.0]]
    cost = PaddedCostTable.from_dict({4: {1: 1.0, 2: 1.2, 3: 1.4, 4: 5.0}})
    assert admission_groups(survival, cost) == [[(0, 0), (1, 0)], [(0, 1), (1, 1)], [(0, 2)]]
    # Theta 3 -> 4.5 / 1.2 = 3.75 (width 2) -> 5.3 / 1.4 = 3.79 (width 3) -> 5.4 / 5.0 (width 4, stop); taken one
    # token at a time, the first draft alone (3.9 / 1.2 = 3.25) would already have looked like a loss
    assert schedule_algorithm1(survival, cost) == [2, 2, 0]
    assert schedule_full_search(survival, cost) == [2, 2, 0] and async_capacity(survival, cost) == 4
    assert cost.forward_seconds(2, 1) == 1.0 and cost.forward_seconds(8, 2) == pytest.approx(2.4)  # rows beyond: linear
    assert PaddedCostTable.from_dict(cost.to_dict()) == cost
    with pytest.raises(ValueError, match="one time per"):
        PaddedCostTable((1, 2), (1,), ((1.0,),))


def test_draft_seconds_make_verifying_more_worthwhile():
    rng = random.Random(3)
    for _ in range(200):
        survival, cost = random_survival(rng, rng.randint(1, 8)), random_cost(rng)
        assert sum(schedule_full_search(survival, cost, draft_seconds=1.0)) >= sum(schedule_full_search(survival, cost))


def test_a_drafter_call_after_plain_rounds_pays_for_the_positions_it_missed():
    """The profiled times hold ``BASE_CONTEXT`` new context positions per row; each further one (of the longest row,
    the context being right-padded) adds its measured price."""
    draft = DraftCost.from_dict({1: [0.001, 0.002], 4: [0.002, 0.004]}, {1: 1e-4, 4: 3e-4})
    assert draft.context_seconds == (1e-4, 3e-4) and DraftCost.BASE_CONTEXT == 2
    assert draft.draft_seconds(4, 1) == draft.draft_seconds(4, 1, context=1) == 0.002  # steady state
    assert draft.draft_seconds(3, 2, context=12) == pytest.approx(0.004 + 10 * 3e-4)
    assert draft.catch_up_seconds(8, 12) == pytest.approx(2 * 10 * 3e-4)  # linear beyond the profiled rows
    assert draft.draft_seconds(4, 0, context=100) == 0.0  # no call, nothing read
    assert DraftCost.from_dict({4: [0.002]}).draft_seconds(4, 1, context=100) == 0.002  # not measured: not modelled
    with pytest.raises(ValueError, match="context_seconds"):
        DraftCost((1, 4), ((0.1,), (0.2,)), (1e-4,))
    with pytest.raises(ValueError, match="context_seconds"):
        DraftCost((1,), ((0.1,),), (-1e-4,))


def test_draft_cost_lookup_and_depth_planning():
    draft = DraftCost.from_dict({1: [0.001, 0.002, 0.003], 4: [0.002, 0.004, 0.006]})
    assert draft.max_depth == 3 and draft.draft_seconds(3, 0) == 0.0 and draft.draft_seconds(3, 2) == 0.004
    assert draft.draft_seconds(8, 1) == pytest.approx(0.004)  # linear beyond the profiled rows
    with pytest.raises(ValueError, match="profiled up to 3"):
        draft.draft_seconds(1, 4)
    with pytest.raises(ValueError, match="same number of depths"):
        DraftCost((1, 2), ((0.1,), (0.1, 0.2)))
    flat = PaddedCostTable.from_dict({4: {w: 0.01 for w in range(1, 5)}})
    sure, hopeless = [[0.9, 0.8, 0.7]] * 4, [[0.01, 0.001, 0.0]] * 4
    assert plan_draft_depth(sure, flat, DraftCost.from_dict({4: [0.0] * 3}), 3) == 3  # free drafting, free width
    assert plan_draft_depth(hopeless, flat, draft, 3) == 0  # skip the drafter: it cannot pay for itself
    costly_slots = DraftCost.from_dict({4: [0.001, 0.02, 0.04]})
    assert plan_draft_depth(sure, flat, costly_slots, 3) == 1
    with pytest.raises(ValueError, match="max_depth=3"):
        plan_draft_depth([[0.9]], flat, draft, 3)
    # a catch-up to pay before drafting, per token left: plain decoding takes 2.5 ms a token here (4 rows, 10 ms),
    # full blocks of this survival 0.74 ms; 1 ms more a token still pays, 2 ms no longer does
    free = DraftCost.from_dict({4: [0.0] * 3})
    assert plan_draft_depth(sure, flat, free, 3, catch_up_per_token=0.001) == 3
    assert plan_draft_depth(sure, flat, free, 3, catch_up_per_token=0.002) == 0


# ------------------------------------------------------------------------------------ Appendix A
P_TARGET = {"A": 0.7, "B": 0.3}
P_DRAFT = {"A": 0.5, "B": 0.5}
C2 = {"A": 0.9, "B": 0.0}  # the confidence of slot 2 depends on the sampled first draft
A1 = 0.8
COST = CostTable.from_dict({1: 1.0, 2: 0.5, 3: 0.45})


def first_token_distribution(verify_length) -> dict:
    """Exact output distribution of the first token when the drafter samples x1 ~ P_DRAFT and the scheduler,
    seeing the block's survival [a1, a1 * c2(x1)], decides whether x1 is verified (speculative sampling)."""
    residual = {t: max(P_TARGET[t] - P_DRAFT[t], 0.0) for t in P_TARGET}
    z = sum(residual.values())
    out = {t: 0.0 for t in P_TARGET}
    for x1, q in P_DRAFT.items():
        if verify_length([[A1, A1 * C2[x1]]]) == 0:  # the target samples the token itself
            for t, p in P_TARGET.items():
                out[t] += q * p
            continue
        accept = min(1.0, P_TARGET[x1] / P_DRAFT[x1])
        out[x1] += q * accept
        for t in out:
            out[t] += q * (1 - accept) * residual[t] / z
    return out


def test_appendix_a_look_ahead_is_biased():
    out = first_token_distribution(lambda s: schedule_full_search(s, COST)[0])
    assert out["A"] == pytest.approx(0.85) and out["B"] == pytest.approx(0.15)


def test_appendix_a_algorithm1_is_exact():
    assert schedule_algorithm1([[A1, A1 * 0.9]], COST) == [0]  # Theta_1 = 0.9 <= Theta_0 = 1: stop at once
    out = first_token_distribution(lambda s: schedule_algorithm1(s, COST)[0])
    assert out["A"] == pytest.approx(0.7) and out["B"] == pytest.approx(0.3)


@pytest.mark.parametrize("stale", [[[A1, A1 * 0.9]], [[A1, 0.0]], [[0.1]]], ids=["K=2", "K=0", "other"])
def test_appendix_a_asynchronous_variant_is_exact(stale):
    capacity = async_capacity(stale, COST)  # from old confidences only
    out = first_token_distribution(lambda s: schedule_top_k(s, capacity)[0])
    assert out["A"] == pytest.approx(0.7) and out["B"] == pytest.approx(0.3)


def test_cost_tables_are_smoothed_by_an_isotonic_fit_not_a_running_maximum():
    from generation.scheduling.profiler import _isotonic, _monotone

    # one width measured during a burst of load: it must not become the cost of every wider forward
    line = [41.0, 42.0, 43.0, 66.0, 45.0, 46.0, 47.0, 48.0]
    smooth = _isotonic(line)
    assert all(a <= b for a, b in zip(smooth, smooth[1:]))
    assert smooth[:3] == line[:3] and max(smooth) < 52.0 and smooth[-1] >= 48.0
    assert _isotonic([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0] and _isotonic([3.0, 1.0]) == [2.0, 2.0]
    grid = _monotone([[10.0, 30.0, 12.0, 13.0], [20.0, 21.0, 22.0, 23.0], [15.0, 40.0, 41.0, 42.0]])
    for i, row in enumerate(grid):  # non-decreasing along both axes
        assert all(a <= b for a, b in zip(row, row[1:]))
        assert i == 0 or all(a <= b for a, b in zip(grid[i - 1], row))
    assert grid[0][3] < 30.0 and grid[2][3] >= 42.0


def test_profiler_times_the_points_of_a_table_in_turns(monkeypatch):
    """A burst of load as long as one point's repeats slows that point alone when points are timed one after the
    other (calls 4-6 would be b's warm-up and two of its three repeats); timed in turns, every point gets at most
    one slow repeat and the medians stay level."""
    import torch

    import generation.scheduling.profiler as profiler

    clock = {"now": 0.0, "calls": 0}
    burst = range(4, 7)  # calls 4-6 run 10x slower

    def call(key, order):
        def fn():
            order.append(key)
            clock["now"] += 10.0 if clock["calls"] in burst else 1.0
            clock["calls"] += 1

        return fn

    monkeypatch.setattr(profiler.time, "perf_counter", lambda: clock["now"])
    order: list = []
    calls = {key: (call(key, order), None) for key in ("a", "b", "c")}
    medians = profiler._interleaved_medians(calls, 3, torch.device("cpu"), "test", progress=False)
    assert order == ["a", "b", "c"] * 4, "a warm-up pass, then the timed passes in turns"
    assert medians == {"a": 1.0, "b": 1.0, "c": 1.0}
