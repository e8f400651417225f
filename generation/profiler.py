"""The cost table: ``SPS(B)``, target forward steps per second at ``B`` tokens, measured on the real model.

``profile_sps(target)`` times one forward of ``B`` new tokens on top of a cache of ``context_length`` tokens
(the engine's verify forward) for a grid of ``B``, takes the median of ``repeats`` runs, and caches the table
on disk keyed by model, dtype, device and context length (``~/.cache/dspark/sps``, ``DSPARK_CACHE`` moves it),
so an engine start re-profiles only on a new machine or model. ``plot_cost_table`` draws it.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path

import torch

from .scheduler import CostTable

__all__ = ["DEFAULT_GRID", "cost_table_path", "plot_cost_table", "profile_sps"]

DEFAULT_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def _cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark")) / "sps"


def cost_table_path(target, context_length: int) -> Path:
    cfg = target.config.get_text_config()
    name = getattr(target, "name_or_path", "") or cfg.model_type
    weights = sum(p.numel() for p in target.parameters())
    device = str(target.device) if target.device.type != "cuda" else torch.cuda.get_device_name(target.device)
    key = f"{name}|{cfg.model_type}|{weights}|{target.dtype}|{device}|{torch.get_num_threads()}|ctx{context_length}"
    return _cache_dir() / f"{cfg.model_type}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"


@torch.no_grad()
def profile_sps(
    target, *, max_tokens: int = 256, context_length: int = 256, grid=DEFAULT_GRID, repeats: int = 5,
    use_cache: bool = True, progress: bool = True,
) -> CostTable:  # fmt: skip
    """Measure (or load) the cost table of ``target`` on its device and dtype."""
    from tqdm.auto import tqdm
    from transformers.cache_utils import DynamicCache

    path = cost_table_path(target, context_length)
    points = [b for b in grid if b <= max_tokens] or [1]
    if use_cache and path.is_file():
        stored = json.loads(path.read_text())
        if set(points) <= {int(b) for b in stored["steps_per_second"]}:
            return CostTable.from_dict({int(b): s for b, s in stored["steps_per_second"].items() if int(b) in points})
    device = target.device
    vocab = target.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(0)
    context = torch.randint(1, vocab, (1, context_length), generator=g).to(device)
    cache = DynamicCache()
    target(input_ids=context, cache=cache, use_cache=True)
    table = {}
    for b in tqdm(points, desc="profiling SPS(B)", disable=not progress):
        ids = torch.randint(1, vocab, (1, b), generator=g).to(device)
        positions = torch.arange(context_length, context_length + b, device=device)[None]
        times = []
        for i in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            target(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:  # the first call warms up this shape
                times.append(time.perf_counter() - start)
            cache.crop(-b)  # back to the context
        table[b] = 1.0 / statistics.median(times)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": getattr(target, "name_or_path", ""), "dtype": str(target.dtype), "device": str(device),
                                "context_length": context_length, "steps_per_second": table}, indent=2) + "\n")  # fmt: skip
    return CostTable.from_dict(table)


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


def main(argv: list[str] | None = None) -> int:
    """``dspark profile``: measure (or show the cached) cost table of an embedded target and plot it."""
    import argparse

    from modeling_dspark import load_target

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--context-length", type=int, default=256)
    parser.add_argument("--remeasure", action="store_true", help="ignore the cached table")
    parser.add_argument("--plot", default=None, help="PNG to draw the table into")
    args = parser.parse_args(argv)
    target, _ = load_target(args.target, dtype=torch.bfloat16)
    cost = profile_sps(target, max_tokens=args.max_tokens, context_length=args.context_length, use_cache=not args.remeasure)
    print(f"cost table ({cost_table_path(target, args.context_length)}):")
    for b, s in zip(cost.tokens, cost.steps_per_second):
        print(f"  B={b:>4}: {s:7.2f} steps/s  ({b * s:8.1f} tokens/s)")
    if args.plot:
        plot_cost_table(cost, args.plot, title=f"SPS(B), {args.target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
