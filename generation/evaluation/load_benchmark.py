"""Throughput under load (the paper's Figure 8 analogue): generated tokens/s and the mean verification budget
per request at concurrency R, for no speculation, fixed lengths, a static threshold, Algorithm 1 and the
asynchronous variant, all through :class:`generation.DSparkEngine`.

    python -m generation.evaluation.load_benchmark --drafter checkpoints/dspark-smollm2-135m-instruct

R requests start together (eval prompts from GSM8K, HumanEval and MT-Bench in turn, seeded), each samples
``--max-new-tokens`` tokens at temperature 1 (seed fixed per run); wall time includes prefill. The prefill forward
is the same for every method and, at R = 32 on a 2-core CPU, most of a batch's time, so a second table times the
decode steps alone (``DSparkEngine.prefill_seconds`` subtracted, each request's first token left out): the
schedulers' differences, without the prefill's noise. The single-request reference is plain ``target.generate()``
on the same prompts and settings.

Algorithm 1 and the asynchronous variant run twice: with the paper's cost model (``SPS(B)`` of B flattened tokens,
``generation.profile_sps``; full blocks drafted every step, drafting time left out) and with the engine's own
(``profile_verify_cost``: the right-padded verify forward; ``profile_draft_cost``: the drafter for R rows and D
slots; the depth planned before drafting, 0 = skip the drafter). All tables are profiled once, cached, plotted.
"algorithm 1, survival as calibrated" is Algorithm 1 with the engine's costs but without the planner's scaling of
the survival by the drafts accepted against it (``correct_survival=False``). ``--methods`` runs a subset.

Every method first serves a warm-up batch of R other prompts (``--warmup-tokens`` each): shapes, allocations.
A cost-aware scheduler's measured engine continues from the depth planner of the engine before it (its survival
estimates and measured cost corrections), as a serving engine under steady load does; the "cold" rows start from
nothing, so their gap to the warm rows is what exploration costs in one batch. Each (method, R) is measured
``--repeats`` times. Within a measured batch the methods' engines take one step each in turn, and a method's time
is the sum of its own steps: the machine's drift (10-25 % between two batches minutes apart, and up to 2x within
minutes on a shared 2-core CPU) then hits every method alike, where batches run one after another measured the
drift more than the methods. The engines draw from one seeded random stream in turn, so each method's samples
differ from a run of that method alone, with the same distribution. The table gives the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from generation.decoding.stats import acceptance_length
from generation.evaluation.prompts import chat_input_ids, load_eval_prompts
from modeling_dspark.provenance import command_line

__all__ = ["METHODS", "engine_costs", "run_load", "write_load_report"]

# label -> DSparkEngine keyword arguments; "costs": which cost model a cost-aware scheduler gets
METHODS = {
    "no speculation": {"scheduler": "none"},
    "fixed 1": {"scheduler": "fixed", "num_verify": 1},
    "fixed 3": {"scheduler": "fixed", "num_verify": 3},
    "fixed 7": {"scheduler": "fixed", "num_verify": 7},
    "threshold 0.3": {"scheduler": "threshold", "threshold": 0.3},
    "algorithm 1, paper cost": {"scheduler": "algorithm1", "costs": "paper"},
    "asynchronous, paper cost": {"scheduler": "async", "costs": "paper"},
    "algorithm 1": {"scheduler": "algorithm1", "costs": "engine"},
    "algorithm 1, survival as calibrated": {"scheduler": "algorithm1", "costs": "engine", "correct_survival": False},
    "asynchronous": {"scheduler": "async", "costs": "engine"},
    "algorithm 1, cold": {"scheduler": "algorithm1", "costs": "engine", "warm": False},
    "asynchronous, cold": {"scheduler": "async", "costs": "engine", "warm": False},
}


def engine_costs(target, drafter, concurrency) -> tuple:
    """The engine's profiled cost tables (padded verify forward, drafter) for the default rows and every R run."""
    from generation.scheduling.profiler import DEFAULT_ROWS, profile_draft_cost, profile_verify_cost

    rows = tuple(sorted({*DEFAULT_ROWS, *concurrency}))
    verify_cost = profile_verify_cost(target, rows=rows, max_width=drafter.config.block_size + 1)
    return verify_cost, profile_draft_cost(target, drafter, rows=rows)


def _prompts(tokenizer, n: int, eval_dir=None) -> list[list[int]]:
    kwargs = {} if eval_dir is None else {"eval_dir": eval_dir}
    pools = [load_eval_prompts(name, n, **kwargs) for name in ("gsm8k", "humaneval", "mt-bench")]
    rows = [pools[i % 3][(i // 3) % len(pools[i % 3])] for i in range(n)]  # cycles when a benchmark runs short
    return [chat_input_ids(tokenizer, row["prompt"])[0].tolist() for row in rows]


def _step_in_turn(engines: dict) -> dict:
    """Runs the engines' queued requests to completion, one step of each engine in turn; returns each engine's
    seconds, the sum of its own steps (prefill included). A shared machine's speed drifts by 10-25 % within
    minutes, more than the differences measured here; stepped in turn, every method runs under the same drift."""
    seconds = dict.fromkeys(engines, 0.0)
    while any(engine.has_work() for engine in engines.values()):
        for label, engine in engines.items():
            if engine.has_work():
                start = time.perf_counter()
                engine.step()
                seconds[label] += time.perf_counter() - start
    return seconds


@torch.no_grad()
def run_load(
    target, drafter, tokenizer, *, concurrency=(1, 2, 4, 8, 16, 32), methods=None, max_new_tokens: int = 64,
    cost_table=None, verify_cost=None, draft_cost=None, eval_dir=None, seed: int = 0, progress: bool = True,
    warmup_tokens: int = 32, repeats: int = 1,
) -> dict:  # fmt: skip
    """``cost_table``: the paper's SPS(B) table; ``verify_cost`` / ``draft_cost``: the engine's (profiled when
    None and a method needs them). ``warmup_tokens``: new tokens per request of the warm-up batch before each
    measured one (its prompts are not measured). ``repeats``: measured batches per method and R, interleaved
    across methods; the table gives the median tokens/s, the other columns pool the batches."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    from tqdm.auto import tqdm

    from generation.serving.engine import DSparkEngine

    methods = methods or METHODS
    pool = _prompts(tokenizer, 2 * max(concurrency), eval_dir)
    prompts, warmup_prompts = pool[: max(concurrency)], pool[max(concurrency) :]
    results = {"max_new_tokens": max_new_tokens, "warmup_tokens": warmup_tokens, "repeats": repeats,
               "concurrency": list(concurrency), "methods": {}}  # fmt: skip
    # single-request reference: plain generate() on the first prompts
    plain_tokens = plain_time = 0.0
    for i, ids in enumerate(prompts[: min(4, len(prompts))]):
        torch.manual_seed(seed + i)
        start = time.perf_counter()
        out = target.generate(torch.tensor([ids]), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              max_new_tokens=max_new_tokens, pad_token_id=target.generation_config.pad_token_id)  # fmt: skip
        plain_time += time.perf_counter() - start
        plain_tokens += out.shape[1] - len(ids)
    results["plain_generate_tokens_per_s"] = plain_tokens / plain_time
    engine_kwargs = {}
    for label, spec in methods.items():
        kwargs = {k: v for k, v in spec.items() if k not in ("costs", "warm")}
        if spec.get("costs") == "paper":
            kwargs.update(cost_table=cost_table, draft_cost=False)
        elif spec.get("costs") == "engine":
            if verify_cost is None or draft_cost is None:
                verify_cost, draft_cost = engine_costs(target, drafter, concurrency)
            kwargs.update(cost_table=verify_cost, draft_cost=draft_cost)
        engine_kwargs[label] = kwargs
    runs = {label: {r: [] for r in concurrency} for label in methods}
    carried = {label for label, spec in methods.items() if spec.get("warm", True)}  # continue from the last planner
    bar = tqdm(total=len(methods) * len(concurrency) * repeats, desc="load benchmark", disable=not progress)
    for r in concurrency:
        planners = {}  # label -> the planner the next measured engine continues from
        for rep in range(repeats):
            engines, ids = {}, {}
            for label in list(methods) if rep % 2 == 0 else list(methods)[::-1]:
                kwargs = engine_kwargs[label]
                if rep == 0:  # a warm-up batch of other prompts: shapes, allocations, and the planner's first looks
                    warm = DSparkEngine(target, drafter, **kwargs)
                    torch.manual_seed(seed + 1)
                    warm.generate(warmup_prompts[:r], max_new_tokens=max(warmup_tokens, 1), temperature=1.0)
                    planners[label] = warm.depth_planner
                engines[label] = DSparkEngine(target, drafter, **kwargs, depth_planner=planners[label] if label in carried else None)
                ids[label] = [engines[label].add_request(p, max_new_tokens=max_new_tokens, temperature=1.0) for p in prompts[:r]]
            torch.manual_seed(seed + rep)
            seconds = _step_in_turn(engines)
            for label, engine in engines.items():
                if label in carried:
                    planners[label] = engine.depth_planner
                outs = [engine.finished[i].output_ids for i in ids[label]]
                rounds = [x for req in engine.finished.values() for x in req.stats.rounds]
                runs[label][r].append((sum(len(o) for o in outs), seconds[label], engine.step_log, rounds,
                                       seconds[label] - engine.prefill_seconds, len(outs)))  # fmt: skip
                bar.update()
    for label in methods:
        rows = {}
        for r in concurrency:
            speeds = [n / wall for n, wall, *_ in runs[label][r]]
            # the decode rounds alone: every token but each request's first, which its prefill forward samples
            decode = [(n - requests) / seconds for n, _, _, _, seconds, requests in runs[label][r]]
            steps = [x for _, _, step_log, *_ in runs[label][r] for x in step_log]
            rounds = [x for _, _, _, batch_rounds, *_ in runs[label][r] for x in batch_rounds]
            rows[r] = {
                "tokens_per_s": statistics.median(speeds),
                "tokens_per_s_runs": speeds,
                "decode_tokens_per_s": statistics.median(decode),
                "decode_tokens_per_s_runs": decode,
                "wall_s": sum(wall for _, wall, *_ in runs[label][r]),
                "steps": len(steps),
                "mean_draft_depth": sum(x["drafted"] for x in steps) / max(len(steps), 1),
                "mean_budget_per_request": sum(x.verified for x in rounds) / max(len(rounds), 1),
                "tau": acceptance_length(x.accepted for x in rounds),  # nan for plain decoding (no rounds)
            }
        results["methods"][label] = rows
    bar.close()
    return results


def write_load_report(results: dict, out_dir, cost_table=None, command: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from generation.evaluation.cost_plots import plot_cost_table, plot_engine_costs

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    conc = results["concurrency"]
    methods = results["methods"]
    lines = [
        f"# Throughput under load (DSparkEngine)\n\n`{command}`\n",
        f"Temperature 1, {results['max_new_tokens']} new tokens per request, R requests started together after a warm-up "
        f"batch of R other prompts ({results.get('warmup_tokens', 0)} tokens each; cost-aware rows continue from its depth "
        f"planner, \"cold\" rows start fresh); median of {results.get('repeats', 1)} batches, the methods' engines "
        f"stepped in turn (a method's time: the sum of its own steps); "
        f"single-request plain `generate()`: "
        f"{results['plain_generate_tokens_per_s']:.1f} tok/s.\n",
        "## Generated tokens / s\n",
        "| method | " + " | ".join(f"R={r}" for r in conc) + " |",
        "|---" * (len(conc) + 1) + "|",
    ]
    for label, rows in methods.items():
        lines.append(f"| {label} | " + " | ".join(f"{rows[r]['tokens_per_s']:.1f}" for r in conc) + " |")
    base = methods.get("no speculation")
    lines += ["\n## Decode tokens / s, the prefill forwards left out" + (" (over no speculation)" if base else "") + "\n",
              "The prefill is the same forward for every method, and at R = 32 it is most of a batch's time on a 2-core "
              "CPU, so its noise swamps the schedulers' differences in the table above; this one times the decode "
              "steps alone (each request's first token, sampled by its prefill, left out).\n",
              "| method | " + " | ".join(f"R={r}" for r in conc) + " |", "|---" * (len(conc) + 1) + "|"]  # fmt: skip
    for label, rows in methods.items():
        cells = [f"{rows[r]['decode_tokens_per_s']:.1f}" + (f" ({rows[r]['decode_tokens_per_s'] / base[r]['decode_tokens_per_s']:.3f})" if base else "")
                 for r in conc]  # fmt: skip
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["\n## Mean slots drafted per step (0 = drafter skipped)\n",
              "| method | " + " | ".join(f"R={r}" for r in conc) + " |", "|---" * (len(conc) + 1) + "|"]  # fmt: skip
    for label, rows in methods.items():
        lines.append(f"| {label} | " + " | ".join(f"{rows[r].get('mean_draft_depth', 0):.2f}" for r in conc) + " |")
    lines += ["\n## Mean verification budget per request per step (drafts verified) / tau\n",
              "| method | " + " | ".join(f"R={r}" for r in conc) + " |", "|---" * (len(conc) + 1) + "|"]  # fmt: skip
    for label, rows in methods.items():
        lines.append(f"| {label} | " + " | ".join(f"{rows[r]['mean_budget_per_request']:.2f} / {rows[r]['tau']:.2f}" for r in conc) + " |")
    (out / "load.md").write_text("\n".join(lines) + "\n")
    (out / "load.json").write_text(json.dumps({"command": command, **results}, indent=2) + "\n")

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, rows in methods.items():
        style = "--" if "paper cost" in label else ":" if "cold" in label else "-"
        ax1.plot(conc, [rows[r]["tokens_per_s"] for r in conc], style, marker="o", label=label)
        ax2.plot(conc, [rows[r]["mean_budget_per_request"] for r in conc], style, marker="o", label=label)
    ax1.axhline(results["plain_generate_tokens_per_s"], color="k", linestyle="--", linewidth=1, label="plain generate(), 1 request")
    ax1.set(xscale="log", xlabel="concurrent requests R", ylabel="generated tokens / s", title="throughput")
    ax2.set(xscale="log", xlabel="concurrent requests R", ylabel="drafts verified per request per step", title="verification budget")
    for ax in (ax1, ax2):
        ax.set_xticks(conc, [str(r) for r in conc])
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "load.png", dpi=120)
    plt.close(fig)
    dtype = results.get("dtype", "bf16")
    if cost_table is not None:
        plot_cost_table(cost_table, out / "sps.png", title=f"SPS(B), SmolLM2-135M {dtype}, this CPU")
    if "verify_cost_seconds" in results and "draft_cost_seconds" in results:
        from generation.scheduling.scheduler import DraftCost, PaddedCostTable

        verify = PaddedCostTable.from_dict(results["verify_cost_seconds"])
        plot_engine_costs(verify, DraftCost.from_dict(results["draft_cost_seconds"]), out / "engine_costs.png",
                          title=f"verify forward, SmolLM2-135M {dtype}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from generation.scheduling.profiler import profile_sps
    from modeling_dspark import DSparkModel
    from modeling_dspark.targets import add_target_arguments, dtype_label, target_from_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True)
    add_target_arguments(parser)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--warmup-tokens", type=int, default=32, help="new tokens per request of each warm-up batch")
    parser.add_argument("--repeats", type=int, default=2, help="measured batches per method and R (median reported)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS), metavar="METHOD",
                        help=f"rows to run, in this order (default: all of {', '.join(map(repr, METHODS))})")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    methods = {label: METHODS[label] for label in dict.fromkeys(args.methods)}
    target, tokenizer = target_from_args(args)
    drafter = DSparkModel.from_pretrained(args.drafter, dtype=target.dtype).eval()
    # the paper's SPS(B) table only where a "paper cost" row reads it
    paper = any(spec.get("costs") == "paper" for spec in methods.values())
    cost = profile_sps(target, max_tokens=8 * max(args.concurrency)) if paper else None
    verify_cost, draft_cost = engine_costs(target, drafter, args.concurrency)
    results = run_load(target, drafter, tokenizer, concurrency=args.concurrency, methods=methods,
                       max_new_tokens=args.max_new_tokens, cost_table=cost, verify_cost=verify_cost,
                       draft_cost=draft_cost, warmup_tokens=args.warmup_tokens, repeats=args.repeats)  # fmt: skip
    results["dtype"] = dtype_label(target.dtype)
    if cost is not None:
        results["cost_table"] = dict(zip(cost.tokens, cost.steps_per_second))
    results["verify_cost_seconds"] = verify_cost.to_dict()
    results["draft_cost_seconds"] = draft_cost.to_dict()
    results["draft_context_seconds"] = dict(zip(draft_cost.rows, draft_cost.context_seconds))  # per further context token
    command = command_line("generation.evaluation.load_benchmark", argv)
    write_load_report(results, args.out, cost, command)
    for label, rows in results["methods"].items():
        print(f"{label:>15}: " + "  ".join(f"R={r} {v['tokens_per_s']:.1f}" for r, v in rows.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
