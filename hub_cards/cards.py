"""Model cards for drafter folders, from what the folder and the evaluation already hold.

``drafter_card(folder)`` reads ``config.json`` (kind and geometry), ``training_budget.json`` (command, budget,
final logs), ``calibration.json`` (ECE / AUROC / Brier before and after STS) and, when given, the evaluation
harness's ``eval.json`` (tau per benchmark, also as model-index results), appends ``card_notes.md`` when the
folder has one, and returns a ``huggingface_hub.ModelCard`` with the metadata the Hub indexes (base model =
the target, ``library_name: transformers``, tags, licence).

    python -m hub_cards.cards checkpoints/dspark-smollm2-135m-instruct --eval benchmarks/results/eval.json --label dspark
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

__all__ = ["DEFAULT_TARGET_REPO", "drafter_card", "write_card"]

DEFAULT_TARGET_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
KINDS = {  # model_type -> (tag, one-line description)
    "dspark": ("dspark", "DSpark drafter: parallel block drafting, Markov sequential head, confidence head"),
    "eagle3_drafter": ("eagle3", "Eagle3 drafter: one autoregressive layer on fused target features"),
}


def _read(folder: Path, name: str):
    path = folder / name
    return json.loads(path.read_text()) if path.is_file() else None


def _kind(config: dict) -> tuple[str, str]:
    if config.get("model_type") == "dspark" and config.get("markov_head_type") is None and not config.get("confidence_head"):
        return "dflash", "DFlash drafter (the paper's parallel baseline): DSpark backbone without Markov or confidence head"
    if config.get("model_type") not in KINDS:
        raise ValueError(f"{config.get('model_type')!r} is not a drafter this project writes cards for")
    return KINDS[config["model_type"]]


def _truncation(config: dict, block) -> str | None:
    """What a round verifies by default (``truncation`` and ``confidence_threshold`` of a DSpark config), and how a
    ``generate()`` call overrides it; None for drafters without that setting (Eagle3)."""
    if config.get("model_type") != "dspark":
        return None
    mode, threshold = config.get("truncation", "threshold"), float(config.get("confidence_threshold") or 0.0)
    if mode == "threshold" and threshold > 0 and config.get("confidence_head"):
        default = (f"Each round drafts up to {block} tokens and verifies them up to the last whose calibrated cumulative survival "
                   f"(the product of the confidence head's STS-calibrated confidences) is at least {threshold:g}")  # fmt: skip
    elif mode == "cost":
        default = (f"Each round verifies as many of its {block} drafts as Algorithm 1 finds worth their cost, on verify and "
                   "drafting costs profiled once on the machine")  # fmt: skip
    else:
        default = f"Each round drafts and verifies the whole block of {block} tokens"
    return (f"{default} (`truncation: \"{mode}\"`, `confidence_threshold: {threshold:g}` in `config.json`). "
            '`generate(..., dspark_truncation="fixed" | "threshold" | "cost", dspark_confidence_threshold=...)` '
            "overrides them for one call; the output is the target's either way.")


def drafter_card(folder: str | Path, *, target_repo: str = DEFAULT_TARGET_REPO, eval_results: str | Path | None = None,
                 label: str | None = None, repo_id: str | None = None) -> ModelCard:  # fmt: skip
    folder = Path(folder)
    config = _read(folder, "config.json")
    if config is None:
        raise FileNotFoundError(f"{folder} has no config.json: not a drafter folder")
    tag, description = _kind(config)
    name = repo_id or folder.name
    budget, calibration = _read(folder, "training_budget.json"), _read(folder, "calibration.json")
    taus = {}
    if eval_results is not None:
        stored = json.loads(Path(eval_results).read_text())
        row = stored["summary"]["tau"].get(label or tag)
        if row is None:
            raise ValueError(f"{eval_results} has no drafter labelled {label or tag!r}; it has {sorted(stored['summary']['tau'])}")
        taus = {b: v for b, v in row.items() if b in stored["benchmarks"]}
    data = ModelCardData(
        base_model=target_repo,
        library_name="transformers",
        license="apache-2.0",
        tags=["speculative-decoding", "drafter", tag, "assisted-generation"],
        model_name=name,
        eval_results=[
            EvalResult(task_type="text-generation", dataset_type=b, dataset_name=b, metric_type="acceptance_length",
                       metric_name="tau (T=1, block 7)", metric_value=round(v, 3))  # fmt: skip
            for b, v in taus.items()
        ]
        or None,
    )
    block = config.get("block_size", config.get("ttt_length"))
    layers = config.get("num_draft_layers", 1)
    lines = [
        f"# {name}",
        "",
        f"{description}, for [{target_repo}](https://huggingface.co/{target_repo}): {layers} draft layer(s), "
        f"{block} drafts per round, target feature layers {config.get('target_layer_ids')}. The target's embedding "
        "and LM head are not stored. The folder carries its code (`trust_remote_code`): the model and the hook that "
        "routes `generate(assistant_model=drafter)` to its drafting, so nothing else needs installing.",
        "",
        "## Usage",
        "",
        "```python",
        "import torch",
        "from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer",
        f'target = AutoModelForCausalLM.from_pretrained("{target_repo}", dtype=torch.bfloat16)',
        f'tokenizer = AutoTokenizer.from_pretrained("{target_repo}")',
        f'drafter = AutoModel.from_pretrained("{repo_id or "<this repo>"}", dtype=torch.bfloat16, trust_remote_code=True)',
        'ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12*13?"}], add_generation_prompt=True,',
        '                                    return_tensors="pt", return_dict=True)["input_ids"]',
        "out = target.generate(ids, assistant_model=drafter, max_new_tokens=128)  # greedy or do_sample=True: lossless",
        "```",
    ]
    truncation = _truncation(config, block)
    if truncation:
        lines += ["", "## Drafting", "", truncation]
    if taus:
        lines += ["", "## Acceptance length (tau, temperature 1, full blocks, first turn)", "",
                  "| " + " | ".join(taus) + " |", "|---" * len(taus) + "|", "| " + " | ".join(f"{v:.2f}" for v in taus.values()) + " |"]  # fmt: skip
    if calibration:
        b, a = calibration["before"], calibration["after"]
        lines += ["", "## Confidence calibration (held-out split)", "",
                  "| | ECE | AUROC | Brier |", "|---|---|---|---|",
                  f"| raw | {100 * b['ece']:.2f} % | {b['auroc']:.3f} | {b['brier']:.4f} |",
                  f"| STS | {100 * a['ece']:.2f} % | {a['auroc']:.3f} | {a['brier']:.4f} |"]  # fmt: skip
    if budget:
        lines += ["", "## Training budget", "", f"`{budget.get('command', '')}`", "",
                  f"{budget.get('steps')} steps x {budget.get('batch_size')} sequences, {budget.get('train_sequences')} training "
                  f"sequences ({budget.get('train_response_tokens')} response tokens), {budget.get('wall_time_s_this_run')} s."]  # fmt: skip
    lines += ["", "## Licences", "",
              f"Target: {target_repo}, Apache-2.0. Training prompts: math, code and chat prompts of mixed licences, listed in "
              "the project's `shared/data/SOURCES.md` (ShareGPT conversations declare none); the responses were "
              "regenerated by the target. These weights: Apache-2.0."]  # fmt: skip
    notes = folder / "card_notes.md"
    if notes.is_file():
        lines += ["", notes.read_text().strip()]
    return ModelCard.from_template(data, template_str="---\n{{ card_data }}\n---\n\n" + "\n".join(lines) + "\n")


def write_card(folder: str | Path, **kwargs) -> Path:
    card = drafter_card(folder, **kwargs)
    path = Path(folder) / "README.md"
    card.save(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--target-repo", default=DEFAULT_TARGET_REPO)
    parser.add_argument("--eval", default=None, help="eval.json of the evaluation harness")
    parser.add_argument("--label", default=None, help="the drafter's label in eval.json (default: its kind)")
    parser.add_argument("--repo-id", default=None)
    args = parser.parse_args(argv)
    try:
        path = write_card(args.folder, target_repo=args.target_repo, eval_results=args.eval, label=args.label, repo_id=args.repo_id)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
