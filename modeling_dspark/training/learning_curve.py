"""Tau against training positions seen: how far a drafter's training has come and where it is heading.

    python -m modeling_dspark.training.learning_curve benchmarks/results/learning_curve/learning_curve.json

The input holds one or more training runs (``runs``: name, ``positions_per_step``, ``offset_positions`` for a run
warm-started from another, ``held_out_expected_tau`` at its end, and ``log``: the trainer's logged steps with
``expected_tau`` and ``accept_rate@0`` of the training batches, analytic at T = 1). Writes ``learning_curve.png`` and
``learning_curve.md`` beside it, with where the held-out points are heading: the least-squares line
``tau = a + b ln(positions)`` through them (three runs or more) and the positions at which it reaches ``--targets``.

A run is appended from what training leaves behind (the trainer's ``trainer_state.json`` and the exported
``training_budget.json``); one warm-started (``--init-from``) continues where the file's last run ended:

    python -m modeling_dspark.training.learning_curve benchmarks/results/learning_curve/learning_curve.json \
        --append runs/smollm2_v7/checkpoint-1350/trainer_state.json checkpoints/<drafter>/training_budget.json \
        --name "v7: warm start from v6, 980k tokens"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from modeling_dspark.provenance import command_line

__all__ = ["append_run", "held_out_trend", "plot_learning_curve", "positions_to_reach"]

LOGGED = ("expected_tau", "accept_rate@0", "ce_loss", "learning_rate")
DEFAULT_TARGETS = (2.0, 2.5)


def _positions(run: dict, step: int) -> float:
    """Predicted positions seen by the end of ``step`` of ``run`` (the runs before it included)."""
    return run["offset_positions"] + step * run["positions_per_step"]


def _end_positions(run: dict) -> float:
    return _positions(run, run["log"][-1]["step"])


def held_out_trend(runs: list[dict]) -> tuple[float, float] | None:
    """``(a, b)`` of the least-squares ``tau = a + b ln(positions)`` through the runs' held-out expected tau at their
    end positions; ``None`` with fewer than three runs, too few to call a trend."""
    import math

    points = [(math.log(_end_positions(run)), run["held_out_expected_tau"]) for run in runs]
    if len(points) < 3:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    var_x = sum((x - mean_x) ** 2 for x, _ in points)
    if var_x == 0:
        return None
    b = sum((x - mean_x) * (y - mean_y) for x, y in points) / var_x
    return mean_y - b * mean_x, b


def positions_to_reach(trend: tuple[float, float], tau: float) -> float | None:
    """Predicted positions at which the trend line reaches ``tau``; ``None`` where it never rises."""
    import math

    a, b = trend
    return math.exp((tau - a) / b) if b > 0 else None


def _smooth(values: list[float], window: int = 5) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def plot_learning_curve(path: str | Path, targets: tuple[float, ...] = DEFAULT_TARGETS) -> Path:
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    data = json.loads(path.read_text())
    if not data.get("runs"):
        raise ValueError(f"{path} has no runs")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    argv = [str(path)] + ([] if tuple(targets) == DEFAULT_TARGETS else ["--targets", *map(str, targets)])
    lines = ["# Learning curve\n", f"`{command_line('modeling_dspark.training.learning_curve', argv)}`\n", data.get("source", ""), "",
             "| run | predicted positions at the end | training-batch expected tau (last 5 logs) | held-out expected tau |",
             "|---|---|---|---|"]  # fmt: skip
    for run in data["runs"]:
        log = run["log"]
        if not log:
            raise ValueError(f"run {run['name']!r} has an empty log")
        x = [_positions(run, entry["step"]) / 1e6 for entry in log]
        for ax, key in zip(axes, ("expected_tau", "accept_rate@0")):
            ax.plot(x, _smooth([entry[key] for entry in log]), label=run["name"])
        axes[0].scatter([x[-1]], [run["held_out_expected_tau"]], marker="*", s=120, zorder=3)
        tail = [entry["expected_tau"] for entry in log[-5:]]
        lines.append(f"| {run['name']} | {x[-1]:.2f}M | {sum(tail) / len(tail):.3f} | {run['held_out_expected_tau']:.3f} |")
    trend = held_out_trend(data["runs"])
    if trend is not None:
        a, b = trend
        lines += ["", "## Where the held-out points are heading", "",
                  f"Least squares through the {len(data['runs'])} held-out points: tau = {a:.3f} + {b:.4f} ln(positions), "
                  f"{b * math.log(2):+.3f} per doubling of the predicted positions seen. It mixes more steps with the data that grew "
                  "between runs, and it is an extrapolation: a straight line in log positions, no ceiling.", "",
                  "| held-out expected tau | predicted positions on the line | times the last run's end |", "|---|---|---|"]  # fmt: skip
        last = _end_positions(data["runs"][-1])
        reach = {tau: positions_to_reach(trend, tau) for tau in targets}
        for tau, positions in reach.items():
            lines.append(f"| {tau:.2f} | " + ("never (the line falls)" if positions is None else f"{positions / 1e6:,.0f}M | {positions / last:.1f}x") + " |")
        lo, hi = min(_end_positions(r) for r in data["runs"]), max([last] + [p for p in reach.values() if p is not None])
        xs = [lo * (hi / lo) ** (i / 50) for i in range(51)]  # evenly spaced in log positions
        axes[0].plot([x / 1e6 for x in xs], [a + b * math.log(x) for x in xs], "k--", lw=1, label="held-out trend (log fit)")
        for ax in axes:
            ax.set_xscale("log")
    axes[0].set_ylabel("expected tau (T = 1; stars: held out at the end)")
    axes[1].set_ylabel("acceptance of slot 1")
    for ax in axes:
        ax.set_xlabel("predicted block positions seen (millions)")
        ax.grid(alpha=0.3)
    axes[1].legend(*axes[0].get_legend_handles_labels(), fontsize=7, loc="upper left")  # the curves leave that corner empty
    fig.tight_layout()
    fig.savefig(path.with_name("learning_curve.png"), dpi=120)
    plt.close(fig)
    out = path.with_name("learning_curve.md")
    out.write_text("\n".join(lines) + "\n")
    return out


def append_run(path: str | Path, name: str, trainer_state: str | Path, budget: str | Path) -> dict:
    """Add a training run to the learning-curve file (created if missing) and return the entry."""
    path = Path(path)
    data = json.loads(path.read_text()) if path.is_file() else {"runs": [], "source": ""}
    state = json.loads(Path(trainer_state).read_text())
    budget_data = json.loads(Path(budget).read_text())
    log = [{"step": e["step"], **{k: e[k] for k in LOGGED}} for e in state["log_history"] if all(k in e for k in LOGGED)]
    if not log:
        raise ValueError(f"{trainer_state} logs no training steps with {', '.join(LOGGED)}")
    held_out = (budget_data.get("held_out_eval") or {}).get("eval_expected_tau")
    if held_out is None:
        raise ValueError(f"{budget} has no held-out evaluation (eval_expected_tau)")
    if any(run["name"] == name for run in data["runs"]):
        raise ValueError(f"{path} already has a run named {name!r}")
    offset = 0.0
    if budget_data.get("arguments", {}).get("init_from") and data["runs"]:
        last = data["runs"][-1]
        offset = _end_positions(last)
    # a resumed run counts its positions from the checkpoint it resumed (Trainer names them checkpoint-<step>)
    resumed = budget_data.get("resumed_from")
    steps_this_run = budget_data["steps"] - (int(Path(resumed).name.rsplit("-", 1)[1]) if resumed else 0)
    entry = {
        "name": name,
        "positions_per_step": budget_data["predicted_positions_this_run"] / steps_this_run,
        "offset_positions": offset,
        "held_out_expected_tau": held_out,
        "log": log,
    }
    data["runs"].append(entry)
    source = f"{Path(trainer_state).parent} ({Path(trainer_state).name}) with {budget}"
    data["source"] = f"{data['source']}; {source}" if data.get("source") else f"log_history of {source}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="learning_curve.json")
    parser.add_argument("--append", nargs=2, metavar=("TRAINER_STATE", "TRAINING_BUDGET"), help="add this run first")
    parser.add_argument("--name", help="the appended run's label")
    parser.add_argument("--targets", type=float, nargs="+", default=list(DEFAULT_TARGETS),
                        help="held-out expected tau values to place on the trend line")  # fmt: skip
    args = parser.parse_args(argv)
    if args.append:
        if not args.name:
            parser.error("--append needs --name")
        for file in args.append:
            if not Path(file).is_file():
                parser.error(f"{file} is not a file")
        append_run(args.path, args.name, *args.append)
    elif args.name:
        parser.error("--name labels an --append run")
    if not Path(args.path).is_file():
        parser.error(f"{args.path} is not a file")
    print(plot_learning_curve(args.path, tuple(args.targets)).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
