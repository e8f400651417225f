"""DSpark training: loss terms against a slow reference, masking, the Trainer, STS calibration."""

import math
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import bigram_dataset, bigram_target, tiny_drafter, tiny_target

from modeling_dspark import DSparkModel
from modeling_dspark.training.calibration import (
    CalibrationRounds,
    calibration_metrics,
    sequential_temperature_scaling,
    write_confidence_temperatures,
)
from modeling_dspark.training.loss import build_block_targets, compute_block_loss_terms, compute_dspark_loss, sample_anchor_positions
from modeling_dspark.training.trainer import DSparkTrainer, DSparkTrainingArguments


def tiny_batch(target, seed=0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, target.config.vocab_size, (2, 20), generator=g)
    loss_mask = torch.zeros(2, 20, dtype=torch.long)
    loss_mask[0, 5:20] = 1
    loss_mask[1, 8:15] = 1  # the response ends before the sequence does (padding after it)
    with torch.no_grad():
        out = target.model(input_ids=input_ids, output_hidden_states=True)
    return input_ids, loss_mask, out


def slow_reference_loss(drafter, target, input_ids, loss_mask, hidden, anchors, keep, decay=4.0):
    """Each kept block on its own (context = features before the anchor), every term from its formula."""
    gamma = drafter.config.block_size
    feats = drafter.context_features(hidden.hidden_states)
    last = hidden.last_hidden_state
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    ce_num = l1_num = conf_num = den = 0.0
    for b in range(input_ids.shape[0]):
        for n in range(anchors.shape[1]):
            if not keep[b, n]:
                continue
            p = int(anchors[b, n])
            out = drafter(drafter.embed_block(input_ids[b, p : p + 1], embed), feats[b : b + 1, :p], torch.arange(p + gamma)[None])
            h = out.last_hidden_state[0]
            alive = True
            for k in range(gamma):
                label_pos = p + k + 1
                alive = alive and label_pos < input_ids.shape[1] and bool(loss_mask[b, label_pos])
                if not alive:
                    break
                prev = input_ids[b, p + k]  # teacher forcing: x_{k-1} is the true previous token
                m = drafter.markov_head
                logits = head(h[k]) + m.markov_w2.weight @ m.markov_w1.weight[prev]
                p_d = torch.exp(logits - torch.logsumexp(logits, -1))
                p_t = torch.softmax(head(last[b, p + k]), -1)
                w = math.exp(-k / decay)
                ce = -torch.log(p_d[input_ids[b, label_pos]])
                l1 = (p_d - p_t).abs().sum()
                c_star = min(max(1 - 0.5 * float(l1), 0.0), 1.0)
                z = drafter.confidence_head.proj(torch.cat([h[k], m.markov_w1.weight[prev]]))[0]
                bce = -(c_star * torch.log(torch.sigmoid(z)) + (1 - c_star) * torch.log(1 - torch.sigmoid(z)))
                ce_num, l1_num, conf_num, den = ce_num + w * ce, l1_num + w * l1, conf_num + w * bce, den + w
    return ce_num, l1_num, conf_num, den


def test_loss_terms_match_slow_reference():
    target = tiny_target(initializer_range=0.3)
    drafter = tiny_drafter(target, block_size=4)
    input_ids, loss_mask, hidden = tiny_batch(target)
    anchors, keep = sample_anchor_positions(loss_mask, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = compute_dspark_loss(
            drafter, input_ids=input_ids, loss_mask=loss_mask, context_features=drafter.context_features(hidden.hidden_states),
            target_last_hidden=hidden.last_hidden_state, input_embeddings=target.get_input_embeddings(),
            lm_head=target.get_output_embeddings(), anchors=anchors, keep=keep, chunk_size=2,
        )  # fmt: skip
        ce, l1, conf, den = slow_reference_loss(drafter, target, input_ids, loss_mask, hidden, anchors, keep)
    for ours, ref in [(out.ce_num, ce), (out.l1_num, l1), (out.confidence_num, conf), (out.weight_den, den)]:
        torch.testing.assert_close(ours, torch.as_tensor(ref, dtype=torch.float32), atol=1e-4, rtol=1e-4)
    total = 0.1 * ce / den + 0.9 * l1 / den + 1.0 * conf / den
    torch.testing.assert_close(out.loss, torch.as_tensor(total, dtype=torch.float32), atol=1e-4, rtol=1e-4)


def test_anchors_only_where_the_next_token_is_a_response_token():
    _, loss_mask, _ = tiny_batch(tiny_target())
    anchors, keep = sample_anchor_positions(loss_mask, 12, generator=torch.Generator().manual_seed(0))
    for b in range(2):
        for p, k in zip(anchors[b].tolist(), keep[b].tolist()):
            if k:
                assert loss_mask[b, p] and loss_mask[b, p + 1]
        assert keep[b].sum() == min(12, int((loss_mask[b, :-1] & loss_mask[b, 1:]).sum()))
    assert (anchors[1][~keep[1]] == 0).all() and anchors[0][keep[0]].tolist() == sorted(anchors[0][keep[0]].tolist())


def test_block_labels_past_the_response_are_masked():
    input_ids = torch.arange(20)[None]
    loss_mask = torch.zeros(1, 20, dtype=torch.long)
    loss_mask[0, 8:15] = 1
    anchors, keep = torch.tensor([[12, 8]]), torch.tensor([[True, True]])
    target_ids, eval_mask, prev_ids, _ = build_block_targets(input_ids, loss_mask, anchors, keep, 4)
    assert eval_mask[0, 0].tolist() == [True, True, False, False]  # labels 13, 14 supervised; 15, 16 are not
    assert eval_mask[0, 1].tolist() == [True, True, True, True]
    assert target_ids[0, 1].tolist() == [9, 10, 11, 12] and prev_ids[0, 1].tolist() == [8, 9, 10, 11]
    # a hole in the mask cuts the rest of the block (only a contiguous prefix counts)
    loss_mask[0, 10] = 0
    assert build_block_targets(input_ids, loss_mask, anchors, keep, 4)[1][0, 1].tolist() == [True, False, False, False]


def test_confidence_target_carries_no_gradient():
    torch.manual_seed(0)
    draft = torch.randn(3, 4, 10, requires_grad=True)
    target_logits, ids = torch.randn(3, 4, 10), torch.randint(0, 10, (3, 4))
    conf = torch.randn(3, 4, requires_grad=True)
    _, _, conf_num, _ = compute_block_loss_terms(draft, target_logits.softmax(-1), ids, conf, torch.ones(3, 4))
    conf_num.backward()
    assert draft.grad is None and conf.grad is not None and conf.grad.abs().sum() > 0


def test_distribution_cross_entropy_is_kl_plus_target_entropy():
    torch.manual_seed(0)
    draft, target_logits, ids = torch.randn(3, 4, 10), torch.randn(3, 4, 10), torch.randint(0, 10, (3, 4))
    w = torch.rand(3, 4)
    target_probs = target_logits.softmax(-1)
    ce_label, l1, _, _ = compute_block_loss_terms(draft, target_probs, ids, None, w)
    ce_dist, l1_dist, _, _ = compute_block_loss_terms(draft, target_probs, ids, None, w, ce_target="distribution")
    p_log, q_log = target_logits.log_softmax(-1), draft.log_softmax(-1)
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)
    entropy = -(p_log.exp() * p_log).sum(-1)
    assert torch.allclose(ce_dist, (w * (kl + entropy)).sum(), atol=1e-5)
    assert not torch.allclose(ce_dist, ce_label) and torch.equal(l1, l1_dist)
    with pytest.raises(ValueError, match="ce_target"):
        compute_block_loss_terms(draft, target_probs, ids, None, w, ce_target="soft")


def test_sts_keeps_ranking_and_lowers_ece_on_overconfident_scores():
    torch.manual_seed(0)
    true_logit = torch.randn(3000, 5) * 1.5 + 0.5
    accepted = torch.bernoulli(torch.sigmoid(true_logit)).cumprod(-1).sum(-1).long()
    rounds = CalibrationRounds(true_logit * 3.0, accepted)  # over-confident
    ones = [1.0] * 5
    temps = sequential_temperature_scaling(rounds)
    before, after = calibration_metrics(rounds, ones), calibration_metrics(rounds, temps)
    assert all(t > 1 for t in temps)  # over-confidence is cooled
    assert after["ece"] < before["ece"] / 3 and after["ece"] < 0.03
    assert after["per_position"][0]["auroc"] == pytest.approx(before["per_position"][0]["auroc"], abs=1e-9)
    for b, a in zip(before["per_position"], after["per_position"]):
        assert a["ece"] <= b["ece"] + 1e-9


def test_sts_leaves_uninformative_positions_alone():
    torch.manual_seed(2)
    logits = torch.randn(500, 3) * 2
    accepted = torch.bernoulli(torch.full((500,), 0.5)).long()  # slot 1 sometimes accepted, slots 2-3 never
    temps = sequential_temperature_scaling(CalibrationRounds(logits, accepted))
    assert temps[1:] == [1.0, 1.0]


def test_sts_does_not_touch_a_calibrated_head():
    torch.manual_seed(1)
    true_logit = torch.randn(3000, 4)
    accepted = torch.bernoulli(torch.sigmoid(true_logit)).cumprod(-1).sum(-1).long()
    temps = sequential_temperature_scaling(CalibrationRounds(true_logit, accepted))
    assert all(0.7 < t < 1.4 for t in temps)


def test_calibration_writes_temperatures_without_touching_bf16_weights(tmp_path):
    drafter = tiny_drafter(tiny_target()).to(torch.bfloat16)
    drafter.save_pretrained(tmp_path)
    weights = (tmp_path / "model.safetensors").read_bytes()
    write_confidence_temperatures(tmp_path, [0.5, 1.0, 2.0, 1.0])
    assert (tmp_path / "model.safetensors").read_bytes() == weights
    loaded = DSparkModel.from_pretrained(tmp_path)
    assert loaded.config.confidence_temperatures == [0.5, 1.0, 2.0, 1.0]
    assert loaded.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="block_size"):
        write_confidence_temperatures(tmp_path, [1.0, 1.0])
    assert DSparkModel.from_pretrained(tmp_path).config.confidence_temperatures == [0.5, 1.0, 2.0, 1.0]


def test_trainer_reduces_loss_and_saves_drafter_only(tmp_path):
    target = bigram_target(initializer_range=0.3)
    drafter = tiny_drafter(target, dtype=torch.float32).train()
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    args = DSparkTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=60, learning_rate=1e-2, logging_steps=20,
        report_to=[], use_cpu=True, num_anchors=8, save_strategy="no", seed=0,
    )  # fmt: skip
    data = bigram_dataset(target)
    trainer = DSparkTrainer(model=drafter, args=args, target=target, train_dataset=data)
    batch = trainer.data_collator([data[i] for i in range(8)])
    batch["anchor_positions"], batch["block_keep_mask"] = sample_anchor_positions(batch["loss_mask"], 8, generator=torch.Generator().manual_seed(0))

    def fixed_batch_loss():
        with torch.no_grad():
            return float(trainer.compute_loss(trainer.model, batch))

    start = fixed_batch_loss()
    trainer.train()
    assert fixed_batch_loss() < 0.85 * start
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logs[-1]["loss"] < logs[0]["loss"] and logs[-1]["expected_tau"] > logs[0]["expected_tau"]
    assert {"ce_loss", "l1_loss", "confidence_loss", "accept_rate@0"} <= set(logs[0])
    assert all(p.grad is None for p in target.parameters())
    assert any(not torch.equal(before[k], v) for k, v in drafter.state_dict().items())
    trainer.save_model(str(tmp_path / "drafter"))
    loaded = DSparkModel.from_pretrained(tmp_path / "drafter")
    for k, v in drafter.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    assert not any("embed_tokens" in k or "lm_head" in k for k in loaded.state_dict())


def test_trainer_needs_a_target():
    drafter = tiny_drafter(tiny_target())
    with pytest.raises(ValueError, match="frozen target"):
        DSparkTrainer(model=drafter, args=DSparkTrainingArguments(output_dir="/tmp/x", report_to=[], use_cpu=True))


DDP_SCRIPT = '''
import os, sys, torch, torch.distributed as dist
sys.path[:0] = [{root!r}, {tests!r}]
from modeling_dspark.training.trainer import DSparkTrainer, DSparkTrainingArguments
from tiny_models import bigram_target, tiny_drafter
from tiny_models import bigram_dataset
target = bigram_target(initializer_range=0.3)
drafter = tiny_drafter(target, dtype=torch.float32).train()
args = DSparkTrainingArguments(output_dir={out!r}, per_device_train_batch_size=2, max_steps=4, learning_rate=1e-3,
    report_to=[], use_cpu=True, num_anchors=4, save_strategy="no", ddp_backend="gloo", logging_steps=1)
trainer = DSparkTrainer(model=drafter, args=args, target=target, train_dataset=bigram_dataset(target, n=16))
trainer.train()
assert dist.is_initialized() and dist.get_world_size() == 2 and dist.get_backend() == "gloo"
w = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
gathered = [torch.zeros_like(w) for _ in range(2)]
dist.all_gather(gathered, w)
assert torch.equal(gathered[0], gathered[1]), "data-parallel replicas diverged"
# one file per rank: the two processes share stdout, where their lines can interleave
open({out!r} + f"/rank{{dist.get_rank()}}.txt", "w").write(f"ok {{trainer.state.global_step}}")
dist.barrier()
dist.destroy_process_group()
# gloo's worker threads can abort the interpreter's own teardown ("terminate called without an active
# exception", seen under CPU contention); everything this test checks is on disk by now
sys.stdout.flush(), sys.stderr.flush()
os._exit(0)
'''


def test_two_process_data_parallel_training(tmp_path):
    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT.format(root=str(root), tests=str(root / "tests"), out=str(tmp_path / "out")))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533", str(script)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert [(tmp_path / "out" / f"rank{r}.txt").read_text() for r in range(2)] == ["ok 4", "ok 4"]


def test_trainer_evaluate_reports_expected_tau_through_the_metric(tmp_path):
    target = bigram_target(initializer_range=0.3)
    drafter = tiny_drafter(target, dtype=torch.float32).train()
    args = DSparkTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=60,
        learning_rate=1e-2, logging_steps=20, report_to=[], use_cpu=True, num_anchors=8, save_strategy="no", seed=0,
    )  # fmt: skip
    trainer = DSparkTrainer(model=drafter, args=args, target=target, train_dataset=bigram_dataset(target), eval_dataset=bigram_dataset(target, seed=1, n=8))
    before = trainer.evaluate()
    keys = {"eval_loss", "eval_ce_loss", "eval_l1_loss", "eval_confidence_loss", "eval_expected_tau", "eval_accept_rate@0"}
    assert keys <= set(before)
    rates = [before[f"eval_accept_rate@{k}"] for k in range(drafter.config.block_size)]
    assert all(0.0 <= r <= 1.0 for r in rates)
    expected = 1.0
    for k in range(len(rates)):
        expected += torch.tensor(rates[: k + 1]).prod().item()
    assert before["eval_expected_tau"] == pytest.approx(expected, rel=1e-5)
    trainer.train()
    after = trainer.evaluate()
    assert after["eval_expected_tau"] > before["eval_expected_tau"] + 0.05
    assert after["eval_loss"] < before["eval_loss"]
    # training logs never carry evaluation blocks, and evaluation does not eat pending training statistics
    assert all("eval_expected_tau" not in e for e in trainer.state.log_history if "loss" in e and "eval_loss" not in e)


def test_ablation_report_compares_held_out_runs(tmp_path):
    import json

    from modeling_dspark.training.ablation import load_runs, write_ablation_report

    for name, rates in (("a", [0.4, 0.2]), ("b", [0.5, 0.3])):
        metrics = {"eval_expected_tau": 1 + rates[0] + rates[0] * rates[1], "eval_ce_loss": 3.0, "eval_l1_loss": 1.0}
        metrics.update({f"eval_accept_rate@{k}": r for k, r in enumerate(rates)})
        (tmp_path / name).mkdir()
        budget = {"steps": 5, "wall_time_s_this_run": 1.0, "command": f"python -m modeling_dspark.training.train --x {name}", "held_out_eval": metrics}
        (tmp_path / name / "training_budget.json").write_text(json.dumps(budget))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "training_budget.json").write_text(json.dumps({"held_out_eval": None}))
    runs = load_runs([f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}"])
    write_ablation_report(runs, tmp_path / "out", "cmd")
    table = (tmp_path / "out" / "ablation.md").read_text()
    assert "| b | 5 | 1 | 1.650 | 3.00 | 1.000 | 0.500 | 0.300 | `--x b` |" in table
    assert (tmp_path / "out" / "ablation.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="no held_out_eval"):
        load_runs([f"c={tmp_path / 'c'}"])
    with pytest.raises(SystemExit, match="LABEL=FOLDER"):
        load_runs([str(tmp_path / "a")])
    # the report records a command that a shell gives back unchanged, labels with spaces included
    from modeling_dspark.training.ablation import main

    argv = ["--run", f"rank 256 (paper)={tmp_path / 'b'}", "--out", str(tmp_path / "rerun")]
    main(argv)
    command = json.loads((tmp_path / "rerun" / "ablation.json").read_text())["command"]
    assert shlex.split(command) == ["python", "-m", "modeling_dspark.training.ablation", *argv]
