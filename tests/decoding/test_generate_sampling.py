"""Sampling with a DSpark assistant leaves the target's output distribution unchanged.

Tiny vocabulary (4 tokens), 4 new tokens: the exact distribution of the 256 continuations is enumerated
from the target and compared with a chi-square test. Round 1 after the prefill drafts the 2nd and 3rd
tokens and the 4th is the bonus or a correction, so the tokens under test really come from drafting (the
tests assert it). A deliberately broken acceptance rule must fail the same test."""


import pytest
import torch
from exactness import SAMPLES, VOCAB, chi_square_pvalue, config, exact_distribution, peaked_target, sample_counts
from tiny_models import bigram_target, oracle_drafter, tiny_drafter
from transformers.generation import utils as generation_utils

import modeling_dspark  # noqa: F401


def token_dependent_threshold(drafter) -> float:
    """Make ``c_k`` a function of the previously sampled token only (``sigmoid(b + w . W1[x_{k-1}])``) and return a
    threshold on ``c_1 c_2`` that keeps the second draft after some first drafts and truncates it after others,
    so the block length depends on sampled tokens (never on the token being admitted)."""
    d = drafter.config.hidden_size
    with torch.no_grad():
        drafter.confidence_head.proj.weight[:, :d].zero_()
        drafter.confidence_head.proj.weight[:, d:].normal_(0.0, 1.0)
        drafter.confidence_head.proj.bias.fill_(1.0)
        z = drafter.confidence_logits(torch.zeros(VOCAB, d), torch.arange(VOCAB))
    c = torch.sigmoid(z)
    ranked = c.sort().values
    # c_1 (read from the anchor) is at most the largest value; cut c_1 c_2 in the middle of the c_2 values
    return float(ranked[-1]) * float(ranked[VOCAB // 2 - 1] + ranked[VOCAB // 2]) / 2


@pytest.mark.parametrize(
    "settings",
    [dict(dspark_truncation="fixed"), dict(dspark_truncation="threshold")],
    ids=["fixed", "threshold"],
)
def test_random_drafter_sampling_matches_target(settings):
    target = peaked_target()
    drafter = tiny_drafter(target, seed=7)
    if settings["dspark_truncation"] == "threshold":
        settings = {**settings, "dspark_confidence_threshold": token_dependent_threshold(drafter)}
    counts, drafted_rounds, accepted, lengths = sample_counts(target, drafter, config(**settings))
    assert drafted_rounds >= SAMPLES // 2, "the tokens under test must come from drafted rounds"
    assert 0 < sum(accepted) < len(accepted) * 2, "both acceptance and rejection must occur"
    if settings["dspark_truncation"] == "threshold":
        assert {1, 2} <= lengths, f"round 1 must stop after 1 or 2 drafts depending on the sampled tokens, saw {lengths}"
    assert chi_square_pvalue(counts, exact_distribution(target), SAMPLES) > 1e-3


def test_oracle_drafter_sampling_matches_target():
    target = bigram_target(vocab_size=VOCAB, initializer_range=0.5, seed=3, num_hidden_layers=2)
    drafter = oracle_drafter(target)
    counts, drafted_rounds, accepted, _ = sample_counts(target, drafter, config(dspark_truncation="fixed"))
    assert drafted_rounds == SAMPLES and min(accepted) == 2  # q == p: every drafted token is accepted
    assert chi_square_pvalue(counts, exact_distribution(target), SAMPLES) > 1e-3


def broken_accept_all(candidate_input_ids, candidate_logits, candidate_length, new_logits, **_):
    """Mutation: keep every draft (no p/q test) and add a bonus token from the target."""
    bonus = torch.multinomial(new_logits[0, candidate_length].softmax(-1), 1)
    return torch.cat([candidate_input_ids[:, -candidate_length:], bonus[None]], dim=1), candidate_length


def broken_residual(candidate_input_ids, candidate_logits, candidate_length, new_logits, **_):
    """Mutation: the p/q test is right but a rejected draft is resampled from p instead of norm(max(p - q, 0))."""
    drafts = candidate_input_ids[:, -candidate_length:]
    q = candidate_logits.softmax(-1)[0, torch.arange(candidate_length), drafts[0]]
    p = new_logits[:, :candidate_length].softmax(-1)[0, torch.arange(candidate_length), drafts[0]]
    rejected = ~(torch.rand_like(q) <= p / q)
    n = int((rejected.cumsum(-1) < 1).sum())
    nxt = torch.multinomial(new_logits[0, n].softmax(-1), 1)
    return torch.cat([drafts[:, :n], nxt[None]], dim=1), n


@pytest.mark.parametrize("mutation", [broken_accept_all, broken_residual])
def test_broken_acceptance_is_detected(monkeypatch, mutation):
    monkeypatch.setattr(generation_utils, "_speculative_sampling", mutation)
    target = peaked_target()
    drafter = tiny_drafter(target, seed=7)
    counts, *_ = sample_counts(target, drafter, config(dspark_truncation="fixed"))
    assert chi_square_pvalue(counts, exact_distribution(target), SAMPLES) < 1e-3
