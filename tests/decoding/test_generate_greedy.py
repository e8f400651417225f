"""generate(assistant_model=drafter) is token-for-token identical to plain greedy decoding."""

import pytest
import torch
from exactness import assert_lossless, prompts
from tiny_models import bigram_target, oracle_drafter, tiny_drafter, tiny_target
from transformers import GenerationConfig, GenerationMixin

import generation
from generation import dspark_generate, install_generate_hook, uninstall_generate_hook


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("markov", ["vanilla", "rnn", None])
def test_random_drafter_greedy_identical(family, markov):
    target = tiny_target(family)
    drafter = tiny_drafter(target, markov_head_type=markov)
    for ids in prompts(target.config.vocab_size):
        assert_lossless(target, drafter, ids, max_new_tokens=40)
        stats = drafter.last_stats
        assert stats.num_rounds > 0 and sum(r.drafted for r in stats.rounds) > 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_oracle_drafter_greedy_identical_and_fully_accepted(family):
    target = bigram_target(family=family)
    drafter = oracle_drafter(target)
    for ids in prompts(target.config.vocab_size):
        assert_lossless(target, drafter, ids, max_new_tokens=41)
        stats = drafter.last_stats
        # every block is accepted whole: tau = block_size + 1 except in the budget-limited last rounds
        assert stats.acceptance_rate == 1.0
        assert max(r.accepted for r in stats.rounds) == drafter.config.block_size
        assert stats.tau > 4.0


@pytest.mark.parametrize("truncation,threshold", [("fixed", 0.0), ("threshold", 0.3), ("threshold", 0.9)])
def test_truncation_modes_greedy_identical(truncation, threshold):
    target = tiny_target()
    drafter = tiny_drafter(target)
    config = GenerationConfig(max_new_tokens=30, do_sample=False, pad_token_id=0, dspark_truncation=truncation, dspark_confidence_threshold=threshold)
    for ids in prompts(target.config.vocab_size):
        ref = target.generate(ids, max_new_tokens=30, do_sample=False)
        out = target.generate(ids, generation_config=config, assistant_model=drafter)
        assert torch.equal(ref, out)
        drafted = [r.drafted for r in drafter.last_stats.rounds]
        if truncation == "fixed":
            assert max(drafted) == drafter.config.block_size
        else:
            assert len(set(drafted)) > 1 or max(drafted) < drafter.config.block_size


def test_threshold_truncation_shortens_blocks():
    target = tiny_target()
    drafter = tiny_drafter(target)
    ids = prompts(target.config.vocab_size)[1]
    means = []
    for threshold in (0.0, 0.3, 0.6, 1.0):
        config = GenerationConfig(max_new_tokens=30, do_sample=False, pad_token_id=0, dspark_confidence_threshold=threshold)
        target.generate(ids, generation_config=config, assistant_model=drafter)
        means.append(drafter.last_stats.mean_verified)
    assert means == sorted(means, reverse=True) and means[0] > means[-1]
    assert means[-1] == 0.0  # survival below 1 everywhere: nothing is verified, plain decoding


def test_block_larger_than_max_new_tokens():
    target = tiny_target()
    drafter = tiny_drafter(target, block_size=7)
    for n in (1, 2, 3, 5):
        for ids in prompts(target.config.vocab_size):
            out = assert_lossless(target, drafter, ids, max_new_tokens=n)
            assert out.shape[1] == ids.shape[1] + n


def test_oracle_block_larger_than_budget():
    target = bigram_target()
    drafter = oracle_drafter(target, block_size=7)
    for n in (2, 4, 6, 9):
        out = assert_lossless(target, drafter, prompts(96)[0], max_new_tokens=n)
        assert out.shape[1] == 3 + n


def test_eos_inside_a_block():
    target = bigram_target()
    drafter = oracle_drafter(target, block_size=6)
    ids = prompts(96)[1]
    free = target.generate(ids, do_sample=False, max_new_tokens=30)[0, ids.shape[1] :]
    eos = int(free[7])  # a token the target emits in the middle of a drafted block
    out = assert_lossless(target, drafter, ids, max_new_tokens=30, eos_token_id=eos)
    assert int(out[0, -1]) == eos and out.shape[1] < ids.shape[1] + 30


def test_streamer_receives_the_same_tokens():
    target = tiny_target()
    drafter = tiny_drafter(target)
    ids = prompts(96)[0]

    class Collect:
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens.extend(value.flatten().tolist())

        def end(self):
            self.ended = True

    streamer = Collect()
    out = target.generate(ids, do_sample=False, max_new_tokens=20, assistant_model=drafter, streamer=streamer)
    assert streamer.tokens == out[0].tolist() and streamer.ended


def test_batch_size_above_one_names_the_engine():
    target = tiny_target()
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match="DSparkEngine"):
        target.generate(torch.ones(2, 5, dtype=torch.long), max_new_tokens=5, assistant_model=drafter)


def test_padded_prompt_is_refused():
    target = tiny_target()
    drafter = tiny_drafter(target)
    mask = torch.tensor([[0, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="unpadded"):
        target.generate(torch.ones(1, 5, dtype=torch.long), attention_mask=mask, max_new_tokens=5, assistant_model=drafter)


@pytest.mark.parametrize(
    "other,match",
    [
        (dict(vocab_size=80), "vocabulary"),
        (dict(hidden_size=48), "hidden size"),
        (dict(num_hidden_layers=2), "target_layer_ids"),
        (dict(num_hidden_layers=6), "layers"),
    ],
)
def test_incompatible_target_is_refused(other, match):
    drafter = tiny_drafter(tiny_target())
    target = tiny_target(**other)
    with pytest.raises(ValueError, match=match):
        target.generate(torch.ones(1, 5, dtype=torch.long), max_new_tokens=5, assistant_model=drafter)


def test_custom_generate_without_the_hook():
    target = tiny_target()
    drafter = tiny_drafter(target)
    ids = prompts(96)[2]
    ref = target.generate(ids, do_sample=False, max_new_tokens=25)
    assert uninstall_generate_hook()
    try:
        out = target.generate(ids, do_sample=False, max_new_tokens=25, custom_generate=dspark_generate, dspark_model=drafter)
        assert torch.equal(ref, out) and drafter.last_stats.num_rounds > 0
        assert "_get_candidate_generator" not in target.__dict__
    finally:
        install_generate_hook()


def test_hook_is_idempotent_and_leaves_other_assistants_alone():
    tiny_drafter(tiny_target())  # building a drafter installs the hook
    assert install_generate_hook() is False
    for name in ("_get_candidate_generator", "_validate_generation_mode"):
        wrapped = getattr(GenerationMixin, name)
        assert getattr(wrapped, "__dspark_hook__") and not getattr(wrapped.__wrapped__, "__dspark_hook__", False)
    target = tiny_target()
    ids = prompts(96)[1]
    ref = target.generate(ids, do_sample=False, max_new_tokens=20)
    assert torch.equal(ref, target.generate(ids, do_sample=False, max_new_tokens=20, prompt_lookup_num_tokens=3))
    assistant = tiny_target(seed=5)  # an ordinary causal LM assistant takes the stock path
    assert torch.equal(ref, target.generate(ids, do_sample=False, max_new_tokens=20, assistant_model=assistant))


def test_last_stats_counts_rounds():
    target = bigram_target()
    drafter = oracle_drafter(target)
    ids = prompts(96)[0]
    out = target.generate(ids, do_sample=False, max_new_tokens=21, assistant_model=drafter)
    stats = drafter.last_stats
    produced = sum(r.accepted + 1 for r in stats.rounds)
    assert produced + 1 == out.shape[1] - ids.shape[1]  # + the prefill token
    assert stats.tau == pytest.approx(produced / stats.num_rounds)
    assert all(r.verified == r.drafted for r in stats.rounds)
    assert isinstance(stats, generation.DSparkGenerationStats) and stats.as_dict()["num_rounds"] == stats.num_rounds


def test_prefilled_cache_is_a_clear_error():
    from transformers import DynamicCache

    target = tiny_target()
    drafter = tiny_drafter(target)
    ids = prompts(96)[1]
    cache = DynamicCache()
    with torch.no_grad():
        target(ids[:, :-1], cache=cache)
    with pytest.raises(ValueError, match="pre-filled cache"):
        target.generate(ids, cache=cache, max_new_tokens=8, do_sample=False, assistant_model=drafter)


def test_static_cache_works():
    target = tiny_target()
    drafter = tiny_drafter(target)
    ids = prompts(96)[0]
    ref = target.generate(ids, do_sample=False, max_new_tokens=20)
    out = target.generate(ids, do_sample=False, max_new_tokens=20, assistant_model=drafter, cache_implementation="static")
    assert torch.equal(ref, out)


def test_dspark_settings_as_generate_keywords_and_their_errors():
    target = tiny_target()
    drafter = tiny_drafter(target)
    ids = torch.tensor([[1, 2, 3]])
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=9, do_sample=False, dspark_truncation="fixed", dspark_num_draft_tokens=2)
    assert torch.equal(out, target.generate(ids, max_new_tokens=9, do_sample=False))
    assert max(r.drafted for r in drafter.last_stats.rounds) == 2
    with pytest.raises(ValueError, match=r"dspark_confidence_threshold .* in \[0, 1\]; got 5.0"):
        target.generate(ids, assistant_model=drafter, max_new_tokens=5, dspark_confidence_threshold=5.0)
    with pytest.raises(ValueError, match="num_beams=2 cannot be combined"):
        target.generate(ids, assistant_model=drafter, max_new_tokens=5, num_beams=2)
