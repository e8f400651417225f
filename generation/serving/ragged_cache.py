"""A batched KV cache whose rows hold different numbers of valid tokens (the engine's requests).

Every forward appends the same number of columns to every row (Transformers' ``DynamicCache`` grows by
concatenation); a boolean ``valid`` mask [R, S] says which columns each row really keeps, so rolling back a
rejected draft is clearing its bits, a request leaving is dropping its row, and a request joining is
appending a (padded) row. Causality is by column index, which keeps each row's kept tokens in order;
positions are always passed explicitly. ``compact()`` squeezes the holes out when they waste too much.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache, DynamicLayer

__all__ = ["RaggedCache"]


def _make_cache(tensors) -> DynamicCache:
    """A ``DynamicCache`` holding the given per-layer (keys, values)."""
    cache = DynamicCache()
    for k, v in tensors:
        layer = DynamicLayer()
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
        cache.layers.append(layer)
    return cache


class RaggedCache:
    def __init__(self, cache: DynamicCache | None = None, valid: torch.Tensor | None = None):
        self.cache = cache if cache is not None else DynamicCache()
        self.valid = valid if valid is not None else torch.zeros(0, 0, dtype=torch.bool)

    @property
    def num_rows(self) -> int:
        return self.valid.shape[0]

    @property
    def width(self) -> int:
        return self.valid.shape[1]

    def lengths(self) -> torch.Tensor:
        """Valid tokens per row."""
        return self.valid.sum(-1)

    def _tensors(self):
        return [(layer.keys, layer.values) for layer in self.cache.layers if getattr(layer, "is_initialized", False)]

    def _set(self, tensors) -> None:
        for layer, (k, v) in zip(self.cache.layers, tensors):
            layer.keys, layer.values = k, v

    def extend(self, new_valid: torch.Tensor) -> None:
        """Record the columns the last forward appended: ``new_valid`` [R, Q] marks the ones each row keeps."""
        self.valid = torch.cat([self.valid, new_valid.to(self.valid.device, torch.bool)], dim=1)
        if self._tensors() and self._tensors()[0][0].shape[-2] != self.width:
            raise RuntimeError(f"cache has {self._tensors()[0][0].shape[-2]} columns, the valid mask {self.width}")

    def attention_mask(self, new_valid: torch.Tensor) -> torch.Tensor:
        """[R, S + Q] 0/1 mask over the cached columns and ``Q`` new ones (``new_valid`` [R, Q])."""
        return torch.cat([self.valid, new_valid.to(self.valid.device, torch.bool)], dim=1).long()

    def keep_rows(self, rows: torch.Tensor | list[int]) -> None:
        """Keep only these rows, in this order (requests that left are dropped)."""
        index = torch.as_tensor(rows, dtype=torch.long, device=self.valid.device)
        self.valid = self.valid.index_select(0, index)
        self._set([(k.index_select(0, index.to(k.device)), v.index_select(0, index.to(v.device))) for k, v in self._tensors()])

    def append_rows(self, other: "RaggedCache") -> None:
        """Add ``other``'s rows after this cache's (both are padded to the wider one with invalid columns)."""
        width = max(self.width, other.width)
        valid = torch.cat([F.pad(self.valid, (0, width - self.width)), F.pad(other.valid.to(self.valid.device), (0, width - other.width))])
        mine, theirs = self._tensors(), other._tensors()
        template = mine or theirs
        if template:

            def filled(tensors, rows):  # each layer [rows, H, width, D]; zeros for a cache that saw no forward yet
                if tensors:
                    return [(F.pad(k, (0, 0, 0, width - k.shape[-2])), F.pad(v, (0, 0, 0, width - v.shape[-2]))) for k, v in tensors]
                return [(k.new_zeros(rows, k.shape[1], width, k.shape[-1]), v.new_zeros(rows, v.shape[1], width, v.shape[-1])) for k, v in template]

            merged = [
                (torch.cat([k1, k2]), torch.cat([v1, v2]))
                for (k1, v1), (k2, v2) in zip(filled(mine, self.num_rows), filled(theirs, other.num_rows))
            ]
            self.cache = _make_cache(merged)
        self.valid = valid

    def compact(self, slack: int = 32) -> None:
        """Move every row's valid columns to the front when the holes exceed ``slack`` columns."""
        longest = int(self.lengths().max()) if self.num_rows else 0
        if self.width - longest <= slack:
            return
        order = torch.argsort((~self.valid).to(torch.int8), dim=1, stable=True)[:, :longest]  # valid columns first, in order
        tensors = []
        for k, v in self._tensors():
            index = order.to(k.device)[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])
            tensors.append((k.gather(2, index), v.gather(2, index)))
        self._set(tensors)
        self.valid = self.valid.gather(1, order)
