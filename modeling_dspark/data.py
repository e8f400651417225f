"""Self-distilled training data (SPEC section 7): the target regenerates its own responses to the training
prompts, so the drafter learns the distribution it will be verified against.

``regenerate_responses`` samples with the target's recommended settings, batched on the CPU, appending one
JSON line per prompt to a cache file and skipping ids already there (so an interrupted run resumes).
``build_dataset`` turns the cache into a ``datasets.Dataset`` of ``input_ids`` and a ``loss_mask`` that covers
the response tokens (the assistant turn's content and its end-of-turn token).

    python -m modeling_dspark.data --out data_cache/smollm2_regen.jsonl --num-prompts 4000
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from collections.abc import Iterable
from pathlib import Path

import torch

__all__ = [
    "SAMPLING",
    "build_dataset",
    "chat_prompt_ids",
    "load_prompts",
    "read_responses",
    "regenerate_responses",
    "split_holdout",
]

# SmolLM2-Instruct model card's recommended sampling; the paper regenerates with the target's own settings.
SAMPLING = {"smollm2-135m-instruct": dict(do_sample=True, temperature=0.2, top_p=0.9, top_k=0)}
DEFAULT_TRAIN_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "train"


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


def read_responses(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    with _open(path, "r") as f:
        return [json.loads(line) for line in f if line.strip()]


@torch.no_grad()
def regenerate_responses(
    target,
    tokenizer,
    prompts: list[dict],
    out_path: str | Path,
    *,
    sampling: dict,
    batch_size: int = 16,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 384,
    seed: int = 0,
) -> int:
    """Append ``{"id", "domain", "prompt_ids", "response_ids", "finished"}`` lines for prompts not yet in ``out_path``.

    Prompts are sorted by length inside each chunk to limit padding. Returns the number of new responses."""
    from tqdm.auto import tqdm

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = {row["id"] for row in read_responses(out_path)}
    todo = []
    for row in prompts:
        if row["id"] in done:
            continue
        ids = chat_prompt_ids(tokenizer, row["prompt"])
        if len(ids) <= max_prompt_tokens:
            todo.append((row, ids))
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    written = 0
    with _open(out_path, "a") as f, tqdm(total=len(todo), desc="regenerating responses", unit="prompt") as bar:
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
                    finished = eos in seq
                    response = seq[: seq.index(eos) + 1] if finished else seq
                    f.write(json.dumps({"id": row["id"], "domain": row["domain"], "prompt_ids": ids, "response_ids": response, "finished": finished}) + "\n")
                f.flush()
                written += len(batch)
                bar.update(len(batch))
    return written


def split_holdout(rows: list[dict], fraction: float = 0.05, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Deterministic (train, held-out) split by id, so the held-out set stays put as the cache grows."""
    rng = random.Random(seed)
    ids = sorted(row["id"] for row in rows)
    held = set(rng.sample(ids, max(1, round(fraction * len(ids))))) if ids else set()
    return [r for r in rows if r["id"] not in held], [r for r in rows if r["id"] in held]


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
    from . import load_target

    parser = argparse.ArgumentParser(description="Let the target regenerate its own responses to the training prompts")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--train-dir", default=str(DEFAULT_TRAIN_DIR))
    parser.add_argument("--out", default="data_cache/smollm2_regen.jsonl")
    parser.add_argument("--num-prompts", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--domains", nargs="+", default=["math", "code", "chat"])
    parser.add_argument("--exclude", nargs="*", default=[], help="response files whose prompt ids are skipped (fresh data)")
    args = parser.parse_args(argv)
    target, tokenizer = load_target(args.target)
    excluded = {row["id"] for path in args.exclude for row in read_responses(path)}
    prompts = load_prompts(args.train_dir, num_prompts=args.num_prompts + len(excluded), seed=args.seed, domains=tuple(args.domains))
    prompts = [p for p in prompts if p["id"] not in excluded][: args.num_prompts]
    n = regenerate_responses(
        target, tokenizer, prompts, args.out, sampling=SAMPLING[args.target], batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens, seed=args.seed,
    )  # fmt: skip
    print(f"{n} new responses; {len(read_responses(args.out))} in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
