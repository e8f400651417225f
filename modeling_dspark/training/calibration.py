"""Sequential Temperature Scaling (STS, SPEC section 5) and the confidence metrics.

The confidence head predicts ``c_k``, the chance that slot k is accepted given every earlier slot was; the
quantity a scheduler uses is the prefix survival ``a_k = prod_{i<=k} c_i``. STS fits one temperature per
position, in order: ``T_k`` minimises the ECE of ``a_k`` against the observed prefix acceptance, with
``T_1..T_{k-1}`` already fixed. Temperature scaling is monotone, so each position's ranking (AUROC) is kept.

Calibration data come from really drafting and verifying: ``collect_rounds`` runs ``generate()`` with the
drafter at temperature 1, full blocks, and records every round's raw confidence logits and accepted count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modeling_dspark.checkpoint.confidence_head import calibrated_confidence, prefix_survival
from modeling_dspark.provenance import command_line

__all__ = [
    "CalibrationRounds",
    "auroc",
    "brier",
    "calibration_metrics",
    "collect_rounds",
    "expected_calibration_error",
    "plot_reliability",
    "sequential_temperature_scaling",
    "survival",
]

DEFAULT_GRID = torch.logspace(-1.0, 1.0, 161)  # T in [0.1, 10]


@dataclass
class CalibrationRounds:
    """Per verification round: raw confidence logits of the drafted slots (NaN-padded to the block size) and
    how many of them the target accepted."""

    logits: torch.Tensor  # [R, B] float, NaN where the slot was not drafted
    accepted: torch.Tensor  # [R] long

    @classmethod
    def from_lists(cls, confidence_logits, accepted, block_size: int | None = None) -> "CalibrationRounds":
        """From per-round lists of raw logits (verified slots, any length) and accepted counts."""
        width = block_size or max((len(z) for z in confidence_logits), default=0)
        logits = torch.full((len(confidence_logits), width), float("nan"), dtype=torch.float64)
        for i, z in enumerate(confidence_logits):
            if len(z) > width:
                raise ValueError(f"round {i} has {len(z)} confidence logits, more than the block size {width}")
            logits[i, : len(z)] = torch.as_tensor(z, dtype=torch.float64)
        accepted = torch.as_tensor(list(accepted), dtype=torch.long)
        if accepted.numel() != logits.shape[0]:
            raise ValueError("confidence_logits and accepted must have one entry per round")
        return cls(logits, accepted)

    @property
    def drafted(self) -> torch.Tensor:
        return (~self.logits.isnan()).sum(-1)

    def labels(self) -> torch.Tensor:
        """[R, B] prefix acceptance: 1 where slots 0..k were all accepted."""
        k = torch.arange(self.logits.shape[1])
        return (k[None] < self.accepted[:, None]).float()

    def valid(self) -> torch.Tensor:
        return ~self.logits.isnan()


def survival(logits: torch.Tensor, temperatures) -> torch.Tensor:
    """``a_k = prod_{i<=k} sigmoid(z_i / T_i)`` over the last axis (NaN slots stay NaN), in float64 from the logits
    on (a float32 sigmoid saturates into ties that would move AUROC)."""
    return prefix_survival(calibrated_confidence(logits.double(), temperatures))


def expected_calibration_error(pred: torch.Tensor, label: torch.Tensor, num_bins: int = 20) -> float:
    """Equal-width-bin ECE: ``sum_bins |mean pred - mean label| * n_bin / N``."""
    if pred.numel() == 0:
        return float("nan")
    bins = (pred.clamp(0, 1 - 1e-9) * num_bins).long()
    total = 0.0
    for b in bins.unique():
        sel = bins == b
        total += abs(float(pred[sel].mean() - label[sel].mean())) * int(sel.sum())
    return total / pred.numel()


def auroc(pred: torch.Tensor, label: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney, ties get half credit); NaN when one class is missing."""
    pos, neg = int(label.sum()), int((1 - label).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = pred.argsort()
    ranks = torch.empty_like(pred, dtype=torch.float64)
    ranks[order] = torch.arange(1, pred.numel() + 1, dtype=torch.float64)
    for value in pred.unique():  # average ranks over ties
        tied = pred == value
        if tied.sum() > 1:
            ranks[tied] = ranks[tied].mean()
    return float((ranks[label.bool()].sum() - pos * (pos + 1) / 2) / (pos * neg))


def brier(pred: torch.Tensor, label: torch.Tensor) -> float:
    return float(((pred - label) ** 2).mean()) if pred.numel() else float("nan")


def calibration_metrics(rounds: CalibrationRounds, temperatures, num_bins: int = 20) -> dict:
    """Per-position ECE / AUROC / Brier of the survival against prefix acceptance, and count-weighted means."""
    a, y, valid = survival(rounds.logits, temperatures), rounds.labels().double(), rounds.valid()
    per = []
    for k in range(a.shape[1]):
        sel = valid[:, k]
        p, t = a[sel, k], y[sel, k]
        per.append(
            {"position": k + 1, "count": int(sel.sum()), "ece": expected_calibration_error(p, t, num_bins),
             "auroc": auroc(p, t), "brier": brier(p, t), "mean_pred": float(p.mean()) if p.numel() else float("nan"),
             "mean_label": float(t.mean()) if t.numel() else float("nan")}
        )  # fmt: skip
    counts = torch.tensor([m["count"] for m in per], dtype=torch.float64)

    def mean(key):
        vals = torch.tensor([m[key] for m in per], dtype=torch.float64)
        ok = ~vals.isnan() & (counts > 0)
        return float((vals[ok] * counts[ok]).sum() / counts[ok].sum()) if ok.any() else float("nan")

    return {"per_position": per, "ece": mean("ece"), "auroc": mean("auroc"), "brier": mean("brier")}


def sequential_temperature_scaling(
    rounds: CalibrationRounds, grid: torch.Tensor = DEFAULT_GRID, num_bins: int = 20, min_each_class: int = 20
) -> list[float]:
    """Fit ``T_1..T_B`` in order, each by a 1-D grid search minimising the ECE of the survival at its position.

    A position with fewer than ``min_each_class`` accepted or rejected prefixes carries no information about a
    temperature (any T that pushes the survival to the majority label wins); it keeps ``T = 1``."""
    logits, labels, valid = rounds.logits.double(), rounds.labels().double(), rounds.valid()
    num_slots = logits.shape[1]
    temps = [1.0] * num_slots
    prefix = torch.ones(logits.shape[0], dtype=torch.float64)  # survival up to k-1 with the fitted temperatures
    for k in range(num_slots):
        sel = valid[:, k]
        if sel.sum() == 0:
            continue
        z, y, before = logits[sel, k], labels[sel, k], prefix[sel]
        if min(int(y.sum()), int((1 - y).sum())) < min_each_class:
            prefix = prefix * torch.sigmoid(logits[:, k].nan_to_num(0.0))
            continue
        scores = [expected_calibration_error(before * torch.sigmoid(z / t), y, num_bins) for t in grid.tolist()]
        temps[k] = float(grid[int(torch.tensor(scores).argmin())])
        prefix = prefix * torch.sigmoid(logits[:, k].nan_to_num(0.0) / temps[k])
    return temps


def collect_rounds(target, drafter, prompt_ids: list[list[int]], *, max_new_tokens: int = 96, seed: int = 0, progress: bool = True) -> CalibrationRounds:
    """Draft and verify on ``prompt_ids`` (temperature 1, full blocks, no top-k/top-p) and keep every drafted round."""
    from generation.evaluation.prompts import verified_rounds

    rounds = [r for r in verified_rounds(target, drafter, prompt_ids, max_new_tokens=max_new_tokens, seed=seed, progress=progress) if r.drafted]
    return CalibrationRounds.from_lists([r.confidence_logits for r in rounds], [r.accepted for r in rounds], drafter.config.block_size)


def plot_reliability(rounds: CalibrationRounds, temperature_sets: dict[str, list[float]], path, num_bins: int = 10) -> None:
    """Reliability diagram of the survival at every position, one panel per temperature set (e.g. before / after)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(temperature_sets), figsize=(5 * len(temperature_sets), 4.5), squeeze=False)
    y, valid = rounds.labels(), rounds.valid()
    for ax, (name, temps) in zip(axes[0], temperature_sets.items()):
        a = survival(rounds.logits, temps)
        metrics = calibration_metrics(rounds, temps)
        for k in range(a.shape[1]):
            p, t = a[valid[:, k], k], y[valid[:, k], k]
            if p.numel() < 20:
                continue
            bins = (p.clamp(0, 1 - 1e-9) * num_bins).long()
            xs = [float(p[bins == b].mean()) for b in bins.unique()]
            ys = [float(t[bins == b].mean()) for b in bins.unique()]
            ax.plot(xs, ys, marker="o", markersize=3, label=f"k={k + 1}")
        ax.plot([0, 1], [0, 1], "k--", linewidth=1)
        ax.set_title(f"{name}: ECE {100 * metrics['ece']:.1f} %, AUROC {metrics['auroc']:.3f}")
        ax.set_xlabel("predicted survival a_k")
        ax.set_ylabel("observed prefix acceptance")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_confidence_temperatures(folder, temperatures: list[float]) -> None:
    """Store fitted STS temperatures in ``folder``'s config, leaving its weights and their dtype as saved.

    Calibration runs the drafter in the target's dtype (fp32 where the CPU lacks fast bf16); saving that model
    would rewrite a bf16 checkpoint's weights in fp32."""
    from modeling_dspark import DSparkConfig

    config = DSparkConfig.from_pretrained(folder)
    config.confidence_temperatures = [float(t) for t in temperatures]
    config.validate_dspark()
    config.save_pretrained(folder)


def main(argv: list[str] | None = None) -> int:
    """Calibrate a drafter folder in place on the held-out split of the regenerated data.

    python -m modeling_dspark.training.calibration --drafter checkpoints/dspark-smollm2-135m-instruct --data data_cache/smollm2_regen.jsonl
    """
    import argparse
    import json
    from pathlib import Path

    from modeling_dspark import DSparkModel
    from modeling_dspark.targets import add_target_arguments, target_from_args
    from modeling_dspark.training.data import read_responses, split_holdout

    parser = argparse.ArgumentParser(description="Sequential Temperature Scaling of a drafter's confidence head")
    add_target_arguments(parser)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--data", required=True, nargs="+", help="regenerated responses; their held-out split is used")
    parser.add_argument("--num-prompts", type=int, default=120, help="held-out prompts (half fit, half report)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args(argv)

    target, _ = target_from_args(args)
    folder = Path(args.drafter)
    drafter = DSparkModel.from_pretrained(folder, dtype=target.dtype).eval()
    drafter.config.confidence_temperatures = None  # collect raw logits
    _, held_out = split_holdout([row for path in args.data for row in read_responses(path)])
    prompts = [row["prompt_ids"] for row in held_out[: args.num_prompts]]
    half = len(prompts) // 2
    fit_rounds = collect_rounds(target, drafter, prompts[:half], max_new_tokens=args.max_new_tokens, seed=0)
    report_rounds = collect_rounds(target, drafter, prompts[half:], max_new_tokens=args.max_new_tokens, seed=10_000)
    ones = [1.0] * drafter.config.block_size
    temps = sequential_temperature_scaling(fit_rounds)
    result = {
        "command": command_line("modeling_dspark.training.calibration", argv),
        "temperatures": temps,
        "fit": {"prompts": half, "rounds": int(fit_rounds.accepted.numel())},
        "report": {"prompts": len(prompts) - half, "rounds": int(report_rounds.accepted.numel())},
        "before": calibration_metrics(report_rounds, ones),
        "after": calibration_metrics(report_rounds, temps),
        "before_fit_split": calibration_metrics(fit_rounds, ones),
        "after_fit_split": calibration_metrics(fit_rounds, temps),
    }
    write_confidence_temperatures(folder, temps)
    (folder / "calibration.json").write_text(json.dumps(result, indent=2) + "\n")
    plot_reliability(report_rounds, {"raw": ones, "STS": temps}, folder / "reliability.png")
    b, a = result["before"], result["after"]
    print(f"temperatures {['%.3f' % t for t in temps]}")
    print(f"held-out report split: ECE {100 * b['ece']:.2f}% -> {100 * a['ece']:.2f}%, AUROC {b['auroc']:.3f} -> {a['auroc']:.3f}, Brier {b['brier']:.4f} -> {a['brier']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
