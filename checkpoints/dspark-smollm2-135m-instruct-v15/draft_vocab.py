"""The draft vocabulary: the drafter predicts over the ``draft_vocab_size`` tokens its target actually writes.

The convention of EAGLE-3, vLLM, SGLang and speculators: a buffer ``d2t`` of offsets, ``target_id = draft_id +
d2t[draft_id]``, saved with the drafter. The drafter's LM head is the rows of the target's frozen LM head for
those ids, selected at call time (and cached while the target's weight is unchanged), never saved; the Markov
head's ``W2`` produces draft-vocabulary logits and its ``W1`` has one row per draft token plus one shared row
for a previous token outside the draft vocabulary (an anchor, or a teacher-forced label, can be any token).

Lossless drafting needs ``q`` over the target's vocabulary: :meth:`DraftVocabMixin.to_target_vocab` scatters the
draft logits into a full row with ``-inf`` elsewhere, so a token outside the draft vocabulary is never drafted
and verification treats it as any token with ``q = 0``. With ``draft_vocab_size=None`` every map is the identity.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

__all__ = ["DraftVocabMixin", "cached", "select_draft_vocab", "tensor_key"]


def select_draft_vocab(
    responses: Iterable[Iterable[int]], size: int, *, always: Iterable[int] = (), vocab_size: int | None = None
) -> torch.LongTensor:
    """The ``size`` most frequent token ids of ``responses`` (the target's own response tokens, assistant turn
    only), always including ``always`` (EOS, the chat template's end-of-turn token); sorted ascending.

    Ties are broken by the smaller id, so the choice is a function of the counts alone. Where the responses use
    fewer than ``size`` distinct tokens the rest are the smallest unused ids (a fixed ``draft_vocab_size`` keeps
    checkpoints of one recipe interchangeable)."""
    always = sorted({int(t) for t in always})
    if size < len(always):
        raise ValueError(f"draft vocabulary size {size} cannot hold the {len(always)} required ids {always}")
    counts = Counter()
    for ids in responses:
        counts.update(int(t) for t in ids)
    chosen = set(always)
    for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        if len(chosen) >= size:
            break
        chosen.add(token)
    if vocab_size is not None:
        bad = [t for t in chosen if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the target vocabulary of {vocab_size}")
    filler = 0
    while len(chosen) < size:
        if vocab_size is not None and filler >= vocab_size:
            raise ValueError(f"draft vocabulary size {size} exceeds the target vocabulary {vocab_size}")
        chosen.add(filler)
        filler += 1
    return torch.tensor(sorted(chosen), dtype=torch.long)


def tensor_key(t: torch.Tensor) -> tuple:
    """Identifies a tensor's current contents for a cache: storage, in-place version, dtype, device."""
    return t.data_ptr(), t._version, t.dtype, t.device


def cached(store: dict, name: str, key: tuple, build):
    """``build()``'s value for ``name``, kept in ``store`` while ``key`` (the :func:`tensor_key` of what it is built
    from) stays the same."""
    hit = store.get(name)
    if hit is None or hit[0] != key:
        hit = (key, build())
        store[name] = hit
    return hit[1]


class DraftVocabMixin:
    """Maps between the target's vocabulary and a drafter's draft vocabulary (``config.draft_vocab_size``).

    The model registers ``d2t`` (a persistent buffer) in ``__init__`` through :meth:`_init_draft_vocab`."""

    def _init_draft_vocab(self) -> None:
        size = self.config.draft_vocab_size
        if size is not None:
            self.register_buffer("d2t", torch.zeros(size, dtype=torch.long), persistent=True)
        else:
            self.d2t = None
        self._draft_vocab_cache: dict[str, tuple] = {}

    @property
    def has_draft_vocab(self) -> bool:
        return self.d2t is not None

    @property
    def num_draft_tokens_in_vocab(self) -> int:
        """Width of the drafter's logits: ``draft_vocab_size``, or the target's vocabulary."""
        return self.config.draft_vocab_size or self.config.vocab_size

    def set_draft_vocab(self, draft_vocab_ids: torch.LongTensor) -> None:
        """Store the draft vocabulary (target ids, strictly increasing) as ``d2t`` offsets."""
        ids = torch.as_tensor(draft_vocab_ids, dtype=torch.long).flatten()
        if self.d2t is None or ids.numel() != self.d2t.numel():
            raise ValueError(f"draft_vocab_ids has {ids.numel()} ids, config.draft_vocab_size is {self.config.draft_vocab_size}")
        if ids.numel() and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(f"draft_vocab_ids must lie in [0, {self.config.vocab_size}), got [{int(ids.min())}, {int(ids.max())}]")
        if bool((ids[1:] <= ids[:-1]).any()):
            raise ValueError("draft_vocab_ids must be strictly increasing (no duplicates)")
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(ids.numel()))

    def _cached(self, name: str, key: tuple, build):
        return cached(self._draft_vocab_cache, name, key, build)

    @property
    def draft_token_ids(self) -> torch.LongTensor | None:
        """Target id of every draft token [draft_vocab_size] (None with the full vocabulary)."""
        if self.d2t is None:
            return None
        d2t = self.d2t
        return self._cached("ids", tensor_key(d2t), lambda: torch.arange(d2t.numel(), device=d2t.device) + d2t)

    def _t2d(self) -> torch.LongTensor:
        d2t = self.d2t

        def build():
            t2d = torch.full((self.config.vocab_size,), d2t.numel(), dtype=torch.long, device=d2t.device)
            t2d[self.draft_token_ids] = torch.arange(d2t.numel(), device=d2t.device)
            return t2d

        return self._cached("t2d", tensor_key(d2t), build)

    def draft_index(self, target_ids: torch.LongTensor) -> torch.LongTensor:
        """Draft index of each target id; ``draft_vocab_size`` (the Markov head's shared row) for ids outside."""
        if self.d2t is None:
            return target_ids
        return self._t2d().to(target_ids.device)[target_ids]

    def to_target_ids(self, draft_index: torch.LongTensor) -> torch.LongTensor:
        """Target id of each draft index (the inverse of :meth:`draft_index` inside the draft vocabulary)."""
        if self.d2t is None:
            return draft_index
        return self.draft_token_ids.to(draft_index.device)[draft_index]

    def in_draft_vocab(self, target_ids: torch.LongTensor) -> torch.Tensor:
        if self.d2t is None:
            return torch.ones_like(target_ids, dtype=torch.bool)
        return self.draft_index(target_ids) < self.d2t.numel()

    def draft_lm_head_weight(self, lm_head: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target LM head's rows (and bias) for the draft vocabulary; cached while the target's weight is the
        same tensor, unchanged (it is frozen), so a drafting round does not copy it."""
        weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
        if self.d2t is None:
            return weight, bias
        ids = self.draft_token_ids.to(weight.device)
        key = (tensor_key(weight), tensor_key(self.d2t), None if bias is None else tensor_key(bias))
        return self._cached(
            "lm_head", key, lambda: (weight.detach().index_select(0, ids), None if bias is None else bias.detach().index_select(0, ids))
        )

    def draft_base_logits(self, hidden_states: torch.Tensor, lm_head: torch.nn.Module) -> torch.Tensor:
        """The parallel backbone's logits ``U`` over the draft vocabulary [..., draft vocab] (gradients reach
        ``hidden_states``; the target's LM head stays frozen)."""
        weight, bias = self.draft_lm_head_weight(lm_head)
        # as one [rows, hidden] matrix: a strided [R, D, hidden] slice (the block after the context in the
        # backbone's output) sends the matmul to a batched one that copies the weight once per row
        x = hidden_states.to(weight.dtype)
        flat = x.reshape(-1, x.shape[-1])
        logits = lm_head(flat) if self.d2t is None else torch.nn.functional.linear(flat, weight, bias)
        return logits.view(*x.shape[:-1], logits.shape[-1])

    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., Vd] as target-vocabulary logits [..., V], ``-inf`` outside (float32)."""
        logits = logits.float()
        if self.d2t is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        index = self.draft_token_ids.to(logits.device).expand_as(logits)
        return full.scatter_(-1, index, logits)  # in place: the out-of-place form copies the whole row first
