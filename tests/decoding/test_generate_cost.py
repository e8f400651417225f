"""``dspark_truncation="cost"`` through ``generate(assistant_model=...)``: the depth of each round is planned from
earlier rounds (0 = a plain round without the drafter), Algorithm 1 cuts the drafted block; greedy output stays
the target's and sampled output keeps the target's distribution."""

import pytest
import torch
from exactness import PROMPT, SAMPLES, VOCAB, chi_square_pvalue, config, exact_distribution, peaked_target
from tiny_models import tiny_drafter, tiny_target
from transformers import GenerationConfig

import modeling_dspark  # noqa: F401
from generation.scheduling.scheduler import DraftCost, PaddedCostTable

# a verify forward whose cost grows a little with its width, as on a CPU
VERIFY = PaddedCostTable.from_dict({1: {w: 0.010 * (1 + 0.05 * w) for w in range(1, 9)}})


def confident(drafter, bias: float = 6.0):
    """Survival near 1 at every slot: drafting looks worth it whenever it is cheap."""
    with torch.no_grad():
        drafter.confidence_head.proj.weight.zero_()
        drafter.confidence_head.proj.bias.fill_(bias)
    return drafter


def cost_config(draft_cost, **kwargs):
    return dict(dspark_truncation="cost", dspark_cost_table=VERIFY, dspark_draft_cost=draft_cost, dspark_adapt_costs=False, **kwargs)


def test_cost_truncation_greedy_equals_target_and_follows_the_draft_cost(monkeypatch):
    from generation.scheduling.depth_planner import DepthPlanner

    target = tiny_target()
    prompt = torch.tensor([[5, 17, 3, 44, 9, 21]])
    ref = target.generate(prompt, do_sample=False, max_new_tokens=120)
    rounds = {}
    costly = DraftCost.from_dict({1: [1.0 * d for d in range(1, 5)]})  # 100 target forwards per call
    for label, draft_cost, budget in (
        ("free", DraftCost.from_dict({1: [0.0] * 4}), DepthPlanner.PROBE_BUDGET),
        ("costly", costly, DepthPlanner.PROBE_BUDGET),
        ("costly, probes unbudgeted", costly, float("inf")),
    ):
        monkeypatch.setattr(DepthPlanner, "PROBE_BUDGET", budget)
        drafter = confident(tiny_drafter(target))
        gen = GenerationConfig(do_sample=False, max_new_tokens=120, **cost_config(draft_cost))
        out = target.generate(prompt, generation_config=gen, assistant_model=drafter)
        assert torch.equal(out, ref), label
        rounds[label] = drafter.last_stats.rounds
    free = [r.verified for r in rounds["free"]]
    # free drafting: after the first look (one slot), full blocks until the token budget shortens them
    assert free[0] == 1 and set(free[1:-3]) == {4}, free
    # a drafter call that costs 100 plain rounds: a probe may come only after 100 / PROBE_BUDGET rounds, so within
    # 120 tokens the first look (one slot) is all the drafting
    costly = [r.drafted for r in rounds["costly"]]
    assert costly[0] == 1 and set(costly[1:]) == {0}, costly
    # without the budget, each probe that does not change the plan doubles the wait for the next (16, 32, 64 rounds)
    unbudgeted = [r.drafted for r in rounds["costly, probes unbudgeted"]]
    assert set(unbudgeted) == {0, 1} and [i for i, d in enumerate(unbudgeted) if d] == [0, 16, 48, 112], unbudgeted


def verified_block_sums(drafter):
    """(rounds, accepted drafts, what their calibrated survival expected) over the verified DSpark rounds of the
    drafter's last generate(): the sums its planner should hold, recomputed from the rounds themselves."""
    rounds = [r for r in drafter.last_stats.rounds if r.proposal == "dspark" and r.verified]
    with torch.no_grad():
        expected = sum(drafter.survival(torch.tensor([r.confidence_logits])).sum().item() for r in rounds)
    return rounds, sum(min(r.accepted, r.verified) for r in rounds), expected


def test_cost_truncation_scales_survival_by_the_accepted_drafts(monkeypatch):
    """generate() reports each verified block's calibrated survival and accepted drafts to its planner (the one the
    drafter keeps for this target): an untrained drafter that promises survival near 1 and is mostly rejected gets
    its survival scaled down, slot by slot, from exactly the undecayed sums of what its verified drafts reached
    and promised, and the output is the target's."""
    from generation.scheduling import depth_planner

    monkeypatch.setattr(depth_planner.DepthPlanner, "ACCEPTANCE_DECAY", 1.0)
    # every round takes what the tables say: what the planner does next then depends on the drafts alone, not on
    # wall-clock times that vary run to run (they decide when it drafts, and so how many blocks there are to count)
    record = depth_planner.DepthPlanner.record_round_time

    def as_modelled(self, num_rows, depth, lengths, seconds, committed=None, context=DraftCost.BASE_CONTEXT):
        record(self, num_rows, depth, lengths, self.modelled_seconds(num_rows, depth, lengths, context), committed, context)

    monkeypatch.setattr(depth_planner.DepthPlanner, "record_round_time", as_modelled)
    target = tiny_target()
    prompt = torch.tensor([[5, 17, 3, 44, 9, 21]])
    ref = target.generate(prompt, do_sample=False, max_new_tokens=60)
    drafter = confident(tiny_drafter(target))
    gen = GenerationConfig(do_sample=False, max_new_tokens=60, **{**cost_config(DraftCost.from_dict({1: [0.0] * 4})), "dspark_adapt_costs": True})
    out = target.generate(prompt, generation_config=gen, assistant_model=drafter)
    assert torch.equal(out, ref)
    planner, _ = depth_planner.generate_planner(target, drafter, gen)
    rounds, accepted, expected = verified_block_sums(drafter)
    assert len(rounds) >= 5
    assert sum(s[0] for s in planner.slot_sums) == accepted and sum(s[1] for s in planner.slot_sums) == pytest.approx(expected)
    reached, promised = planner.slot_sums[0]
    assert accepted < 0.5 * expected and reached < 0.5 * promised
    low, prior = planner.SURVIVAL_SCALE_BOUNDS[0], planner.ACCEPTANCE_PRIOR
    first = planner.survival_scales[0]
    assert first == pytest.approx(max((reached + prior) / (promised + prior), low)) and first < 0.75


def token_dependent_confidence(drafter):
    """``c_k`` a function of the previously sampled token only, from 0.02 to 0.98 across the vocabulary, so that
    Algorithm 1 keeps the second draft after some first drafts and cuts it after others."""
    d = drafter.config.hidden_size
    with torch.no_grad():
        weight = drafter.confidence_head.proj.weight
        weight[:, :d].zero_()
        weight[:, d:].normal_(0.0, 1.0, generator=torch.Generator().manual_seed(5))
        drafter.confidence_head.proj.bias.zero_()
        z = drafter.confidence_logits(torch.zeros(VOCAB, d), torch.arange(VOCAB))
        scale = 8.0 / float(z.max() - z.min())
        weight[:, d:] *= scale
        drafter.confidence_head.proj.bias.fill_(-scale * float(z.max() + z.min()) / 2)
    return drafter


def test_cost_truncation_sampling_matches_target():
    target = peaked_target()
    drafter = token_dependent_confidence(tiny_drafter(target, seed=7))
    gen = config(**cost_config(DraftCost.from_dict({1: [0.0] * 4})))
    torch.manual_seed(0)
    counts, verified_after_two = {}, set()
    drafted_rounds, accepted = 0, []
    for _ in range(SAMPLES):
        out = target.generate(PROMPT, generation_config=gen, assistant_model=drafter)
        key = tuple(out[0, PROMPT.shape[1] :].tolist())
        counts[key] = counts.get(key, 0) + 1
        for r in drafter.last_stats.rounds:
            drafted_rounds += r.verified > 0
            accepted += [r.accepted] if r.verified else []
            if r.drafted == 2:
                verified_after_two.add(r.verified)
    assert drafted_rounds >= SAMPLES // 2, "the tokens under test must come from drafted rounds"
    assert 0 < sum(accepted) < 2 * len(accepted), "both acceptance and rejection must occur"
    assert {1, 2} <= verified_after_two, f"Algorithm 1 must keep or cut the second draft by the first, saw {verified_after_two}"
    assert chi_square_pvalue(counts, exact_distribution(target), SAMPLES) > 1e-3


def test_cost_truncation_refuses_a_drafter_without_confidence_head():
    target = tiny_target()
    drafter = tiny_drafter(target, confidence_head=False)
    gen = GenerationConfig(do_sample=False, max_new_tokens=4, **cost_config(DraftCost.from_dict({1: [0.0] * 4})))
    with pytest.raises(ValueError, match="cost truncation needs a drafter with a confidence head"):
        target.generate(torch.tensor([[1, 2, 3]]), generation_config=gen, assistant_model=drafter)
    with pytest.raises(ValueError, match="'fixed', 'threshold' or 'cost'"):
        lazy = GenerationConfig(do_sample=False, max_new_tokens=4, dspark_truncation="lazy")
        target.generate(torch.tensor([[1, 2, 3]]), generation_config=lazy, assistant_model=tiny_drafter(target))
