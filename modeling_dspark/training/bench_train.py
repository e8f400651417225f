"""``dspark bench-train``: predicted block positions per second of training recipes, measured in one run.

Each recipe builds its drafter and a :class:`DSparkTrainer` over the same batches of regenerated responses, and
runs the trainer's own ``compute_loss`` + backward + clipped AdamW step, the work of one training step. After a
warm-up step each, the recipes take turns (A, B, A, B, ...) so that a machine whose speed drifts affects both
alike; the rate of a recipe is its total predicted positions (supervised block slots, the unit of the loss)
over its total step time. The last line is ``speed-up: X.XXx`` (default recipe over the first shipped one).

    python -m modeling_dspark.training.bench_train --steps 4 --out benchmarks/results/bench_train
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import time
from pathlib import Path

import torch

from modeling_dspark.provenance import command_line
from modeling_dspark.targets import cpu_flags

__all__ = ["RECIPES", "main"]

# "default" is what `python -m modeling_dspark.training.train` trains with by default, "default+cache" the same with
# `--target-cache` after the cache is built (every epoch after the first), "shipped-v1" the recipe of the first
# shipped SmolLM2 drafter.
RECIPES = {
    "default": dict(markov_rank=256, num_anchors=256, draft_vocab_size=8192, bf16="auto", target_cache=False),
    "default+cache": dict(markov_rank=256, num_anchors=256, draft_vocab_size=8192, bf16="auto", target_cache=True),
    "shipped-v1": dict(markov_rank=64, num_anchors=32, draft_vocab_size=0, bf16="off", target_cache=False),
}
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "training_data" / "smollm2_regen.jsonl.gz"


def cpu_description() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "unknown CPU").strip()
    native = [f for f in cpu_flags() if f in ("avx512_bf16", "amx_bf16", "amx_tile", "avx512f", "avx2")]
    return f"{name}, {torch.get_num_threads()} threads, flags: {' '.join(native) or 'none of avx2/avx512/amx'}"


def build_recipe(name: str, target, tokenizer, train_rows, dataset, args):
    from modeling_dspark import DSparkModel
    from modeling_dspark.training.train import response_draft_vocab, use_bf16_autocast
    from modeling_dspark.training.trainer import DSparkTrainer, DSparkTrainingArguments

    recipe = RECIPES[name]
    vocab = {}
    if recipe["draft_vocab_size"]:
        vocab = {"draft_vocab_ids": response_draft_vocab(train_rows, tokenizer, recipe["draft_vocab_size"])}
    torch.manual_seed(0)
    drafter = DSparkModel.from_target(
        target, dtype=torch.float32, block_size=args.block_size, num_draft_layers=args.num_draft_layers,
        markov_rank=recipe["markov_rank"], num_anchors=recipe["num_anchors"], **vocab,
    )  # fmt: skip
    training_args = DSparkTrainingArguments(
        output_dir=str(Path(args.scratch) / f"run-{name}"), report_to=[], use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=args.batch_size, num_anchors=recipe["num_anchors"],
        bf16=use_bf16_autocast(recipe["bf16"]),
    )  # fmt: skip
    trainer = DSparkTrainer(model=drafter, args=training_args, target=target, train_dataset=dataset)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4)
    drafter.train()
    return trainer, optimizer


def train_step(trainer, optimizer, batch) -> tuple[float, int]:
    """One step of the trainer's work: loss, backward, clipped AdamW step. Returns (seconds, predicted positions)."""
    model = trainer.model
    before = trainer.predicted_positions
    start = time.perf_counter()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start, trainer.predicted_positions - before


def main(argv: list[str] | None = None) -> int:
    from tqdm.auto import tqdm

    from modeling_dspark import load_target
    from modeling_dspark.targets import add_target_arguments
    from modeling_dspark.training.data import build_dataset, read_responses, split_holdout
    from modeling_dspark.training.trainer import DSparkCollator

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_arguments(parser, dtype=False)
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--recipes", nargs="+", default=["default", "default+cache", "shipped-v1"], choices=sorted(RECIPES))
    parser.add_argument("--steps", type=int, default=4, help="timed steps per recipe (after one warm-up step)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=7)
    parser.add_argument("--num-draft-layers", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=640)
    parser.add_argument("--target-dtype", default="auto")
    parser.add_argument("--out", default=None, help="folder for bench_train.json / bench_train.md")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        parser.error("--steps and --batch-size must be >= 1")
    if not Path(args.data).is_file():
        parser.error(f"--data {args.data} does not exist")
    args.out = args.out or "runs/bench_train"
    import tempfile

    scratch = tempfile.TemporaryDirectory(prefix="dspark-bench-train-")  # trainer folders and the target cache
    args.scratch = scratch.name

    target, tokenizer = load_target(args.target, dtype=args.target_dtype)
    rows = read_responses(args.data)
    train_rows, _ = split_holdout(rows)
    dataset = build_dataset(train_rows, max_length=args.max_length)
    collate = DSparkCollator(getattr(target.generation_config, "pad_token_id", None) or 0)
    rng = random.Random(0)
    picks = [rng.sample(range(len(dataset)), args.batch_size) for _ in range(args.steps + 1)]
    batches = [collate([dataset[i] for i in pick]) for pick in picks]  # the same batches for every recipe
    cache_build_s = None
    if any(RECIPES[name]["target_cache"] for name in args.recipes):
        from modeling_dspark.checkpoint.model import target_geometry
        from modeling_dspark.training.target_cache import TargetFeatureCache

        used = sorted({i for pick in picks for i in pick})
        layer_ids = target_geometry(target)["target_layer_ids"]  # what DSparkModel.from_target reads
        start = time.perf_counter()
        cache = TargetFeatureCache.build(Path(args.scratch) / "target_cache", target, layer_ids, [dataset[i]["input_ids"] for i in used])
        cache_build_s = (time.perf_counter() - start) / len(used)
        where = {i: n for n, i in enumerate(used)}
        cached_collate = DSparkCollator(collate.pad_token_id, target_cache=cache)
        cached_batches = [cached_collate([{**dataset[i], "cache_index": where[i]} for i in pick]) for pick in picks]

    recipes = {name: build_recipe(name, target, tokenizer, train_rows, dataset, args) for name in args.recipes}
    seconds = {name: [] for name in recipes}
    positions = {name: [] for name in recipes}
    total = len(recipes) * (args.steps + 1)
    with tqdm(total=total, desc="training steps", unit="step") as bar:
        for step, batch in enumerate(batches):
            for name, (trainer, optimizer) in recipes.items():  # interleaved: drift hits every recipe alike
                s, n = train_step(trainer, optimizer, cached_batches[step] if RECIPES[name]["target_cache"] else batch)
                if step > 0:  # step 0 warms up (allocations, autotuning, caches)
                    seconds[name].append(s), positions[name].append(n)
                bar.update(1)
    results = {}
    for name in recipes:
        rate = sum(positions[name]) / sum(seconds[name])
        results[name] = {
            **RECIPES[name],
            "bf16_autocast": bool(recipes[name][0].args.bf16),
            "median_step_s": round(statistics.median(seconds[name]), 3),
            "predicted_positions_per_step": round(statistics.mean(positions[name]), 1),
            "predicted_positions_per_s": round(rate, 1),
        }
    base = results.get("shipped-v1", {}).get("predicted_positions_per_s")
    speedup = results["default"]["predicted_positions_per_s"] / base if base and "default" in results else None
    cached_speedup = results["default+cache"]["predicted_positions_per_s"] / base if base and "default+cache" in results else None
    report = {
        "cpu": cpu_description(),
        "torch": torch.__version__,
        "target_dtype": str(target.dtype).removeprefix("torch."),
        "batch_size": args.batch_size,
        "block_size": args.block_size,
        "num_draft_layers": args.num_draft_layers,
        "timed_steps_per_recipe": args.steps,
        "data": str(args.data),
        "command": command_line("modeling_dspark.training.bench_train", argv),
        "recipes": results,
        "target_cache_build_s_per_sequence": round(cache_build_s, 3) if cache_build_s else None,
        "speedup": round(speedup, 2) if speedup else None,
        "speedup_with_target_cache": round(cached_speedup, 2) if cached_speedup else None,
    }
    lines = [
        f"CPU: {report['cpu']}; torch {report['torch']}; target in {report['target_dtype']}; batch {args.batch_size} "
        f"sequences, block {args.block_size}, {args.num_draft_layers} draft layers; {args.steps} timed steps per recipe",
        "",
        "| recipe | Markov rank | anchors / seq | draft vocab | bf16 autocast | target | s / step | positions / step | positions / s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['markov_rank']} | {r['num_anchors']} | {r['draft_vocab_size'] or 'full'} | {r['bf16_autocast']} | "
            f"{'cached' if r['target_cache'] else 'forward'} | {r['median_step_s']:.2f} | {r['predicted_positions_per_step']:.0f} | "
            f"{r['predicted_positions_per_s']:.0f} |"
        )
    if cache_build_s:
        lines.append(f"\nBuilding the target cache cost {cache_build_s:.2f} s per sequence, once (the first epoch's forwards).")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_train.json").write_text(json.dumps(report, indent=2) + "\n")
    footer = []
    if speedup is not None:
        extra = f" (default+cache, every epoch after the first: {cached_speedup:.2f}x)" if cached_speedup else ""
        footer = ["", f"speed-up: {speedup:.2f}x{extra}"]
    (out / "bench_train.md").write_text("\n".join(lines + ["", f"    {report['command']}"] + footer + [""]))
    print("\n".join(lines + footer))
    scratch.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
