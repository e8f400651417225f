"""What ``MKL_CBWR`` (``modeling_dspark.cpu_blas``) does to verification on this CPU: MKL's default path against the
one importing ``modeling_dspark`` sets (``MKL_CBWR=AUTO`` on AMD CPUs; elsewhere both arms run MKL's default).

MKL reads the variable once per process, so each arm runs in its own fresh interpreter, the arms alternating
(``--pairs`` times) so a drift of a shared machine reaches both. Each worker times the target's forward of 1-8 new
tokens on a 300-token cache (the verification shapes) and greedy ``generate()`` plain and with the drafter on one
prompt per domain, interleaved; tokens/s and the ratio are medians over the pairs.

    python benchmarks/mkl_small_rows.py --drafter checkpoints/dspark-smollm2-135m-instruct-v14 --pairs 3 \\
        --out benchmarks/results/mkl_small_rows_epyc
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROWS = (1, 2, 4, 8)
ARMS = {"MKL default (MKL_CBWR empty)": "", "as imported (modeling_dspark.cpu_blas)": None}


def worker(drafter_path: str, max_new_tokens: int, repeats: int) -> dict:
    import torch

    import modeling_dspark  # sets MKL_CBWR (or not) before the first product
    from generation.evaluation.prompts import chat_input_ids, load_eval_prompts
    from generation.evaluation.speed import DEFAULT_DOMAINS
    from modeling_dspark.cpu_blas import cpu_vendor

    target, tokenizer = modeling_dspark.load_target("smollm2-135m-instruct")
    drafter = modeling_dspark.DSparkModel.from_pretrained(drafter_path, dtype=target.dtype).eval()
    result = {"mkl_cbwr": os.environ.get("MKL_CBWR"), "vendor": cpu_vendor(), "dtype": str(target.dtype), "generate": {}}
    torch.manual_seed(0)
    with torch.no_grad():
        cache = target(torch.randint(100, 20000, (1, 300)), use_cache=True).past_key_values
        seconds = {rows: [] for rows in ROWS}
        for _ in range(repeats + 2):  # in turns, so a burst of load reaches every width; two passes to warm up
            for rows in ROWS:
                ids = torch.randint(100, 20000, (1, rows))
                start = time.perf_counter()
                target(ids, past_key_values=cache, use_cache=True)
                seconds[rows].append(time.perf_counter() - start)
                cache.crop(-rows)
        result["forward_ms"] = {rows: 1000 * statistics.median(values[2:]) for rows, values in seconds.items()}
        common = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=target.generation_config.pad_token_id)
        target.generate(chat_input_ids(tokenizer, "Hello"), **{**common, "max_new_tokens": 8}, assistant_model=drafter)
        for domain, name in DEFAULT_DOMAINS.items():
            ids = chat_input_ids(tokenizer, load_eval_prompts(name, 1)[0]["prompt"])
            row = {}
            for method, extra in (("plain", {}), ("dspark", {"assistant_model": drafter})):
                start = time.perf_counter()
                out = target.generate(ids, **common, **extra)
                seconds = time.perf_counter() - start
                row[f"{method}_tok_s"] = (out.shape[1] - ids.shape[1]) / seconds
                row[f"{method}_ids"] = out[0, ids.shape[1] :].tolist()
            row["tokens_per_round"] = (len(row["dspark_ids"])) / max(drafter.last_stats.num_rounds, 1)
            row["same_text"] = row.pop("plain_ids") == row.pop("dspark_ids")
            result["generate"][domain] = row
    return result


def run_arm(value: str | None, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    if value is not None:
        env["MKL_CBWR"] = value
    argv = [sys.executable, __file__, "--worker", "--drafter", args.drafter, "--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    if done.returncode:
        raise RuntimeError(f"worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(runs: dict[str, list[dict]]) -> dict:
    summary = {}
    for arm, results in runs.items():
        med = lambda values: statistics.median(values)  # noqa: E731
        forward = {rows: med([r["forward_ms"][str(rows)] for r in results]) for rows in ROWS}
        domains = results[0]["generate"]
        summary[arm] = {
            "mkl_cbwr": results[0]["mkl_cbwr"],
            "forward_ms": forward,
            "forward_in_one_row_steps": {rows: forward[rows] / forward[1] for rows in ROWS},
            "generate": {
                d: {
                    "plain_tok_s": med([r["generate"][d]["plain_tok_s"] for r in results]),
                    "dspark_tok_s": med([r["generate"][d]["dspark_tok_s"] for r in results]),
                    "ratio": med([r["generate"][d]["dspark_tok_s"] / r["generate"][d]["plain_tok_s"] for r in results]),
                    "tokens_per_round": results[0]["generate"][d]["tokens_per_round"],
                    "same_text": all(r["generate"][d]["same_text"] for r in results),
                }
                for d in domains
            },
        }
    return summary


def write_report(summary: dict, meta: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "mkl_small_rows.json").write_text(json.dumps({**meta, "summary": summary}, indent=2) + "\n")
    arms = list(summary)
    lines = [
        "# MKL's path for products with a few rows\n",
        f"`{meta['command']}`\n",
        f"CPU vendor {meta['vendor']}, target dtype {meta['dtype']}, {meta['pairs']} pairs of fresh processes (arms "
        f"alternating), medians over them; forward: the target's forward of R new tokens on a 300-token cache, median "
        f"of {meta['repeats']} taken in turns; generate: greedy, {meta['max_new_tokens']} new tokens, one prompt per domain.\n",
        "| arm | MKL_CBWR | " + " | ".join(f"forward R={r}, ms" for r in ROWS) + " | R=8 in R=1 steps |",
        "|---|---|" + "---|" * (len(ROWS) + 1),
    ]
    for arm in arms:
        s = summary[arm]
        cells = " | ".join(f"{s['forward_ms'][r]:.0f}" for r in ROWS)
        lines.append(f"| {arm} | `{s['mkl_cbwr']!r}` | {cells} | {s['forward_in_one_row_steps'][8]:.2f} |")
    domains = list(summary[arms[0]]["generate"])
    lines += ["", "| arm | " + " | ".join(f"{d}: plain / DSpark tok/s, ratio" for d in domains) + " | same text as plain |",
              "|---|" + "---|" * (len(domains) + 1)]  # fmt: skip
    for arm in arms:
        g = summary[arm]["generate"]
        cells = " | ".join(f"{g[d]['plain_tok_s']:.1f} / {g[d]['dspark_tok_s']:.1f}, {g[d]['ratio']:.2f}x" for d in domains)
        lines.append(f"| {arm} | {cells} | {all(g[d]['same_text'] for d in domains)} |")
    lines.append("\nTokens per round (greedy tau): " + ", ".join(f"{d} {summary[arms[-1]]['generate'][d]['tokens_per_round']:.2f}" for d in domains) + ".")
    (out / "mkl_small_rows.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for arm in arms:
        ax.plot(ROWS, [summary[arm]["forward_ms"][r] for r in ROWS], marker="o", label=arm)
    ax.set_xlabel("new tokens in the forward (R)")
    ax.set_ylabel("target forward, ms")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "mkl_small_rows.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.drafter, args.max_new_tokens, args.repeats)))
        return 0
    if args.pairs < 1 or not Path(args.drafter).is_dir():
        parser.error("--pairs must be >= 1 and --drafter a drafter folder")
    from tqdm.auto import tqdm

    runs = {arm: [] for arm in ARMS}
    with tqdm(total=args.pairs * len(ARMS), desc="fresh processes") as bar:
        for _ in range(args.pairs):
            for arm, value in ARMS.items():
                runs[arm].append(run_arm(value, args))
                bar.update()
    first = runs[next(iter(ARMS))][0]
    meta = {"command": shlex.join(["python", "benchmarks/mkl_small_rows.py", *(sys.argv[1:] if argv is None else argv)]), "vendor": first["vendor"], "dtype": first["dtype"],
            "pairs": args.pairs, "repeats": args.repeats, "max_new_tokens": args.max_new_tokens, "runs": runs}  # fmt: skip
    summary = summarize(runs)
    if args.out:
        write_report(summary, meta, Path(args.out))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
