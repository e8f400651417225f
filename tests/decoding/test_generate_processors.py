"""Sampling with logits processors and stopping criteria keeps the target's exact output distribution.

The drafter applies the same processors to its logits and hands verification the processed ``q`` each token was
drawn from (`generation.decoding.drafting.draft_token`); every setting below is checked by enumeration + chi-square (as
`test_generate_sampling`), with drafts both accepted and rejected, and each must catch a mutation of that code
which draws from the processed distribution but reports the unprocessed one. Stops inside a block are checked the
same way, against a mutation that leaves the block uncut."""

import pytest
import torch
from exactness import NEW, PROMPT, VOCAB, chi_square_pvalue, config, exact_distribution, sample_counts
from test_generate_stopping import uncut
from tiny_models import StopAfterTokens, bigram_target, oracle_drafter
from transformers import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import generation.decoding.drafting
from generation.decoding.candidate_generator import HiddenStateCandidateGenerator

EOS = 3
CHECKED, MUTATED = 1500, 1000  # samples; each mutation measured at p < 2e-6 with this many (top-k the weakest)

# generate() settings -> the processors it builds from them (in its order: processors, then warpers)
SETTINGS = {
    "temperature": (dict(temperature=0.4), [TemperatureLogitsWarper(0.4)]),
    "top_k": (dict(top_k=2), [TopKLogitsWarper(2)]),
    "top_p": (dict(top_p=0.6), [TopPLogitsWarper(0.6)]),
    "repetition_penalty": (dict(repetition_penalty=3.0), [RepetitionPenaltyLogitsProcessor(3.0)]),
    "min_new_tokens": (
        dict(min_new_tokens=3, eos_token_id=EOS),
        [MinNewTokensLengthLogitsProcessor(PROMPT.shape[1], 3, EOS)],
    ),
}


def expected(target, name):
    settings, processors = SETTINGS[name]
    eos = settings.get("eos_token_id")
    stop = StoppingCriteriaList([StopAfterTokens(eos)]) if eos is not None else None
    return exact_distribution(target, processors=LogitsProcessorList(processors), stop=stop)


def tempered_oracle():
    """A bigram target with spread-out probabilities and a drafter that ranks tokens as the target does, with
    sharper probabilities (the oracle's Markov head at temperature 1/2): drafts are accepted often and rejected
    often, and a q reported before the processors is far from the q each draft was drawn from."""
    target = bigram_target(vocab_size=VOCAB, initializer_range=0.1, seed=3, num_hidden_layers=2)
    drafter = oracle_drafter(target)
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.mul_(2.0)
    return target, drafter


def run(name, samples):
    target, drafter = tempered_oracle()
    counts, drafted_rounds, accepted, _ = sample_counts(target, drafter, config(dspark_truncation="fixed", **SETTINGS[name][0]), samples)
    return target, counts, drafted_rounds, accepted


@pytest.mark.parametrize("name", list(SETTINGS))
def test_processed_sampling_matches_target(name):
    target, counts, drafted_rounds, accepted = run(name, CHECKED)
    assert drafted_rounds >= CHECKED // 2, "the tokens under test must come from drafted rounds"
    assert 0.2 < sum(accepted) / (len(accepted) * 2) < 0.9, "drafts must be both accepted and rejected, often"
    assert chi_square_pvalue(counts, expected(target, name), CHECKED) > 1e-3


def unprocessed_q(original):
    def draft_token(drafter, step_logits, greedy, logits_processor=None, ids=None):
        """Mutation: draw from the processed distribution, report the unprocessed one as q."""
        token, _ = original(drafter, step_logits, greedy, logits_processor, ids)
        return token, drafter.to_target_vocab(step_logits).float()

    return draft_token


@pytest.mark.parametrize("name", list(SETTINGS))
def test_unprocessed_q_is_detected(monkeypatch, name):
    monkeypatch.setattr(generation.decoding.drafting, "draft_token", unprocessed_q(generation.decoding.drafting.draft_token))
    target, counts, *_ = run(name, MUTATED)
    assert chi_square_pvalue(counts, expected(target, name), MUTATED) < 1e-3


def stop_counts(samples):
    target, drafter = tempered_oracle()
    criteria = StoppingCriteriaList([StopAfterTokens(3)])  # fires on a draft in about a third of the samples
    gen = config(dspark_truncation="fixed", max_new_tokens=NEW)
    torch.manual_seed(0)
    counts, cut_rounds = {}, 0
    for _ in range(samples):
        out = target.generate(PROMPT, generation_config=gen, assistant_model=drafter, stopping_criteria=criteria)
        key = tuple(out[0, PROMPT.shape[1] :].tolist())
        counts[key] = counts.get(key, 0) + 1
        rounds = drafter.last_stats.rounds  # none when the prefill's token already stops
        cut_rounds += bool(rounds) and rounds[-1].drafted > rounds[-1].verified and len(key) < NEW
    return target, criteria, counts, cut_rounds


def test_sampling_with_a_stop_inside_the_block_matches_target():
    target, criteria, counts, cut_rounds = stop_counts(CHECKED)
    assert cut_rounds >= CHECKED // 20, "some samples must stop on a drafted token before the block's end"
    assert chi_square_pvalue(counts, exact_distribution(target, stop=criteria), CHECKED) > 1e-3


def test_an_uncut_block_is_detected(monkeypatch):
    monkeypatch.setattr(HiddenStateCandidateGenerator, "_cut_at_stop", uncut)
    target, criteria, counts, _ = stop_counts(MUTATED)
    assert chi_square_pvalue(counts, exact_distribution(target, stop=criteria), MUTATED) < 1e-3
