"""Does a wider draft vocabulary pay without training? A trained drafter's draft vocabulary widened to the ``--size``
most frequent tokens of its training responses (its own tokens always kept): the new tokens' LM-head rows come
from the frozen target head, their Markov ``W2`` rows are zero (``--fill zero``) or the mean of the trained rows
(``--fill mean``), and as a previous token each keeps the shared out-of-vocabulary ``W1`` row it was read through
before. Everything else is the trained drafter's. Score it with ``python -m modeling_dspark.training.expected_tau``.

    python benchmarks/widen_draft_vocab.py --drafter checkpoints/dspark-smollm2-135m-instruct-v14 --size 16384 \\
        --fill zero --out runs/v14_widened_16k --coverage benchmarks/results/text_temperature/held_out_t1.jsonl.gz

Measured in ``benchmarks/results/widen_draft_vocab`` (v14, 8,192 -> 16,384 tokens, zero fill): expected tau falls on
every domain of both texts, so the new tokens need training, not only their LM-head rows.
"""

import argparse

import torch

from modeling_dspark import DSparkModel
from modeling_dspark.checkpoint.draft_vocab import select_draft_vocab
from modeling_dspark.training.data import read_responses, split_holdout

TRAINING_FILES = [
    "training_data/smollm2_regen.jsonl.gz",
    "training_data/smollm2_code_regen.jsonl.gz",
    "training_data/smollm2_regen_v2.jsonl.gz",
    "training_data/smollm2_regen_v3.jsonl.gz",
    "training_data/smollm2_regen_v4.jsonl.gz",
]


def widen(drafter: DSparkModel, new_ids: torch.LongTensor, fill: str) -> DSparkModel:
    """``drafter`` over the draft vocabulary ``new_ids`` (target ids, a superset of its own, sorted)."""
    size = new_ids.numel()
    config = drafter.config.__class__.from_dict({**drafter.config.to_dict(), "draft_vocab_size": size})
    wide = DSparkModel(config).to(torch.float32)
    state = {k: v for k, v in drafter.state_dict().items() if not k.startswith("markov_head.") and k != "d2t"}
    missing, unexpected = wide.load_state_dict(state, strict=False)
    if unexpected or any(not k.startswith("markov_head.") and k != "d2t" for k in missing):
        raise RuntimeError(f"not the same geometry: missing {missing}, unexpected {unexpected}")
    wide.set_draft_vocab(new_ids)
    w1, w2 = drafter.markov_head.markov_w1.weight.data, drafter.markov_head.markov_w2.weight.data
    old_index = drafter.draft_index(new_ids)  # the shared out-of-vocabulary row for the new tokens
    inside = old_index < drafter.num_draft_tokens_in_vocab
    if int(inside.sum()) != drafter.num_draft_tokens_in_vocab:
        raise ValueError("the new draft vocabulary must contain the drafter's own")
    with torch.no_grad():
        wide.markov_head.markov_w1.weight.copy_(torch.cat([w1[old_index], w1[-1:]], 0))
        rows = torch.zeros(size, w2.shape[1]) if fill == "zero" else w2.mean(0, keepdim=True).expand(size, -1).clone()
        rows[inside] = w2[old_index[inside]]
        wide.markov_head.markov_w2.weight.copy_(rows)
    return wide


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--size", type=int, required=True, help="the wider draft vocabulary size")
    parser.add_argument("--fill", choices=("zero", "mean"), default="zero", help="the new tokens' Markov W2 rows")
    parser.add_argument("--data", nargs="+", default=TRAINING_FILES, help="the responses whose frequent tokens are added")
    parser.add_argument("--coverage", nargs="*", default=[], help="response files whose tokens' coverage to print")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    drafter = DSparkModel.from_pretrained(args.drafter, dtype=torch.float32)
    if drafter.markov_head is None or drafter.d2t is None or args.size <= drafter.num_draft_tokens_in_vocab:
        raise SystemExit("--drafter needs a Markov head and a draft vocabulary smaller than --size")
    train, _ = split_holdout([row for path in args.data for row in read_responses(path)])
    new_ids = select_draft_vocab((r["response_ids"] for r in train), args.size, always=drafter.draft_token_ids.tolist(),
                                 vocab_size=drafter.config.vocab_size)  # fmt: skip
    widen(drafter, new_ids, args.fill).to(torch.bfloat16).save_pretrained(args.out)
    print(f"{args.out}: {drafter.num_draft_tokens_in_vocab} -> {args.size} draft tokens ({args.fill} fill)")
    # share of response tokens each vocabulary can draft: the held-out split of --data, and each --coverage file
    held = [row for path in args.data for row in read_responses(path)]
    texts = {"held-out split of --data": split_holdout(held)[1], **{path: read_responses(path) for path in args.coverage}}
    for name, rows in texts.items():
        ids = torch.tensor([t for r in rows for t in r["response_ids"]])
        own, wide = drafter.in_draft_vocab(ids).float().mean(), torch.isin(ids, new_ids).float().mean()
        print(f"{name}: {ids.numel()} response tokens, {100 * own:.1f} % in the drafter's vocabulary, {100 * wide:.1f} % in the wider one")


if __name__ == "__main__":
    main()
