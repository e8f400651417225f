"""benchmarks/planner_replay.py: a replayed greedy decode is the decode it stands for, round by round."""

import copy
import importlib.util

import pytest
import torch
from conftest import ROOT
from tiny_models import bigram_target, oracle_drafter

from generation.scheduling.scheduler import DraftCost, PaddedCostTable


def replay_module():
    spec = importlib.util.spec_from_file_location("planner_replay", ROOT / "benchmarks" / "planner_replay.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("depth", [1, 3, 4])
def test_a_replayed_fixed_depth_decode_verifies_and_accepts_what_generate_did(depth):
    replay = replay_module()
    target = bigram_target()
    drafter = oracle_drafter(target)
    with torch.no_grad():  # an oracle with errors: some drafts accepted, some not
        drafter.markov_head.markov_w2.weight.add_(torch.randn(drafter.markov_head.markov_w2.weight.shape, generator=torch.Generator().manual_seed(3)))
    prompt = torch.tensor([[5, 17, 3, 44, 9, 21]])
    record = replay.record_blocks(target, drafter, prompt, 40, pad_token_id=0)
    assert record["tokens"] == 40 and len(record["survival"]) == 38, "a block from every anchor with room for a draft"
    config = copy.deepcopy(target.generation_config)
    config.dspark_truncation, config.dspark_num_draft_tokens = "fixed", depth
    out = target.generate(prompt, generation_config=config, assistant_model=drafter, do_sample=False, max_new_tokens=40, pad_token_id=0)
    assert out.shape[1] - prompt.shape[1] == record["tokens"]
    real = [(r.drafted, r.verified, r.accepted) for r in drafter.last_stats.rounds]
    verify = PaddedCostTable.from_dict({1: {w: 0.01 * w for w in range(1, 9)}})
    result = replay.replay(record, replay.fixed(depth), verify, DraftCost.from_dict({1: [0.001] * 4}))
    assert [t for t in result["trace"] if t[0]] == real
    accepted = [a for _, _, a in real]
    assert 0 in accepted and max(accepted) > 0, "both rejections and acceptances replayed"


def test_the_replayed_cost_planner_decides_as_generate_does(monkeypatch):
    """The replay's planner policy copies the candidate generator's use of the planner (plan, estimates, Algorithm 1's
    cut on the corrected survival, acceptance and round time): with generate()'s round times taken as the tables
    model them, as the replay prices them, both run the same rounds."""
    from generation.scheduling import depth_planner

    replay = replay_module()
    record_time = depth_planner.DepthPlanner.record_round_time

    def as_modelled(self, num_rows, depth, lengths, seconds, committed=None, context=DraftCost.BASE_CONTEXT):
        record_time(self, num_rows, depth, lengths, self.modelled_seconds(num_rows, depth, lengths, context), committed, context)

    monkeypatch.setattr(depth_planner.DepthPlanner, "record_round_time", as_modelled)
    target = bigram_target()
    drafter = oracle_drafter(target)
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.add_(torch.randn(drafter.markov_head.markov_w2.weight.shape, generator=torch.Generator().manual_seed(3)))
    prompt = torch.tensor([[5, 17, 3, 44, 9, 21]])
    record = replay.record_blocks(target, drafter, prompt, 60, pad_token_id=0)
    verify = PaddedCostTable.from_dict({1: {w: 0.01 * (1 + 0.1 * w) for w in range(1, 9)}})
    draft = DraftCost.from_dict({1: [0.002 + 0.0005 * d for d in range(1, 5)]}, {1: 0.0001})
    config = copy.deepcopy(target.generation_config)
    config.dspark_truncation, config.dspark_cost_table, config.dspark_draft_cost = "cost", verify, draft
    out = target.generate(prompt, generation_config=config, assistant_model=drafter, do_sample=False, max_new_tokens=60, pad_token_id=0)
    assert out.shape[1] - prompt.shape[1] == record["tokens"]
    real = [(r.drafted, r.verified, r.accepted) for r in drafter.last_stats.rounds]
    result = replay.replay(record, replay.PlannerPolicy(depth_planner, verify, draft, drafter.config.block_size), verify, draft)
    assert [t for t in result["trace"] if t[0]] == [r for r in real if r[0]]
    assert len({d for d, _, _ in real}) > 2, "several depths planned"
