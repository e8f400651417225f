"""Cost tables measured on the real models, cached on disk keyed by model, dtype, device, threads, MKL's path
(``MKL_CBWR``, see ``modeling_dspark.cpu_blas``), context length and code (:func:`code_key`), so an engine start
re-profiles only on a new machine, model or code (this module's included). The tables live in
``~/.cache/dspark/sps``: ``DSPARK_CACHE`` moves the whole cache, ``DSPARK_COST_CACHE`` only the tables. A table
timed while something else loads the cores keeps that load's prices for every later run, so profile on a machine
otherwise idle (the test suite, whose workers share the cores, keeps its tables apart). Every point is the median
of ``repeats`` timed runs after one warm-up, and the points of a table are timed in turns (every point once, then
again), so a burst of load on a shared machine slows all of them alike instead of one.

- ``profile_sps(target)``: the paper's ``SPS(B)``, one forward of ``B`` new tokens on top of a cache of
  ``context_length`` tokens, for a grid of ``B`` (:class:`CostTable`).
- ``profile_verify_cost(target)``: the engine's verify forward, ``R`` rows with their own caches of
  ``context_length`` tokens, right-padded to a width of 1..``max_width`` tokens, its mask passed as the engine
  passes it (:class:`PaddedCostTable`).
- ``profile_draft_cost(target, drafter)``: one drafting call (backbone, then :func:`draft_block`) for ``R`` rows
  drafting 1..block_size slots, and what each further new context position adds (:class:`DraftCost`).

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
from .ragged_cache import four_d_mask_pays, verify_attention_mask

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
    if os.environ.get("DSPARK_COST_CACHE"):
        return Path(os.environ["DSPARK_COST_CACHE"])
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark")) / "sps"


_PROFILER_SOURCE = hashlib.sha1(Path(__file__).read_bytes()).hexdigest()[:12]


def model_key(model) -> str:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    name = getattr(model, "name_or_path", "") or cfg.model_type
    weights = sum(p.numel() for p in model.parameters())
    return f"{name}|{cfg.model_type}|{weights}|{model.dtype}"


def code_key(drafter=None) -> str:
    """torch's and Transformers' versions, a hash of this module's source and, with a drafter, of the source of every
    module its timed call runs (its classes and its submodules', the drafting loop): a table measured before a code
    change is measured again rather than reused (a slower drafting path would otherwise keep the schedulers from
    drafting)."""
    import inspect
    import sys

    import transformers

    parts = [torch.__version__, transformers.__version__, _PROFILER_SOURCE]
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
    if target.device.type == "cpu":  # MKL's path for few-row products sets the verification's price (cpu_blas)
        key += f"|MKL_CBWR={os.environ.get('MKL_CBWR')}"
    if drafter is not None:
        key += "|" + model_key(drafter)
    prefix = cfg.model_type if kind == "sps" else f"{cfg.model_type}-{kind}"
    return _cache_dir() / f"{prefix}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"


def _interleaved_medians(calls: dict, repeats: int, device, desc: str, progress: bool) -> dict:
    """Median seconds of each ``calls[key] = (fn, after)`` over ``repeats`` timed calls, taken in turns: one warm-up
    pass over every key (the first call of a shape pays for its allocations), then ``repeats`` passes in the same
    order, so a burst of load no longer than a pass slows each key at most once. ``after`` (or None) runs untimed
    after each call (a cache crop)."""
    from tqdm.auto import tqdm

    times: dict = {key: [] for key in calls}
    order = list(calls)
    bar = tqdm(total=len(order) * (repeats + 1), desc=desc, disable=not progress)
    for i in range(repeats + 1):
        for key in order:
            fn, after = calls[key]
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:
                times[key].append(time.perf_counter() - start)
            if after is not None:
                after()
            bar.update()
    bar.close()
    return {key: statistics.median(values) for key, values in times.items()}


def _isotonic(values: list[float]) -> list[float]:
    """The least-squares non-decreasing fit (pool adjacent violators): a point measured too slow is averaged with
    the points after it that it exceeds, rather than lifting every later point to its value as a running maximum
    would."""
    blocks: list[list[float]] = []  # [mean, weight]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2), (m1, w1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    return [m for m, w in blocks for _ in range(int(w))]


def _monotone(grid: list[list[float]]) -> list[list[float]]:
    """Non-decreasing along both axes (more rows, more tokens, more slots are never cheaper), else timing noise
    would make a wider forward look free and the schedulers admit on noise: isotonic fits along each line and each
    column in turn, then a running maximum for what small violations the alternation leaves."""
    out = [list(line) for line in grid]
    for _ in range(3):
        out = [_isotonic(line) for line in out]
        if len(out) > 1:
            columns = [_isotonic([line[j] for line in out]) for j in range(len(out[0]))]
            out = [[columns[j][i] for j in range(len(columns))] for i in range(len(out))]
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
    use_cache: bool = True, progress: bool = True, four_d_mask: bool | None = None,
) -> PaddedCostTable:  # fmt: skip
    """Seconds of the engine's verify forward: ``R`` rows (their own caches of ``context_length`` tokens) x width
    ``W`` new tokens, with the hidden states returned, as ``DSparkEngine.step`` runs it. ``four_d_mask``: the mask
    passed ready-made in 4-D (``verify_attention_mask``), as the engine does where ``four_d_mask_pays`` (None: the
    engine's choice on this device), or in 2-D, as ``generate()`` passes it; the two cost differently for one
    token on CPU."""
    if four_d_mask is None:
        four_d_mask = four_d_mask_pays(target)
    path = cost_table_path(target, context_length, kind="verify-4d" if four_d_mask else "verify")
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
    calls = {}
    for r in rows:
        cache = DynamicCache()
        target(input_ids=torch.randint(1, vocab, (r, context_length), generator=g).to(device), cache=cache, use_cache=True)
        for w in widths:
            ids = torch.randint(1, vocab, (r, w), generator=g).to(device)
            positions = torch.arange(context_length, context_length + w, device=device)[None].expand(r, -1)
            mask = verify_attention_mask(
                torch.ones(r, context_length, dtype=torch.bool), torch.ones(r, w, dtype=torch.bool), four_d=four_d_mask
            ).to(device)

            def forward(ids=ids, mask=mask, positions=positions, cache=cache):
                target(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True, output_hidden_states=True)

            calls[r, w] = (forward, lambda cache=cache, w=w: cache.crop(-w))
    table = _interleaved_medians(calls, repeats, device, "profiling the verify forward", progress)
    smooth = _monotone([[table[r, w] for w in widths] for r in rows])
    table = {r: dict(zip(widths, line)) for r, line in zip(rows, smooth)}
    _store(path, {"model": getattr(target, "name_or_path", ""), "dtype": str(target.dtype), "device": str(device),
                  "context_length": context_length, "seconds": table})  # fmt: skip
    return PaddedCostTable.from_dict(table)


@torch.no_grad()
def profile_draft_cost(
    target, drafter, *, rows=DEFAULT_ROWS, context_length: int = 256, repeats: int = 5, use_cache: bool = True,
    progress: bool = True,
) -> DraftCost:  # fmt: skip
    """Seconds of one drafting call as the engine and ``generate()`` make it: the drafter's backbone over
    ``DraftCost.BASE_CONTEXT`` new context tokens per row and the block, then :func:`draft_block` sampling D slots,
    for ``R`` rows with ``context_length`` tokens already in the draft cache; and what each further new context
    token per row adds (a call after rounds without the drafter reads every position it missed)."""
    path = cost_table_path(target, context_length, kind="draft", drafter=drafter)
    depth = drafter.config.block_size
    stored = _load_cached(path, use_cache)
    if stored is not None and "context_seconds" in stored:
        table = DraftCost.from_dict(stored["seconds"], stored["context_seconds"])
        if set(rows) <= set(table.rows) and table.max_depth == depth:
            keep = [table.rows.index(r) for r in rows]
            return DraftCost(tuple(rows), tuple(table.seconds[i] for i in keep), tuple(table.context_seconds[i] for i in keep))
    device = drafter.device
    vocab = target.config.get_text_config().vocab_size
    width = len(drafter.config.target_layer_ids) * drafter.config.target_hidden_size
    embeddings, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    g = torch.Generator().manual_seed(0)
    base, catch_up = DraftCost.BASE_CONTEXT, 64  # new context tokens per row: an average round's, and a catch-up's
    calls = {}
    for r in rows:
        cache = DynamicCache()
        anchors = torch.randint(1, vocab, (r,), generator=g).to(device)
        block = drafter.embed_block(anchors, embeddings)

        def backbone(num_context: int, start: int, r=r, block=block, cache=cache):
            features = torch.randn(r, num_context, width, generator=g).to(device, drafter.dtype)
            positions = torch.arange(start, start + num_context + drafter.config.block_size, device=device)[None].expand(r, -1)
            return drafter(block_embeds=block, context_features=features, position_ids=positions, cache=cache)

        backbone(context_length, 0)  # the prompts into the draft cache
        for d, new_context in [(d, base) for d in range(1, depth + 1)] + [(1, base + catch_up)]:

            def draft_call(d=d, new_context=new_context, anchors=anchors, backbone=backbone):
                out = backbone(new_context, context_length)
                draft_block(drafter, out.last_hidden_state, lm_head, anchors, num_slots=d, greedy=False)

            key = (r, d) if new_context == base else (r, "catch-up")
            calls[key] = (draft_call, lambda cache=cache, n=new_context: cache.crop(-n))
    seconds = _interleaved_medians(calls, repeats, device, "profiling the drafter", progress)
    table = dict(zip(rows, _monotone([[seconds[r, d] for d in range(1, depth + 1)] for r in rows])))
    per_token = {r: max(0.0, seconds[r, "catch-up"] - seconds[r, 1]) / catch_up for r in rows}
    _store(path, {"target": getattr(target, "name_or_path", ""), "drafter": getattr(drafter, "name_or_path", ""),
                  "dtype": str(drafter.dtype), "device": str(device), "context_length": context_length,
                  "seconds": table, "context_seconds": per_token})  # fmt: skip
    return DraftCost.from_dict(table, per_token)


@torch.no_grad()
def profile_sps(
    target, *, max_tokens: int = 256, context_length: int = 256, grid=DEFAULT_GRID, repeats: int = 5,
    use_cache: bool = True, progress: bool = True,
) -> CostTable:  # fmt: skip
    """Measure (or load) the cost table of ``target`` on its device and dtype."""
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
    calls = {}
    for b in points:
        ids = torch.randint(1, vocab, (1, b), generator=g).to(device)
        positions = torch.arange(context_length, context_length + b, device=device)[None]

        def forward(ids=ids, positions=positions):
            target(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)

        calls[b] = (forward, lambda b=b: cache.crop(-b))  # back to the context
    table = {b: 1.0 / s for b, s in _interleaved_medians(calls, repeats, device, "profiling SPS(B)", progress).items()}
    _store(path, {"model": getattr(target, "name_or_path", ""), "dtype": str(target.dtype), "device": str(device),
                  "context_length": context_length, "steps_per_second": table})  # fmt: skip
    return CostTable.from_dict(table)
