"""Compare training runs on their held-out evaluation: a table and a per-position plot.

Each run is a folder written by ``python -m modeling_dspark.training.train --export DIR`` (its ``training_budget.json`` holds
the command, the budget and the held-out metrics of ``DSparkTrainer.evaluate()``: teacher-forced acceptance rate
``1 - 0.5 ||p_d - p_t||_1`` per block slot and the expected tau they imply at T = 1)::

    python -m modeling_dspark.training.ablation --run base=runs/ablate/base/export --run eagle3=runs/ablate/eagle3/export \\
        --out benchmarks/results/ablation
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from modeling_dspark.provenance import command_line

__all__ = ["load_runs", "write_ablation_report"]


def load_runs(specs: list[str]) -> dict[str, dict]:
    """``LABEL=FOLDER`` -> {label: training_budget.json contents}; refuses runs without a held-out evaluation."""
    runs = {}
    for spec in specs:
        label, sep, folder = spec.partition("=")
        if not sep:
            raise SystemExit(f"--run takes LABEL=FOLDER, got {spec!r}")
        path = Path(folder) / "training_budget.json"
        if not path.is_file():
            raise SystemExit(f"{path} not found: export the run with python -m modeling_dspark.training.train --export")
        budget = json.loads(path.read_text())
        if not budget.get("held_out_eval"):
            raise SystemExit(f"{path} has no held_out_eval (trained with --no-eval)")
        runs[label] = budget
    return runs


def _rates(metrics: dict) -> list[float]:
    rates, k = [], 0
    while f"eval_accept_rate@{k}" in metrics:
        rates.append(metrics[f"eval_accept_rate@{k}"])
        k += 1
    return rates


def write_ablation_report(runs: dict[str, dict], out_dir, command: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    width = max(len(_rates(b["held_out_eval"])) for b in runs.values())
    lines = [
        f"# Training ablations, held-out evaluation\n\n`{command}`\n",
        "Held-out prompts' regenerated responses, the same anchors for every run; acceptance per block slot is the "
        "teacher-forced analytic rate `1 - 0.5 ||p_d - p_t||_1`, expected tau the product formula at T = 1.\n",
        "| run | steps | wall s | expected tau | CE | L1 | " + " | ".join(f"slot {k + 1}" for k in range(width)) + " | command |",
        "|---" * (width + 7) + "|",
    ]
    for label, b in runs.items():
        m = b["held_out_eval"]
        rates = _rates(m) + [float("nan")] * (width - len(_rates(m)))
        args = b["command"].replace("python -m modeling_dspark.training.train ", "")
        lines.append(
            f"| {label} | {b['steps']} | {b['wall_time_s_this_run']:.0f} | {m['eval_expected_tau']:.3f} | "
            f"{m['eval_ce_loss']:.2f} | {m['eval_l1_loss']:.3f} | " + " | ".join(f"{r:.3f}" for r in rates) + f" | `{args}` |"
        )
    (out / "ablation.md").write_text("\n".join(lines) + "\n")
    (out / "ablation.json").write_text(json.dumps({"command": command, "runs": runs}, indent=2) + "\n")
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, b in runs.items():
        rates = _rates(b["held_out_eval"])
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{label} (tau {b['held_out_eval']['eval_expected_tau']:.3f})")
    ax.set(xlabel="block slot", ylabel="held-out acceptance rate", title="training ablations")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ablation.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", required=True, metavar="LABEL=FOLDER")
    parser.add_argument("--out", default="benchmarks/results/ablation")
    args = parser.parse_args(argv)
    runs = load_runs(args.run)
    command = command_line("modeling_dspark.training.ablation", argv)
    write_ablation_report(runs, args.out, command)
    for label, b in runs.items():
        print(f"{label:>12}: expected tau {b['held_out_eval']['eval_expected_tau']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
