"""``dspark profile``: measure (or show the cached) cost table of an embedded target and plot it; the plots of the
engine's cost tables the load benchmark draws."""

from __future__ import annotations

from generation.scheduling.profiler import cost_table_path, profile_sps
from generation.scheduling.scheduler import CostTable, DraftCost, PaddedCostTable

__all__ = ["plot_cost_table", "plot_engine_costs"]


def plot_cost_table(cost: CostTable, path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.plot(cost.tokens, cost.steps_per_second, marker="o")
    ax1.set(xscale="log", xlabel="tokens in one forward (B)", ylabel="target steps / s", title=title or "SPS(B)")
    ax2.plot(cost.tokens, [b * s for b, s in zip(cost.tokens, cost.steps_per_second)], marker="o")
    ax2.set(xscale="log", xlabel="tokens in one forward (B)", ylabel="tokens / s (B * SPS(B))", title="throughput ceiling")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_engine_costs(verify_cost: PaddedCostTable, draft_cost: DraftCost, path, title: str = "") -> None:
    """The engine's two cost tables side by side: verify forward by width, drafter call by depth, one line per R."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for r, line in zip(verify_cost.rows, verify_cost.seconds):
        ax1.plot(verify_cost.widths, [1000 * t for t in line], marker="o", label=f"R={r}")
    for r, line in zip(draft_cost.rows, draft_cost.seconds):
        ax2.plot(range(1, draft_cost.max_depth + 1), [1000 * t for t in line], marker="o", label=f"R={r}")
    ax1.set(xlabel="verify width (1 + longest l_r)", ylabel="ms per call", yscale="log", title=title or "verify forward")
    ax2.set(xlabel="slots drafted (D)", title="drafter call")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """``dspark profile``: measure (or show the cached) cost table of an embedded target and plot it."""
    import argparse

    from modeling_dspark.targets import add_target_arguments, target_from_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_arguments(parser)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--context-length", type=int, default=256)
    parser.add_argument("--remeasure", action="store_true", help="ignore the cached table")
    parser.add_argument("--plot", default=None, help="PNG to draw the table into")
    args = parser.parse_args(argv)
    target, _ = target_from_args(args)
    cost = profile_sps(target, max_tokens=args.max_tokens, context_length=args.context_length, use_cache=not args.remeasure)
    print(f"cost table ({cost_table_path(target, args.context_length)}):")
    for b, s in zip(cost.tokens, cost.steps_per_second):
        print(f"  B={b:>4}: {s:7.2f} steps/s  ({b * s:8.1f} tokens/s)")
    if args.plot:
        plot_cost_table(cost, args.plot, title=f"SPS(B), {args.target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
