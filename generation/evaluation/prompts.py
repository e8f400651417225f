"""Measure a drafter through ``target.generate(assistant_model=drafter)``: tau at temperature 1 (the paper's
protocol: chain drafting, fixed block, first turn only) and the wall-clock speed-up over plain greedy
``generate()`` at batch size 1, on seeded subsamples of the eval benchmarks.

    python -m generation.evaluation.prompts --drafter checkpoints/dspark-smollm2-135m-instruct --num-prompts 20
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from modeling_dspark.provenance import command_line

__all__ = ["chat_input_ids", "load_eval_prompts", "measure_speed", "measure_tau", "verified_rounds"]

EVAL_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "eval"
PAPER_SEED = 980406  # DeepSpec's eval.py: random.Random(seed).shuffle(rows), then the first n


def load_eval_prompts(name: str, num_prompts: int, *, eval_dir: str | Path = EVAL_DIR, seed: int = PAPER_SEED) -> list[dict]:
    rows = [json.loads(line) for line in (Path(eval_dir) / f"{name}.jsonl").open(encoding="utf-8")]
    random.Random(seed).shuffle(rows)
    return rows[:num_prompts]


def chat_input_ids(tokenizer, prompt: str) -> torch.Tensor:
    """[1, L] prompt ids with the target's chat template (first turn only, as in the paper)."""
    from modeling_dspark.training.data import chat_prompt_ids

    return torch.tensor([chat_prompt_ids(tokenizer, prompt)])


@torch.no_grad()
def verified_rounds(
    target, drafter, prompt_ids: list[list[int]], *, max_new_tokens: int, seed: int = 0, temperature: float = 1.0,
    progress: bool = False,
):  # fmt: skip
    """Every round of drafting and verifying on ``prompt_ids`` with the paper's protocol (temperature 1, no
    top-k/top-p, full blocks); prompt i runs under seed ``seed + i``. ``temperature=0`` verifies greedily (the
    target's argmax, the acceptance rule of greedy decoding). Shared by tau measurement and calibration."""
    from tqdm.auto import tqdm
    from transformers import GenerationConfig

    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    sampling = dict(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, **sampling,
        pad_token_id=target.generation_config.pad_token_id, eos_token_id=target.generation_config.eos_token_id,
        dspark_truncation="fixed",
    )  # fmt: skip
    for i, ids in enumerate(tqdm(prompt_ids, desc="drafting + verifying", disable=not progress)):
        torch.manual_seed(seed + i)
        target.generate(torch.tensor([ids]), generation_config=config, assistant_model=drafter)
        yield from drafter.last_stats.rounds


def measure_tau(target, drafter, tokenizer, prompts: list[dict], *, max_new_tokens: int = 128, seed: int = 0) -> dict:
    """Pooled tau (``acceptance_length`` over all rounds) and per-position prefix acceptance."""
    from modeling_dspark.metrics import round_acceptance

    prompt_ids = [chat_input_ids(tokenizer, row["prompt"])[0].tolist() for row in prompts]
    rounds = list(verified_rounds(target, drafter, prompt_ids, max_new_tokens=max_new_tokens, seed=seed))
    stats = round_acceptance([r.accepted for r in rounds], [r.verified for r in rounds], drafter.config.block_size)
    return {key: stats[key] for key in ("tau", "rounds", "prefix_acceptance")}


@torch.no_grad()
def measure_speed(target, drafter, tokenizer, prompts: list[dict], *, max_new_tokens: int = 128) -> dict:
    """Greedy tokens/s of plain ``generate()`` and of DSpark, same prompts, same dtype, batch size 1."""
    plain_tokens = plain_time = ds_tokens = ds_time = 0.0
    ratios = []
    common = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    warm = chat_input_ids(tokenizer, "Hello!")
    target.generate(warm, **{**common, "max_new_tokens": 8})
    target.generate(warm, assistant_model=drafter, **{**common, "max_new_tokens": 8})
    for row in prompts:
        ids = chat_input_ids(tokenizer, row["prompt"])
        start = time.perf_counter()
        plain = target.generate(ids, **common)
        t_plain = time.perf_counter() - start
        start = time.perf_counter()
        ds = target.generate(ids, assistant_model=drafter, **common)
        t_ds = time.perf_counter() - start
        n_plain, n_ds = plain.shape[1] - ids.shape[1], ds.shape[1] - ids.shape[1]
        plain_tokens, plain_time, ds_tokens, ds_time = plain_tokens + n_plain, plain_time + t_plain, ds_tokens + n_ds, ds_time + t_ds
        ratios.append((n_ds / t_ds) / (n_plain / t_plain))
    return {
        "plain_tokens_per_s": plain_tokens / plain_time,
        "dspark_tokens_per_s": ds_tokens / ds_time,
        "speedup": (ds_tokens / ds_time) / (plain_tokens / plain_time),
        "speedup_median_per_prompt": statistics.median(ratios),
        "speedup_min_max_per_prompt": [min(ratios), max(ratios)],
    }


def main(argv: list[str] | None = None) -> int:
    from modeling_dspark import DSparkModel
    from modeling_dspark.targets import add_target_arguments, target_from_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True)
    add_target_arguments(parser)
    parser.add_argument("--benchmarks", nargs="+", default=["gsm8k", "humaneval", "mt-bench"])
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    target, tokenizer = target_from_args(args)
    drafter = DSparkModel.from_pretrained(args.drafter, dtype=target.dtype).eval()
    results = {"command": command_line("generation.evaluation.prompts", argv), "benchmarks": {}}
    for name in args.benchmarks:
        prompts = load_eval_prompts(name, args.num_prompts)
        tau = measure_tau(target, drafter, tokenizer, prompts, max_new_tokens=args.max_new_tokens)
        speed = measure_speed(target, drafter, tokenizer, prompts, max_new_tokens=args.max_new_tokens)
        results["benchmarks"][name] = {"prompts": len(prompts), **tau, **speed}
        print(f"{name:>10}: tau {tau['tau']:.2f} (T=1, block {drafter.config.block_size}, fixed) | greedy "
              f"{speed['plain_tokens_per_s']:.1f} -> {speed['dspark_tokens_per_s']:.1f} tok/s = {speed['speedup']:.2f}x", flush=True)  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
