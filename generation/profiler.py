"""Cost tables measured on the real models, cached on disk keyed by model, dtype, device, threads and context
length (``~/.cache/dspark/sps``, ``DSPARK_CACHE`` moves it), so an engine start re-profiles only on a new machine
or model. Every point is the median of ``repeats`` timed runs after one warm-up.

- ``profile_sps(target)``: the paper's ``SPS(B)``, one forward of ``B`` new tokens on top of a cache of
  ``context_length`` tokens, for a grid of ``B`` (:class:`CostTable`); ``plot_cost_table`` draws it.
- ``profile_verify_cost(target)``: the engine's verify forward, ``R`` rows with their own caches of
  ``context_length`` tokens, right-padded to a width of 1..``max_width`` tokens (:class:`PaddedCostTable`).
- ``profile_draft_cost(target, drafter)``: the engine's drafter call for ``R`` rows drafting 1..block_size slots
  (:class:`DraftCost`).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path

import torch

from .scheduler import CostTable, DraftCost, PaddedCostTable

__all__ = [
    "DEFAULT_GRID",
    "DEFAULT_ROWS",
    "cost_table_path",
    "plot_cost_table",
    "plot_engine_costs",
    "profile_draft_cost",
    "profile_sps",
    "profile_verify_cost",
]

DEFAULT_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
DEFAULT_ROWS = (1, 2, 4, 8, 16, 32)  # concurrent requests; beyond the last, costs are extrapolated linearly


def _cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark")) / "sps"


def _model_key(model) -> str:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    name = getattr(model, "name_or_path", "") or cfg.model_type
    weights = sum(p.numel() for p in model.parameters())
    return f"{name}|{cfg.model_type}|{weights}|{model.dtype}"


def cost_table_path(target, context_length: int, kind: str = "sps", drafter=None) -> Path:
    cfg = target.config.get_text_config()
    device = str(target.device) if target.device.type != "cuda" else torch.cuda.get_device_name(target.device)
    key = f"{_model_key(target)}|{device}|{torch.get_num_threads()}|ctx{context_length}"
    if drafter is not None:
        key += "|" + _model_key(drafter)
    prefix = cfg.model_type if kind == "sps" else f"{cfg.model_type}-{kind}"
    return _cache_dir() / f"{prefix}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"


def _median_seconds(fn, repeats: int, device, after=None) -> float:
    times = []
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first call warms up this shape
            times.append(time.perf_counter() - start)
        if after is not None:
            after()
    return statistics.median(times)


def _monotone(grid: list[list[float]]) -> list[list[float]]:
    """Running maximum along both axes (more rows, more tokens, more slots are never cheaper): timing noise
    would otherwise make a wider forward look free and the schedulers admit on noise."""
    out = [list(line) for line in grid]
    for i, line in enumerate(out):
        for j in range(len(line)):
            line[j] = max(line[j], line[j - 1] if j else 0.0, out[i - 1][j] if i else 0.0)
    return out


def _load_cached(path: Path, use_cache: bool):
    return json.loads(path.read_text()) if use_cache and path.is_file() else None


def _store(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


@torch.no_grad()
def profile_verify_cost(
    target, *, rows=DEFAULT_ROWS, max_width: int = 8, context_length: int = 256, repeats: int = 5,
    use_cache: bool = True, progress: bool = True,
) -> PaddedCostTable:  # fmt: skip
    """Seconds of the engine's verify forward: ``R`` rows (their own caches of ``context_length`` tokens) x width
    ``W`` new tokens, with a 2-D attention mask and the hidden states returned, as ``DSparkEngine.step`` runs it."""
    from tqdm.auto import tqdm
    from transformers.cache_utils import DynamicCache

    path = cost_table_path(target, context_length, kind="verify")
    widths = list(range(1, max_width + 1))
    stored = _load_cached(path, use_cache)
    if stored is not None:
        table = PaddedCostTable.from_dict(stored["seconds"])
        if set(rows) <= set(table.rows) and set(widths) <= set(table.widths):
            cached = table.to_dict()
            return PaddedCostTable.from_dict({r: {w: cached[r][w] for w in widths} for r in rows})
    device = target.device
    vocab = target.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(0)
    table = {}
    bar = tqdm(total=len(rows) * len(widths), desc="profiling the verify forward", disable=not progress)
    for r in rows:
        cache = DynamicCache()
        target(input_ids=torch.randint(1, vocab, (r, context_length), generator=g).to(device), cache=cache, use_cache=True)
        table[r] = {}
        for w in widths:
            ids = torch.randint(1, vocab, (r, w), generator=g).to(device)
            positions = torch.arange(context_length, context_length + w, device=device)[None].expand(r, -1)
            mask = torch.ones(r, context_length + w, dtype=torch.long, device=device)

            def forward():
                target(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True, output_hidden_states=True)

            table[r][w] = _median_seconds(forward, repeats, device, after=lambda: cache.crop(-w))
            bar.update()
    bar.close()
    smooth = _monotone([[table[r][w] for w in widths] for r in rows])
    table = {r: dict(zip(widths, line)) for r, line in zip(rows, smooth)}
    _store(path, {"model": getattr(target, "name_or_path", ""), "dtype": str(target.dtype), "device": str(device),
                  "context_length": context_length, "seconds": table})  # fmt: skip
    return PaddedCostTable.from_dict(table)


@torch.no_grad()
def profile_draft_cost(
    target, drafter, *, rows=DEFAULT_ROWS, context_length: int = 256, repeats: int = 5, use_cache: bool = True,
    progress: bool = True,
) -> DraftCost:  # fmt: skip
    """Seconds of ``DSparkEngine``'s drafter call (backbone over 2 new context tokens per row and the block,
    LM head and sampling over D slots) for ``R`` rows with ``context_length`` tokens already in the draft cache."""
    from tqdm.auto import tqdm

    from .engine import DSparkEngine

    path = cost_table_path(target, context_length, kind="draft", drafter=drafter)
    depth = drafter.config.block_size
    stored = _load_cached(path, use_cache)
    if stored is not None:
        table = DraftCost.from_dict(stored["seconds"])
        if set(rows) <= set(table.rows) and table.max_depth == depth:
            cached = table.to_dict()
            return DraftCost.from_dict({r: cached[r] for r in rows})
    vocab = target.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(0)
    table = {}
    bar = tqdm(total=len(rows) * depth, desc="profiling the drafter", disable=not progress)
    for r in rows:
        engine = DSparkEngine(target, drafter, scheduler="fixed")
        for _ in range(r):
            engine.add_request(torch.randint(1, vocab, (context_length,), generator=g).tolist(), max_new_tokens=1 << 20, temperature=1.0)
        engine._prefill()
        requests = engine.active
        width = requests[0].pending_features.shape[-1]
        engine._draft(requests, depth)  # the prompts into the draft cache

        def feed():  # two new committed tokens per row, as after an average round
            for request in requests:
                request.pending_features = torch.randn(2, width, generator=g).to(drafter.device, drafter.dtype)
                request.output_ids.append(int(request.output_ids[-1]))

        table[r] = []
        feed()  # and again after every timed call
        for d in range(1, depth + 1):
            table[r].append(_median_seconds(lambda: engine._draft(requests, d), repeats, drafter.device, after=feed))
            bar.update()
    bar.close()
    table = dict(zip(rows, _monotone([table[r] for r in rows])))
    _store(path, {"target": getattr(target, "name_or_path", ""), "drafter": getattr(drafter, "name_or_path", ""),
                  "dtype": str(drafter.dtype), "device": str(drafter.device), "context_length": context_length,
                  "seconds": table})  # fmt: skip
    return DraftCost.from_dict(table)


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
    stored = _load_cached(path, use_cache)
    if stored is not None:
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

        def forward():
            target(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)

        table[b] = 1.0 / _median_seconds(forward, repeats, device, after=lambda: cache.crop(-b))  # back to the context
    _store(path, {"model": getattr(target, "name_or_path", ""), "dtype": str(target.dtype), "device": str(device),
                  "context_length": context_length, "steps_per_second": table})  # fmt: skip
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

    from modeling_dspark import load_target
    from modeling_dspark.targets import resolve_dtype

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 where this CPU has fast bf16, else fp32), bf16 or fp32")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--context-length", type=int, default=256)
    parser.add_argument("--remeasure", action="store_true", help="ignore the cached table")
    parser.add_argument("--plot", default=None, help="PNG to draw the table into")
    args = parser.parse_args(argv)
    target, _ = load_target(args.target, dtype=resolve_dtype(args.dtype))
    cost = profile_sps(target, max_tokens=args.max_tokens, context_length=args.context_length, use_cache=not args.remeasure)
    print(f"cost table ({cost_table_path(target, args.context_length)}):")
    for b, s in zip(cost.tokens, cost.steps_per_second):
        print(f"  B={b:>4}: {s:7.2f} steps/s  ({b * s:8.1f} tokens/s)")
    if args.plot:
        plot_cost_table(cost, args.plot, title=f"SPS(B), {args.target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
