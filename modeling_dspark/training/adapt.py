"""LoRA adaptation of a trained drafter with PEFT: a new domain, or a fine-tuned target, for a few MB.

    python -m modeling_dspark.training.adapt --drafter checkpoints/dspark-smollm2-135m-instruct \
        --data data_cache/smollm2_code_regen.jsonl --output-dir runs/lora_code \
        --export adapters/dspark-smollm2-135m-instruct-code-lora --max-steps 150

The adapter sits on the drafter's attention and MLP projections; ``DSparkTrainer`` trains it with the
drafter's own loss (Markov and confidence heads stay frozen unless ``--train-heads``). Use it as

    drafter = PeftModel.from_pretrained(DSparkModel.from_pretrained(base), adapter)   # or .merge_and_unload()
    target.generate(**inputs, assistant_model=drafter)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from modeling_dspark.provenance import command_line

__all__ = ["DRAFTER_LORA_MODULES", "add_lora", "drafter_lora_config", "load_adapted_drafter"]

# projections of the draft layers (DSpark / DFlash layers and the Eagle3 layer use the same names)
DRAFTER_LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def drafter_lora_config(rank: int = 16, alpha: int | None = None, dropout: float = 0.0, train_heads: bool = False):
    from peft import LoraConfig

    return LoraConfig(
        r=rank,
        lora_alpha=alpha or 2 * rank,
        lora_dropout=dropout,
        target_modules=DRAFTER_LORA_MODULES,
        # the Markov and confidence heads are small: train them fully when asked, as PEFT "modules to save"
        modules_to_save=["markov_head", "confidence_head"] if train_heads else None,
    )


def add_lora(drafter, **config_kwargs):
    """``PeftModel`` around ``drafter`` with a fresh LoRA adapter (base weights frozen)."""
    from peft import get_peft_model

    return get_peft_model(drafter, drafter_lora_config(**config_kwargs))


def load_adapted_drafter(adapter: str | Path, base: str | Path | None = None, *, dtype=torch.bfloat16, merge: bool = False):
    """A drafter with a saved LoRA adapter on top; ``base`` defaults to the adapter's recorded base folder."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoModel

    from modeling_dspark import DSparkModel  # noqa: F401  (registers the Auto classes)

    adapter = Path(adapter)
    if not (adapter / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{adapter} is not a PEFT adapter folder (no adapter_config.json)")
    base = base or PeftConfig.from_pretrained(str(adapter)).base_model_name_or_path
    if not base or not (Path(base) / "config.json").is_file():
        raise FileNotFoundError(f"base drafter {base!r} of adapter {adapter} not found; pass base=<drafter folder>")
    model = PeftModel.from_pretrained(AutoModel.from_pretrained(base, dtype=dtype), str(adapter)).eval()
    return model.merge_and_unload() if merge else model


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModel

    from modeling_dspark import load_target
    from modeling_dspark.targets import add_target_arguments
    from modeling_dspark.training.data import build_dataset, read_responses, split_holdout
    from modeling_dspark.training.trainer import DSparkTrainer, DSparkTrainingArguments

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_arguments(p, dtype=False)
    p.add_argument("--drafter", required=True, help="trained drafter folder (the base of the adapter)")
    p.add_argument("--data", required=True, help="regenerated responses of the new domain (JSONL, optionally .gz)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--export", required=True, help="adapter folder to write")
    p.add_argument("--max-steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--train-heads", action="store_true", help="also train the Markov / confidence heads fully")
    p.add_argument("--ce-alpha", type=float, default=0.1)
    p.add_argument("--l1-alpha", type=float, default=0.9)
    p.add_argument("--confidence-alpha", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    target, _ = load_target(args.target)  # auto dtype
    rows = read_responses(args.data)
    if not rows:
        raise SystemExit(f"no regenerated responses in {args.data}")
    train_rows, held_out = split_holdout(rows)
    dataset = build_dataset(train_rows).shuffle(seed=args.seed)
    base = AutoModel.from_pretrained(args.drafter, dtype=torch.float32)
    model = add_lora(base, rank=args.rank, train_heads=args.train_heads)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"LoRA rank {args.rank}: {trainable:,} trainable of {sum(p.numel() for p in model.parameters()):,} parameters")
    training_args = DSparkTrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, warmup_steps=0.05, lr_scheduler_type="cosine", weight_decay=0.0, max_grad_norm=1.0,
        logging_steps=10, save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
        train_sampling_strategy="group_by_length", seed=args.seed, ce_alpha=args.ce_alpha, l1_alpha=args.l1_alpha,
        confidence_alpha=args.confidence_alpha if base.confidence_head is not None else 0.0,
    )  # fmt: skip
    trainer = DSparkTrainer(model=model, args=training_args, target=target, train_dataset=dataset)
    start = time.time()
    result = trainer.train()
    export = Path(args.export)
    trainer.model.save_pretrained(export)
    budget = {
        "base_drafter": args.drafter, "data": args.data, "train_sequences": len(dataset), "held_out_prompts": len(held_out),
        "steps": result.global_step, "batch_size": args.batch_size, "lora_rank": args.rank, "trainable_parameters": trainable,
        "wall_time_s": round(time.time() - start, 1), "final_train_loss": result.training_loss,
        "command": command_line("modeling_dspark.training.adapt", argv),
        "log_history": trainer.state.log_history[-3:],
    }  # fmt: skip
    (export / "training_budget.json").write_text(json.dumps(budget, indent=2) + "\n")
    print(f"saved adapter to {export}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
