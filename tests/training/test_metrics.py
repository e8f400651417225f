"""The shipped `evaluate` metric modules against hand-computed values, loaded the way users load them."""

import math

import evaluate
import pytest

from modeling_dspark.metrics import metric_path


def test_acceptance_length_rounds_by_hand():
    metric = evaluate.load(metric_path("acceptance_length"), "rounds")
    out = metric.compute(accepted=[0, 1, 3, 2], verified=[3, 3, 3, 3])
    assert out["tau"] == pytest.approx((1 + 2 + 4 + 3) / 4)
    assert out["acceptance_rate"] == pytest.approx(6 / 12)
    assert out["mean_verified"] == 3
    # accept_rate@k: rounds with accepted > k over rounds that verified > k
    assert out["prefix_acceptance"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    # conditional: among rounds that reached slot k, the share that accepted it
    assert out["conditional_acceptance"] == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    # truncated rounds (verified < block) only count where they offered the slot
    short = metric.compute(accepted=[1, 0], verified=[1, 2], block_size=3)
    assert short["prefix_acceptance"][:2] == pytest.approx([1 / 2, 0.0]) and math.isnan(short["prefix_acceptance"][2])
    with pytest.raises(ValueError, match="accepted <= verified"):
        metric.compute(accepted=[4], verified=[3])


def test_acceptance_length_analytic_by_hand():
    metric = evaluate.load(metric_path("acceptance_length"), "analytic")
    out = metric.compute(acceptance_rates=[[0.8, 0.5, 0.2], [0.6, 0.3, 0.9]], masks=[[1, 1, 1], [1, 1, 0]])
    r = [0.7, 0.4, 0.2]  # per-slot means over supervised slots
    assert out["acceptance_rate_per_position"] == pytest.approx(r)
    assert out["expected_tau"] == pytest.approx(1 + 0.7 + 0.7 * 0.4 + 0.7 * 0.4 * 0.2)
    assert out["supervised_per_position"] == [2, 2, 1]


def test_calibration_metric_by_hand():
    metric = evaluate.load(metric_path("calibration"))
    # slot 1 logits 0 -> survival 0.5 for both rounds; one accepted, one not: perfectly calibrated
    out = metric.compute(confidence_logits=[[0.0], [0.0]], accepted=[1, 0], num_bins=10)
    assert out["per_position"][0]["ece"] == pytest.approx(0.0)
    assert out["per_position"][0]["brier"] == pytest.approx(0.25)
    assert math.isnan(out["per_position"][0]["auroc"]) is False and out["per_position"][0]["auroc"] == pytest.approx(0.5)
    # a perfect ranking (accepted rounds have the higher survival), with a position-2 label that is a prefix label
    z = [[2.0, 2.0], [-2.0, 0.0], [1.0, -3.0]]
    out = metric.compute(confidence_logits=z, accepted=[2, 0, 1], num_bins=10)
    first = out["per_position"][0]
    s = [1 / (1 + math.exp(-v)) for v in (2.0, -2.0, 1.0)]
    assert first["auroc"] == pytest.approx(1.0)
    assert first["brier"] == pytest.approx(((s[0] - 1) ** 2 + s[1] ** 2 + (s[2] - 1) ** 2) / 3)
    # ECE with 10 bins: 0.881 and 0.731 fall in different bins, 0.119 in its own: mean |pred - label|
    assert first["ece"] == pytest.approx(((1 - s[0]) + s[1] + (1 - s[2])) / 3)
    second = out["per_position"][1]
    a2 = [s[0] * s[0], s[1] * 0.5, s[2] / (1 + math.exp(3.0))]  # cumulative survival a_2
    assert second["brier"] == pytest.approx(((a2[0] - 1) ** 2 + a2[1] ** 2 + a2[2] ** 2) / 3)
    # temperatures rescale the logits before the product: T_1 = 2 halves them
    hot = metric.compute(confidence_logits=[[2.0]], accepted=[1], temperatures=[2.0], num_bins=10)
    assert hot["per_position"][0]["brier"] == pytest.approx((1 / (1 + math.exp(-1.0)) - 1) ** 2)


def test_unknown_metric_is_named():
    with pytest.raises(ValueError, match="shipped"):
        metric_path("bleu")


def test_learning_curve_plot_and_table(tmp_path):
    import json

    from modeling_dspark.training.learning_curve import plot_learning_curve

    log = [{"step": s, "expected_tau": 1 + s / 100, "accept_rate@0": s / 200} for s in (10, 20, 30)]
    path = tmp_path / "learning_curve.json"
    path.write_text(json.dumps({"runs": [{"name": "a", "positions_per_step": 1e5, "offset_positions": 0, "held_out_expected_tau": 1.2, "log": log}]}))
    table = plot_learning_curve(path).read_text()
    assert "| a | 3.00M | 1.200 | 1.200 |" in table
    assert (tmp_path / "learning_curve.png").stat().st_size > 10_000
    path.write_text(json.dumps({"runs": []}))
    with pytest.raises(ValueError, match="no runs"):
        plot_learning_curve(path)


def test_learning_curve_trend_through_the_held_out_points(tmp_path):
    import json
    import math

    from modeling_dspark.training.learning_curve import held_out_trend, plot_learning_curve, positions_to_reach

    def runs(taus):  # run i ends at 2^i million positions: held-out tau 1.0 + 0.1 i is 0.1 per doubling
        return [{"name": f"r{i}", "positions_per_step": 2**i * 1e4, "offset_positions": 0, "held_out_expected_tau": tau,
                 "log": [{"step": 100, "expected_tau": tau, "accept_rate@0": 0.3}]} for i, tau in enumerate(taus)]  # fmt: skip

    a, b = held_out_trend(runs([1.0, 1.1, 1.2, 1.3]))
    assert b * math.log(2) == pytest.approx(0.1)
    assert positions_to_reach((a, b), 1.5) == pytest.approx(32e6)  # 2^5 million: two doublings past the last run
    assert held_out_trend(runs([1.0, 1.1])) is None, "two points are not a trend"
    assert positions_to_reach((1.0, -0.1), 2.0) is None, "a falling line never reaches a higher tau"
    path = tmp_path / "learning_curve.json"
    path.write_text(json.dumps({"runs": runs([1.0, 1.1, 1.2, 1.3])}))
    table = plot_learning_curve(path, targets=(1.5,)).read_text()
    assert "+0.100 per doubling" in table and "| 1.50 | 32M | 4.0x |" in table
    assert "--targets 1.5" in table, "the report's command reproduces its targets"
    path.write_text(json.dumps({"runs": runs([1.3, 1.2, 1.1])}))
    assert "| 2.00 | never (the line falls) |" in plot_learning_curve(path).read_text()


def test_learning_curve_appends_a_warm_started_run_after_the_last(tmp_path):
    import json

    from modeling_dspark.training.learning_curve import main

    def run_files(name, steps, positions, init_from, resumed_from=None):
        log = [{"step": s, "loss": 2.0, "expected_tau": 1 + s / 100, "accept_rate@0": s / 200, "ce_loss": 3.0, "learning_rate": 1e-3}
               for s in range(10, steps + 1, 10)]  # fmt: skip
        log.append({"step": steps, "train_runtime": 1.0})  # the trainer's closing entry, not a logged step
        state, budget = tmp_path / f"{name}_state.json", tmp_path / f"{name}_budget.json"
        state.write_text(json.dumps({"log_history": log}))
        budget.write_text(json.dumps({"steps": steps, "predicted_positions_this_run": positions, "arguments": {"init_from": init_from},
                                      "held_out_eval": {"eval_expected_tau": 1.5}, "resumed_from": resumed_from}))  # fmt: skip
        return [str(state), str(budget)]

    path = tmp_path / "curve" / "learning_curve.json"
    assert main([str(path), "--append", *run_files("a", 30, 3e6, None), "--name", "a"]) == 0
    # b resumed from its step-10 checkpoint: the positions it counted are those of its last 10 steps
    assert main([str(path), "--append", *run_files("b", 20, 5e5, "a", "runs/b/checkpoint-10"), "--name", "b"]) == 0
    runs = json.loads(path.read_text())["runs"]
    assert [r["offset_positions"] for r in runs] == [0.0, 3e6] and runs[1]["positions_per_step"] == 5e4
    assert [e["step"] for e in runs[1]["log"]] == [10, 20]
    assert "| b | 4.00M |" in path.with_name("learning_curve.md").read_text()
    with pytest.raises(ValueError, match="already has a run named 'b'"):
        main([str(path), "--append", *run_files("b", 20, 1e6, "a"), "--name", "b"])
    with pytest.raises(SystemExit):
        main([str(path), "--append", *run_files("c", 20, 1e6, "a")])  # no --name
