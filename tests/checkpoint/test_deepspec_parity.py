"""Numerical parity with the official DeepSpec code, on the fixture it produced (see its README).

Set DSPARK_PARITY_FIXTURE to point the same checks at another fixture of the same layout."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from generation.decoding.drafting import draft_block
from modeling_dspark import DSparkModel

# shipped with the tests (a copy of the fixture the official code wrote; its README says how)
FIXTURE = Path(os.environ.get("DSPARK_PARITY_FIXTURE", Path(__file__).resolve().parents[1] / "fixtures" / "deepspec_parity"))
ATOL = RTOL = 1e-5
pytestmark = pytest.mark.skipif(not FIXTURE.is_dir(), reason=f"parity fixture not found at {FIXTURE}")


@pytest.fixture(scope="module")
def fx():
    ref = load_file(FIXTURE / "reference.safetensors")
    meta = json.loads((FIXTURE / "reference.json").read_text())
    target = AutoModelForCausalLM.from_pretrained(FIXTURE / "target", dtype=torch.float32, attn_implementation="sdpa").eval()
    drafter = DSparkModel.from_pretrained(FIXTURE / "drafter", dtype=torch.float32).eval()
    return ref, meta, target, drafter


def close(name, ours, ref, report):
    ours = ours.detach().float()
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    diff = (ours - ref).abs().max().item() if ref.numel() else 0.0
    report[name] = diff
    assert torch.allclose(ours, ref, atol=ATOL, rtol=RTOL), f"{name}: max diff {diff:.3e}"


def run_block(drafter, target, features, anchor, positions, cache=None):
    with torch.no_grad():
        out = drafter(
            block_embeds=drafter.embed_block(anchor, target.get_input_embeddings()),
            context_features=features,
            position_ids=positions,
            cache=cache,
            output_hidden_states=True,
        )
        return out, target.get_output_embeddings()(out.last_hidden_state)


def test_loaded_as_ours(fx):
    _, meta, target, drafter = fx
    cfg, args = drafter.config, meta["model_args"]  # the geometry the official code was run with
    assert cfg.model_type == "dspark" and cfg.block_size == args["block_size"] and cfg.target_layer_ids == args["target_layer_ids"]
    assert cfg.num_draft_layers == args["num_draft_layers"] and cfg.mask_token_id == args["mask_token_id"]
    assert cfg.markov_head_type == args["markov_head_type"] and cfg.markov_rank == args["markov_rank"]
    keys = set(drafter.state_dict())
    assert "embed_tokens.weight" not in keys and "lm_head.weight" not in keys
    assert keys == set(meta["drafter_keys"]) - {"embed_tokens.weight", "lm_head.weight"}
    drafter.check_compatible(target)


def test_inference_round_one(fx, parity_report):
    ref, meta, target, drafter = fx
    full = ref["inf.full_ids"]
    with torch.no_grad():
        t_out = target(full, output_hidden_states=True)
    close("inf.target_hidden_states_all", torch.stack(t_out.hidden_states), ref["inf.target_hidden_states_all"], parity_report)
    close("inf.target_logits", t_out.logits, ref["inf.target_logits"], parity_report)
    features = drafter.context_features(t_out.hidden_states)
    close("inf.ctx_features", features, ref["inf.ctx_features"], parity_report)

    r1 = meta["inference"]["round1"]
    start = r1["start"]
    out, base = run_block(drafter, target, features[:, :start], full[:, start], ref["inf.r1.position_ids"])
    ids = torch.tensor(r1["draft_input_ids"])[None]
    assert torch.equal(ids, ref["inf.r1.draft_input_ids"])
    close("inf.r1.ctx_proj", out.context_projection, ref["inf.r1.ctx_proj"], parity_report)
    for i, layer_out in enumerate(out.hidden_states):
        close(f"inf.r1.layer_out.{i}", layer_out, ref[f"inf.r1.layer_out.{i}"], parity_report)
    close("inf.r1.h", out.last_hidden_state, ref["inf.r1.h"], parity_report)
    close("inf.r1.base_logits", base, ref["inf.r1.base_logits"], parity_report)

    prev = ref["inf.r1.tf_prev_ids"]
    h = out.last_hidden_state
    close("inf.r1.tf_markov_logits", drafter.markov_head.apply_block_logits(base, prev, h), ref["inf.r1.tf_markov_logits"], parity_report)
    close("inf.r1.tf_confidence_logits", drafter.confidence_logits(h, prev), ref["inf.r1.tf_confidence_logits"], parity_report)

    block = draft_block(drafter, h, target.get_output_embeddings(), full[:, start], num_slots=h.shape[1], greedy=True)
    tokens, corrected = block.tokens, block.logits
    assert torch.equal(tokens, ref["inf.r1.greedy_tokens"])
    close("inf.r1.greedy_markov_logits", corrected, ref["inf.r1.greedy_markov_logits"], parity_report)
    greedy_prev = torch.cat([full[:, start : start + 1], tokens[:, :-1]], dim=1)
    close("inf.r1.greedy_confidence_logits", drafter.confidence_logits(h, greedy_prev), ref["inf.r1.greedy_confidence_logits"], parity_report)
    assert torch.equal(torch.cat([full[:, start : start + 1], tokens], 1), ref["inf.r1.verify_input_ids"])


def test_inference_round_two_with_cache(fx, parity_report):
    from transformers import DynamicCache

    ref, meta, target, drafter = fx
    full = ref["inf.full_ids"]
    with torch.no_grad():
        features = drafter.context_features(target(full, output_hidden_states=True).hidden_states)
    r1, r2 = meta["inference"]["round1"], meta["inference"]["round2"]
    cache = DynamicCache()
    run_block(drafter, target, features[:, : r1["start"]], full[:, r1["start"]], ref["inf.r1.position_ids"], cache)
    assert cache.get_seq_length() == r1["cache_len_after"]
    lo, hi = r2["new_context_positions"]
    out, base = run_block(drafter, target, features[:, lo : hi + 1], full[:, r2["start"]], ref["inf.r2.position_ids"], cache)
    assert cache.get_seq_length() == r2["cache_len_after"]
    close("inf.r2.h", out.last_hidden_state, ref["inf.r2.h"], parity_report)
    close("inf.r2.base_logits", base, ref["inf.r2.base_logits"], parity_report)
    prev, h = ref["inf.r2.tf_prev_ids"], out.last_hidden_state
    close("inf.r2.tf_markov_logits", drafter.markov_head.apply_block_logits(base, prev, h), ref["inf.r2.tf_markov_logits"], parity_report)
    close("inf.r2.tf_confidence_logits", drafter.confidence_logits(h, prev), ref["inf.r2.tf_confidence_logits"], parity_report)
    positions = torch.arange(r2["start"] + drafter.config.block_size)[None]
    nocache, _ = run_block(drafter, target, features[:, : r2["start"]], full[:, r2["start"]], positions)
    close("inf.r2.h_nocache", nocache.last_hidden_state, ref["inf.r2.h_nocache"], parity_report)


def test_end_to_end_greedy(fx, parity_report):
    ref, meta, target, drafter = fx
    e2e = meta["e2e"]
    block_h = []
    hook = drafter.norm.register_forward_hook(lambda m, i, o: block_h.append(o.detach()))
    try:
        out = target.generate(
            ref["inf.prompt_ids"], assistant_model=drafter, do_sample=False, max_new_tokens=e2e["max_new_tokens"], pad_token_id=0
        )
    finally:
        hook.remove()
    assert torch.equal(out, ref["inf.e2e.output_ids"])
    ours = torch.cat(block_h)  # one [1, B, d] per drafted round
    close("inf.e2e.block_h", ours, ref["inf.e2e.block_h"][: ours.shape[0]], parity_report)
    assert ours.shape[0] >= len(e2e["rounds"]) - 2  # all but the rounds with no room left for a draft
    accepted = [r.accepted for r in drafter.last_stats.rounds]
    assert accepted == e2e["accepted_draft_lengths"][: len(accepted)]


def test_training_forward(fx, parity_report):
    ref, meta, target, drafter = fx
    keep = ref["train.block_keep_mask"].bool()  # [bsz, N]
    anchors = ref["train.anchor_positions"]
    input_ids = ref["train.input_ids"]
    anchor_ids = torch.where(keep, input_ids.gather(1, anchors), torch.full_like(anchors, drafter.config.mask_token_id))
    block_embeds = drafter.embed_block(anchor_ids, target.get_input_embeddings())
    mask = ref["train.attn_mask_dense"].bool()[:, None]
    with torch.no_grad():
        out = drafter(
            block_embeds=block_embeds,
            context_features=ref["train.target_hidden_states"],
            position_ids=ref["train.position_ids"],
            attention_mask=mask,
            output_hidden_states=True,
        )
    bsz, n = anchors.shape
    gamma = drafter.config.block_size
    rows = keep[:, :, None].expand(bsz, n, gamma).reshape(bsz, n * gamma)
    close("train.ctx_proj", out.context_projection, ref["train.ctx_proj"], parity_report)
    for i, layer_out in enumerate(out.hidden_states):
        close(f"train.layer_out.{i} (kept blocks)", layer_out[rows], ref[f"train.layer_out.{i}"][rows], parity_report)
    h = out.last_hidden_state.view(bsz, n, gamma, -1)
    close("train.h (kept blocks)", h[keep], ref["train.h"][keep], parity_report)
    base = target.get_output_embeddings()(h)
    close("train.base_logits (kept blocks)", base[keep], ref["train.base_logits"][keep], parity_report)
    prev = ref["train.prev_token_ids"]
    draft = drafter.markov_head.apply_block_logits(base, prev, h)
    close("train.draft_logits (kept blocks)", draft[keep], ref["train.draft_logits"][keep], parity_report)
    close("train.confidence_pred (kept blocks)", drafter.confidence_logits(h, prev)[keep], ref["train.confidence_pred"][keep], parity_report)


def fixture_trainer(target, drafter, settings, tmp_path):
    from modeling_dspark.training.trainer import DSparkTrainer, DSparkTrainingArguments

    args = DSparkTrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, logits_chunk_size=4,  # chunking must not change anything
        ce_alpha=settings["ce_loss_alpha"], l1_alpha=settings["l1_loss_alpha"],
        confidence_alpha=settings["confidence_head_alpha"], loss_decay=settings["loss_decay_gamma"],
    )  # fmt: skip
    return DSparkTrainer(model=drafter, args=args, target=target)


def fixture_batch(ref):
    """The fixture's batch with its target cache and anchors, which the trainer takes as given."""
    return {
        "input_ids": ref["train.input_ids"],
        "loss_mask": ref["train.loss_mask"],
        "attention_mask": ref["train.attention_mask"],
        "target_hidden_states": ref["train.target_hidden_states"],
        "target_last_hidden_states": ref["train.target_last_hidden_states"],
        "anchor_positions": ref["train.anchor_positions"],
        "block_keep_mask": ref["train.block_keep_mask"],
    }


def test_training_loss(fx, parity_report, tmp_path):
    from modeling_dspark.training.loss import build_loss_weights

    ref, meta, target, drafter = fx
    keep = ref["train.block_keep_mask"].bool()
    settings = meta["training"]["loss_settings"]
    trainer = fixture_trainer(target, drafter, settings, tmp_path)
    with torch.no_grad():
        loss, out = trainer.compute_loss(drafter, fixture_batch(ref), return_outputs=True)
    assert torch.equal(out.eval_mask, ref["train.eval_mask"].bool())
    close("train.loss_weight_mask", build_loss_weights(out.eval_mask, settings["loss_decay_gamma"]), ref["train.loss_weight_mask"], parity_report)
    close("train.draft_logits (loss, kept)", out.draft_logits[keep], ref["train.draft_logits"][keep], parity_report)
    close("train.aligned_target_logits (kept)", out.target_logits[keep], ref["train.aligned_target_logits"][keep], parity_report)
    close("train.confidence_pred (loss, kept)", out.confidence_logits[keep], ref["train.confidence_pred"][keep], parity_report)
    for ours, name in [
        (out.ce_num, "train.ce_loss_num"),
        (out.l1_num, "train.l1_loss_num"),
        (out.confidence_num, "train.confidence_loss_num"),
        (out.weight_den, "train.ce_loss_den"),
        (out.ce_loss, "train.ce_loss"),
        (out.l1_loss, "train.l1_loss"),
        (out.confidence_loss, "train.confidence_loss"),
        (loss, "train.total_loss"),
    ]:
        close(name, ours, ref[name], parity_report)


def test_training_gradients(fx, parity_report, tmp_path):
    """Supplementary: gradients of the total loss (DeepSpec's eager dense-mask pass) through DSparkTrainer's
    chunked, checkpointed loss."""
    import copy

    ref, meta, target, drafter = fx
    drafter = copy.deepcopy(drafter).train()
    target = copy.deepcopy(target)
    trainer = fixture_trainer(target, drafter, meta["training"]["loss_settings"], tmp_path)
    trainer.args.logits_chunk_size = 3
    trainer.compute_loss(drafter, fixture_batch(ref)).backward()
    params = dict(drafter.named_parameters())
    for name in meta["training"]["gradient_params"]:
        close(f"grad.{name}", params[name].grad, ref[f"grad.{name}"], parity_report)
    assert all(p.grad is None for p in target.parameters())  # the trainer froze the target
