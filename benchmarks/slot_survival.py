"""Per slot, the drafter's calibrated survival against how often the target's verification reached that slot, in
real decoding at a fixed depth (every slot of every block verified), greedy and at T = 1, per domain: how far the
calibration is off slot by slot, which `DepthPlanner.corrected` learns online.

    python benchmarks/slot_survival.py --drafter checkpoints/dspark-smollm2-135m-instruct-v14 \
        --out benchmarks/results/slot_survival_v14

Writes ``slot_survival.json`` and ``slot_survival.md`` (the command, the CPU, one row per mode and domain).
"""

import argparse
import copy
import json
import shlex
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from generation.evaluation.prompts import chat_input_ids, load_eval_prompts
from generation.evaluation.speed import DEFAULT_DOMAINS
from modeling_dspark import DSparkModel, load_target
from modeling_dspark.cpu_blas import cpuinfo_field

MODES = {"greedy": dict(do_sample=False), "T = 1": dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)}


def slot_survival(target, tokenizer, drafter, *, num_prompts: int, max_new_tokens: int) -> dict:
    """``{mode: {domain: {"rounds", "promised", "reached"}}}``: per slot k, the mean calibrated survival of slot k
    and the share of rounds whose accepted drafts reached past it, over the rounds that verified slot k."""
    config = copy.deepcopy(target.generation_config)
    config.dspark_truncation = "fixed"
    block = drafter.config.block_size
    jobs = [(m, d, i, r) for m in MODES for d, name in DEFAULT_DOMAINS.items() for i, r in enumerate(load_eval_prompts(name, num_prompts))]
    rounds: dict = {m: {d: [] for d in DEFAULT_DOMAINS} for m in MODES}
    for mode, domain, i, row in tqdm(jobs, desc="decoding at a fixed depth"):
        torch.manual_seed(i)
        ids = chat_input_ids(tokenizer, row["prompt"])
        target.generate(ids, generation_config=config, assistant_model=drafter, max_new_tokens=max_new_tokens,
                        pad_token_id=tokenizer.eos_token_id, **MODES[mode])  # fmt: skip
        for r in drafter.last_stats.rounds:
            if r.verified:
                with torch.no_grad():
                    survival = drafter.survival(torch.tensor(r.confidence_logits)).tolist()
                rounds[mode][domain].append((survival, r.accepted, r.verified))
    out: dict = {}
    for mode, by_domain in rounds.items():
        out[mode] = {}
        for domain, rs in by_domain.items():
            seen = [[x for x in rs if x[2] > k] for k in range(block)]
            out[mode][domain] = {
                "rounds": len(rs),
                "promised": [sum(s[k] for s, _, _ in xs) / len(xs) if xs else None for k, xs in enumerate(seen)],
                "reached": [sum(a > k for _, a, _ in xs) / len(xs) if xs else None for k, xs in enumerate(seen)],
            }
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--num-prompts", type=int, default=3, help="per domain")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    target, tokenizer = load_target("smollm2-135m-instruct")
    drafter = DSparkModel.from_pretrained(args.drafter, dtype=target.dtype).eval()
    result = slot_survival(target, tokenizer, drafter, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "slot_survival.json").write_text(json.dumps(result, indent=1) + "\n")
    slots = drafter.config.block_size
    lines = [
        "# Calibrated survival against the slots reached, per slot",
        "",
        f"`{shlex.join(['python', 'benchmarks/slot_survival.py', *(sys.argv[1:] if argv is None else argv)])}`",
        "",
        f"CPU: {cpuinfo_field('model name')}; target in {str(target.dtype).removeprefix('torch.')}; {args.num_prompts} prompts per "
        f"domain, {args.max_new_tokens} new tokens, every round drafting and verifying all {slots} slots. Promised: mean calibrated "
        "survival of slot k; reached: share of those rounds whose accepted drafts reached past slot k.",
        "",
        "| mode | domain | rounds | " + " | ".join(f"slot {k + 1} promised / reached" for k in range(slots)) + " |",
        "|---|---|---|" + "---|" * slots,
    ]
    for mode, by_domain in result.items():
        for domain, row in by_domain.items():
            cells = [f"{p:.2f} / {r:.2f}" if p is not None else "-" for p, r in zip(row["promised"], row["reached"])]
            lines.append(f"| {mode} | {domain} | {row['rounds']} | " + " | ".join(cells) + " |")
    (out / "slot_survival.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
