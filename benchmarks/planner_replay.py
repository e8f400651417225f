"""Replay depth-planning policies on recorded greedy decodes, against the cost tables, without the machine's noise.

Greedy decoding's output does not depend on the schedule, and neither does a block the drafter drafts from a given
anchor (the drafter reads the target's features of the positions before it, causally). So one recording, the
drafter's full block and calibrated survival at every anchor of a greedy decode, plus how many of its drafts the
target's output matches, gives every round any policy would run: a round from anchor i that verifies L drafts
accepts min(a_i, L) and moves to anchor i + min(a_i, L) + 1. Each round is priced by this machine's profiled tables
(draft call with its catch-up over the positions the drafter missed, verify forward of L + 1 tokens), the same
tables the planner reads, so what differs between policies is their decisions alone. Sampling is not replayed: its
trajectory depends on the schedule.

    python benchmarks/planner_replay.py --drafter checkpoints/dspark-smollm2-135m-instruct-v14 \
        --out benchmarks/results/planner_replay_v14

Policies: every fixed depth D (all drafts verified); the confidence threshold of the drafter's config (and those of
``--thresholds``); the depth planner with Algorithm 1's cut, as ``dspark_truncation="cost"`` runs it, fed the
replayed rounds at their modelled times (``--planner-module FILE`` adds the planner of another checkout, to compare
code). Writes ``planner_replay.json`` and ``planner_replay.md``: modelled speed against plain decoding, tokens per
round, slots drafted per round, per domain and pooled.
"""

import argparse
import copy
import importlib.util
import json
import shlex
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from generation.decoding.candidate_generator import DSparkCandidateGenerator
from generation.evaluation.prompts import chat_input_ids, load_eval_prompts
from generation.evaluation.speed import DEFAULT_DOMAINS
from generation.scheduling import depth_planner
from generation.scheduling.profiler import profile_draft_cost, profile_verify_cost
from generation.scheduling.scheduler import DraftCost
from modeling_dspark import DSparkModel, load_target
from modeling_dspark.cpu_blas import cpuinfo_field


def record_blocks(target, drafter, prompt_ids: torch.LongTensor, max_new_tokens: int, pad_token_id: int) -> dict:
    """Greedy-decode ``prompt_ids`` one token a round while the drafter drafts its full block from every anchor:
    ``{"tokens", "survival", "accepted"}`` per anchor (anchor i is the i-th generated token)."""
    blocks = []
    propose = DSparkCandidateGenerator._propose

    def record(self, input_ids, model_outputs):  # draft as usual, verify nothing: one target token a round
        candidates, _ = propose(self, input_ids, model_outputs)
        round_ = self._pending_round
        if round_ is None:  # no room left for a draft: the last round, which the target runs alone
            return candidates, None
        drafted = candidates[0, input_ids.shape[1] :].tolist()
        with torch.no_grad():
            survival = self.drafter.survival(torch.tensor(round_.confidence_logits)).tolist()
        blocks.append((input_ids.shape[1] - prompt_ids.shape[1], drafted, survival))
        round_.verified, round_.confidence_logits = 0, []
        return input_ids, None

    config = copy.deepcopy(target.generation_config)
    config.dspark_truncation = "fixed"
    DSparkCandidateGenerator._propose = record
    try:
        out = target.generate(prompt_ids, generation_config=config, assistant_model=drafter, do_sample=False,
                              max_new_tokens=max_new_tokens, pad_token_id=pad_token_id)  # fmt: skip
    finally:
        DSparkCandidateGenerator._propose = propose
    generated = out[0, prompt_ids.shape[1] :].tolist()
    rows = {"prompt_tokens": prompt_ids.shape[1], "tokens": len(generated), "survival": [], "accepted": []}
    for i, (offset, drafted, survival) in enumerate(blocks):
        assert offset == i + 1, "one round per generated token"
        truth = generated[i + 1 : i + 1 + len(drafted)]
        accepted = next((k for k, (d, t) in enumerate(zip(drafted, truth)) if d != t), min(len(drafted), len(truth)))
        rows["survival"].append(survival)
        rows["accepted"].append(accepted)
    return rows


def replay(record: dict, policy, verify, draft_cost: DraftCost) -> dict:
    """Run ``policy`` over one recorded decode: modelled seconds, rounds, drafted slots, and per round ``(depth,
    verified, accepted)``. ``policy(i, context, room)`` returns ``(depth, cut)``, where ``cut(survival)`` gives the
    drafts to verify; a policy with an ``outcome`` method is told each round's
    ``(survival, verified, accepted, depth, context, seconds)``."""
    n = record["tokens"]
    # the drafter's first call reads the prompt's features
    i, seconds, trace, context = 0, 0.0, [], record["prompt_tokens"]
    while i < n - 1:  # anchor i: the tokens after it are generated by this round
        room = n - 2 - i  # drafts that fit before the last token, which the target itself adds
        depth, cut = policy(i, context, room) if room > 0 else (0, None)
        depth = min(depth, room, len(record["survival"][i])) if depth else 0
        survival = record["survival"][i][:depth] if depth else []
        verified = min(cut(survival), depth) if depth else 0
        accepted = min(record["accepted"][i], verified) if verified else 0
        spent = draft_cost.draft_seconds(1, depth, context) if depth else 0.0
        spent += verify.step_seconds(1, 1 + verified, 1 + verified)
        if hasattr(policy, "outcome") and room > 0:
            policy.outcome(survival, verified, accepted, depth, context, spent)
        seconds += spent
        trace.append((depth, verified, accepted))
        context = accepted + 1 if depth else context + accepted + 1
        i += accepted + 1
    plain = (n - 1) * verify.step_seconds(1, 1, 1)
    return {"tokens": n - 1, "seconds": seconds, "plain_seconds": plain, "rounds": len(trace),
            "slots": sum(d for d, _, _ in trace), "trace": trace}  # fmt: skip


def fixed(depth: int):
    return lambda i, context, left: (depth, lambda s: len(s))


def threshold(value: float, depth: int):
    def cut(survival):
        return next((k for k, a in enumerate(survival) if a < value), len(survival))

    return lambda i, context, left: (depth, cut)


class PlannerPolicy:
    """``dspark_truncation="cost"``'s decisions, as the candidate generator makes them, on replayed rounds."""

    def __init__(self, module, verify, draft_cost, block: int):
        self.planner = module.DepthPlanner(verify, draft_cost, block)
        self.estimate = None

    def __call__(self, i, context, left):
        self.depth = self.planner.plan([self.estimate], context, tokens_left=left + 1)
        self.context = context
        self.planner.drafted(self.depth)
        return self.depth, self.cut

    def _method(self, name: str):
        """The replayed planner's own ``name``; a planner from before that method gets this checkout's, which
        reads only what every replayable planner has (its tables, ``corrected``, the two ``record_*`` methods)."""
        return getattr(type(self.planner), name, getattr(depth_planner.DepthPlanner, name)).__get__(self.planner)

    def cut(self, survival):
        self.estimate = self.planner.update_estimates([self.estimate], [survival])[0]
        return self._method("cut")([survival], self.depth, self.context)[0]

    def outcome(self, survival, verified, accepted, depth, context, seconds):
        self._method("record_round")(
            depth, [verified], [accepted], seconds, survival=[survival[:verified]] if verified else None,
            committed=accepted + 1, context=context,
        )  # fmt: skip


def load_module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--num-prompts", type=int, default=4, help="per domain")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--planner-module", action="append", default=[], metavar="LABEL=FILE",
                        help="another depth_planner.py to replay beside this checkout's")  # fmt: skip
    parser.add_argument("--records", help="reuse the recordings of an earlier run (its planner_replay.json)")
    parser.add_argument("--thresholds", type=float, nargs="*", default=[],
                        help="confidence thresholds (on the calibrated survival) to replay beside the config's")  # fmt: skip
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    target, tokenizer = load_target("smollm2-135m-instruct")
    drafter = DSparkModel.from_pretrained(args.drafter, dtype=target.dtype).eval()
    block = drafter.config.block_size
    verify = profile_verify_cost(target, rows=(1,), max_width=block + 1, four_d_mask=False)
    draft_cost = profile_draft_cost(target, drafter, rows=(1,))
    if args.records:
        records = json.loads(Path(args.records).read_text())["records"]
    else:
        records = {}
        jobs = [(d, r) for d, name in DEFAULT_DOMAINS.items() for r in load_eval_prompts(name, args.num_prompts)]
        for domain, row in tqdm(jobs, desc="recording every anchor's block"):
            ids = chat_input_ids(tokenizer, row["prompt"])
            records.setdefault(domain, []).append(record_blocks(target, drafter, ids, args.max_new_tokens, tokenizer.eos_token_id))
    modules = {"planner": depth_planner}
    for spec in args.planner_module:
        label, path = spec.split("=", 1)
        modules[label] = load_module(path, f"replayed_{label}")
    policies = {f"fixed {d}": (lambda d=d: fixed(d)) for d in range(1, block + 1)}
    for value in dict.fromkeys([drafter.config.confidence_threshold, *args.thresholds]):
        policies[f"threshold {value:g}"] = lambda value=value: threshold(value, block)
    for label, module in modules.items():
        policies[label] = lambda module=module: PlannerPolicy(module, verify, draft_cost, block)
    results = {}
    for name, make in policies.items():
        results[name] = {}
        policy = make()  # one planner for the whole replay, as a drafter keeps its planner across generate() calls
        for domain, recs in records.items():
            totals = [replay(rec, policy, verify, draft_cost) for rec in recs]
            keys = ("tokens", "seconds", "plain_seconds", "rounds", "slots")
            results[name][domain] = {k: sum(t[k] for t in totals) for k in keys}
    table = {}
    for name, by_domain in results.items():
        pooled = {k: sum(v[k] for v in by_domain.values()) for k in next(iter(by_domain.values()))}
        table[name] = {d: {"speedup": v["plain_seconds"] / v["seconds"], "tokens_per_round": v["tokens"] / v["rounds"],
                           "slots_per_round": v["slots"] / v["rounds"]} for d, v in {**by_domain, "all": pooled}.items()}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "planner_replay.json").write_text(json.dumps({"table": table, "records": records}) + "\n")
    domains = [*records, "all"]
    lines = [
        "# Depth-planning policies replayed on recorded greedy decodes",
        "",
        f"`{shlex.join(['python', 'benchmarks/planner_replay.py', *(sys.argv[1:] if argv is None else argv)])}`",
        "",
        f"CPU: {cpuinfo_field('model name')}; target in {str(target.dtype).removeprefix('torch.')}; {args.num_prompts} prompts per "
        f"domain, {args.max_new_tokens} new tokens, greedy. Each round priced by this machine's profiled tables (a plain step: "
        f"{1000 * verify.step_seconds(1, 1, 1):.0f} ms; drafting {1000 * draft_cost.draft_seconds(1, 1):.0f}-"
        f"{1000 * draft_cost.draft_seconds(1, block):.0f} ms for 1-{block} slots). Speed-up: modelled time of plain decoding over "
        "the policy's; tokens and drafted slots per round.",
        "",
        "| policy | " + " | ".join(f"{d} speed-up | {d} tokens / round | {d} slots / round" for d in domains) + " |",
        "|---|" + "---|---|---|" * len(domains),
    ]
    for name, by_domain in table.items():
        cells = [f"{v['speedup']:.3f}x | {v['tokens_per_round']:.2f} | {v['slots_per_round']:.2f}" for v in (by_domain[d] for d in domains)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    (out / "planner_replay.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
