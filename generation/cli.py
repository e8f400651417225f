"""``dspark`` command line: ``dspark generate`` runs DSpark on the embedded default target and reports tau and the
speed-up over plain ``generate()`` in the same dtype; the other sub-commands run the workflow's modules
(``dspark <command> --help`` shows each one's options)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# the parser is built before torch / transformers are imported (bad arguments fail at once), so it does not use
# modeling_dspark.targets.add_target_arguments
DTYPE_CHOICES = ("auto", "bf16", "fp32")

__all__ = ["main"]

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, then explain it briefly."
# The shipped SmolLM2 drafter: the main job, the Space and its build read it from here; a random drafter is used
# where the folder is missing.
SHIPPED_DRAFTER = Path(__file__).resolve().parents[1] / "checkpoints" / "dspark-smollm2-135m-instruct-v14"


def _timed_generate(target, input_ids, **kwargs):
    start = time.perf_counter()
    out = target.generate(input_ids, **kwargs)
    return out, time.perf_counter() - start


def cmd_generate(args) -> int:
    import torch

    from generation.evaluation.prompts import chat_input_ids
    from modeling_dspark import DSparkModel, load_target
    from modeling_dspark.targets import dtype_label, resolve_dtype

    drafter_path = Path(args.drafter) if args.drafter else SHIPPED_DRAFTER
    torch.manual_seed(args.seed)
    dtype = resolve_dtype(args.dtype)
    dtype_name = dtype_label(dtype)
    why = " (auto: this CPU has no fast bf16 matrix products)" if args.dtype == "auto" and dtype != torch.bfloat16 else ""
    print(f"loading {args.target} ({dtype_name}{why}) ...", file=sys.stderr)
    target, tokenizer = load_target(args.target, dtype=dtype)
    if drafter_path.is_dir():
        drafter = DSparkModel.from_pretrained(drafter_path, dtype=dtype).eval()
        drafter.check_compatible(target)
        source = str(drafter_path)
    else:
        drafter = DSparkModel.from_target(target, num_draft_layers=2, markov_rank=64).eval()
        source = "random (untrained: expect tau near 1 and a speed-up below 1)"
    input_ids = chat_input_ids(tokenizer, args.prompt)
    sampling = dict(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0) if args.temperature > 0 else dict(do_sample=False)
    common = dict(max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.eos_token_id, **sampling)

    from transformers import GenerationConfig

    plain_config = GenerationConfig(**common)
    dspark_settings = dict(dspark_truncation=args.truncation, dspark_confidence_threshold=args.threshold)
    dspark_config = GenerationConfig(**common, **dspark_settings)
    # one short warm-up of each path (first calls pay for allocations; a "cost" run profiles this machine), then
    # the timed runs
    target.generate(input_ids, max_new_tokens=8, pad_token_id=tokenizer.eos_token_id)
    warm_up = GenerationConfig(**{**common, "max_new_tokens": 8}, **dspark_settings)
    target.generate(input_ids, generation_config=warm_up, assistant_model=drafter)
    hybrid_config = None
    if args.prompt_lookup:  # also profiles this machine's costs once (cached on disk) before anything is timed
        hybrid_config = GenerationConfig(**common, **dspark_settings, prompt_lookup_num_tokens=args.prompt_lookup)
        warm_up.prompt_lookup_num_tokens = args.prompt_lookup
        target.generate(input_ids, generation_config=warm_up, assistant_model=drafter)
    plain_out, plain_s = _timed_generate(target, input_ids, generation_config=plain_config)
    ds_out, ds_s = _timed_generate(target, input_ids, generation_config=dspark_config, assistant_model=drafter)
    stats = drafter.last_stats
    n_plain = plain_out.shape[1] - input_ids.shape[1]
    n_ds = ds_out.shape[1] - input_ids.shape[1]
    text = tokenizer.decode(ds_out[0, input_ids.shape[1] :], skip_special_tokens=True)
    plain_tps, ds_tps = n_plain / plain_s, n_ds / ds_s
    print(f"drafter: {source}")
    mkl = f"; MKL_CBWR={os.environ['MKL_CBWR']} (modeling_dspark.cpu_blas)" if os.environ.get("MKL_CBWR") else ""
    print(f"dtype: {dtype_name}{why}{mkl}")
    print(f"prompt: {args.prompt}\n")
    print(text.strip() + "\n")
    print(f"tau (tokens per target forward, bonus included): {stats.tau:.2f} over {stats.num_rounds} rounds")
    if args.truncation == "cost":
        drafting = sum(r.drafted > 0 for r in stats.rounds)
        print(f"cost truncation: the drafter ran in {drafting} of {stats.num_rounds} rounds (the rest decoded plainly)")
    print(f"plain generate():  {n_plain} tokens in {plain_s:.2f} s = {plain_tps:.1f} tok/s")
    print(f"DSpark generate(): {n_ds} tokens in {ds_s:.2f} s = {ds_tps:.1f} tok/s")
    mode = "greedy" if args.temperature == 0 else f"T={args.temperature}"
    print(f"speed-up: {ds_tps / plain_tps:.2f}x ({dtype_name}, {mode})")
    if hybrid_config is not None:
        hy_out, hy_s = _timed_generate(target, input_ids, generation_config=hybrid_config, assistant_model=drafter)
        hy_stats, n_hy = drafter.last_stats, hy_out.shape[1] - input_ids.shape[1]
        share = ", ".join(f"{kind} {part:.0%}" for kind, part in hy_stats.proposal_share().items())
        print(f"\nhybrid (DSpark + prompt lookup of {args.prompt_lookup} tokens, chosen each round): tau {hy_stats.tau:.2f}, rounds: {share}")
        print(f"hybrid generate(): {n_hy} tokens in {hy_s:.2f} s = {n_hy / hy_s:.1f} tok/s, speed-up {n_hy / hy_s / plain_tps:.2f}x ({dtype_name}, {mode})")
    return 0


# sub-command -> (module whose main(argv) it runs, help)
WORKFLOW = {
    "prepare-data": ("modeling_dspark.training.data", "let the target regenerate its responses to the training prompts"),
    "train": ("modeling_dspark.training.train", "train a DSpark, DFlash or Eagle3 drafter (resumable)"),
    "bench-train": ("modeling_dspark.training.bench_train", "training speed (predicted positions / s) of the default recipe against the first shipped one"),
    "calibrate": ("modeling_dspark.training.calibration", "Sequential Temperature Scaling of a drafter's confidence head"),
    "expected-tau": ("modeling_dspark.training.expected_tau", "teacher-forced expected tau of a drafter on any response files, per domain"),
    "adapt": ("modeling_dspark.training.adapt", "LoRA-adapt a trained drafter to a new domain with PEFT"),
    "eval": ("generation.evaluation.harness", "the paper's tau evaluation on the nine benchmarks, tables and plots"),
    "bench": ("generation.evaluation.speed", "wall-clock speed at batch size 1 against plain generate() and prompt lookup"),
    "profile": ("generation.evaluation.cost_plots", "measure the target's SPS(B) cost table (cached on disk) and plot it"),
    "load": ("generation.evaluation.load_benchmark", "batched engine throughput under load for every scheduler"),
    "card": ("hub_cards.cards", "write a drafter folder's model card (README.md) from its config and results"),
    "push": ("hub_cards.push", "upload a drafter folder to the Hugging Face Hub (remote code included)"),
    "demo": ("hub_cards.space.app", "the Gradio demo: plain and DSpark generation side by side, in the browser"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative decoding for Transformers")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in WORKFLOW.items():
        # the module parses its own options (and its own --help)
        sub.add_parser(name, help=help_text, add_help=False).set_defaults(module=module)
    gen = sub.add_parser("generate", help="DSpark generation on an embedded target, with tau and the speed-up")
    gen.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT, help="user message (chat template applied)")
    gen.add_argument("--target", default="smollm2-135m-instruct", help="embedded target name")
    gen.add_argument("--drafter", default=None, help="drafter folder (default: the shipped SmolLM2 drafter if present)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--truncation", choices=("fixed", "threshold", "cost"), default="threshold", help="cost: plan each round from this machine's profiled costs (may decode plainly where drafting cannot pay)")
    gen.add_argument("--threshold", type=float, default=0.0, help="cumulative-survival threshold (threshold mode)")
    gen.add_argument("--prompt-lookup", type=int, default=10, help="also run hybrid drafting with prompt lookup of this many tokens (0: off)")
    gen.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help="auto: bf16 where this CPU has fast bf16, else fp32")
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, rest = build_parser().parse_known_args(argv)
    if getattr(args, "module", None):
        import importlib

        return importlib.import_module(args.module).main(rest)
    if rest:
        build_parser().error(f"unrecognized arguments: {' '.join(rest)}")
    if args.func is cmd_generate:  # before anything slow is loaded
        problem = generate_argument_problem(args)
        if problem:
            build_parser().error(problem)
    return args.func(args)


def generate_argument_problem(args) -> str | None:
    """What is wrong with ``dspark generate``'s arguments, in one line (None when nothing is)."""
    if not args.max_new_tokens >= 1:
        return f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"
    if not args.temperature >= 0:  # also catches nan
        return f"--temperature must be >= 0 (0 = greedy), got {args.temperature}"
    if not 0 <= args.threshold <= 1:
        return f"--threshold is a cumulative survival probability in [0, 1], got {args.threshold}"
    if args.prompt_lookup < 0:
        return f"--prompt-lookup must be >= 0 (0 = off), got {args.prompt_lookup}"
    if args.drafter and not Path(args.drafter).is_dir():
        return f"--drafter {args.drafter} is not a folder"
    return None


if __name__ == "__main__":
    sys.exit(main())
