"""Self-distilled training data (SPEC section 7): the target regenerates its own responses to the training
prompts, so the drafter learns the distribution it will be verified against.

``regenerate_responses`` samples with the target's recommended settings (the command's ``--temperature`` /
``--top-p`` override them: a T = 1 evaluation decodes other text than T = 0.2 writes), batched on the CPU, appending
one JSON line per prompt to a cache file and skipping ids already there (so an interrupted run resumes).
``build_dataset`` turns the cache into a ``datasets.Dataset`` of ``input_ids`` and a ``loss_mask`` that covers
the response tokens (the assistant turn's content and its end-of-turn token).

    python -m modeling_dspark.training.data --out data_cache/smollm2_regen.jsonl --num-prompts 4000
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import signal
import sys
import time
import zlib
from collections.abc import Iterable
from pathlib import Path

import torch

__all__ = [
    "SAMPLING",
    "build_dataset",
    "chat_prompt_ids",
    "load_prompts",
    "read_responses",
    "write_responses",
    "regenerate_responses",
    "split_holdout",
]

# SmolLM2-Instruct model card's recommended sampling; the paper regenerates with the target's own settings.
SAMPLING = {"smollm2-135m-instruct": dict(do_sample=True, temperature=0.2, top_p=0.9, top_k=0)}
DEFAULT_TRAIN_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "train"


def load_prompts(train_dir: str | Path = DEFAULT_TRAIN_DIR, *, num_prompts: int, seed: int = 0, domains=("math", "code", "chat")):
    """A seeded sample of ``num_prompts`` training prompts, balanced over ``domains``."""
    by_domain: dict[str, list[dict]] = {d: [] for d in domains}
    for path in sorted(Path(train_dir).glob("*.jsonl")):
        for line in path.open(encoding="utf-8"):  # not splitlines(): prompts contain U+2028
            row = json.loads(line)
            if row["domain"] in by_domain:
                by_domain[row["domain"]].append({"id": row["id"], "prompt": row["prompt"], "domain": row["domain"]})
    rng = random.Random(seed)
    for rows in by_domain.values():
        rng.shuffle(rows)
    per_domain = -(-num_prompts // len(domains))
    picked = [row for rows in by_domain.values() for row in rows[:per_domain]]
    rng.shuffle(picked)
    return picked[:num_prompts]


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The target's chat template with the generation prompt (first turn only, as in the paper)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False)


def _open(path: Path, mode: str):
    return gzip.open(path, mode + "t") if path.suffix == ".gz" else open(path, mode)


def _gzip_members_text(data: bytes) -> tuple[bytes, bool]:
    """The text of every gzip member in ``data`` and whether each was whole.

    A run killed mid-write leaves a member without its end, and a later run appends its own members after it, so
    a plain gzip reader stops (or fails) at the break. Each member is decoded on its own; after a broken one
    decoding resumes at the next member header, and of the broken member only its whole lines are kept."""
    parts, whole, pos = [], True, 0
    while pos < len(data):
        start, decoder, out = pos, zlib.decompressobj(wbits=31), []
        while pos < len(data) and not decoder.eof:
            chunk, before = data[pos : pos + 65536], decoder.copy()
            try:
                out.append(decoder.decompress(chunk))
            except zlib.error:  # the break is in this chunk: decode up to it byte by byte, keeping what comes out
                decoder = before
                for i in range(len(chunk)):
                    try:
                        out.append(decoder.decompress(chunk[i : i + 1]))
                    except zlib.error:
                        break
                break
            pos += len(chunk)
        if decoder.eof:
            pos -= len(decoder.unused_data)
            parts.append(b"".join(out))
            continue
        whole = False
        text = b"".join(out)
        parts.append(text[: text.rfind(b"\n") + 1])
        following = data.find(b"\x1f\x8b\x08", start + 1)
        pos = following if following >= 0 else len(data)
    return b"".join(parts), whole


def _read_response_lines(path: Path) -> tuple[list[dict], bool]:
    """(rows, whole): every complete response line of ``path``, and whether the file had no broken part."""
    if not path.is_file():
        return [], True
    data = path.read_bytes()
    text, whole = _gzip_members_text(data) if path.suffix == ".gz" else (data, True)
    rows = []
    for line in text.decode("utf-8", errors="replace").splitlines():
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                whole = False  # the line being written when a run stopped
                continue
            if isinstance(row, dict) and "response_ids" in row:
                rows.append(row)
    return rows, whole


def read_responses(path: str | Path) -> list[dict]:
    """Every complete response line of ``path`` (JSONL, optionally gzip). What a run stopped mid-write left broken
    (a truncated line, a gzip member without its end, with later runs' members after it) is skipped and everything
    else kept, so appending to the same file resumes."""
    return _read_response_lines(Path(path))[0]


def write_responses(path: str | Path, rows: Iterable[dict]) -> None:
    """Write ``rows`` as ``path`` anew (one gzip member for ``.gz``), through a temporary file so that a run stopped
    meanwhile leaves the old file intact."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}")  # the same suffix, so _open compresses alike
    with _open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


@torch.no_grad()
def regenerate_responses(
    target,
    tokenizer,
    prompts: list[dict],
    out_path: str | Path,
    *,
    sampling: dict,
    batch_size: int = 96,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 384,
    seed: int = 0,
    backend: str = "auto",
) -> int:
    """Append ``{"id", "domain", "prompt_ids", "response_ids", "finished"}`` lines for prompts not yet in ``out_path``.

    ``backend="engine"`` decodes with continuous batching (``DSparkEngine`` without a drafter): a finished response
    leaves the batch at once and the next prompt takes its row, so no step is spent on padding after EOS (half
    of the responses stop before the token limit). ``"generate"`` is Transformers' static batched ``generate()``
    over length-sorted chunks, for targets the engine refuses (sliding-window attention); ``"auto"`` picks the
    engine where it can. Each finished response is written at once, so an interrupted run resumes.
    Returns the number of new responses."""
    from tqdm.auto import tqdm

    if backend not in ("auto", "engine", "generate"):
        raise ValueError(f"backend must be auto, engine or generate, got {backend!r}")
    if backend == "auto":
        from generation.serving.engine import uses_sliding_window

        backend = "generate" if uses_sliding_window(target) else "engine"
    if backend == "engine" and (sampling.get("top_k") or 0) > 0:
        raise ValueError("the engine samples with temperature and top-p only; pass top_k=0 or backend='generate'")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    existing, whole = _read_response_lines(out_path)
    if not whole:  # rewrite what a stopped run left broken, so the members appended now follow whole ones
        write_responses(out_path, existing)
    done = {row["id"] for row in existing}
    todo = []
    for row in prompts:
        if row["id"] in done:
            continue
        ids = chat_prompt_ids(tokenizer, row["prompt"])
        if len(ids) <= max_prompt_tokens:
            todo.append((row, ids))
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    written = tokens = 0
    start = time.perf_counter()
    with _open(out_path, "a") as f, tqdm(total=len(todo), desc="regenerating responses", unit="prompt") as bar:

        def write(row, ids, seq):
            nonlocal written, tokens
            finished = eos in seq
            response = seq[: seq.index(eos) + 1] if finished else seq
            f.write(json.dumps({"id": row["id"], "domain": row["domain"], "prompt_ids": ids, "response_ids": response, "finished": finished}) + "\n")
            written, tokens = written + 1, tokens + len(response)
            bar.update(1)
            bar.set_postfix(response_tok_per_s=f"{tokens / (time.perf_counter() - start):.0f}", refresh=False)

        torch.manual_seed(seed)
        if backend == "engine":
            from generation.serving.engine import DSparkEngine

            engine = DSparkEngine(target, None, scheduler="none")
            queue, owner = list(todo), {}
            while queue or engine.has_work():
                while queue and len(engine.active) + len(engine.waiting) < batch_size:
                    row, ids = queue.pop(0)
                    rid = engine.add_request(
                        ids, max_new_tokens=max_new_tokens, temperature=float(sampling.get("temperature", 1.0)),
                        top_p=float(sampling.get("top_p", 1.0)), eos_token_id=eos,
                    )  # fmt: skip
                    owner[rid] = (row, ids)
                for request in engine.step():
                    write(*owner.pop(request.request_id), request.output_ids)
                    del engine.finished[request.request_id]
                f.flush()
            return written
        for start in range(0, len(todo), batch_size * 8):
            chunk = sorted(todo[start : start + batch_size * 8], key=lambda item: len(item[1]))
            for b in range(0, len(chunk), batch_size):
                batch = chunk[b : b + batch_size]
                width = max(len(ids) for _, ids in batch)
                input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for _, ids in batch])
                mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch])
                torch.manual_seed(seed + start + b)
                out = target.generate(
                    input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=eos, **sampling
                )
                for (row, ids), seq in zip(batch, out[:, width:].tolist()):
                    write(row, ids, seq)
                f.flush()
    return written


def split_holdout(rows: list[dict], fraction: float = 0.05, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Deterministic (train, held-out) split by a hash of each id, so a prompt stays on its side as the data grows
    (a drafter resumed on more data never trains on what it was evaluated on)."""
    import hashlib

    def held(row) -> bool:
        digest = hashlib.sha1(f"{seed}:{row['id']}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < fraction

    return [r for r in rows if not held(r)], [r for r in rows if held(r)]


def build_dataset(rows: Iterable[dict], *, max_length: int = 640, min_response_tokens: int = 8):
    """``datasets.Dataset`` with ``input_ids`` (prompt + response) and ``loss_mask`` (1 on response tokens)."""
    from datasets import Dataset

    input_ids, loss_mask = [], []
    for row in rows:
        prompt, response = row["prompt_ids"], row["response_ids"]
        if len(response) < min_response_tokens:
            continue
        ids = (prompt + response)[:max_length]
        mask = ([0] * len(prompt) + [1] * len(response))[:max_length]
        if sum(mask) >= min_response_tokens:
            input_ids.append(ids)
            loss_mask.append(mask)
    return Dataset.from_dict({"input_ids": input_ids, "loss_mask": loss_mask})


def main(argv: list[str] | None = None) -> int:
    from modeling_dspark import load_target
    from modeling_dspark.targets import add_target_arguments

    parser = argparse.ArgumentParser(description="Let the target regenerate its own responses to the training prompts")
    add_target_arguments(parser, dtype=False)
    parser.add_argument("--train-dir", default=str(DEFAULT_TRAIN_DIR))
    parser.add_argument("--out", default="data_cache/smollm2_regen.jsonl")
    parser.add_argument("--num-prompts", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=96, help="concurrent requests (engine) or batch size (generate)")
    parser.add_argument("--backend", choices=("auto", "engine", "generate"), default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--domains", nargs="+", default=["math", "code", "chat"])
    parser.add_argument("--exclude", nargs="*", default=[], help="response files whose prompt ids are skipped (fresh data)")
    parser.add_argument(
        "--held-out-of", nargs="+", default=None, metavar="FILE",
        help="only the prompts of the held-out split of these response files (as training splits them), e.g. to "
        "regenerate the held-out text at another temperature; --num-prompts of them, balanced over --domains",
    )  # fmt: skip
    parser.add_argument(
        "--temperature", type=float, default=None,
        help="sampling temperature instead of the target's recommended one (e.g. 1.0: the text a T = 1 evaluation decodes)",
    )  # fmt: skip
    parser.add_argument("--top-p", type=float, default=None, help="top-p instead of the target's recommended one")
    parser.add_argument(
        "--compact", action="store_true",
        help="only rewrite --out as one gzip member (smaller; what to commit after runs that were stopped and resumed)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    sampling = dict(SAMPLING[args.target])
    if args.temperature is not None:
        if args.temperature <= 0:
            raise SystemExit(f"--temperature must be > 0 (the responses are sampled), got {args.temperature}")
        sampling["temperature"] = args.temperature
    if args.top_p is not None:
        if not 0 < args.top_p <= 1:
            raise SystemExit(f"--top-p must be in (0, 1], got {args.top_p}")
        sampling["top_p"] = args.top_p
    if args.held_out_of:
        missing = [path for path in args.held_out_of if not Path(path).is_file()]
        if missing:
            raise SystemExit(f"--held-out-of: no such file: {', '.join(missing)}")
    if args.compact:
        rows = read_responses(args.out)
        write_responses(args.out, rows)
        print(f"{len(rows)} responses, {sum(len(r['response_ids']) for r in rows)} response tokens in {args.out}")
        return 0
    # a stop by `kill` closes the file (its gzip member ends whole) instead of leaving it cut mid-member
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    target, tokenizer = load_target(args.target)
    excluded = {row["id"] for path in args.exclude for row in read_responses(path)}
    if args.held_out_of:
        held = {row["id"] for row in split_holdout([row for path in args.held_out_of for row in read_responses(path)])[1]}
        every = load_prompts(args.train_dir, num_prompts=sys.maxsize, seed=args.seed, domains=tuple(args.domains))  # shuffled
        pool = [p for p in every if p["id"] in held and p["id"] not in excluded]
        per_domain = -(-args.num_prompts // len(args.domains))
        prompts = [p for d in args.domains for p in [q for q in pool if q["domain"] == d][:per_domain]][: args.num_prompts]
    else:
        prompts = load_prompts(args.train_dir, num_prompts=args.num_prompts + len(excluded), seed=args.seed, domains=tuple(args.domains))
        prompts = [p for p in prompts if p["id"] not in excluded][: args.num_prompts]
    n = regenerate_responses(
        target, tokenizer, prompts, args.out, sampling=sampling, batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens, seed=args.seed, backend=args.backend,
    )  # fmt: skip
    print(f"{n} new responses; {len(read_responses(args.out))} in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
