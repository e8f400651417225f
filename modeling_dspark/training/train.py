"""Train a DSpark drafter for an embedded target on its regenerated responses (resumable).

    python -m modeling_dspark.training.train --data data_cache/smollm2_regen.jsonl --output-dir runs/smollm2 \
        --max-steps 600 --export checkpoints/dspark-smollm2-135m-instruct

The default recipe is the fast one (``dspark bench-train`` measures it against the first shipped recipe): a draft
vocabulary of the 8,192 tokens most frequent in the training responses, dense anchors (256 per sequence, about
every response position), the drafter's matrix products in bf16 autocast where the CPU has native bf16.

Checkpoints go to ``--output-dir`` every ``--save-steps``; rerunning the same command resumes from the last one.
The held-out split (5 % of prompt ids, see ``data.split_holdout``) is kept out of training for calibration.
Under ``accelerate launch`` the same script trains data parallel.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from modeling_dspark.checkpoint.draft_vocab import select_draft_vocab
from modeling_dspark.provenance import command_line
from modeling_dspark.targets import add_target_arguments
from modeling_dspark.training.data import build_dataset, read_responses, split_holdout

__all__ = ["main", "training_mixture"]


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_arguments(p, dtype=False)
    p.add_argument("--data", required=True, nargs="+", help="regenerated responses (JSONL, optionally .gz; several files are joined)")
    p.add_argument(
        "--repeat", type=int, nargs="+", default=None, metavar="N",
        help="times each --data file's training responses enter the training set, one N per file (default 1 each): "
        "the mixture weight of a small file, e.g. responses sampled at another temperature",
    )  # fmt: skip
    p.add_argument("--output-dir", required=True, help="Trainer checkpoints (resumed from when present)")
    p.add_argument("--export", default=None, help="where to save the final drafter (bf16 save_pretrained folder)")
    p.add_argument("--max-steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-ratio", type=float, default=0.04)
    p.add_argument("--num-anchors", type=int, default=256, help="anchors per sequence (256: about every response position)")
    p.add_argument("--draft-vocab-size", type=int, default=8192, help="draft vocabulary: the most frequent response tokens; 0 = the whole vocabulary")
    p.add_argument("--max-length", type=int, default=640)
    p.add_argument("--save-steps", type=int, default=50)
    p.add_argument("--drafter", choices=("dspark", "eagle3"), default="dspark", help="dspark (DFlash: --markov-head none --no-confidence-head --ce-alpha 1 --l1-alpha 0) or the eagle3 baseline")
    p.add_argument("--block-size", type=int, default=7, help="block size (DSpark/DFlash) or training-time-test steps (Eagle3)")
    p.add_argument("--num-draft-layers", type=int, default=2)
    p.add_argument("--markov-head", default="vanilla", help="vanilla, rnn or none (DFlash)")
    p.add_argument("--markov-rank", type=int, default=256)
    p.add_argument("--no-confidence-head", action="store_true")
    p.add_argument("--ce-alpha", type=float, default=0.1)
    p.add_argument("--l1-alpha", type=float, default=0.9)
    p.add_argument("--confidence-alpha", type=float, default=1.0)
    p.add_argument(
        "--ce-target",
        choices=("label", "distribution"),
        default="label",
        help="CE of the sampled token (Eq. 9) or to the target's distribution (distillation)",
    )
    p.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation after training")
    p.add_argument(
        "--target-dtype",
        default="auto",
        help="dtype of the frozen target's forward: auto (bf16 where the CPU has fast bf16, else fp32), bf16 or fp32",
    )
    p.add_argument("--bf16", choices=("auto", "on", "off"), default="auto", help="bf16 autocast for the drafter (fp32 master weights); auto: where the CPU has fast bf16")
    p.add_argument(
        "--target-cache", default="auto",
        help="folder of an offline cache of the target's features (built on first use; epochs after the first skip the "
        "target's forward), 'none', or 'auto': OUTPUT_DIR/target_cache when the run plans two epochs or more",
    )  # fmt: skip
    p.add_argument("--init-from", default=None, help="warm-start from a drafter folder, e.g. the last export: the same "
                   "geometry, or fewer draft layers than --num-draft-layers (the added layers start as identity blocks)")
    p.add_argument("--seed", type=int, default=42)
    return p


def training_mixture(files: list[list[dict]], repeat: list[int]) -> tuple[list[dict], list[dict], int]:
    """(training rows, held-out rows, distinct training prompts) of several response files: each file's training rows
    ``repeat[i]`` times, its held-out rows once. The split hashes each id, so splitting per file equals splitting the
    joined files, and a repeated file never leaks a held-out prompt into training."""
    splits = [split_holdout(rows) for rows in files]
    train_rows = [row for (train, _), times in zip(splits, repeat, strict=True) for _ in range(times) for row in train]
    held_out = [row for _, held in splits for row in held]
    return train_rows, held_out, sum(len(train) for train, _ in splits)


def response_draft_vocab(rows: list[dict], tokenizer, size: int) -> torch.LongTensor:
    """The draft vocabulary for a recipe: the ``size`` most frequent response tokens of ``rows``, with EOS and the
    tokenizer's special tokens (the chat template's end-of-turn among them) always in."""
    always = set(tokenizer.all_special_ids)
    if tokenizer.eos_token_id is not None:
        always.add(tokenizer.eos_token_id)
    return select_draft_vocab((r["response_ids"] for r in rows), size, always=always, vocab_size=len(tokenizer))


def use_bf16_autocast(choice: str) -> bool:
    from modeling_dspark.targets import fast_dtype

    return choice == "on" or (choice == "auto" and fast_dtype() == torch.bfloat16)


def main(argv: list[str] | None = None) -> int:
    from transformers.trainer_utils import get_last_checkpoint

    from modeling_dspark import DSparkModel, Eagle3DrafterModel, load_target
    from modeling_dspark.targets import resolve_dtype
    from modeling_dspark.training.trainer import DSparkCollator, DSparkTrainer, DSparkTrainingArguments

    parser = build_arg_parser()
    args = parser.parse_args(argv)
    repeat = args.repeat or [1] * len(args.data)
    if len(repeat) != len(args.data) or min(repeat) < 1:
        parser.error(f"--repeat needs one count of at least 1 per --data file ({len(args.data)} files), got {args.repeat}")
    torch.manual_seed(args.seed)
    target_dtype = resolve_dtype(args.target_dtype)
    target, tokenizer = load_target(args.target, dtype=target_dtype)
    train_rows, held_out, train_prompts = training_mixture([read_responses(path) for path in args.data], repeat)
    if not train_rows and not held_out:
        raise SystemExit(f"no regenerated responses in {args.data}; run python -m modeling_dspark.training.data first")
    dataset = build_dataset(train_rows, max_length=args.max_length)
    markov = None if args.markov_head == "none" else args.markov_head
    vocab = {}
    if args.draft_vocab_size:
        vocab = {"draft_vocab_ids": response_draft_vocab(train_rows, tokenizer, args.draft_vocab_size)}
    if args.drafter == "eagle3":  # one layer, training-time test over block-size steps, soft CE (its own recipe)
        drafter = Eagle3DrafterModel.from_target(
            target, dtype=torch.float32, ttt_length=args.block_size, num_anchors=args.num_anchors, **vocab
        )
    else:
        drafter = DSparkModel.from_target(
            target,
            dtype=torch.float32,  # fp32 master weights; the frozen target runs in target_dtype
            block_size=args.block_size,
            num_draft_layers=args.num_draft_layers,
            markov_head_type=markov,
            markov_rank=args.markov_rank,
            confidence_head=not args.no_confidence_head,
            num_anchors=args.num_anchors,
            **vocab,
        )
    warm_started = None
    if args.init_from:
        from modeling_dspark.training.warm_start import warm_start

        warm = type(drafter).from_pretrained(args.init_from, dtype=torch.float32)
        try:  # its draft vocabulary (d2t) comes with it; added draft layers start as identity blocks
            warm_started = warm_start(drafter, warm)
        except ValueError as err:
            raise SystemExit(f"--init-from {args.init_from}: {err}") from None
    target_cache = None
    epochs = args.max_steps * args.batch_size * args.grad_accum / max(len(dataset), 1)
    if args.target_cache == "auto":
        args.target_cache = str(Path(args.output_dir) / "target_cache") if epochs >= 2 else None
    elif args.target_cache == "none":
        args.target_cache = None
    if args.target_cache:
        from modeling_dspark.training.target_cache import TargetFeatureCache

        target_cache = TargetFeatureCache.open_or_build(args.target_cache, target, drafter.config.target_layer_ids, dataset["input_ids"])
        dataset = dataset.add_column("cache_index", list(range(len(dataset))))
    dataset = dataset.shuffle(seed=args.seed)
    out_dir = Path(args.output_dir)
    training_args = DSparkTrainingArguments(
        output_dir=str(out_dir),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        warmup_steps=args.warmup_ratio,  # a float below 1 is a fraction of max_steps
        lr_scheduler_type="cosine",
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=10,
        save_steps=args.save_steps,
        save_total_limit=2,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        train_sampling_strategy="group_by_length",  # less right padding: the frozen target's forward dominates a CPU step
        seed=args.seed,
        bf16=use_bf16_autocast(args.bf16),
        ce_alpha=args.ce_alpha,
        l1_alpha=args.l1_alpha,
        confidence_alpha=args.confidence_alpha if not args.no_confidence_head else 0.0,
        num_anchors=args.num_anchors,
        ce_target=args.ce_target,
        per_device_eval_batch_size=args.batch_size,
    )
    eval_dataset = build_dataset(held_out, max_length=args.max_length) if held_out and not args.no_eval else None
    pad = getattr(target.generation_config, "pad_token_id", None) or 0
    trainer = DSparkTrainer(
        model=drafter, args=training_args, target=target, train_dataset=dataset, eval_dataset=eval_dataset,
        data_collator=DSparkCollator(pad, target_cache=target_cache),
    )
    last = get_last_checkpoint(str(out_dir)) if out_dir.is_dir() else None
    start = time.time()
    result = trainer.train(resume_from_checkpoint=last)
    wall = time.time() - start
    # the held-out prompts' responses: loss terms, per-position acceptance rates, expected tau (analytic, T = 1)
    torch.manual_seed(args.seed)  # the same evaluation anchors for every run
    held_out_metrics = trainer.evaluate() if eval_dataset is not None else None
    if held_out_metrics is not None:
        print(json.dumps(held_out_metrics, indent=2))
    if args.export and trainer.is_world_process_zero():
        export = Path(args.export)
        trainer.model.to(torch.bfloat16).save_pretrained(export)
        budget = {
            "target": args.target,
            "data": [str(d) for d in args.data],
            "train_prompts": train_prompts,
            "held_out_prompts": len(held_out),
            "train_sequences": len(dataset),
            "train_response_tokens": int(sum(sum(m) for m in dataset["loss_mask"])),
            "steps": result.global_step,
            "batch_size": args.batch_size * args.grad_accum,
            "anchors_per_sequence": args.num_anchors,
            "draft_vocab_size": args.draft_vocab_size or None,
            "bf16_autocast": bool(training_args.bf16),
            "predicted_positions_this_run": trainer.predicted_positions,
            "target_dtype": str(target_dtype).removeprefix("torch."),
            "sequences_seen": result.global_step * args.batch_size * args.grad_accum,
            "wall_time_s_this_run": round(wall, 1),
            "resumed_from": last,
            "warm_start": warm_started,  # the --init-from drafter's layers and the identity layers added to them
            "final_train_loss": result.training_loss,
            "command": command_line("modeling_dspark.training.train", argv),
            "arguments": vars(args),
            "held_out_eval": held_out_metrics,
            "log_history": trainer.state.log_history[-5:],
        }
        (export / "training_budget.json").write_text(json.dumps(budget, indent=2) + "\n")
        print(f"saved drafter to {export}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
