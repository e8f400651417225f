"""Summarise load-benchmark runs of two code versions taken in turns (an A/B of the scheduler): for each run folder
(``<arm><n>/load.json``, written by ``python -m generation.evaluation.load_benchmark ... --out <dir>/<arm><n>``), the
ratio of Algorithm 1 to no speculation at each R (the median of its batches, which stepped both engines in turn),
then per arm the median over its runs, into ``<dir>/ab.md``.

    python benchmarks/load_ab_summary.py benchmarks/results/load_ab_catch_up_avx2 --arms before after --notes "..."
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path


def run_ratios(path: Path, method: str = "algorithm 1") -> dict:
    """R -> (ratio of medians, slots drafted per step, tau) of one load.json."""
    results = json.loads(path.read_text())
    plain, spec = results["methods"]["no speculation"], results["methods"][method]
    return {int(r): (spec[r]["tokens_per_s"] / plain[r]["tokens_per_s"], spec[r]["mean_draft_depth"], spec[r]["tau"]) for r in plain}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--arms", nargs="+", required=True, help="run-folder name prefixes, one per code version")
    parser.add_argument("--notes", default="", help="what each arm ran (commits, commands, machine), written under the title")
    args = parser.parse_args(argv)
    concurrency = _concurrency(args)
    lines = ["| arm | run | " + " | ".join(f"R={r}" for r in concurrency) + " |", "|---" * (2 + len(concurrency)) + "|"]
    for arm in args.arms:
        runs = sorted((p for p in args.folder.iterdir() if re.fullmatch(rf"{re.escape(arm)}\d+", p.name)), key=lambda p: p.name)
        if not runs:
            raise SystemExit(f"no run folders {arm}<n> in {args.folder}")
        per_run = {p.name: run_ratios(p / "load.json") for p in runs}
        for name, rows in per_run.items():
            cells = [f"{x:.3f} ({depth:.2f} / {tau:.2f})" for x, depth, tau in rows.values()]
            lines.append(f"| {arm} | {name} | " + " | ".join(cells) + " |")
        medians = [statistics.median(rows[r][0] for rows in per_run.values()) for r in concurrency]
        lines.append(f"| {arm} | median | " + " | ".join(f"**{v:.3f}**" for v in medians) + " |")
    text = (
        "# Algorithm 1 over no speculation, two code versions in turns\n\n"
        + (args.notes + "\n\n" if args.notes else "")
        + "Each cell: tokens/s of Algorithm 1 over no speculation (median of the run's batches), then (slots drafted per "
        "step / tau).\n\n" + "\n".join(lines) + "\n"
    )
    (args.folder / "ab.md").write_text(text)
    print(text)
    return 0


def _concurrency(args) -> list[int]:
    first = next(p for p in sorted(args.folder.iterdir()) if (p / "load.json").is_file())
    return sorted(run_ratios(first / "load.json"))


if __name__ == "__main__":
    raise SystemExit(main())
