"""The engine's KV cache: arena layers written in place, rows handed from a request that left to one that joins."""

import pytest
import torch
from tiny_models import tiny_drafter, tiny_target

from generation import DSparkEngine
from generation.scheduling.scheduler import CostTable
from generation.serving import ragged_cache
from generation.serving.ragged_cache import ArenaLayer, RaggedCache


def test_arena_layer_holds_what_concatenation_holds_and_grows_in_place():
    torch.manual_seed(0)
    layer = ArenaLayer()
    chunks = [torch.randn(3, 2, n, 4) for n in (5, 1, 1, 8, 70, 1)]
    buffers = set()
    for i, k in enumerate(chunks):
        keys, values = layer.update(k, -k)
        expected = torch.cat(chunks[: i + 1], dim=-2)
        assert torch.equal(keys, expected) and torch.equal(values, -expected)
        buffers.add(layer._keys.data_ptr())
    assert len(buffers) < len(chunks), "single-column updates must write into room already there"
    assert layer.get_seq_length() == sum(k.shape[-2] for k in chunks)
    layer.crop(-3)
    assert torch.equal(layer.keys, torch.cat(chunks, dim=-2)[:, :, :-3])
    assert layer.update(chunks[-1], chunks[-1])[0].shape[-2] == layer.get_seq_length()


def _cache(rows, columns, valid, seed):
    g = torch.Generator().manual_seed(seed)
    tensors = [(torch.randn(rows, 2, columns, 4, generator=g), torch.randn(rows, 2, columns, 4, generator=g)) for _ in range(2)]
    return RaggedCache(ragged_cache._arena_cache(tensors), valid)


@pytest.mark.parametrize("newcomer_width", [3, 9])  # narrower than the cache, and wider (the cache widens)
def test_replace_rows_writes_only_the_given_rows(newcomer_width):
    cache = _cache(4, 6, torch.rand(4, 6, generator=torch.Generator().manual_seed(1)) > 0.3, seed=0)
    before = [(k.clone(), v.clone()) for k, v in cache._tensors()]
    valid_before = cache.valid.clone()
    lengths = torch.tensor([newcomer_width, newcomer_width - 2])
    joined = _cache(2, newcomer_width, torch.arange(newcomer_width)[None] < lengths[:, None], seed=2)
    cache.replace_rows([3, 1], joined)
    width = max(6, newcomer_width)
    assert cache.width == width
    for (k, v), (k0, v0), (kj, vj) in zip(cache._tensors(), before, joined._tensors()):
        assert k.shape[-2] == width
        for row, src in ((3, 0), (1, 1)):
            assert torch.equal(k[row, :, :newcomer_width], kj[src]) and torch.equal(v[row, :, :newcomer_width], vj[src])
        for row in (0, 2):
            assert torch.equal(k[row, :, :6], k0[row]) and torch.equal(v[row, :, :6], v0[row])
    assert torch.equal(cache.valid[[3, 1], :newcomer_width], joined.valid)
    assert not cache.valid[[3, 1], newcomer_width:].any()
    assert torch.equal(cache.valid[[0, 2], :6], valid_before[[0, 2]])
    assert not cache.valid[[0, 2], 6:].any()
    with pytest.raises(ValueError, match="valid columns come first"):
        cache.replace_rows([0], _cache(1, 3, torch.tensor([[True, False, True]]), seed=3))
    with pytest.raises(ValueError, match="2 rows to replace, 1 given"):
        cache.replace_rows([0, 2], _cache(1, 3, torch.ones(1, 3, dtype=torch.bool), seed=3))


@pytest.mark.parametrize("scheduler", ["none", "fixed", "algorithm1"])
def test_requests_joining_as_others_leave_take_their_rows_and_decode_exactly(scheduler, monkeypatch):
    """Continuous batching as the data regeneration runs it: at most three requests at once, a new one joining at
    each step that sees one leave. Greedy outputs must equal plain greedy decoding of each prompt alone."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    cost = CostTable.from_dict({1: 100.0, 4: 95.0, 8: 90.0})
    settings = {"none": {}, "fixed": {"num_verify": 3}, "algorithm1": {"cost_table": cost}}[scheduler]
    engine = DSparkEngine(target, drafter, scheduler=scheduler, **settings)
    replaced, dropped = [], []
    real_replace, real_keep = RaggedCache.replace_rows, RaggedCache.keep_rows

    def replace(self, rows, other):
        if self is engine.target_cache and rows:
            replaced.append(list(rows))
        return real_replace(self, rows, other)

    def keep(self, rows):
        if self is engine.target_cache:
            dropped.append(self.num_rows - len(rows))
        return real_keep(self, rows)

    monkeypatch.setattr(RaggedCache, "replace_rows", replace)
    monkeypatch.setattr(RaggedCache, "keep_rows", keep)
    g = torch.Generator().manual_seed(0)
    # a long prompt joins late, so the cache must widen for it
    lengths = [4, 11, 6, 3, 9, 40, 5, 7]
    budgets = [9, 5, 14, 6, 10, 8, 12, 4]
    queue = [(torch.randint(1, target.config.vocab_size, (n,), generator=g).tolist(), b) for n, b in zip(lengths, budgets)]
    jobs = {}
    while queue or engine.has_work():
        while queue and len(engine.active) + len(engine.waiting) < 3:
            ids, budget = queue.pop(0)
            jobs[engine.add_request(ids, max_new_tokens=budget)] = (ids, budget)
        engine.step()
    for rid, (ids, budget) in jobs.items():
        plain = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=budget)[0, len(ids) :].tolist()
        assert engine.finished[rid].output_ids == plain, f"request {rid} ({scheduler})"
    assert len(replaced) >= 3, "joiners must have taken the rows of requests that left"
    assert sum(dropped) <= 3, "rows are dropped only when no request is waiting to take them"
    if scheduler != "none":
        assert sum(r.verified for job in jobs for r in engine.finished[job].stats.rounds) > 0


def test_the_four_d_verify_mask_is_the_two_d_mask_transformers_builds():
    """A forward on a cache with holes (rolled-back columns, a shorter row) and right-padded new columns gives the
    same logits with the mask ready-made in 4-D as with the 2-D mask, and the engine passes 4-D masks on CPU with
    sdpa only (eager adds a mask to the scores, where a boolean one would be silently wrong)."""
    from transformers.cache_utils import DynamicCache

    target = tiny_target().float()
    torch.manual_seed(0)
    cache_valid = torch.tensor([[True, True, False, True, True, True], [True, True, True, False, False, False]])
    new_valid = torch.tensor([[True, True, True], [True, False, False]])
    ids = torch.randint(1, 96, (2, 9))
    positions = torch.cumsum(torch.cat([cache_valid, new_valid], dim=1).long(), dim=1) - 1
    two_d = ragged_cache.verify_attention_mask(cache_valid, new_valid)
    four_d = ragged_cache.verify_attention_mask(cache_valid, new_valid, four_d=True)
    assert four_d.shape == (2, 1, 3, 9) and four_d.dtype == torch.bool
    assert four_d[1, 0, 2].tolist() == [True] * 3 + [False] * 3 + [True, False, False]  # a padded query sees the valid keys
    no_holes = ragged_cache.verify_attention_mask(torch.ones_like(cache_valid), new_valid, four_d=True)
    logits = []
    for mask in (two_d, four_d, no_holes):
        cache = DynamicCache()
        with torch.no_grad():
            target(input_ids=ids[:, :6], attention_mask=two_d[:, :6], position_ids=positions[:, :6], cache=cache, use_cache=True)
            logits.append(target(input_ids=ids[:, 6:], attention_mask=mask, position_ids=positions[:, 6:], cache=cache, use_cache=True).logits)
    valid_new = new_valid[:, :, None].expand_as(logits[0])
    torch.testing.assert_close(logits[0][valid_new], logits[1][valid_new], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits[0][valid_new], logits[2][valid_new], atol=1e-3)  # the holes are seen

    assert ragged_cache.four_d_mask_pays(target)
    assert DSparkEngine(target, tiny_drafter(target), scheduler="fixed").four_d_mask
    target.config._attn_implementation = "eager"
    assert not ragged_cache.four_d_mask_pays(target)
