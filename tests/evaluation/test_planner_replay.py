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
