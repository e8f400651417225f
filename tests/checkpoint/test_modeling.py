"""DSparkConfig / DSparkModel: registration, geometry checks, checkpoints, heads."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import tiny_drafter, tiny_target
from transformers import AutoConfig, AutoModel

from generation.decoding.drafting import draft_block
from modeling_dspark import DSparkConfig, DSparkModel, build_target_layer_ids
from modeling_dspark.checkpoint.deepspec import to_deepspec


def test_auto_classes_know_dspark(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    drafter.save_pretrained(tmp_path)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), DSparkConfig)
    assert isinstance(AutoModel.from_pretrained(tmp_path), DSparkModel)


def test_from_target_copies_geometry():
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, block_size=5, markov_head_type="rnn", markov_rank=6)
    cfg = drafter.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (96, 32, 4, 2, 8)
    assert cfg.rope_parameters == target.config.rope_parameters and cfg.num_target_layers == 4
    assert cfg.block_size == 5 and cfg.markov_head_type == "rnn" and cfg.target_model_type == "qwen3"
    assert drafter.dtype == target.dtype
    with pytest.raises(ValueError, match="unknown DSparkConfig field"):
        DSparkModel.from_target(target, blok_size=3)


def test_target_layer_ids_rule():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # DeepSpec's Qwen3-4B/8B setting
    assert build_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert max(build_target_layer_ids(4, 5)) <= 2
    with pytest.raises(ValueError):
        build_target_layer_ids(1, 1)


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(markov_head_type="crf"), "markov_head_type"),
        (dict(block_size=0), "block_size"),
        (dict(target_layer_ids=[2, 1]), "strictly increasing"),
        (dict(target_layer_ids=[1, 3], num_target_layers=4), "last layer"),
        (dict(truncation="sometimes"), "truncation"),
        (dict(confidence_threshold=1.5), "confidence_threshold"),
        (dict(confidence_temperatures=[1.0, 2.0]), "confidence_temperatures"),
    ],
)
def test_config_rejects_bad_settings(bad, match):
    with pytest.raises(ValueError, match=match):
        DSparkConfig(block_size=bad.pop("block_size", 4), **bad)


def test_save_load_round_trip_is_exact_and_holds_no_target_weights(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target, markov_head_type="rnn")
    drafter.save_pretrained(tmp_path)
    keys = set(load_file(tmp_path / "model.safetensors"))
    assert not any("embed_tokens" in k or "lm_head" in k for k in keys)
    assert {"fc.weight", "hidden_norm.weight", "mask_embedding", "markov_head.joint_proj.weight", "confidence_head.proj.weight"} <= keys
    assert (tmp_path / "modeling_dspark.py").is_file() and (tmp_path / "configuration_dspark.py").is_file()
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"]["AutoModel"] == "modeling_dspark.DSparkModel"
    loaded = DSparkModel.from_pretrained(tmp_path)
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    ids = torch.randint(1, 96, (1, 6))
    assert torch.equal(
        target.generate(ids, do_sample=False, max_new_tokens=12, assistant_model=drafter),
        target.generate(ids, do_sample=False, max_new_tokens=12, assistant_model=loaded),
    )


def test_corrupted_checkpoint_is_a_clear_error(tmp_path):
    drafter = tiny_drafter(tiny_target())
    drafter.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(OSError, match=f"could not read {weights}: .*truncated or corrupt"):
        DSparkModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("draft_vocab", [False, True], ids=["full-vocabulary", "draft-vocabulary"])
def test_trust_remote_code_in_a_fresh_process(tmp_path, draft_vocab):
    drafter = tiny_drafter(tiny_target(), **({"draft_vocab_ids": torch.arange(0, 96, 3)} if draft_vocab else {}))
    drafter.save_pretrained(tmp_path / "drafter")
    script = textwrap.dedent(
        f"""
        import sys, torch
        from transformers import AutoModel
        assert "modeling_dspark" not in sys.modules
        try:
            AutoModel.from_pretrained({str(tmp_path / "drafter")!r})
            raise SystemExit("loaded without trust_remote_code")
        except ValueError:
            pass
        model = AutoModel.from_pretrained({str(tmp_path / "drafter")!r}, trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        if model.config.draft_vocab_size is not None:
            assert model.draft_token_ids.tolist() == list(range(0, 96, 3)), model.d2t
        print(type(model).__name__, sum(p.numel() for p in model.parameters()))
        """
    )
    # run from tmp_path so the project packages are not importable
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, env={"PATH": "", "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-1] == str(sum(p.numel() for p in drafter.parameters()))


@pytest.mark.parametrize("head", ["vanilla", "rnn"])
def test_markov_step_and_block_verbs_agree(head):
    drafter = tiny_drafter(tiny_target(), markov_head_type=head)
    markov = drafter.markov_head
    torch.manual_seed(0)
    base, h = torch.randn(2, 4, 96), torch.randn(2, 4, 32)
    prev = torch.randint(0, 96, (2, 4))
    block = markov.apply_block_logits(base, prev, h)
    state = markov.initial_state(h[:, 0])
    for k in range(4):
        step, state = markov.apply_step_logits(base[:, k], prev[:, k], h[:, k], state)
        torch.testing.assert_close(step, block[:, k])
    # the drafting loop (generation.decoding.drafting.draft_block) applies the step verb; feeding its sampled tokens back
    # through the block verb gives the same logits
    head = torch.nn.Linear(32, 96, bias=False)
    with torch.no_grad():
        draft = draft_block(drafter, h, head, prev[:, 0], num_slots=4, greedy=True)
        base_h = head(h)
    teacher = torch.cat([prev[:, :1], draft.tokens[:, :-1]], dim=1)
    torch.testing.assert_close(draft.logits, markov.apply_block_logits(base_h, teacher, h))
    assert torch.equal(draft.tokens, draft.logits.argmax(-1))


def test_markov_bias_is_eq5():
    drafter = tiny_drafter(tiny_target())
    m = drafter.markov_head
    prev = torch.tensor([3, 7])
    expected = m.markov_w1.weight[prev] @ m.markov_w2.weight.T  # W1[x] W2 with W2 in R^{r x V}
    torch.testing.assert_close(m.apply_step_logits(torch.zeros(2, 96), prev, None)[0], expected)


def test_markov_table_at_inference_equals_the_factored_bias():
    m = tiny_drafter(tiny_target()).markov_head
    prev = torch.tensor([[3, 7], [0, 95]])
    factored = m.markov_w2(m.markov_w1(prev))
    assert m.bigram_bias(prev).requires_grad and "table" not in m._bigram_cache, "with gradients: the trainable product"
    with torch.no_grad():
        torch.testing.assert_close(m.bigram_bias(prev), factored)
        assert m._bigram_cache["table"][1].shape == (96, 96), "eval, no gradients: the table"
        m.markov_w2.weight.mul_(2)  # changed weights rebuild it
        torch.testing.assert_close(m.bigram_bias(prev), 2 * factored)
        m.max_table_bytes = 96 * 96 * 4 - 1
        m._bigram_cache.clear()
        torch.testing.assert_close(m.bigram_bias(prev), 2 * factored)
        assert "table" not in m._bigram_cache, "a table over the limit is never built"
    rnn = tiny_drafter(tiny_target(), markov_head_type="rnn").markov_head
    assert not hasattr(rnn, "bigram_bias"), "the RNN head's bias (Eq. 6) depends on its state: it has no bigram table"


def test_confidence_head_reads_h_and_previous_token():
    drafter = tiny_drafter(tiny_target())
    h, prev = torch.randn(3, 32), torch.tensor([1, 2, 3])
    w, b = drafter.confidence_head.proj.weight[0], drafter.confidence_head.proj.bias
    features = torch.cat([h, drafter.markov_head.markov_w1(prev)], -1)
    torch.testing.assert_close(drafter.confidence_logits(h, prev), features @ w + b)
    drafter.config.confidence_temperatures = [2.0, 1.0, 1.0, 1.0]
    torch.testing.assert_close(drafter.calibrated_confidence(torch.tensor(1.0), position=0), torch.sigmoid(torch.tensor(0.5)))


def _features(drafter, length, seed=0):
    torch.manual_seed(seed)
    return torch.randn(1, length, drafter.config.target_hidden_size * len(drafter.config.target_layer_ids))


def test_cached_context_equals_full_recompute():
    from transformers import DynamicCache

    target = tiny_target()
    drafter = tiny_drafter(target)
    embed = target.get_input_embeddings()
    feats, cache = _features(drafter, 10), DynamicCache()
    with torch.no_grad():
        drafter(drafter.embed_block(torch.tensor([5]), embed), feats[:, :6], torch.arange(10)[None], cache=cache)
        assert cache.get_seq_length() == 6  # only the context is cached, never the block
        block = drafter.embed_block(torch.tensor([9]), embed)
        incremental = drafter(block, feats[:, 6:], torch.arange(6, 14)[None], cache=cache).last_hidden_state
        full = drafter(block, feats, torch.arange(14)[None]).last_hidden_state
    assert cache.get_seq_length() == 10
    torch.testing.assert_close(incremental, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_masked_blocks_never_see_context_at_or_after_their_anchor(attn):
    target = tiny_target()
    drafter = tiny_drafter(target)
    drafter.set_attn_implementation(attn)
    gamma, length, anchors = drafter.config.block_size, 12, [4, 8]
    embed = target.get_input_embeddings()
    # one forward over two blocks: block b sees context positions < anchors[b] and its own block only
    mask = torch.zeros(2 * gamma, length + 2 * gamma, dtype=torch.bool)
    for b, a in enumerate(anchors):
        mask[b * gamma : (b + 1) * gamma, :a] = True
        mask[b * gamma : (b + 1) * gamma, length + b * gamma : length + (b + 1) * gamma] = True
    positions = torch.cat([torch.arange(length)] + [torch.arange(a, a + gamma) for a in anchors])[None]
    blocks = drafter.embed_block(torch.tensor([[3, 7]]), embed)
    feats = _features(drafter, length)
    future = feats.clone()
    future[:, anchors[0] :] += 10 * torch.randn_like(future[:, anchors[0] :])
    with torch.no_grad():
        packed = drafter(blocks, feats, positions, attention_mask=mask[None, None]).last_hidden_state
        perturbed = drafter(blocks, future, positions, attention_mask=mask[None, None]).last_hidden_state
        alone = drafter(blocks[:, :gamma], feats[:, : anchors[0]], torch.arange(anchors[0] + gamma)[None]).last_hidden_state
    torch.testing.assert_close(packed[:, :gamma], perturbed[:, :gamma])  # the future of block 0 is invisible to it
    assert not torch.allclose(packed[:, gamma:], perturbed[:, gamma:])  # ... but block 1 sees positions 4..7
    torch.testing.assert_close(packed[:, :gamma], alone, atol=1e-5, rtol=1e-5)


def test_deepspec_export_round_trip_is_exact(tmp_path):
    target = tiny_target("qwen3")
    for mask_token_id in (None, 95):
        drafter = tiny_drafter(target, mask_token_id=mask_token_id, dtype=torch.bfloat16)
        folder = to_deepspec(drafter, target, tmp_path / f"ds{mask_token_id}")
        raw = json.loads((folder / "config.json").read_text())
        assert raw["architectures"] == ["Qwen3DSparkModel"] and raw["model_type"] == "qwen3"
        assert raw["markov_rank"] == 8 and raw["enable_confidence_head"] and raw["confidence_head_with_markov"]
        keys = set(load_file(folder / "model.safetensors"))
        assert {"embed_tokens.weight", "lm_head.weight"} <= keys
        back = DSparkModel.from_pretrained(folder)
        assert back.config.mask_token_id == 95  # the explicit id, or the last id carrying the learned mask
        ours = {k: v for k, v in drafter.state_dict().items() if k != "mask_embedding"}
        for name, tensor in ours.items():
            assert torch.equal(tensor, back.state_dict()[name]), name
        if mask_token_id is None:  # the learned mask travels in the exported embedding row and mask_embedding.pt
            exported = load_file(folder / "model.safetensors")["embed_tokens.weight"][95]
            assert torch.equal(exported, drafter.mask_embedding.detach())
            assert torch.equal(torch.load(folder / "mask_embedding.pt"), drafter.mask_embedding.detach())
    assert isinstance(DSparkModel.from_pretrained(folder), DSparkModel)


@pytest.mark.parametrize(
    "field,value,allowed",
    [("block_size", "7", "an int"), ("target_layer_ids", 0, "a list of ints"), ("markov_rank", 7.5, "an int"),
     ("confidence_head", "yes", "true or false"), ("draft_vocab_size", 3.0, "an int or null")],
)  # fmt: skip
def test_config_field_of_the_wrong_type_is_named(field, value, allowed, tmp_path):
    with pytest.raises(ValueError, match=f"DSparkConfig.{field} must be {allowed}, got {value!r}"):
        DSparkConfig(**{field: value})
    # the same from a hand-edited config.json
    tiny_drafter(tiny_target()).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=f"{field} must be {allowed}"):
        DSparkModel.from_pretrained(tmp_path)
