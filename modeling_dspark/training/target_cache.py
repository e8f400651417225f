"""An offline cache of the frozen target's features, so that epochs after the first skip the target's forward.

As DeepSpec's ``prepare_target_cache.py``: per training sequence, the context features of the drafter's target
layers and the target's final (post-norm) hidden state, in bf16; the target's logits are recomputed from the latter
with its frozen LM head. One flat memory-mapped file holds every token's row (``F + d`` values, 6.9 kB per token
for SmolLM2 with five feature layers), ``meta.json`` the offsets and what the cache was built from (target, layers,
a hash of the token ids), so a cache is rebuilt rather than misused when any of them changes.

On a 2-core CPU with a 135M target the forward is about a third of a dense-anchor training step
(``dspark bench-train`` measures both), so a multi-epoch run gains that much from the second epoch on.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

__all__ = ["TargetFeatureCache", "dataset_fingerprint", "target_features"]


@torch.no_grad()
def target_features(target, layer_ids, input_ids, attention_mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen target's context features of ``layer_ids`` (HF tuple: index i + 1 is layer i's output) and its
    final (post-norm) hidden states, for a batch. ``get_decoder()`` rather than ``.model``: a PEFT-wrapped target
    forwards it to its LoRA-carrying decoder."""
    out = target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1), out.last_hidden_state


def dataset_fingerprint(input_ids) -> str:
    digest = hashlib.sha1()
    for ids in input_ids:
        digest.update(np.asarray(ids, dtype=np.int64).tobytes())
        digest.update(b"|")
    return digest.hexdigest()


def _target_key(target) -> str:
    text = target.config.get_text_config()
    return f"{getattr(target, 'name_or_path', '')}|{text.model_type}|{sum(p.numel() for p in target.parameters())}|{target.dtype}"


class TargetFeatureCache:
    """``cache[i]`` -> (features [L_i, F], last hidden [L_i, d]) of sequence i, bf16 tensors read from disk."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.meta = json.loads((self.folder / "meta.json").read_text())
        self.offsets = np.asarray(self.meta["offsets"], dtype=np.int64)
        self.feature_width, self.hidden_width = self.meta["feature_width"], self.meta["hidden_width"]
        width = self.feature_width + self.hidden_width
        self._rows = np.memmap(self.folder / "features.bin", dtype=np.uint16, mode="r", shape=(int(self.offsets[-1]), width))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.from_numpy(np.array(self._rows[self.offsets[index] : self.offsets[index + 1]])).view(torch.bfloat16)
        return rows[:, : self.feature_width], rows[:, self.feature_width :]

    def matches(self, target, layer_ids, fingerprint: str) -> bool:
        return (
            self.meta.get("target") == _target_key(target)
            and self.meta.get("target_layer_ids") == list(layer_ids)
            and self.meta.get("fingerprint") == fingerprint
        )

    @classmethod
    def open_or_build(cls, folder, target, layer_ids, input_ids, batch_size: int = 8) -> "TargetFeatureCache":
        """The cache in ``folder`` if it was built from this target, these layers and these sequences; else build it."""
        fingerprint = dataset_fingerprint(input_ids)
        folder = Path(folder)
        if (folder / "meta.json").is_file():
            cache = cls(folder)
            if cache.matches(target, layer_ids, fingerprint):
                return cache
        return cls.build(folder, target, layer_ids, input_ids, batch_size=batch_size, fingerprint=fingerprint)

    @classmethod
    @torch.no_grad()
    def build(cls, folder, target, layer_ids, input_ids, *, batch_size: int = 8, fingerprint: str | None = None) -> "TargetFeatureCache":
        """Run the frozen target over ``input_ids`` (lists of token ids) in length-sorted batches and write the cache."""
        from tqdm.auto import tqdm

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "meta.json").unlink(missing_ok=True)  # a half-written cache is never mistaken for a whole one
        lengths = [len(ids) for ids in input_ids]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        text = target.config.get_text_config()
        feature_width, hidden_width = len(layer_ids) * text.hidden_size, text.hidden_size
        rows = np.memmap(folder / "features.bin", dtype=np.uint16, mode="w+", shape=(max(int(offsets[-1]), 1), feature_width + hidden_width))
        order = sorted(range(len(input_ids)), key=lambda i: lengths[i])
        pad = getattr(target.generation_config, "pad_token_id", None) or 0
        for start in tqdm(range(0, len(order), batch_size), desc="target feature cache", unit="batch"):
            batch = order[start : start + batch_size]
            width = max(lengths[i] for i in batch)
            ids = torch.tensor([list(input_ids[i]) + [pad] * (width - lengths[i]) for i in batch], device=target.device)
            mask = (torch.arange(width, device=target.device)[None] < torch.tensor([lengths[i] for i in batch], device=target.device)[:, None]).long()
            both = torch.cat(target_features(target, layer_ids, ids, mask), -1).to(torch.bfloat16).cpu()
            for row, i in enumerate(batch):
                rows[offsets[i] : offsets[i + 1]] = both[row, : lengths[i]].view(torch.uint16).numpy()
        rows.flush()
        meta = {
            "target": _target_key(target),
            "target_layer_ids": list(layer_ids),
            "fingerprint": fingerprint or dataset_fingerprint(input_ids),
            "feature_width": feature_width,
            "hidden_width": hidden_width,
            "offsets": offsets.tolist(),
        }
        (folder / "meta.json").write_text(json.dumps(meta))
        return cls(folder)
