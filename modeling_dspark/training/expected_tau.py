"""Teacher-forced expected tau of a drafter on regenerated responses, per domain: what the trainer's held-out
evaluation reports (``DSparkTrainer.evaluate``: T = 1, the acceptance rate of each slot ``sum min(p, q)`` and the
analytic expected tau over the anchor blocks), on any response files.

It answers which text a drafter is good at. The held-out split of the training files is text the target sampled
at its recommended settings (SmolLM2: T = 0.2, top-p 0.9); the paper's evaluation decodes at T = 1, whose text
is another distribution. Responses regenerated at T = 1 (``python -m modeling_dspark.training.data --temperature
1.0 --top-p 1.0``) and evaluated here show how much of the gap between the held-out expected tau and the
harness's T = 1 tau comes from the text alone.

    python -m modeling_dspark.training.expected_tau --drafter checkpoints/dspark-smollm2-135m-instruct-v14 \\
        --data benchmarks/results/text_temperature/held_out_t1.jsonl.gz --label "T = 1" --out benchmarks/results/text_temperature

Each run adds (or replaces) its label in ``expected_tau.json`` and rewrites ``expected_tau.md`` / ``expected_tau.png`` in
``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import torch

__all__ = ["evaluate_expected_tau", "main", "write_report"]

DOMAINS = ("math", "code", "chat")


def evaluate_expected_tau(drafter, target, rows: list[dict], *, num_anchors: int | None = None, batch_size: int = 1,
                          max_length: int = 640, seed: int = 0) -> dict:  # fmt: skip
    """``{"expected_tau", "acceptance_rate_per_position", "sequences"}`` of ``drafter`` on ``rows`` (responses with
    ``prompt_ids`` / ``response_ids``), from the trainer's own evaluation with anchors drawn under ``seed``."""
    from modeling_dspark.training.data import build_dataset
    from modeling_dspark.training.trainer import DSparkCollator, DSparkTrainer, DSparkTrainingArguments

    dataset = build_dataset(rows, max_length=max_length)
    if len(dataset) == 0:
        raise ValueError("no response long enough to evaluate (build_dataset keeps responses of 8 tokens or more)")
    with tempfile.TemporaryDirectory(prefix="dspark-expected-tau-") as scratch:
        args = DSparkTrainingArguments(
            output_dir=scratch, per_device_eval_batch_size=batch_size, report_to=[], use_cpu=not torch.cuda.is_available(),
            dataloader_num_workers=0, num_anchors=num_anchors,
        )  # fmt: skip
        pad = getattr(target.generation_config, "pad_token_id", None) or 0
        trainer = DSparkTrainer(model=drafter, args=args, target=target, eval_dataset=dataset, data_collator=DSparkCollator(pad))
        torch.manual_seed(seed)
        metrics = trainer.evaluate()
    rates = [metrics[key] for key in sorted((k for k in metrics if k.startswith("eval_accept_rate@")), key=lambda k: int(k.split("@")[1]))]
    return {"expected_tau": metrics["eval_expected_tau"], "acceptance_rate_per_position": rates, "sequences": len(dataset)}


def _markdown(results: dict) -> str:
    lines = [
        "# Teacher-forced expected tau (T = 1) by the text it is measured on",
        "",
        "`python -m modeling_dspark.training.expected_tau` (the trainer's held-out evaluation on the files named); each row's",
        "command is in `expected_tau.json`.",
        "",
        "| text | drafter | " + " | ".join(DOMAINS) + " | macro | sequences |",
        "|---|---|" + "---|" * (len(DOMAINS) + 2),
    ]
    for label, run in results.items():
        cells = [f"{run['domains'][d]['expected_tau']:.3f}" if d in run["domains"] else "-" for d in (*DOMAINS, "macro")]
        count = run["domains"].get("macro", {}).get("sequences", 0)
        lines.append(f"| {label} | {Path(run['drafter']).name} | " + " | ".join(cells) + f" | {count} |")
    lines += ["", "Acceptance rate per slot (mean over domains):", "", "| text | " + " | ".join(f"slot {k + 1}" for k in range(7)) + " |",
              "|---|" + "---|" * 7]  # fmt: skip
    for label, run in results.items():
        rates = run["domains"].get("macro", {}).get("acceptance_rate_per_position", [])
        lines.append(f"| {label} | " + " | ".join(f"{r:.3f}" for r in rates[:7]) + " |")
    return "\n".join(lines) + "\n"


def write_report(out: str | Path, results: dict) -> None:
    """``expected_tau.md`` and ``expected_tau.png`` (acceptance rate per slot, one line per text) in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    (out / "expected_tau.md").write_text(_markdown(results))
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, run in results.items():
        macro = run["domains"].get("macro", {})
        rates = macro.get("acceptance_rate_per_position", [])
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{label}: tau {macro.get('expected_tau', float('nan')):.2f}")
    ax.set_xlabel("block slot")
    ax.set_ylabel("acceptance rate (mean over domains)")
    ax.set_ylim(0, 1)
    ax.set_title("Teacher-forced acceptance (T = 1) by the text it is measured on", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "expected_tau.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from modeling_dspark import DSparkModel, load_target
    from modeling_dspark.provenance import command_line
    from modeling_dspark.targets import add_target_arguments, resolve_dtype
    from modeling_dspark.training.data import read_responses, split_holdout

    parser = argparse.ArgumentParser(description="Teacher-forced expected tau of a drafter on response files, per domain")
    add_target_arguments(parser)
    parser.add_argument("--drafter", required=True, help="drafter folder")
    parser.add_argument("--data", nargs="+", required=True, help="response files (JSONL, optionally gzip)")
    parser.add_argument("--held-out", action="store_true", help="only the held-out split's prompt ids (as training splits them)")
    parser.add_argument("--same-prompts-as", default=None, metavar="FILE",
                        help="only the prompt ids that this response file has (the same prompts, another text)")
    parser.add_argument("--max-sequences", type=int, default=100, help="per domain, a seeded sample (0: all)")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per forward (1: no padding, the cheapest on a CPU)")
    parser.add_argument("--num-anchors", type=int, default=64, help="anchor blocks per sequence")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", required=True, help="the row's name, e.g. 'T = 1 text'")
    parser.add_argument("--out", required=True, help="folder for expected_tau.json / expected_tau.md")
    args = parser.parse_args(argv)
    missing = [path for path in [*args.data, *([args.same_prompts_as] if args.same_prompts_as else [])] if not Path(path).is_file()]
    if missing:
        raise SystemExit(f"--data / --same-prompts-as: no such file: {', '.join(missing)}")
    config_path = Path(args.drafter) / "config.json"
    if not config_path.is_file():
        raise SystemExit(f"--drafter {args.drafter}: not a drafter folder (no config.json)")
    if json.loads(config_path.read_text()).get("model_type") != "dspark":
        raise SystemExit(f"--drafter {args.drafter}: a DSpark or DFlash drafter is needed (the Eagle3 loss has no block slots)")
    if args.num_anchors < 1 or args.max_sequences < 0 or args.batch_size < 1:
        raise SystemExit("--num-anchors and --batch-size must be >= 1 and --max-sequences >= 0")
    rows = [row for path in args.data for row in read_responses(path)]
    if args.held_out:
        rows = split_holdout(rows)[1]
    if args.same_prompts_as:
        ids = {row["id"] for row in read_responses(args.same_prompts_as)}
        rows = [row for row in rows if row["id"] in ids]
    rng = random.Random(args.seed)
    by_domain = {}
    for domain in DOMAINS:
        picked = sorted((r for r in rows if r.get("domain") == domain), key=lambda r: r["id"])
        rng.shuffle(picked)
        if picked:
            by_domain[domain] = picked[: args.max_sequences or None]
    if not by_domain:
        raise SystemExit(f"no {'held-out ' if args.held_out else ''}responses of the domains {DOMAINS} in {args.data}")

    target, _ = load_target(args.target, dtype=resolve_dtype(args.dtype))
    drafter = DSparkModel.from_pretrained(args.drafter, dtype=torch.float32).eval()
    domains = {}
    for domain, picked in by_domain.items():
        domains[domain] = evaluate_expected_tau(drafter, target, picked, num_anchors=args.num_anchors, batch_size=args.batch_size, seed=args.seed)
        print(f"{args.label} {domain}: expected tau {domains[domain]['expected_tau']:.3f} on {domains[domain]['sequences']} sequences", flush=True)
    domains["macro"] = {  # the harness's macro: the mean over domains
        "expected_tau": sum(d["expected_tau"] for d in domains.values()) / len(domains),
        "acceptance_rate_per_position": [sum(r) / len(r) for r in zip(*(d["acceptance_rate_per_position"] for d in domains.values()))],
        "sequences": sum(d["sequences"] for d in domains.values()),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "expected_tau.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    results[args.label] = {
        "command": command_line("modeling_dspark.training.expected_tau", argv),
        "drafter": args.drafter,
        "data": args.data,
        "held_out": args.held_out,
        "same_prompts_as": args.same_prompts_as,
        "num_anchors": args.num_anchors,
        "domains": domains,
    }
    path.write_text(json.dumps(results, indent=1) + "\n")
    write_report(out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
