"""Warm starts: a new drafter begins from a trained one's weights, deeper than it where asked.

A drafter of the same geometry takes the trained weights as they are. A deeper DSpark drafter (more draft layers,
the rest of the geometry equal) takes them for its first layers, heads and embeddings, and its added layers start as
identity blocks: each is a pre-norm residual block whose output projections (``self_attn.o_proj``, ``mlp.down_proj``)
are set to zero, so it adds nothing to the residual stream and the deeper drafter computes exactly what the trained
one does (function-preserving growth, as Net2Net's deepening). Training then moves the zeroed projections first,
whose gradient is not zero, and the rest of the added layers after them. It is how a drafter whose training curve
flattens at its capacity (its training-split tau barely above its held-out tau) gets more, without losing what the
earlier positions bought.
"""

from __future__ import annotations

import re

import torch

__all__ = ["IDENTITY_PROJECTIONS", "warm_start"]

# the projections of a decoder layer that write into the residual stream: zero makes the layer an identity
IDENTITY_PROJECTIONS = ("self_attn.o_proj", "mlp.down_proj")
_LAYER = re.compile(r"^layers\.(\d+)\.")


def _layer_index(key: str) -> int | None:
    """The draft layer a state-dict key belongs to (None: not a layer's)."""
    match = _LAYER.match(key)
    return int(match.group(1)) if match else None


def _num_layers(state: dict) -> int:
    return 1 + max((i for key in state if (i := _layer_index(key)) is not None), default=-1)


@torch.no_grad()
def warm_start(drafter, warm) -> dict:
    """Load ``warm``'s weights into ``drafter`` (both built; ``drafter`` may have more draft layers than ``warm``,
    nothing else may differ). Returns ``{"from_layers": n, "to_layers": m, "identity_layers": [...]}``.

    Raises ValueError naming the first difference when the two cannot be matched: another geometry, or a
    shallower or non-DSpark ``drafter`` against a deeper ``warm``."""
    target_state, source = drafter.state_dict(), warm.state_dict()
    have, want = _num_layers(source), _num_layers(target_state)
    if want < have:
        raise ValueError(f"the drafter has {want} draft layers, the warm start {have}: a warm start can add layers, not drop them")
    if want > have and getattr(drafter.config, "model_type", None) != "dspark":
        raise ValueError(f"only a DSpark drafter can be deepened; this one is {drafter.config.model_type!r}")
    in_added_layer = {key for key in target_state if (index := _layer_index(key)) is not None and index >= have}
    missing = [key for key in target_state if key not in source and key not in in_added_layer]
    unexpected = [key for key in source if key not in target_state]
    if missing or unexpected:
        raise ValueError(f"not the geometry of this drafter: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for key, value in source.items():
        if target_state[key].shape != value.shape:
            raise ValueError(f"not the geometry of this drafter: {key} is {tuple(value.shape)} there, {tuple(target_state[key].shape)} here")
    drafter.load_state_dict(source, strict=False)
    added = list(range(have, want))
    for index in added:
        layer = drafter.layers[index]
        for name in IDENTITY_PROJECTIONS:
            module = layer.get_submodule(name)
            module.weight.zero_()
            if module.bias is not None:
                module.bias.zero_()
    return {"from_layers": have, "to_layers": want, "identity_layers": added}
