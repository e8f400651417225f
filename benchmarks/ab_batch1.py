"""Batch-1 A/B of two code versions (or two settings): ``generate()`` with cost truncation (``--truncation``, and
``--threshold`` for the threshold truncation) against plain ``generate()``, greedy and at T = 1, in one process, so
each ratio's two sides share the machine's state. Run it once per arm and run, in turns,
from a checkout of each version (its own code on ``PYTHONPATH``), then summarise:

    git worktree add ../base <commit>
    for run in new1 old1 new2 old2 new3 old3; do
        dir=.; [[ $run == old* ]] && dir=../base
        (cd $dir && PYTHONPATH=$PWD python <this checkout>/benchmarks/ab_batch1.py --out <this checkout>/runs/ab/$run.json)
    done
    python benchmarks/ab_batch1.py --summarise runs/ab --arms old new --notes "..."

Per domain (math: gsm8k, code: humaneval, chat: mt-bench; ``--num-prompts`` each, 128 new tokens) a run writes the
ratio of tokens per second of DSpark (with that truncation) over plain decoding in each mode, tokens per round and
the share of rounds that ran the drafter. The cost planner lives on the drafter, so what the first prompts teach it
carries over to the next, as it would for a user. The summary is the median over each arm's runs, into ``<folder>/ab.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

DOMAINS = {"math": "gsm8k", "code": "humaneval", "chat": "mt-bench"}
MODES = ("greedy", "sampled")


def measure(drafter_path: str, num_prompts: int, max_new_tokens: int, truncation: str = "cost", threshold=None) -> dict:
    import torch
    from tqdm.auto import tqdm

    from generation.evaluation.prompts import chat_input_ids, load_eval_prompts
    from modeling_dspark import DSparkModel, load_target

    target, tokenizer = load_target("smollm2-135m-instruct")
    drafter = DSparkModel.from_pretrained(drafter_path, dtype=target.dtype).eval()
    config = copy.deepcopy(target.generation_config)
    config.dspark_truncation = truncation
    if threshold is not None:
        config.dspark_confidence_threshold = threshold
    sampled = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    methods = {
        ("plain", "greedy"): dict(do_sample=False),
        ("dspark", "greedy"): dict(do_sample=False, assistant_model=drafter, generation_config=config),
        ("plain", "sampled"): sampled,
        ("dspark", "sampled"): dict(sampled, assistant_model=drafter, generation_config=config),
    }
    common = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id)
    prompts = {d: [chat_input_ids(tokenizer, r["prompt"]) for r in load_eval_prompts(n, num_prompts)] for d, n in DOMAINS.items()}
    for kwargs in methods.values():  # first calls pay allocations (and a cost run profiles the machine once)
        target.generate(prompts["math"][0], **{**common, **kwargs, "max_new_tokens": 8})
    # per (domain, method): tokens, seconds, rounds, rounds that drafted
    sums = {(d, m): [0, 0.0, 0, 0] for d in DOMAINS for m in methods}
    jobs = [(d, i, ids) for d, rows in prompts.items() for i, ids in enumerate(rows)]
    for domain, i, ids in tqdm(jobs, desc="prompts (each: plain and DSpark, greedy and T = 1)"):
        for method, kwargs in methods.items():
            torch.manual_seed(i)
            start = time.perf_counter()
            out = target.generate(ids, **common, **kwargs)
            cell = sums[domain, method]
            cell[0] += out.shape[1] - ids.shape[1]
            cell[1] += time.perf_counter() - start
            if "assistant_model" in kwargs:
                cell[2] += drafter.last_stats.num_rounds
                cell[3] += sum(r.drafted > 0 for r in drafter.last_stats.rounds)
    result = {}
    for d in DOMAINS:
        result[d] = {}
        for mode in MODES:
            plain, spec = sums[d, ("plain", mode)], sums[d, ("dspark", mode)]
            result[d][mode] = spec[0] / spec[1] / (plain[0] / plain[1])
            result[d][f"tokens_per_round_{mode}"] = spec[0] / spec[2]
            result[d][f"drafted_share_{mode}"] = spec[3] / spec[2]
            result[d][f"plain_tok_s_{mode}"] = plain[0] / plain[1]
    return result


def summarise(folder: Path, arms: list[str], notes: str) -> str:
    runs = {arm: sorted(folder.glob(f"{arm}[0-9]*.json")) for arm in arms}
    if any(not paths for paths in runs.values()):
        raise SystemExit(f"no runs for arms {[a for a, p in runs.items() if not p]} in {folder}")
    lines = ["# Batch-1 DSpark over plain generate(), two arms in turns", "", notes, "",
             "Each cell: tokens/s of DSpark over plain `generate()` in the same process, then tokens per round.", ""]  # fmt: skip
    header = [f"{d} {mode}" for mode in MODES for d in DOMAINS]
    lines += ["| arm | run | " + " | ".join(header) + " |", "|---|---|" + "---|" * len(header)]
    for arm, paths in runs.items():
        loaded = [json.loads(p.read_text()) for p in paths]
        for path, run in zip(paths, loaded):
            cells = [f"{run[d][mode]:.3f} ({run[d][f'tokens_per_round_{mode}']:.2f})" for mode in MODES for d in DOMAINS]
            lines.append(f"| {arm} | {path.stem} | " + " | ".join(cells) + " |")
        medians = [f"**{statistics.median(r[d][mode] for r in loaded):.3f}**" for mode in MODES for d in DOMAINS]
        lines.append(f"| {arm} | median | " + " | ".join(medians) + " |")
    text = "\n".join(lines) + "\n"
    (folder / "ab.md").write_text(text)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="this run's JSON")
    parser.add_argument("--drafter", default="checkpoints/dspark-smollm2-135m-instruct-v14")
    parser.add_argument("--num-prompts", type=int, default=2, help="per domain")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--truncation", choices=("cost", "threshold", "fixed"), default="cost")
    parser.add_argument("--threshold", type=float, help="dspark_confidence_threshold (default: the drafter's config)")
    parser.add_argument("--summarise", type=Path, metavar="FOLDER", help="summarise the runs in FOLDER instead")
    parser.add_argument("--arms", nargs="+", default=["old", "new"], help="run-file name prefixes, one per code version")
    parser.add_argument("--notes", default="", help="what each arm ran (commits, commands, machine)")
    args = parser.parse_args(argv)
    if args.summarise:
        print(summarise(args.summarise, args.arms, args.notes))
        return 0
    if args.out is None:
        parser.error("--out is required to measure (or pass --summarise FOLDER)")
    result = measure(args.drafter, args.num_prompts, args.max_new_tokens, args.truncation, args.threshold)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for d, row in result.items():
        print(d, {k: round(v, 3) for k, v in row.items()}, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
