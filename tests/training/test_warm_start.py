"""Warm starts: the same geometry loads as it is; a deeper drafter computes exactly what the shallower one did, and
training can move its added layers."""

import pytest
import torch
from tiny_models import tiny_drafter, tiny_target

from modeling_dspark.training.warm_start import IDENTITY_PROJECTIONS, warm_start


def drafter_outputs(drafter, target):
    """The block hidden states and the first slot's draft logits for a fixed context and anchor."""
    torch.manual_seed(0)
    width = len(drafter.config.target_layer_ids) * target.config.hidden_size
    context = torch.randn(2, 9, width)
    anchors = torch.tensor([3, 11])
    out = drafter(block_embeds=drafter.embed_block(anchors, target.get_input_embeddings()), context_features=context)
    return out.last_hidden_state, drafter.draft_base_logits(out.last_hidden_state, target.get_output_embeddings())


def trained(drafter):
    """Weights away from their initialisation (a fresh layer's zero-mean init could hide a wrong copy)."""
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return drafter


def test_same_geometry_loads_every_weight():
    target = tiny_target()
    warm, fresh = trained(tiny_drafter(target, seed=1)), tiny_drafter(target, seed=2)
    assert warm_start(fresh, warm) == {"from_layers": 2, "to_layers": 2, "identity_layers": []}
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), warm.state_dict().values()))


def test_a_deeper_drafter_starts_as_the_warm_one_and_trains_its_added_layers():
    target = tiny_target()
    warm = trained(tiny_drafter(target, seed=1))
    deeper = tiny_drafter(target, seed=2, num_draft_layers=4)
    assert warm_start(deeper, warm) == {"from_layers": 2, "to_layers": 4, "identity_layers": [2, 3]}
    for a, b in zip(drafter_outputs(deeper, target), drafter_outputs(warm, target)):
        assert torch.equal(a, b)  # identity blocks add exact zeros to the residual stream
    for index in (2, 3):
        layer = deeper.layers[index]
        assert all(not layer.get_submodule(name).weight.any() for name in IDENTITY_PROJECTIONS)
        assert layer.self_attn.q_proj.weight.any()  # the rest keeps its fresh init, so the block can learn
    deeper.train()
    hidden, logits = drafter_outputs(deeper, target)
    logits.logsumexp(-1).sum().backward()
    for index in (2, 3):  # what training moves first: the zeroed projections get a gradient
        assert all(deeper.layers[index].get_submodule(name).weight.grad.abs().sum() > 0 for name in IDENTITY_PROJECTIONS)


def test_what_cannot_be_warm_started_is_refused_by_name():
    target = tiny_target()
    warm = tiny_drafter(target, num_draft_layers=3)
    with pytest.raises(ValueError, match="has 2 draft layers, the warm start 3: a warm start can add layers, not drop them"):
        warm_start(tiny_drafter(target, num_draft_layers=2), warm)
    with pytest.raises(ValueError, match="markov_head"):
        warm_start(tiny_drafter(target, num_draft_layers=3, markov_rank=16), warm)
    with pytest.raises(ValueError, match="not the geometry"):
        warm_start(tiny_drafter(target, num_draft_layers=3, confidence_head=False), warm)
