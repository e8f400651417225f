"""Wall-clock speed at batch size 1: plain greedy and sampled ``generate()``, Transformers'
prompt-lookup decoding, and every drafter through ``generate(assistant_model=...)``, per domain, several runs.

    python -m generation.evaluation.speed --drafter dspark=checkpoints/dspark-smollm2-135m-instruct \
        --drafter dflash=checkpoints/dflash-smollm2-135m-instruct --drafter eagle3=checkpoints/eagle3-smollm2-135m-instruct

Each run visits every prompt once and, per prompt, every method in turn (so slow drifts of the machine hit
all methods alike). Reported: tokens/s per method, domain and run (median and min-max over runs), the ratio
to plain ``generate()`` in the same decoding mode and run, and for drafters the mean draft time and verify
time per round (verify = wall time minus draft time, over rounds; it includes the prefill).

Transformers' built-in DFlash path (``speculation_type="dflash"``) is not run: it takes only its own
``MuseGlimmerAssistantModel`` with a ``mask_token_id`` and reads block slot k as the prediction of ``x_{p+k}``
(dropping slot 0), whereas DeepSpec-convention DFlash / DSpark drafters predict ``x_{p+k+1}`` at slot k, so our
DFlash checkpoint would load only as a different, mis-aligned model.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from generation.evaluation.prompts import chat_input_ids, load_eval_prompts
from modeling_dspark.provenance import command_line

__all__ = ["DEFAULT_DOMAINS", "speed_benchmark", "write_speed_report"]

DEFAULT_DOMAINS = {"math": "gsm8k", "code": "humaneval", "chat": "mt-bench"}


def _methods(drafters: dict, prompt_lookup_num_tokens: int) -> dict[str, dict]:
    """method -> generate() keyword arguments; ``baseline`` names the plain method it is compared with."""
    sampled = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    methods = {
        "plain greedy": {"kwargs": {"do_sample": False}, "baseline": "plain greedy"},
        "plain sampled": {"kwargs": sampled, "baseline": "plain sampled"},
        "prompt lookup": {"kwargs": {"do_sample": False, "prompt_lookup_num_tokens": prompt_lookup_num_tokens}, "baseline": "plain greedy"},
    }
    for label, drafter in drafters.items():
        methods[f"{label} greedy"] = {"kwargs": {"do_sample": False, "assistant_model": drafter}, "baseline": "plain greedy", "drafter": label}
    if "dspark" in drafters:
        dspark = drafters["dspark"]
        methods["dspark sampled"] = {"kwargs": {**sampled, "assistant_model": dspark}, "baseline": "plain sampled", "drafter": "dspark"}
        if getattr(dspark, "confidence_head", None) is not None:  # hardware-aware truncation (profiles once, cached)
            methods["dspark greedy, cost"] = {"kwargs": {"do_sample": False, "assistant_model": dspark}, "config": {"dspark_truncation": "cost"},
                                              "baseline": "plain greedy", "drafter": "dspark"}  # fmt: skip
            methods["dspark sampled, cost"] = {"kwargs": {**sampled, "assistant_model": dspark}, "config": {"dspark_truncation": "cost"},
                                               "baseline": "plain sampled", "drafter": "dspark"}  # fmt: skip
        # hybrid: the prompt-lookup continuation or the DSpark block, chosen each round (generation.decoding.hybrid)
        lookup = {"assistant_model": dspark, "prompt_lookup_num_tokens": prompt_lookup_num_tokens}
        methods["hybrid greedy"] = {"kwargs": {"do_sample": False, **lookup}, "baseline": "plain greedy", "drafter": "dspark"}
        methods["hybrid sampled"] = {"kwargs": {**sampled, **lookup}, "baseline": "plain sampled", "drafter": "dspark"}
    return methods


@torch.no_grad()
def speed_benchmark(
    target, tokenizer, drafters: dict, *, domains: dict[str, str] = DEFAULT_DOMAINS, num_prompts: int = 4, runs: int = 3,
    max_new_tokens: int = 128, prompt_lookup_num_tokens: int = 10, eval_dir=None, progress: bool = True,
) -> dict:  # fmt: skip
    from tqdm.auto import tqdm

    methods = _methods(drafters, prompt_lookup_num_tokens)
    for spec in methods.values():  # DSpark settings travel as GenerationConfig attributes, on the model's defaults
        if "config" in spec:
            config = copy.deepcopy(target.generation_config)
            for name, value in spec.pop("config").items():
                setattr(config, name, value)  # (GenerationConfig.update() skips attributes it does not know)
            spec["kwargs"]["generation_config"] = config
    common = dict(max_new_tokens=max_new_tokens, pad_token_id=target.generation_config.pad_token_id)
    kwargs = {} if eval_dir is None else {"eval_dir": eval_dir}
    prompts = {d: [chat_input_ids(tokenizer, r["prompt"]) for r in load_eval_prompts(name, num_prompts, **kwargs)] for d, name in domains.items()}
    warm = next(iter(prompts.values()))[0]
    for spec in methods.values():  # first calls pay for allocations and lazy imports
        target.generate(warm, **{**common, **spec["kwargs"], "max_new_tokens": 8})
    # raw[method][domain][run] = [tokens, seconds, rounds, draft_seconds, n-gram rounds]
    raw = {m: {d: [[0, 0.0, 0, 0.0, 0] for _ in range(runs)] for d in domains} for m in methods}
    total = runs * sum(len(p) for p in prompts.values()) * len(methods)
    bar = tqdm(total=total, desc="timing generate()", disable=not progress)
    for run in range(runs):
        for d, ids_list in prompts.items():
            for i, ids in enumerate(ids_list):
                for m, spec in methods.items():
                    torch.manual_seed(1000 * run + i)
                    start = time.perf_counter()
                    out = target.generate(ids, **{**common, **spec["kwargs"]})
                    seconds = time.perf_counter() - start
                    cell = raw[m][d][run]
                    cell[0] += out.shape[1] - ids.shape[1]
                    cell[1] += seconds
                    if "drafter" in spec:
                        stats = drafters[spec["drafter"]].last_stats
                        cell[2] += stats.num_rounds
                        cell[3] += sum(r.draft_seconds for r in stats.rounds)
                        cell[4] += sum(r.proposal == "ngram" for r in stats.rounds)
                    bar.update()
    bar.close()
    table = {}
    for m, spec in methods.items():
        table[m] = {}
        for d in domains:
            speeds = [c[0] / c[1] for c in raw[m][d]]
            base = [b[0] / b[1] for b in raw[spec["baseline"]][d]]
            ratios = [s / b for s, b in zip(speeds, base)]
            row = {"tokens_per_s": statistics.median(speeds), "tokens_per_s_min_max": [min(speeds), max(speeds)],
                   "ratio": statistics.median(ratios), "ratio_min_max": [min(ratios), max(ratios)], "baseline": spec["baseline"]}  # fmt: skip
            if "drafter" in spec:
                rounds = sum(c[2] for c in raw[m][d])
                draft = sum(c[3] for c in raw[m][d])
                wall = sum(c[1] for c in raw[m][d])
                row.update(
                    rounds=rounds, tokens_per_round=sum(c[0] for c in raw[m][d]) / max(rounds, 1),
                    draft_ms_per_round=1000 * draft / max(rounds, 1), verify_ms_per_round=1000 * (wall - draft) / max(rounds, 1),
                    ngram_round_share=sum(c[4] for c in raw[m][d]) / max(rounds, 1),
                )  # fmt: skip
                # drafting against what plain decoding spends per token (one target step, prefill spread over them)
                row["draft_share_of_plain_token"] = row["draft_ms_per_round"] / (1000 / statistics.median(base))
            table[m][d] = row
    return {"domains": domains, "num_prompts": num_prompts, "runs": runs, "max_new_tokens": max_new_tokens, "methods": table, "raw": raw}


def write_speed_report(result: dict, out_dir: str | Path, command: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    domains, table = list(result["domains"]), result["methods"]
    lines = [
        f"# Speed at batch size 1\n\n`{command}`\n",
        f"{result['num_prompts']} prompts per domain ({', '.join(f'{d}: {b}' for d, b in result['domains'].items())}), "
        f"{result['max_new_tokens']} new tokens, {result['runs']} runs; median over runs (min-max). Ratio: against plain "
        f"`generate()` in the same decoding mode (greedy or sampled at T = 1), {result.get('dtype', 'bf16')}, same run.\n",
        "| method | " + " | ".join(f"{d} tok/s | {d} ratio" for d in domains) + " |",
        "|---" * (2 * len(domains) + 1) + "|",
    ]
    for m, per in table.items():
        cells = []
        for d in domains:
            r = per[d]
            cells.append(f"{r['tokens_per_s']:.1f} ({r['tokens_per_s_min_max'][0]:.1f}-{r['tokens_per_s_min_max'][1]:.1f})")
            cells.append(f"{r['ratio']:.2f}x ({r['ratio_min_max'][0]:.2f}-{r['ratio_min_max'][1]:.2f})")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines.append(
        "\n## Per round (drafters)\n\nn-gram share: rounds that verified the prompt-lookup continuation rather than the DSpark "
        "block (hybrid rows). Draft / plain token: draft ms per round over plain `generate()`'s ms per token in the same run "
        "(a plain decoding step, its prefill spread over the tokens).\n\n| method | domain | tokens / round | draft ms / round | "
        "draft / plain token | verify ms / round | n-gram share |\n|---|---|---|---|---|---|---|"
    )
    for m, per in table.items():
        for d in domains:
            r = per[d]
            if "rounds" in r:
                share = f"{r['ngram_round_share']:.0%}" if m.startswith("hybrid") else "-"
                lines.append(
                    f"| {m} | {d} | {r['tokens_per_round']:.2f} | {r['draft_ms_per_round']:.1f} | {r['draft_share_of_plain_token']:.0%} | "
                    f"{r['verify_ms_per_round']:.1f} | {share} |"
                )
    lines.append(
        "\nTransformers' built-in DFlash path (`speculation_type=\"dflash\"`) is not in the table: it runs only its own "
        "`MuseGlimmerAssistantModel` (with a `mask_token_id`) and reads block slot k as the prediction of x_{p+k}, dropping "
        "slot 0, while our DeepSpec-convention DFlash predicts x_{p+k+1} at slot k."
    )
    (out / "speed.md").write_text("\n".join(lines) + "\n")
    (out / "speed.json").write_text(json.dumps({"command": command, **result}, indent=2) + "\n")

    fig, ax = plt.subplots(figsize=(9, 4))
    names = [m for m in table if not m.startswith("plain")]
    width = 0.8 / len(domains)
    for i, d in enumerate(domains):
        ax.bar([j + i * width for j in range(len(names))], [table[m][d]["ratio"] for m in names], width, label=d)
    ax.axhline(1.0, color="k", linewidth=1)
    ax.set_xticks([j + width * (len(domains) - 1) / 2 for j in range(len(names))], names, rotation=30, ha="right")
    ax.set_ylabel("speed-up over plain generate()")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "speed.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from generation.evaluation.harness import load_drafter_specs
    from modeling_dspark.targets import add_target_arguments, dtype_label, target_from_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", action="append", default=[], metavar="LABEL=PATH")
    add_target_arguments(parser)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    target, tokenizer = target_from_args(args)
    drafters = load_drafter_specs(parser, args.drafter, dtype=target.dtype)
    result = speed_benchmark(target, tokenizer, drafters, num_prompts=args.num_prompts, runs=args.runs, max_new_tokens=args.max_new_tokens)
    result["dtype"] = dtype_label(target.dtype)
    command = command_line("generation.evaluation.speed", argv)
    write_speed_report(result, args.out, command)
    for m, per in result["methods"].items():
        print(f"{m:>16}: " + "  ".join(f"{d} {r['tokens_per_s']:.1f} tok/s ({r['ratio']:.2f}x)" for d, r in per.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
