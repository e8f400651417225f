"""The draft vocabulary (``d2t``), the one drafting path, and the training loss over a draft vocabulary."""

import pytest
import torch
from exactness import PROMPT, chi_square_pvalue, exact_distribution, peaked_target
from tiny_models import tiny_drafter, tiny_target
from transformers import GenerationConfig

import generation.decoding.candidate_generator as candidate_generator
from generation.decoding.drafting import draft_block, sample_categorical
from generation.serving.verification import process_logits, sample_tokens
from modeling_dspark import DSparkModel, Eagle3DrafterModel
from modeling_dspark.checkpoint.deepspec import to_deepspec
from modeling_dspark.checkpoint.draft_vocab import select_draft_vocab
from modeling_dspark.training.loss import (
    _CrossEntropyAndL1,
    build_block_attention_mask,
    build_block_context_mask,
    build_block_targets,
    build_loss_weights,
    compute_dspark_loss,
    sample_anchor_positions,
)

EVEN = torch.arange(0, 96, 2)  # half of a 96-token vocabulary: the target's argmax is often outside


def test_select_draft_vocab_takes_the_most_frequent_and_the_required_ids():
    responses = [[5, 5, 5, 7, 7, 9], [7, 5, 11]]
    assert select_draft_vocab(responses, 3, always=[2]).tolist() == [2, 5, 7]  # 9 and 11 lose to the required EOS
    assert select_draft_vocab(responses, 4).tolist() == [5, 7, 9, 11]  # ties broken by the smaller id
    assert select_draft_vocab(responses, 6, vocab_size=20).tolist() == [0, 1, 5, 7, 9, 11]  # filled with small ids
    with pytest.raises(ValueError, match="cannot hold"):
        select_draft_vocab(responses, 1, always=[1, 2])
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        select_draft_vocab([[50]], 1, vocab_size=20)


def test_d2t_convention_heads_and_save_load(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target, draft_vocab_ids=EVEN)
    assert drafter.config.draft_vocab_size == 48
    assert torch.equal(torch.arange(48) + drafter.d2t, EVEN)  # target_id = draft_id + d2t[draft_id]
    assert drafter.markov_head.markov_w2.weight.shape == (48, 8)
    assert drafter.markov_head.markov_w1.weight.shape == (49, 8)  # + the row shared by tokens outside
    assert drafter.draft_index(torch.tensor([4, 5])).tolist() == [2, 48]
    drafter.save_pretrained(tmp_path)
    loaded = DSparkModel.from_pretrained(tmp_path)
    assert torch.equal(loaded.d2t, drafter.d2t) and loaded.d2t.dtype == torch.long
    for key, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    eagle = Eagle3DrafterModel.from_target(target, draft_vocab_ids=EVEN)
    assert eagle.config.draft_vocab_size == 48 and eagle.draft_base_logits(torch.randn(2, 32), target.lm_head).shape == (2, 48)
    with pytest.raises(ValueError, match="strictly increasing"):
        tiny_drafter(target, draft_vocab_ids=torch.tensor([4, 2]))
    with pytest.raises(ValueError, match="needs draft_vocab_ids"):
        tiny_drafter(target, draft_vocab_size=10)


def test_deepspec_export_writes_d2t_and_loads_back(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target, draft_vocab_ids=EVEN, mask_token_id=95).float()
    to_deepspec(drafter, target, tmp_path, dtype=torch.float32)
    from safetensors.torch import load_file

    state = load_file(tmp_path / "model.safetensors")
    assert state["lm_head.weight"].shape == (48, 32) and state["markov_head.markov_w1.weight"].shape == (96, 8)
    assert torch.equal(state["d2t"], drafter.d2t)
    loaded = DSparkModel.from_pretrained(tmp_path)
    for key, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[key].to(value.dtype), value), key


def assert_greedy_lossless(target, drafter, ids, **kwargs):
    plain = target.generate(ids, max_new_tokens=24, do_sample=False, **kwargs)
    fast = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter, **kwargs)
    assert torch.equal(plain, fast)
    return drafter.last_stats


@pytest.fixture
def drafted(monkeypatch):
    """The tokens of every block generate() drafts in the test."""
    blocks = []

    def recording(*args, **kwargs):
        block = draft_block(*args, **kwargs)
        blocks.append(block.tokens)
        return block

    monkeypatch.setattr(candidate_generator, "draft_block", recording)
    return blocks


def test_reduced_vocabulary_greedy_identical_with_rejections(drafted):
    target = tiny_target(initializer_range=0.2)
    accepted = rejected = outside_argmax = 0
    for seed in range(4):
        drafter = tiny_drafter(target, seed=seed, draft_vocab_ids=EVEN, truncation="fixed")
        ids = torch.randint(1, 96, (1, 6), generator=torch.Generator().manual_seed(seed))
        stats = assert_greedy_lossless(target, drafter, ids)
        accepted += sum(r.accepted for r in stats.rounds)
        rejected += sum(r.accepted < r.verified for r in stats.rounds)
        out = target.generate(ids, max_new_tokens=24, do_sample=False)
        outside_argmax += int((out[0, 6:] % 2 == 1).sum())
    tokens = torch.cat([t.flatten() for t in drafted])
    assert tokens.numel() > 0 and bool((tokens % 2 == 0).all()), "every draft lies inside the draft vocabulary"
    assert outside_argmax > 10 and rejected > 0, "the target's argmax must often lie outside, so drafts get rejected"


def test_oracle_inside_the_draft_vocabulary_accepts_there():
    from tiny_models import bigram_target, oracle_drafter

    target = bigram_target()
    full = oracle_drafter(target)
    drafter = tiny_drafter(target, markov_rank=32, draft_vocab_ids=EVEN)
    with torch.no_grad():  # the oracle's Markov head, restricted to the draft vocabulary
        drafter.norm.weight.zero_()
        w1 = full.markov_head.markov_w1.weight
        drafter.markov_head.markov_w1.weight.copy_(torch.cat([w1[EVEN], w1[1:2]]))
        drafter.markov_head.markov_w2.weight.copy_(full.markov_head.markov_w2.weight[EVEN])
    stats = assert_greedy_lossless(target, drafter, torch.tensor([[2, 4, 6]]))
    assert sum(r.accepted for r in stats.rounds) > 0


def test_reduced_vocabulary_sampling_matches_target(drafted):
    target = peaked_target()
    drafter = tiny_drafter(target, seed=7, draft_vocab_ids=torch.tensor([0, 1, 3]))  # token 2 is never drafted
    config = GenerationConfig(max_new_tokens=4, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, dspark_truncation="fixed")
    torch.manual_seed(0)
    samples, counts, rounds = 2500, {}, []
    for _ in range(samples):
        out = target.generate(PROMPT, generation_config=config, assistant_model=drafter)
        key = tuple(out[0, PROMPT.shape[1] :].tolist())
        counts[key] = counts.get(key, 0) + 1
        rounds += [r for r in drafter.last_stats.rounds if r.drafted]
    tokens = torch.cat([t.flatten() for t in drafted])
    assert len(rounds) >= samples and bool((tokens != 2).all()), "drafts were made, none outside the draft vocabulary"
    assert 0 < sum(r.accepted for r in rounds) < sum(r.verified for r in rounds), "drafts both accepted and rejected"
    assert sum(c for k, c in counts.items() if 2 in k) > 0, "the target still writes the token the drafter cannot"
    assert chi_square_pvalue(counts, exact_distribution(target), samples) > 1e-3


# ------------------------------------------------------------------------------------------ the drafting function
def previous_generate_loop(drafter, h, lm_head, anchor, ids, do_sample, processor=None):
    """The drafting loop of generate() before it moved into draft_block (one row, whole vocabulary)."""
    markov, prev, tokens, logits = drafter.markov_head, anchor, [], []
    base = lm_head(h[0]).float()
    state = markov.initial_state(h[0, :1])
    for k in range(h.shape[1]):
        step, state = markov.apply_step_logits(base[k : k + 1], prev, h[0, k : k + 1], state)
        if processor is not None:
            step = processor(ids, step)
        token = sample_categorical(torch.softmax(step, dim=-1)) if do_sample else step.argmax(dim=-1)
        tokens.append(token), logits.append(step)
        ids, prev = torch.cat([ids, token[None]], dim=-1), token
    return torch.stack(tokens, 1), torch.stack(logits, 1)


def previous_engine_loop(drafter, h, lm_head, anchors, temperature, top_p):
    """The engine's drafting loop before draft_block (rows with their own temperature / top-p)."""
    base, markov, prev, greedy = lm_head(h).float(), drafter.markov_head, anchors, temperature <= 0
    state, tokens, logits = markov.initial_state(h[:, 0]), [], []
    for k in range(h.shape[1]):
        step, state = markov.apply_step_logits(base[:, k], prev, h[:, k], state)
        step = process_logits(step, temperature, top_p)
        prev = sample_tokens(step, greedy)
        tokens.append(prev), logits.append(step)
    return torch.stack(tokens, 1), torch.stack(logits, 1)


@pytest.mark.parametrize("do_sample", [False, True])
def test_draft_block_matches_the_previous_loops(do_sample):
    target = tiny_target()
    drafter = tiny_drafter(target)
    h, lm_head = torch.randn(1, 4, 32), target.lm_head
    ids = torch.tensor([[3, 5, 7]])
    with torch.no_grad():
        torch.manual_seed(5)
        old_tokens, old_logits = previous_generate_loop(drafter, h, lm_head, ids[:, -1], ids, do_sample)
        torch.manual_seed(5)
        block = draft_block(drafter, h, lm_head, ids[:, -1], num_slots=4, greedy=not do_sample, prefix_ids=ids)
        assert torch.equal(block.tokens, old_tokens) and torch.equal(block.logits, old_logits)
        h4, anchors = torch.randn(3, 4, 32), torch.tensor([3, 9, 11])
        temperature, top_p = torch.tensor([0.0, 0.7, 1.3]) * do_sample, torch.tensor([1.0, 0.9, 0.8])
        torch.manual_seed(6)
        old_tokens, old_logits = previous_engine_loop(drafter, h4, lm_head, anchors, temperature, top_p)
        torch.manual_seed(6)
        block = draft_block(drafter, h4, lm_head, anchors, num_slots=4, greedy=temperature <= 0,
                            logits_processor=lambda _ids, x: process_logits(x, temperature, top_p))  # fmt: skip
    assert torch.equal(block.tokens, old_tokens) and torch.equal(block.logits, old_logits)


@pytest.mark.parametrize("do_sample", [False, True])
def test_unprocessed_pick_reads_the_draft_vocabulary_as_q_would(do_sample):
    """Without processors the pick reads the draft-vocabulary logits and q is scattered once per block; tokens and
    q must be those of the path that processes the whole-vocabulary q (here with the identity)."""
    target = tiny_target(initializer_range=0.2)
    drafter = tiny_drafter(target, seed=1, draft_vocab_ids=EVEN)
    h, anchors = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(2)), torch.tensor([1, 4, 95])
    with torch.no_grad():
        torch.manual_seed(0)
        fast = draft_block(drafter, h, target.lm_head, anchors, num_slots=4, greedy=not do_sample)
        torch.manual_seed(0)
        full = draft_block(drafter, h, target.lm_head, anchors, num_slots=4, greedy=not do_sample, logits_processor=lambda _ids, q: q)
    assert torch.equal(fast.tokens, full.tokens) and torch.equal(fast.logits, full.logits)
    assert fast.logits.shape == (3, 4, 96) and bool((fast.tokens % 2 == 0).all()), "target ids, inside the draft vocabulary"
    assert len(set(fast.tokens.flatten().tolist())) > 3, "the picks must vary for the comparison to mean something"


@pytest.mark.parametrize("vocab", [None, EVEN])
def test_batched_drafting_equals_per_row(vocab):
    target = tiny_target()
    drafter = tiny_drafter(target, **({} if vocab is None else {"draft_vocab_ids": vocab}))
    h, anchors = torch.randn(5, 4, 32), torch.tensor([1, 4, 9, 30, 95])
    with torch.no_grad():
        batched = draft_block(drafter, h, target.lm_head, anchors, num_slots=4, greedy=True, threshold=0.3)
        for r in range(5):
            row = draft_block(drafter, h[r : r + 1], target.lm_head, anchors[r : r + 1], num_slots=4, greedy=True, threshold=0.3)
            n = int(row.lengths[0])
            assert int(batched.lengths[r]) == n
            assert torch.equal(batched.tokens[r, :n], row.tokens[0, :n])
            torch.testing.assert_close(batched.logits[r, :n], row.logits[0, :n])
    if vocab is not None:
        assert bool(torch.isinf(batched.logits[..., 1::2]).all()), "q is -inf outside the draft vocabulary"


@pytest.mark.parametrize("vocab", [None, EVEN])
def test_draft_lm_head_on_a_strided_block_is_one_matrix_product(vocab):
    """The block is a strided slice of the backbone's output (after the context positions); a batched matmul over
    it would copy the LM head's weight once per row (on a CPU, 200 ms a round for 16 rows)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    target = tiny_target()
    drafter = tiny_drafter(target, **({} if vocab is None else {"draft_vocab_ids": vocab}))
    h = torch.randn(5, 2 + 4, 32)[:, 2:]  # the block after two context positions
    assert not h.is_contiguous()
    with torch.no_grad(), Ops() as seen:
        logits = drafter.draft_base_logits(h, target.lm_head)
    assert "aten.bmm" not in seen.ops and seen.ops & {"aten.mm", "aten.addmm"}, sorted(seen.ops)
    with torch.no_grad():
        torch.testing.assert_close(logits, drafter.draft_base_logits(h.contiguous(), target.lm_head))
    assert logits.shape == (5, 4, 96 if vocab is None else 48)


# ------------------------------------------------------------------------------------------------- the loss
def reference_loss(drafter, target, input_ids, loss_mask, anchors, keep, decay=4.0):
    """Eqs. 8-12 over the whole vocabulary for a drafter whose logits are -inf outside its draft vocabulary, from the
    equations: dense attention mask, target softmax per slot, autograd through everything. A label outside the
    draft vocabulary has infinite CE and is left out of the CE term (as the fast loss does)."""
    gamma = drafter.config.block_size
    bsz, seq_len = input_ids.shape
    with torch.no_grad():
        out = target.model(input_ids=input_ids, output_hidden_states=True)
    features = drafter.context_features(out.hidden_states)
    target_ids, eval_mask, prev_ids, logit_index = build_block_targets(input_ids, loss_mask, anchors, keep, gamma)
    positions = torch.cat([torch.arange(seq_len).expand(bsz, -1), (anchors[..., None] + torch.arange(gamma)).view(bsz, -1)], 1)
    h = drafter(
        block_embeds=drafter.embed_block(input_ids.gather(1, anchors), target.get_input_embeddings()), context_features=features,
        position_ids=positions, attention_mask=build_block_attention_mask(anchors, keep, seq_len, gamma),
    ).last_hidden_state.view(bsz, -1, gamma, 32)  # fmt: skip
    inside = torch.zeros(96, dtype=torch.bool)
    inside[drafter.draft_token_ids] = True
    bias = torch.zeros(*prev_ids.shape, 96)
    bias[..., drafter.draft_token_ids] = drafter.markov_head.markov_w2(drafter.markov_head.markov_w1(drafter.draft_index(prev_ids)))
    logits = (target.lm_head(h) + bias).masked_fill(~inside, float("-inf"))
    p_d = logits.softmax(-1)
    hidden = out.last_hidden_state[torch.arange(bsz)[:, None, None], logit_index]
    p_t = target.lm_head(hidden).softmax(-1).detach()
    l1 = (p_d - p_t).abs().sum(-1)
    label_inside = inside[target_ids]
    ce = -torch.where(label_inside, logits.log_softmax(-1).gather(-1, target_ids[..., None])[..., 0].clamp(min=-1e30), torch.zeros(()))
    conf = drafter.confidence_logits(h, prev_ids)
    c_star = (1 - 0.5 * l1).clamp(0, 1).detach()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(conf, c_star, reduction="none")
    w = build_loss_weights(eval_mask, decay)
    den = w.sum()
    ce_l, l1_l, conf_l = (w * ce).sum() / den, (w * l1).sum() / den, (w * bce).sum() / den
    return 0.1 * ce_l + 0.9 * l1_l + conf_l, ce_l, l1_l, conf_l


def test_draft_vocabulary_loss_equals_the_full_vocabulary_reference():
    target = tiny_target(initializer_range=0.2)
    drafter = tiny_drafter(target, seed=3, draft_vocab_ids=EVEN).float().train()
    torch.manual_seed(0)
    input_ids = torch.randint(1, 96, (2, 40))
    loss_mask = torch.zeros(2, 40, dtype=torch.long)
    loss_mask[0, 10:], loss_mask[1, 14:33] = 1, 1
    anchors, keep = sample_anchor_positions(loss_mask, 64, generator=torch.Generator().manual_seed(0))
    ref = reference_loss(drafter, target, input_ids, loss_mask, anchors, keep)
    ref[0].backward()
    ref_grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad()
    with torch.no_grad():
        out = target.model(input_ids=input_ids, output_hidden_states=True)
    fast = compute_dspark_loss(
        drafter, input_ids=input_ids, loss_mask=loss_mask, context_features=drafter.context_features(out.hidden_states),
        target_last_hidden=out.last_hidden_state, input_embeddings=target.get_input_embeddings(), lm_head=target.lm_head,
        anchors=anchors, keep=keep, chunk_size=5, logits_memory_gb=0.0,  # several chunks, recomputed in backward
    )  # fmt: skip
    for got, want in zip((fast.loss, fast.ce_loss, fast.l1_loss, fast.confidence_loss), ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    fast.loss.backward()
    for name, p in drafter.named_parameters():
        if name in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert int(keep.sum()) > 20 and bool((~drafter.in_draft_vocab(input_ids[loss_mask.bool()])).any())


@pytest.mark.parametrize("distribution", [False, True])
def test_fused_cross_entropy_and_l1_gradient(distribution):
    torch.manual_seed(0)
    z = torch.randn(3, 5, 11, dtype=torch.float64, requires_grad=True)
    p = torch.randn(3, 5, 11, dtype=torch.float64).softmax(-1) * 0.9  # mass 0.1 outside
    labels, weight = torch.randint(0, 11, (3, 5)), (torch.rand(3, 5) > 0.3).double()
    assert torch.autograd.gradcheck(lambda z: _CrossEntropyAndL1.apply(z, p, labels, weight, distribution), (z,))


def test_block_sparse_attention_equals_the_dense_mask():
    target = tiny_target()
    drafter = tiny_drafter(target).float()
    torch.manual_seed(0)
    loss_mask = torch.zeros(2, 30, dtype=torch.long)
    loss_mask[:, 8:], loss_mask[1, 25:] = 1, 0
    anchors, keep = sample_anchor_positions(loss_mask, 30)
    keep[0, -1] = False  # a dummy block too
    gamma = drafter.config.block_size
    features = torch.randn(2, 30, len(drafter.config.target_layer_ids) * 32)
    embeds = drafter.embed_block(torch.randint(0, 96, anchors.shape), target.get_input_embeddings())
    positions = torch.cat([torch.arange(30).expand(2, -1), (anchors[..., None] + torch.arange(gamma)).view(2, -1)], 1)
    dense = drafter(block_embeds=embeds, context_features=features, position_ids=positions, attention_mask=build_block_attention_mask(anchors, keep, 30, gamma))
    sparse = drafter(block_embeds=embeds, context_features=features, position_ids=positions, block_context_mask=build_block_context_mask(anchors, keep, 30))
    torch.testing.assert_close(sparse.last_hidden_state, dense.last_hidden_state, rtol=1e-5, atol=1e-5)


def test_target_feature_cache_gives_the_online_loss(tmp_path):
    from modeling_dspark.training.target_cache import TargetFeatureCache
    from modeling_dspark.training.trainer import DSparkCollator, DSparkTrainer, DSparkTrainingArguments

    target = tiny_target(initializer_range=0.2)
    drafter = tiny_drafter(target, draft_vocab_ids=EVEN).float()
    torch.manual_seed(0)
    rows = [{"input_ids": torch.randint(1, 96, (n,)).tolist(), "loss_mask": [0] * 5 + [1] * (n - 5)} for n in (20, 13, 17)]
    cache = TargetFeatureCache.open_or_build(tmp_path / "cache", target, drafter.config.target_layer_ids, [r["input_ids"] for r in rows], batch_size=2)
    assert TargetFeatureCache.open_or_build(tmp_path / "cache", target, drafter.config.target_layer_ids, [r["input_ids"] for r in rows]).meta == cache.meta
    online = DSparkCollator(0)(rows)
    cached = DSparkCollator(0, target_cache=cache)([{**r, "cache_index": i} for i, r in enumerate(rows)])
    args = DSparkTrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True, num_anchors=8)
    trainer = DSparkTrainer(model=drafter, args=args, target=target)
    anchors, keep = sample_anchor_positions(online["loss_mask"], 8, generator=torch.Generator().manual_seed(0))
    losses = [trainer.compute_loss(drafter, {**batch, "anchor_positions": anchors, "block_keep_mask": keep}) for batch in (online, cached)]
    assert "target_hidden_states" in cached and "target_hidden_states" not in online
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-2, atol=1e-3)  # the cache holds bf16 features
    other = [r["input_ids"][:-1] for r in rows]
    assert not cache.matches(target, drafter.config.target_layer_ids, __import__("modeling_dspark.training.target_cache", fromlist=["x"]).dataset_fingerprint(other))
