"""Cost tables measured on the real models, cached on disk keyed by model, dtype, device, threads, context
length and code (:func:`code_key`; ``~/.cache/dspark/sps``, ``DSPARK_CACHE`` moves it), so an engine start
re-profiles only on a new machine, model or code. Every point is the median of ``repeats`` timed runs after one warm-up.

- ``profile_sps(target)``: the paper's ``SPS(B)``, one forward of ``B`` new tokens on top of a cache of
  ``context_length`` tokens, for a grid of ``B`` (:class:`CostTable`).
- ``profile_verify_cost(target)``: the engine's verify forward, ``R`` rows with their own caches of
  ``context_length`` tokens, right-padded to a width of 1..``max_width`` tokens (:class:`PaddedCostTable`).
- ``profile_draft_cost(target, drafter)``: one drafting call (backbone, then :func:`draft_block`) for ``R`` rows
  drafting 1..block_size slots (:class:`DraftCost`).

``dspark profile`` (``generation.evaluation.cost_plots``) measures and plots them.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

from .drafting import draft_block
from .scheduler import CostTable, DraftCost, PaddedCostTable

__all__ = [
    "DEFAULT_GRID",
    "DEFAULT_ROWS",
    "code_key",
    "cost_table_path",
    "model_key",
    "profile_draft_cost",
    "profile_sps",
    "profile_verify_cost",
]

DEFAULT_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
DEFAULT_ROWS = (1, 2, 4, 8, 16, 32)  # concurrent requests; beyond the last, costs are extrapolated linearly


def _cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark")) / "sps"


def model_key(model) -> str:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    name = getattr(model, "name_or_path", "") or cfg.model_type
    weights = sum(p.numel() for p in model.parameters())
    return f"{name}|{cfg.model_type}|{weights}|{model.dtype}"


def code_key(drafter=None) -> str:
    """torch's and Transformers' versions and, with a drafter, a hash of the source of every module its timed call
    runs (its classes and its submodules', the drafting loop): a table measured before a code change is measured
    again rather than reused (a slower drafting path would otherwise keep the schedulers from drafting)."""
    import inspect
    import sys

    import transformers

    parts = [torch.__version__, transformers.__version__]
    if drafter is not None:
        names = {c.__module__ for sub in drafter.modules() for c in type(sub).__mro__} | {draft_block.__module__}
        ours = sorted(n for n in names if n in sys.modules and n.split(".")[0] not in ("torch", "transformers", "builtins"))
        for name in ours:
            try:
                source = inspect.getsource(sys.modules[name])
            except (OSError, TypeError):  # no source file: the module's name is all there is to key on
                source = name
            parts.append(hashlib.sha1(source.encode()).hexdigest()[:12])
    return "|".join(parts)


def cost_table_path(target, context_length: int, kind: str = "sps", drafter=None) -> Path:
    cfg = target.config.get_text_config()
    device = str(target.device) if target.device.type != "cuda" else torch.cuda.get_device_name(target.device)
    key = f"{model_key(target)}|{device}|{torch.get_num_threads()}|ctx{context_length}|{code_key(drafter)}"
    if drafter is not None:
        key += "|" + model_key(drafter)
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
    # written aside and renamed: another process reading the table never sees half of it
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


@torch.no_grad()
def profile_verify_cost(
    target, *, rows=DEFAULT_ROWS, max_width: int = 8, context_length: int = 256, repeats: int = 5,
    use_cache: bool = True, progress: bool = True,
) -> PaddedCostTable:  # fmt: skip
    """Seconds of the engine's verify forward: ``R`` rows (their own caches of ``context_length`` tokens) x width
    ``W`` new tokens, with a 2-D attention mask and the hidden states returned, as ``DSparkEngine.step`` runs it."""
    from tqdm.auto import tqdm

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
    """Seconds of one drafting call as the engine and ``generate()`` make it: the drafter's backbone over 2 new
    context tokens per row and the block, then :func:`draft_block` sampling D slots, for ``R`` rows with
    ``context_length`` tokens already in the draft cache."""
    from tqdm.auto import tqdm

    path = cost_table_path(target, context_length, kind="draft", drafter=drafter)
    depth = drafter.config.block_size
    stored = _load_cached(path, use_cache)
    if stored is not None:
        table = DraftCost.from_dict(stored["seconds"])
        if set(rows) <= set(table.rows) and table.max_depth == depth:
            cached = table.to_dict()
            return DraftCost.from_dict({r: cached[r] for r in rows})
    device = drafter.device
    vocab = target.config.get_text_config().vocab_size
    width = len(drafter.config.target_layer_ids) * drafter.config.target_hidden_size
    embeddings, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    g = torch.Generator().manual_seed(0)
    new_context = 2  # committed tokens per row after an average round
    table = {}
    bar = tqdm(total=len(rows) * depth, desc="profiling the drafter", disable=not progress)
    for r in rows:
        cache = DynamicCache()
        anchors = torch.randint(1, vocab, (r,), generator=g).to(device)
        block = drafter.embed_block(anchors, embeddings)

        def backbone(num_context: int, start: int):
            features = torch.randn(r, num_context, width, generator=g).to(device, drafter.dtype)
            positions = torch.arange(start, start + num_context + drafter.config.block_size, device=device)[None].expand(r, -1)
            return drafter(block_embeds=block, context_features=features, position_ids=positions, cache=cache)

        backbone(context_length, 0)  # the prompts into the draft cache
        table[r] = []
        for d in range(1, depth + 1):

            def draft_call():
                out = backbone(new_context, context_length)
                draft_block(drafter, out.last_hidden_state, lm_head, anchors, num_slots=d, greedy=False)

            table[r].append(_median_seconds(draft_call, repeats, device, after=lambda: cache.crop(-new_context)))
            bar.update()
    bar.close()
    table = dict(zip(rows, _monotone([table[r] for r in rows])))
    _store(path, {"target": getattr(target, "name_or_path", ""), "drafter": getattr(drafter, "name_or_path", ""),
                  "dtype": str(drafter.dtype), "device": str(device), "context_length": context_length,
                  "seconds": table})  # fmt: skip
    return DraftCost.from_dict(table)


@torch.no_grad()
def profile_sps(
    target, *, max_tokens: int = 256, context_length: int = 256, grid=DEFAULT_GRID, repeats: int = 5,
    use_cache: bool = True, progress: bool = True,
) -> CostTable:  # fmt: skip
    """Measure (or load) the cost table of ``target`` on its device and dtype."""
    from tqdm.auto import tqdm

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
