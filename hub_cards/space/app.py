"""DSpark demo (Gradio): plain ``generate()`` and DSpark side by side on the CPU, streaming.

The DSpark text is coloured per token: green = a drafted token the target accepted (darker = higher
calibrated confidence), blue = a token copied by prompt lookup that the target accepted (hybrid drafting: each
round verifies the n-gram continuation or the DSpark block), orange = a token the target produced itself (the
correction after a rejection, or the bonus token of a fully accepted round). Below: tokens/s of both, tau and the speed-up. The two runs go one
after the other, so each has the CPU to itself.

    python -m hub_cards.space.app [--port 7860]          # or: dspark demo

Settings (environment): ``DSPARK_TARGET`` (embedded target name, default the SmolLM2 default target),
``DSPARK_DRAFTER`` (drafter folder, default the shipped one), ``DSPARK_DEMO_MAX_NEW_TOKENS`` (default 96),
``DSPARK_DEMO_PROMPT_LOOKUP`` (prompt-lookup tokens of hybrid drafting, default 10; 0 = DSpark alone).
"""

from __future__ import annotations

import argparse
import html
import os
import queue
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no calls home from a demo box

ROOT = Path(__file__).resolve().parents[2]
if (ROOT / "modeling_dspark").is_dir() and str(ROOT) not in sys.path:  # a Space built by hub_cards.space.build
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

__all__ = ["MAX_PROMPT_CHARS", "build_demo", "dspark_tokens_html", "main", "prompt_problem"]

EXAMPLES = [
    "What is 12*13? Explain step by step.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me three tips for a good night's sleep.",
]


MAX_PROMPT_CHARS = 2000  # a CPU demo: longer prompts would hold the box for minutes


def prompt_problem(prompt: str | None) -> str | None:
    """Why the demo refuses ``prompt`` (None when it takes it)."""
    if not prompt or not prompt.strip():
        return "Type a prompt first."
    if len(prompt) > MAX_PROMPT_CHARS:
        return f"The prompt has {len(prompt):,} characters; this demo takes up to {MAX_PROMPT_CHARS:,}."
    return None


class _QueueStreamer:
    """A ``generate()`` streamer that hands each step's new tokens (and the drafter's round, if any) to a queue."""

    def __init__(self, drafter=None):
        self.queue: queue.Queue = queue.Queue()
        self.drafter = drafter
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:  # generate() sends the prompt first
            self._prompt_seen = True
            return
        stats = getattr(self.drafter, "last_stats", None) if self.drafter is not None else None
        pending = stats.pending if stats is not None else None
        self.queue.put((value.reshape(-1).tolist(), pending))

    def end(self):
        self.queue.put(None)


def dspark_tokens_html(pieces, tokenizer, drafter) -> str:
    """``pieces``: list of (token ids of one step, the round they came from or None). Accepted drafts in green,
    shaded by calibrated confidence; the target's own tokens in orange."""
    spans = []
    for tokens, round_ in pieces:
        accepted = len(tokens) - 1 if round_ is not None and round_.verified > 0 else 0
        copied = round_ is not None and round_.proposal == "ngram"
        for j, token in enumerate(tokens):
            text = html.escape(tokenizer.decode([token]))
            if j < accepted and copied:
                spans.append(f'<span class="copied" title="accepted prompt-lookup token" style="background: rgba(56, 132, 255, 0.55)">{text}</span>')
            elif j < accepted:
                conf = 1.0
                if round_.confidence_logits and j < len(round_.confidence_logits) and drafter.confidence_head is not None:
                    z = torch.tensor(round_.confidence_logits[j])
                    conf = float(drafter.calibrated_confidence(z, position=j))
                alpha = 0.25 + 0.6 * conf
                spans.append(f'<span class="accepted" title="accepted draft, confidence {conf:.2f}" '
                             f'style="background: rgba(46, 160, 67, {alpha:.2f})">{text}</span>')  # fmt: skip
            else:
                spans.append(f'<span class="target" title="target token" style="background: rgba(255, 140, 0, 0.45)">{text}</span>')
    body = "".join(spans).replace("\n", "<br>")
    return f'<div style="white-space: pre-wrap; line-height: 1.6; font-family: monospace">{body}</div>'


def _run_streaming(target, ids, kwargs, drafter=None):
    """Start ``generate()`` in a thread; yield (pieces so far, elapsed seconds) as tokens arrive."""
    streamer = _QueueStreamer(drafter)
    extra = {"assistant_model": drafter} if drafter is not None else {}
    thread = threading.Thread(target=lambda: target.generate(ids, streamer=streamer, **kwargs, **extra), daemon=True)
    start = time.perf_counter()
    thread.start()
    pieces = []
    while True:
        item = streamer.queue.get()
        if item is None:
            break
        pieces.append(item)
        yield pieces, time.perf_counter() - start
    thread.join()
    yield pieces, time.perf_counter() - start


def build_demo(target, tokenizer, drafter, *, max_new_tokens: int = 96, prompt_lookup: int = 10):
    import gradio as gr

    from generation.evaluation.prompts import chat_input_ids
    from modeling_dspark.targets import dtype_label

    def run(prompt):
        problem = prompt_problem(prompt)
        if problem:
            raise gr.Error(problem)
        ids = chat_input_ids(tokenizer, prompt)
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        plain_text, plain_tps, n_plain = "", 0.0, 0
        for pieces, elapsed in _run_streaming(target, ids, kwargs):
            tokens = [t for step, _ in pieces for t in step]
            n_plain, plain_text = len(tokens), tokenizer.decode(tokens, skip_special_tokens=True)
            plain_tps = n_plain / max(elapsed, 1e-9)
            yield plain_text, "", f"plain `generate()`: {n_plain} tokens, {plain_tps:.1f} tok/s ..."
        pieces, elapsed = [], 0.0
        hybrid = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
        for pieces, elapsed in _run_streaming(target, ids, {**kwargs, **hybrid}, drafter):
            yield plain_text, dspark_tokens_html(pieces, tokenizer, drafter), f"DSpark: {sum(len(s) for s, _ in pieces)} tokens ..."
        n = sum(len(step) for step, _ in pieces)
        tau = drafter.last_stats.tau  # the definition generate() reports: every round, bonus included
        tps = n / max(elapsed, 1e-9)
        stats = (
            f"plain `generate()`: {n_plain} tokens, **{plain_tps:.1f} tok/s** | DSpark: {n} tokens, **{tps:.1f} tok/s** | "
            f"tau **{tau:.2f}** tokens per target forward | speed-up **{tps / max(plain_tps, 1e-9):.2f}x** (greedy, {dtype_label(target.dtype)})"
        )
        yield plain_text, dspark_tokens_html(pieces, tokenizer, drafter), stats

    with gr.Blocks(title="DSpark speculative decoding") as demo:
        gr.Markdown(
            "# DSpark speculative decoding\nGreedy output of the target alone (left) and with a DSpark drafter (right): the "
            "same text, up to bf16 rounding at near-ties. Right: <span style='background: rgba(46,160,67,.7)'>accepted drafts</span> (darker = more "
            "confident), <span style='background: rgba(56,132,255,.55)'>accepted prompt-lookup tokens</span> (hybrid drafting), "
            "<span style='background: rgba(255,140,0,.45)'>tokens the target produced</span>."
        )
        prompt = gr.Textbox(label="Prompt", value=EXAMPLES[0], lines=2, elem_id="prompt")
        button = gr.Button("Generate", variant="primary", elem_id="run")
        with gr.Row():
            plain = gr.Textbox(label="Plain generate()", lines=12, elem_id="plain")
            with gr.Column():
                gr.Markdown("**DSpark** `generate(assistant_model=drafter)`")
                dspark = gr.HTML(elem_id="dspark")
        stats = gr.Markdown(elem_id="stats")
        gr.Examples(EXAMPLES, inputs=prompt)
        button.click(run, inputs=prompt, outputs=[plain, dspark, stats])
    return demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", 7860)))
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))  # Spaces set 0.0.0.0
    args = parser.parse_args(argv)
    import modeling_dspark  # noqa: F401  (the generate() hook)
    from generation.cli import SHIPPED_DRAFTER
    from generation.evaluation.harness import load_drafter
    from modeling_dspark import load_target

    target_name = os.environ.get("DSPARK_TARGET", "smollm2-135m-instruct")
    drafter_path = os.environ.get("DSPARK_DRAFTER", str(SHIPPED_DRAFTER))
    target, tokenizer = load_target(target_name)  # auto: bf16 where this CPU has fast bf16, else fp32
    drafter = load_drafter(drafter_path, dtype=target.dtype)
    demo = build_demo(
        target, tokenizer, drafter, max_new_tokens=int(os.environ.get("DSPARK_DEMO_MAX_NEW_TOKENS", 96)),
        prompt_lookup=int(os.environ.get("DSPARK_DEMO_PROMPT_LOOKUP", 10)),
    )  # fmt: skip
    demo.queue().launch(server_name=args.host, server_port=args.port, show_error=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
