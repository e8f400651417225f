"""Tau against training positions seen: how far a drafter's training has come and where it is heading.

    python -m modeling_dspark.training.learning_curve benchmarks/results/learning_curve/learning_curve.json

The input holds one or more training runs (``runs``: name, ``positions_per_step``, ``offset_positions`` for a run
warm-started from another, ``held_out_expected_tau`` at its end, and ``log``: the trainer's logged steps with
``expected_tau`` and ``accept_rate@0`` of the training batches, analytic at T = 1). Writes ``learning_curve.png`` and
``learning_curve.md`` beside it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["plot_learning_curve"]


def _smooth(values: list[float], window: int = 5) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def plot_learning_curve(path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    data = json.loads(path.read_text())
    if not data.get("runs"):
        raise ValueError(f"{path} has no runs")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    lines = ["# Learning curve\n", f"`python -m modeling_dspark.training.learning_curve {path}`\n", data.get("source", ""), "",
             "| run | predicted positions at the end | training-batch expected tau (last 5 logs) | held-out expected tau |",
             "|---|---|---|---|"]  # fmt: skip
    for run in data["runs"]:
        log = run["log"]
        if not log:
            raise ValueError(f"run {run['name']!r} has an empty log")
        x = [(run["offset_positions"] + entry["step"] * run["positions_per_step"]) / 1e6 for entry in log]
        for ax, key in zip(axes, ("expected_tau", "accept_rate@0")):
            ax.plot(x, _smooth([entry[key] for entry in log]), label=run["name"])
        axes[0].scatter([x[-1]], [run["held_out_expected_tau"]], marker="*", s=120, zorder=3)
        tail = [entry["expected_tau"] for entry in log[-5:]]
        lines.append(f"| {run['name']} | {x[-1]:.2f}M | {sum(tail) / len(tail):.3f} | {run['held_out_expected_tau']:.3f} |")
    axes[0].set_ylabel("expected tau (T = 1; stars: held out at the end)")
    axes[1].set_ylabel("acceptance of slot 1")
    for ax in axes:
        ax.set_xlabel("predicted block positions seen (millions)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path.with_name("learning_curve.png"), dpi=120)
    plt.close(fig)
    out = path.with_name("learning_curve.md")
    out.write_text("\n".join(lines) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="learning_curve.json")
    args = parser.parse_args(argv)
    if not Path(args.path).is_file():
        parser.error(f"{args.path} is not a file")
    print(plot_learning_curve(args.path).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
