"""`DSparkTrainer`: a `transformers.Trainer` that trains a DSpark drafter against a frozen target (SPEC section 7).

``trainer.model`` is the drafter, so the optimizer sees only its parameters and ``save_model()`` writes a
drafter-only folder. The frozen target provides the context features and the target distributions; each
batch samples ``num_anchors`` anchors per sequence and computes :func:`modeling_dspark.training.loss.compute_dspark_loss`.
The DFlash baseline is the same trainer with ``ce_alpha=1, l1_alpha=0, confidence_alpha=0`` and a drafter
without Markov and confidence heads.

On a CPU the trainer sets glibc's malloc to keep freed memory in the process
(:func:`modeling_dspark.training.memory.keep_freed_memory`): a step's large tensors then reuse the previous step's
pages instead of faulting in new ones.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from transformers import Trainer, TrainingArguments

from modeling_dspark.metrics import expected_tau_from_sums
from modeling_dspark.training.loss import sample_anchor_positions
from modeling_dspark.training.memory import keep_freed_memory
from modeling_dspark.training.target_cache import target_features

__all__ = ["DSparkCollator", "DSparkTrainer", "DSparkTrainingArguments"]


@dataclass
class DSparkTrainingArguments(TrainingArguments):
    ce_alpha: float = field(default=0.1, metadata={"help": "weight of the cross-entropy term (Eq. 9)"})
    l1_alpha: float = field(default=0.9, metadata={"help": "weight of the L1 / total-variation term (Eq. 10)"})
    confidence_alpha: float = field(default=1.0, metadata={"help": "weight of the confidence BCE (Eq. 11)"})
    ce_target: str = field(
        default="label",
        metadata={"help": "CE against the sampled token ('label', Eq. 9) or the target's distribution ('distribution')"},
    )
    loss_decay: float = field(default=4.0, metadata={"help": "position weights exp(-k / loss_decay), k 0-based"})
    num_anchors: int | None = field(default=None, metadata={"help": "anchors per sequence (default: drafter config)"})
    logits_chunk_size: int = field(default=64, metadata={"help": "blocks whose draft logits are formed at once"})
    logits_memory_gb: float = field(default=6.0, metadata={"help": "above this, chunk logits are recomputed in backward"})
    remove_unused_columns: bool = False  # the drafter's forward does not take the dataset's columns


class DSparkCollator:
    """Right-pads ``input_ids`` / ``loss_mask`` and adds ``attention_mask``; with a
    :class:`~modeling_dspark.training.target_cache.TargetFeatureCache`, rows that carry a ``cache_index`` also get the
    target's cached ``target_hidden_states`` / ``target_last_hidden_states`` (zero-padded), so the trainer skips
    the target's forward."""

    def __init__(self, pad_token_id: int = 0, target_cache=None):
        self.pad_token_id = pad_token_id
        self.target_cache = target_cache

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(r["input_ids"]) for r in rows)
        def pad(values, fill):
            return torch.tensor([list(v) + [fill] * (width - len(v)) for v in values])
        batch = {
            "input_ids": pad([r["input_ids"] for r in rows], self.pad_token_id),
            "loss_mask": pad([r["loss_mask"] for r in rows], 0),
            "attention_mask": pad([[1] * len(r["input_ids"]) for r in rows], 0),
        }
        if self.target_cache is not None and all("cache_index" in r for r in rows):
            cached = [self.target_cache[int(r["cache_index"])] for r in rows]
            for key, part in (("target_hidden_states", 0), ("target_last_hidden_states", 1)):
                out = torch.zeros(len(rows), width, cached[0][part].shape[-1], dtype=cached[0][part].dtype)
                for i, (r, c) in enumerate(zip(rows, cached)):
                    if c[part].shape[0] != len(r["input_ids"]):
                        raise ValueError(f"target cache row {r['cache_index']} has {c[part].shape[0]} positions, the sequence {len(r['input_ids'])}")
                    out[i, : c[part].shape[0]] = c[part]
                batch[key] = out
        return batch


class DSparkTrainer(Trainer):
    loss_is_scaled_for_ga = False  # compute_loss returns a per-batch normalised mean

    def __init__(self, model=None, args: DSparkTrainingArguments | None = None, *, target=None, data_collator=None, **kwargs):
        if target is None:
            raise ValueError("DSparkTrainer needs the frozen target model: DSparkTrainer(model=drafter, target=target, ...)")
        model.check_compatible(target)
        if args is not None and not isinstance(args, DSparkTrainingArguments):
            raise TypeError("DSparkTrainer takes DSparkTrainingArguments (it carries the loss weights)")
        self.target = target.eval().requires_grad_(False)
        pad = getattr(target.generation_config, "pad_token_id", None) or 0
        super().__init__(model=model, args=args, data_collator=data_collator or DSparkCollator(pad), **kwargs)
        self.target.to(self.args.device)
        if self.args.device.type == "cpu":
            keep_freed_memory()  # a third of a CPU step is otherwise spent faulting in pages for its large tensors
        self._dspark_logs: dict[str, list] = defaultdict(list)
        self._eval_prefix: str | None = None  # set while evaluate() runs
        self.predicted_positions = 0  # supervised block slots trained on (the training budget's unit)

    def target_features(self, input_ids, attention_mask):
        """Context features of the drafter's layers and the target's final hidden states, frozen."""
        layers = self.accelerator.unwrap_model(self.model).config.target_layer_ids
        return target_features(self.target, layers, input_ids, attention_mask)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args = self.args
        drafter = self.accelerator.unwrap_model(model)  # model may be a data-parallel wrapper
        input_ids, loss_mask = inputs["input_ids"], inputs["loss_mask"]
        if "target_hidden_states" in inputs:  # a precomputed target cache, as DeepSpec trains
            features, last_hidden = inputs["target_hidden_states"], inputs["target_last_hidden_states"]
        else:
            features, last_hidden = self.target_features(input_ids, inputs.get("attention_mask"))
        if "anchor_positions" in inputs:
            anchors, keep = inputs["anchor_positions"], inputs["block_keep_mask"].bool()
        else:
            anchors, keep = sample_anchor_positions(loss_mask, args.num_anchors or drafter.config.num_anchors)
        loss_inputs = dict(
            input_ids=input_ids,
            loss_mask=loss_mask,
            context_features=features,
            target_last_hidden=last_hidden,
            input_embeddings=self.target.get_input_embeddings(),
            lm_head=self.target.get_output_embeddings(),
            anchors=anchors,
            keep=keep,
            ce_alpha=args.ce_alpha,
            l1_alpha=args.l1_alpha,
            confidence_alpha=args.confidence_alpha,
            ce_target=args.ce_target,
            decay=args.loss_decay,
            chunk_size=args.logits_chunk_size,
            logits_memory_gb=args.logits_memory_gb,
            return_logits=return_outputs,
        )
        # bf16 autocast for the drafter (fp32 master weights) where args.bf16 asks for it: the matrix products run
        # at the CPU's native bf16 rate; the loss terms cast their logits to fp32 themselves
        with torch.autocast(self.args.device.type, dtype=torch.bfloat16, enabled=bool(args.bf16)):
            out = model(dspark_loss_inputs=loss_inputs)  # through the wrapper, so data parallelism syncs gradients
        if self._eval_prefix is None and model.training:
            self.predicted_positions += int(out.accept_rate_den.sum())
        logs = self._dspark_logs
        for name in ("ce_loss", "l1_loss", "confidence_loss"):
            logs[name].append(float(getattr(out, name).detach()))
        logs["accept_num"].append(out.accept_rate_num.detach().cpu())
        logs["accept_den"].append(out.accept_rate_den.detach().cpu())
        if self._eval_prefix is not None:  # evaluation keeps every block for the acceptance_length metric
            mask = out.eval_mask.flatten(0, 1)
            logs["block_rates"] += out.accept_rate.flatten(0, 1)[mask.any(-1)].tolist()
            logs["block_masks"] += mask[mask.any(-1)].long().tolist()
        return (out.loss, out) if return_outputs else out.loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # the drafter has no logits to return: evaluation is the loss terms and the expected tau (see log())
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """Loss terms, per-position acceptance rates and expected tau (the ``acceptance_length`` metric, config
        ``"analytic"``) on the evaluation set, as ``{prefix}_expected_tau`` etc."""
        training_logs, self._dspark_logs = self._dspark_logs, defaultdict(list)
        self._eval_prefix = metric_key_prefix + "_"
        try:
            return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        finally:
            self._dspark_logs, self._eval_prefix = training_logs, None

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        pending = self._dspark_logs
        if pending["ce_loss"]:
            prefix = self._eval_prefix or ""
            for name in ("ce_loss", "l1_loss", "confidence_loss"):
                logs[prefix + name] = sum(pending[name]) / len(pending[name])
            if pending["block_rates"]:
                from modeling_dspark.metrics import load_metric

                metric = load_metric("acceptance_length", "analytic")
                result = metric.compute(acceptance_rates=pending["block_rates"], masks=pending["block_masks"])
                tau, rates = result["expected_tau"], result["acceptance_rate_per_position"]
            else:
                num, den = torch.stack(pending["accept_num"]).sum(0), torch.stack(pending["accept_den"]).sum(0)
                result = expected_tau_from_sums(num.tolist(), den.tolist())
                tau, rates = result["expected_tau"], result["acceptance_rate_per_position"]
            logs[prefix + "expected_tau"] = tau
            for k, rate in enumerate(rates):
                logs[f"{prefix}accept_rate@{k}"] = rate
            pending.clear()
        super().log(logs, *args, **kwargs)
