"""A batched KV cache whose rows hold different numbers of valid tokens (the engine's requests).

Every forward appends the same number of columns to every row; a boolean ``valid`` mask [R, S] says which
columns each row really keeps, so rolling back a rejected draft is clearing its bits, a request leaving is
dropping its row (or leaving it to the next request, :meth:`RaggedCache.replace_rows`), and a request joining is
taking a free row or appending a (padded) one. Causality is by column index, which keeps each row's kept tokens
in order; positions are always passed explicitly. ``compact()`` squeezes the holes out when they waste too much.

Each layer stores its keys and values in a preallocated buffer (:class:`ArenaLayer`) that a forward writes into
in place: growing a cache by concatenation copies every row of every layer on every step, which cost a batched
decode as much time as its attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache, DynamicLayer

__all__ = ["ArenaLayer", "RaggedCache", "four_d_mask_pays", "verify_attention_mask"]


def four_d_mask_pays(model) -> bool:
    """Whether ``model``'s forward should get its attention mask ready-made in 4-D. On CPU, Transformers drops an
    all-ones 2-D mask and calls torch's sdpa with ``enable_gqa``, which for one query token runs 1.1x (1 row) to
    1.8x (16 rows) slower than with a mask (SmolLM2-135M, bf16, torch 2.13, Transformers 5.24,
    ``benchmarks/mask_timing.py``); on an accelerator the maskless kernels are the fast ones. Only sdpa reads a
    boolean mask as it is (eager adds the mask to the scores)."""
    return model.device.type == "cpu" and getattr(model.config, "_attn_implementation", None) == "sdpa"


def verify_attention_mask(cache_valid: torch.Tensor, new_valid: torch.Tensor, *, four_d: bool = False) -> torch.Tensor:
    """The mask of a forward of ``Q`` new columns (``new_valid`` [R, Q]) on top of ``S`` cached ones
    (``cache_valid`` [R, S]): [R, S + Q] 0/1, or with ``four_d`` the boolean [R, 1, Q, S + Q] mask the attention
    reads (new token i sees the valid cached columns and the valid new ones up to i), which Transformers uses as
    it is."""
    valid = torch.cat([cache_valid, new_valid.to(cache_valid.device, torch.bool)], dim=1)
    if not four_d:
        return valid.long()
    num_cached, q_len = cache_valid.shape[1], new_valid.shape[1]
    causal = torch.ones(q_len, num_cached + q_len, dtype=torch.bool, device=valid.device).tril(num_cached)
    return valid[:, None, None, :] & causal[None, None]


class ArenaLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values [R, H, S, D] are views of a buffer with room for more columns:
    ``update`` writes the new columns in place and grows the buffer geometrically when it is full. Unused columns
    are zeros, never uninitialised memory, so a masked column cannot turn attention into NaN."""

    growth = 1.5
    min_room = 64

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._keys = key_states.new_zeros(*key_states.shape[:2], 0, key_states.shape[-1])
        self._values = value_states.new_zeros(*value_states.shape[:2], 0, value_states.shape[-1])
        self.length = 0
        self._expose()
        self.is_initialized = True

    def _expose(self) -> None:
        self.keys = self._keys[:, :, : self.length]
        self.values = self._values[:, :, : self.length]

    def _reserve(self, columns: int) -> None:
        """Make room for ``columns`` columns in all (copies only when the buffer is full)."""
        capacity = self._keys.shape[-2]
        if columns <= capacity:
            return
        capacity = max(columns, int(capacity * self.growth), columns + self.min_room)
        for name in ("_keys", "_values"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[-1])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, new = self.length, key_states.shape[-2]
        self._reserve(start + new)
        self._keys[:, :, start : start + new] = key_states
        self._values[:, :, start : start + new] = value_states
        self.length = start + new
        self._expose()
        return self.keys, self.values

    def assign(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold exactly these keys and values (rows selected or gathered elsewhere), with room to grow."""
        self.device = keys.device
        self._keys, self._values, self.length = keys, values, keys.shape[-2]
        self._reserve(self.length + self.min_room)
        self._expose()
        self.is_initialized = True

    def pad_to(self, columns: int) -> None:
        """Append zero columns up to ``columns`` (masked out by the caller)."""
        if columns > self.length:
            self._reserve(columns)
            self._keys[:, :, self.length : columns] = 0
            self._values[:, :, self.length : columns] = 0
            self.length = columns
            self._expose()

    def write_rows(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite ``rows``' first columns with ``keys``/``values`` [len(rows), H, S', D], S' <= length."""
        width = keys.shape[-2]
        self._keys[rows, :, :width] = keys
        self._values[rows, :, :width] = values

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self.length = self.keys.shape[-2]
        self._expose()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.assign(self.keys[indices], self.values[indices])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self.assign(self.keys.index_select(0, beam_idx.to(self.device)), self.values.index_select(0, beam_idx.to(self.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.assign(self.keys.repeat_interleave(repeats, dim=0), self.values.repeat_interleave(repeats, dim=0))


def _arena_cache(tensors=()) -> DynamicCache:
    """A cache of :class:`ArenaLayer` layers holding the given per-layer (keys, values); more layers are created
    as a forward reaches them."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = ArenaLayer
    for k, v in tensors:
        layer = ArenaLayer()
        layer.assign(k, v)
        cache.layers.append(layer)
    return cache


class RaggedCache:
    def __init__(self, cache: DynamicCache | None = None, valid: torch.Tensor | None = None):
        self.cache = cache if cache is not None else _arena_cache()
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

    def _layers(self):
        return [layer for layer in self.cache.layers if getattr(layer, "is_initialized", False)]

    def _tensors(self):
        return [(layer.keys, layer.values) for layer in self._layers()]

    def _set(self, tensors) -> None:
        """Replace the stored tensors (rows dropped, columns gathered), as arena layers."""
        if any(not isinstance(layer, ArenaLayer) for layer in self.cache.layers):
            self.cache = _arena_cache(tensors)
            return
        for layer, (k, v) in zip(self._layers(), tensors):
            layer.assign(k, v)

    def extend(self, new_valid: torch.Tensor) -> None:
        """Record the columns the last forward appended: ``new_valid`` [R, Q] marks the ones each row keeps."""
        self.valid = torch.cat([self.valid, new_valid.to(self.valid.device, torch.bool)], dim=1)
        if self._tensors() and self._tensors()[0][0].shape[-2] != self.width:
            raise RuntimeError(f"cache has {self._tensors()[0][0].shape[-2]} columns, the valid mask {self.width}")

    def attention_mask(self, new_valid: torch.Tensor, *, four_d: bool = False) -> torch.Tensor:
        """The mask over the cached columns and ``Q`` new ones (``new_valid`` [R, Q]): :func:`verify_attention_mask`."""
        return verify_attention_mask(self.valid, new_valid, four_d=four_d)

    def keep_rows(self, rows: torch.Tensor | list[int]) -> None:
        """Keep only these rows, in this order (requests that left are dropped)."""
        index = torch.as_tensor(rows, dtype=torch.long, device=self.valid.device)
        self.valid = self.valid.index_select(0, index)
        self._set(self._row_tensors(index))

    def select_rows(self, rows) -> RaggedCache:
        """A new cache of these rows (copies)."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        return RaggedCache(_arena_cache(self._row_tensors(index)), self.valid.index_select(0, index.to(self.valid.device)))

    def _row_tensors(self, index: torch.Tensor):
        """Each layer's (keys, values) of the rows in ``index``, copied."""
        return [(k.index_select(0, index.to(k.device)), v.index_select(0, index.to(v.device))) for k, v in self._tensors()]

    def replace_rows(self, rows: list[int], other: RaggedCache) -> None:
        """Give rows ``rows`` (whose requests left) to ``other``'s rows, in order: their columns are overwritten
        from the first one, the rest marked invalid. ``other``'s valid columns must be a prefix of each row (a
        prefill's right padding). Only those rows are written, where dropping and appending rows copies all."""
        if len(rows) != other.num_rows:
            raise ValueError(f"{len(rows)} rows to replace, {other.num_rows} given")
        if not rows:
            return
        if bool((other.valid[:, 1:] & ~other.valid[:, :-1]).any()):
            raise ValueError("replace_rows takes rows whose valid columns come first")
        width = max(self.width, other.width)
        theirs = other._tensors()
        if theirs and not self._layers():
            raise ValueError("replace_rows needs a cache that already holds tensors")
        index = torch.as_tensor(rows, dtype=torch.long)
        for layer in self._layers():
            layer.pad_to(width)
        for layer, (k, v) in zip(self._layers(), theirs):  # none for a drafter that has not run on the newcomers
            layer.write_rows(index.to(layer.device), k, v)
        self.valid = F.pad(self.valid, (0, width - self.width))
        self.valid[index] = F.pad(other.valid.to(self.valid.device), (0, width - other.width))

    def append_rows(self, other: RaggedCache) -> None:
        """Add ``other``'s rows after this cache's (both are padded to the wider one with invalid columns)."""
        if not other.num_rows:
            return
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
            self.cache = _arena_cache(merged)
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
