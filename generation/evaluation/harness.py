"""The paper's evaluation at our scale (SPEC section 8): one decoding loop for every drafter, nine benchmarks.

Protocol: temperature 1 (no top-k / top-p; ``--temperature 0`` for greedy tau), chain drafting, full blocks (no truncation, no scheduler), first
turn only, the target's chat template; tau = mean tokens per verification round, bonus included, pooled over
rounds. Each benchmark is a seeded subsample (``random.Random(980406).shuffle``, first n, as DeepSpec's
eval.py); prompt i runs under seed ``seed + i``, identically for every drafter.

    python -m generation.evaluation.harness --drafter dspark=checkpoints/dspark-smollm2-135m-instruct \
        --drafter dflash=checkpoints/dflash-smollm2-135m-instruct --drafter eagle3=checkpoints/eagle3-smollm2-135m-instruct \
        --num-prompts 10 --max-new-tokens 128 --out benchmarks/results

Writes ``eval.json`` (every round: accepted, verified, raw confidence logits), ``eval.md`` and the plots: Table 1
(tau per benchmark, macro averages, DSpark's gain), Figure 2 (conditional acceptance per position and domain),
Figure 5 (static confidence-threshold sweep, replayed from the full-block rounds) and Figure 6 (reliability of
the survival before / after STS).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch

from generation.decoding.stats import DSparkRound, acceptance_length
from generation.evaluation.prompts import chat_input_ids, load_eval_prompts, verified_rounds
from modeling_dspark.checkpoint.confidence_head import calibrated_confidence, prefix_survival
from modeling_dspark.provenance import command_line

__all__ = ["DOMAINS", "evaluate_drafters", "load_drafter", "load_drafter_specs", "round_statistics", "summarize", "threshold_sweep", "write_report"]

# the paper's nine benchmarks (Table 1 order)
DOMAINS = {
    "math": ["gsm8k", "math500", "aime25"],
    "code": ["humaneval", "mbpp", "livecodebench"],
    "chat": ["mt-bench", "alpaca", "arena-hard-v2"],
}
THRESHOLDS = [0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]


def load_drafter(path: str | Path, dtype=torch.bfloat16):
    """Any drafter folder this project writes (DSpark, DFlash-as-DSpark, Eagle3, DeepSpec exports, LoRA adapters)."""
    from transformers import AutoModel

    import modeling_dspark  # noqa: F401  (registers the Auto classes)
    from modeling_dspark import DSparkModel
    from modeling_dspark.checkpoint.deepspec import is_deepspec_folder

    path = Path(path)
    if (path / "adapter_config.json").is_file():
        from modeling_dspark.training.adapt import load_adapted_drafter

        return load_adapted_drafter(path, dtype=dtype)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a drafter folder (no config.json)")
    if is_deepspec_folder(path):
        return DSparkModel.from_pretrained(path, dtype=dtype).eval()
    return AutoModel.from_pretrained(path, dtype=dtype).eval()


def load_drafter_specs(parser: argparse.ArgumentParser, specs: list[str], dtype=torch.bfloat16) -> dict:
    """``--drafter LABEL=PATH`` options to ``{label: drafter}``, with a clear error for a malformed or missing one."""
    drafters = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            parser.error(f"--drafter takes LABEL=PATH, got {spec!r}")
        try:
            drafters[label] = load_drafter(path, dtype=dtype)
        except FileNotFoundError as e:
            parser.error(str(e))
    return drafters


# ------------------------------------------------------------------------------------------ round statistics
def round_statistics(rounds: list[DSparkRound], block: int) -> dict:
    """Tau and per-position acceptance through the shipped ``acceptance_length`` metric module."""
    from modeling_dspark.metrics import load_metric

    metric = load_metric("acceptance_length", "rounds")
    return metric.compute(accepted=[r.accepted for r in rounds], verified=[r.verified for r in rounds], block_size=block)


def threshold_sweep(rounds: list[DSparkRound], temperatures, thresholds=THRESHOLDS) -> list[dict]:
    """Static truncation replayed on full-block rounds: at threshold lambda a round verifies the leading slots
    with survival ``prod sigmoid(z_i / T_i) >= lambda`` and accepts ``min(accepted, kept)`` of them. Exact per
    round (the same draws decide the same acceptances); only the later rounds' contexts would differ online."""
    usable = [r for r in rounds if r.confidence_logits]
    if not usable:
        return []
    out = []
    for lam in thresholds:
        kept, accepted = [], []
        for r in usable:
            z = torch.tensor(r.confidence_logits, dtype=torch.float64)
            kept.append(int((prefix_survival(calibrated_confidence(z, temperatures)) >= lam).sum()))
            accepted.append(min(r.accepted, kept[-1]))
        out.append(
            {"threshold": lam, "acceptance_rate": sum(accepted) / sum(kept) if sum(kept) else float("nan"),
             "verified_per_round": sum(kept) / len(usable), "tau": acceptance_length(accepted)}
        )  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------ the run
def evaluate_drafters(
    target, tokenizer, drafters: dict, *, benchmarks: list[str], num_prompts: int, max_new_tokens: int, seed: int = 0,
    temperature: float = 1.0, eval_dir=None, progress: bool = True,
) -> dict:  # fmt: skip
    """Rounds of every drafter on every benchmark, same prompts and seeds for all."""
    results = {"temperature": temperature, "drafters": {}, "benchmarks": {}}
    kwargs = {} if eval_dir is None else {"eval_dir": eval_dir}
    prompts = {name: load_eval_prompts(name, num_prompts, **kwargs) for name in benchmarks}
    for name, rows in prompts.items():
        results["benchmarks"][name] = {"prompt_ids": [row.get("id") for row in rows], "domain": rows[0].get("domain") if rows else None}
    for label, drafter in drafters.items():
        cfg = drafter.config
        results["drafters"][label] = {
            "model_type": cfg.model_type, "block_size": cfg.block_size,
            "temperatures": list(getattr(cfg, "confidence_temperatures", None) or [1.0] * cfg.block_size),
            "has_confidence_head": getattr(drafter, "confidence_head", None) is not None, "rounds": {},
        }  # fmt: skip
        for name, rows in prompts.items():
            ids = [chat_input_ids(tokenizer, row["prompt"])[0].tolist() for row in rows]
            rounds = list(verified_rounds(target, drafter, ids, max_new_tokens=max_new_tokens, seed=seed, temperature=temperature, progress=progress))
            results["drafters"][label]["rounds"][name] = [_compact(r) for r in rounds]
            if progress:
                print(f"{label:>8} {name:>14}: tau {acceptance_length(r.accepted for r in rounds):.2f} over {len(rounds)} rounds", flush=True)
    return results


def _compact(r: DSparkRound) -> dict:
    row = asdict(r)
    row["confidence_logits"] = [round(z, 4) for z in r.confidence_logits]
    row["draft_seconds"] = round(r.draft_seconds, 5)
    return row


def _rounds(results, label, names) -> list[DSparkRound]:
    stored = results["drafters"][label]["rounds"]
    return [DSparkRound(**r) for name in names if name in stored for r in stored[name]]


def summarize(results: dict) -> dict:
    """Table 1, Figure 2 and Figure 5 numbers from the stored rounds."""
    benchmarks = list(results["benchmarks"])
    domains = {d: [b for b in names if b in benchmarks] for d, names in DOMAINS.items()}
    domains = {d: names for d, names in domains.items() if names}
    other = [b for b in benchmarks if not any(b in names for names in domains.values())]
    if other:
        domains["other"] = other
    table, curves, sweeps = {}, {}, {}
    for label, info in results["drafters"].items():
        block = info["block_size"]
        row = {b: round_statistics(_rounds(results, label, [b]), block)["tau"] for b in benchmarks}
        for d, names in domains.items():
            row[f"{d} macro"] = sum(row[b] for b in names) / len(names)
        row["macro"] = sum(row[b] for b in benchmarks) / len(benchmarks)
        table[label] = row
        curves[label] = {d: round_statistics(_rounds(results, label, names), block)["conditional_acceptance"] for d, names in domains.items()}
        if info["has_confidence_head"]:
            sweeps[label] = {d: threshold_sweep(_rounds(results, label, names), info["temperatures"]) for d, names in domains.items()}
    gains = {}
    if "dspark" in table:
        for label in table:
            if label != "dspark":
                gains[label] = {k: table["dspark"][k] / v - 1.0 for k, v in table[label].items() if v == v and v > 0}
    return {"domains": domains, "tau": table, "dspark_gain": gains, "conditional_acceptance": curves, "threshold_sweep": sweeps}


# ------------------------------------------------------------------------------------------ report
def write_report(results: dict, out_dir: str | Path, command: str = "") -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from modeling_dspark.metrics import load_metric
    from modeling_dspark.training.calibration import CalibrationRounds, plot_reliability

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(results)
    benchmarks, labels = list(results["benchmarks"]), list(results["drafters"])
    cols = benchmarks + [f"{d} macro" for d in summary["domains"]] + ["macro"]
    temperature = results.get("temperature", 1.0)
    lines = [f"# DSpark evaluation at our scale\n\n`{command}`\n", results.get("protocol", ""), f"\n## Table 1 analogue: tau (T = {temperature:g}, full blocks, chain drafting)\n"]
    lines.append("| drafter | " + " | ".join(cols) + " |")
    lines.append("|---" * (len(cols) + 1) + "|")
    for label in labels:
        lines.append(f"| {label} | " + " | ".join(f"{summary['tau'][label][c]:.2f}" for c in cols) + " |")
    for label, gain in summary["dspark_gain"].items():
        lines.append(f"| DSpark gain vs {label} | " + " | ".join(f"{100 * gain.get(c, float('nan')):+.1f}%" for c in cols) + " |")
    lines.append("\n## Figure 2 analogue: conditional acceptance per position\n")
    for label, per_domain in summary["conditional_acceptance"].items():
        for d, values in per_domain.items():
            lines.append(f"- {label} / {d}: " + ", ".join(f"{v:.3f}" for v in values))
    calibration = {}
    for label, info in results["drafters"].items():
        if not info["has_confidence_head"]:
            continue
        lines.append(f"\n## Figure 5 analogue: static threshold sweep ({label}, replayed from full-block rounds)\n")
        lines.append("| domain | threshold | acceptance rate | verified / round | tau |\n|---|---|---|---|---|")
        for d, rows in summary["threshold_sweep"][label].items():
            for r in rows:
                lines.append(f"| {d} | {r['threshold']:.2f} | {r['acceptance_rate']:.3f} | {r['verified_per_round']:.2f} | {r['tau']:.2f} |")
        rounds = [r for r in _rounds(results, label, benchmarks) if r.confidence_logits]
        block = info["block_size"]
        ones, temps = [1.0] * block, info["temperatures"]
        metric = load_metric("calibration")
        z, acc = [r.confidence_logits for r in rounds], [r.accepted for r in rounds]
        calibration[label] = {"raw": metric.compute(confidence_logits=z, accepted=acc, temperatures=ones),
                              "sts": metric.compute(confidence_logits=z, accepted=acc, temperatures=temps)}  # fmt: skip
        cal = CalibrationRounds.from_lists(z, acc, block)
        plot_reliability(cal, {"raw": ones, "STS": temps}, out / f"figure6_reliability_{label}.png")
        b, a = calibration[label]["raw"], calibration[label]["sts"]
        lines.append(
            f"\n## Figure 6 analogue: reliability of the survival ({label}, all eval rounds)\n\nECE {100 * b['ece']:.2f}% -> "
            f"{100 * a['ece']:.2f}%, AUROC {b['auroc']:.3f} -> {a['auroc']:.3f}, Brier {b['brier']:.4f} -> {a['brier']:.4f} "
            f"(raw -> STS temperatures fitted on the held-out training split). Per position ECE after STS: "
            + ", ".join(f"{100 * m['ece']:.1f}%" for m in a["per_position"])
        )  # fmt: skip
    summary["calibration"] = calibration

    domains = list(summary["domains"])
    fig, axes = plt.subplots(1, len(domains), figsize=(4.5 * len(domains), 3.8), squeeze=False)
    for ax, d in zip(axes[0], domains):
        for label in labels:
            values = summary["conditional_acceptance"][label][d]
            ax.plot(range(1, len(values) + 1), values, marker="o", label=label)
        ax.set_title(f"{d}: conditional acceptance")
        ax.set_xlabel("block position k")
        ax.set_ylim(0, 1)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "figure2_conditional_acceptance.png", dpi=120)
    plt.close(fig)

    for label, per_domain in summary["threshold_sweep"].items():
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
        for d, rows in per_domain.items():
            xs = [r["threshold"] for r in rows]
            ax1.plot(xs, [r["acceptance_rate"] for r in rows], marker="o", label=d)
            ax2.plot(xs, [r["verified_per_round"] for r in rows], marker="o", label=d)
        ax1.set(title=f"{label}: acceptance rate of verified tokens", xlabel="threshold on survival", ylim=(0, 1))
        ax2.set(title=f"{label}: tokens verified per round", xlabel="threshold on survival")
        ax1.legend(), ax2.legend()
        fig.tight_layout()
        fig.savefig(out / f"figure5_threshold_sweep_{label}.png", dpi=120)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(cols)) + 1.5, 3.8))  # + room for the legend beside the bars
    width = 0.8 / max(len(labels), 1)
    for i, label in enumerate(labels):
        ax.bar([j + i * width for j in range(len(cols))], [summary["tau"][label][c] for c in cols], width, label=label)
    ax.set_xticks([j + width * (len(labels) - 1) / 2 for j in range(len(cols))], cols, rotation=45, ha="right")
    ax.set_ylabel("tau (tokens / round)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside the axes: no bar hidden
    fig.tight_layout()
    fig.savefig(out / "table1_tau.png", dpi=120)
    plt.close(fig)

    (out / "eval.md").write_text("\n".join(lines) + "\n")
    (out / "eval.json").write_text(json.dumps({"command": command, "summary": summary, **results}) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    from modeling_dspark.targets import add_target_arguments, dtype_label, target_from_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", action="append", required=True, metavar="LABEL=PATH", help="repeat for each drafter")
    add_target_arguments(parser)
    parser.add_argument("--benchmarks", nargs="+", default=[b for names in DOMAINS.values() for b in names])
    parser.add_argument("--num-prompts", type=int, default=10, help="seeded subsample per benchmark")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0, help="1: the paper's protocol; 0: greedy verification")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if not args.temperature >= 0:
        parser.error(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    target, tokenizer = target_from_args(args)
    drafters = load_drafter_specs(parser, args.drafter, dtype=target.dtype)
    results = evaluate_drafters(
        target, tokenizer, drafters, benchmarks=args.benchmarks, num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens, seed=args.seed, temperature=args.temperature,
    )  # fmt: skip
    regime = "greedy (temperature 0)" if args.temperature == 0 else f"temperature {args.temperature:g}"
    results["protocol"] = (
        f"Target {args.target} ({dtype_label(target.dtype)}), {regime}, full blocks, first turn, {args.num_prompts} prompts per benchmark "
        f"(seeded subsample, seed 980406), {args.max_new_tokens} new tokens, prompt i under seed {args.seed} + i."
    )
    command = command_line("generation.evaluation.harness", argv)
    summary = write_report(results, args.out, command)
    for label, row in summary["tau"].items():
        print(f"{label:>8}: macro tau {row['macro']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
