"""Hybrid drafting, ``generate(assistant_model=drafter, prompt_lookup_num_tokens=N)``: each round verifies the
prompt-lookup continuation or the DSpark block, whichever is priced higher on earlier rounds and the anchor's
confidence. Greedy output stays the target's, sampled output keeps the target's distribution with both kinds of
proposal verified, and a choice that reads a confidence of a token sampled in the same round is detected."""

import pytest
import torch
from exactness import PROMPT, SAMPLES, chi_square_pvalue, config, exact_distribution, peaked_target
from test_generate_cost import VERIFY, confident, token_dependent_confidence, verified_block_sums
from tiny_models import tiny_drafter, tiny_target
from transformers import GenerationConfig

import modeling_dspark  # noqa: F401
from generation.decoding.candidate_generator import DSparkCandidateGenerator
from generation.decoding.hybrid import HybridChooser, SlotAcceptance, anchored_survival, ngram_continuation
from generation.scheduling.scheduler import DraftCost

FREE = DraftCost.from_dict({1: [0.0] * 4})


def hybrid(lookup: int = 6, draft_cost=FREE, **kwargs) -> dict:
    return dict(prompt_lookup_num_tokens=lookup, dspark_cost_table=VERIFY, dspark_draft_cost=draft_cost, dspark_adapt_costs=False, **kwargs)


def test_ngram_continuation_takes_the_longest_match_and_its_longest_continuation():
    ids = torch.tensor([7, 1, 2, 3, 4, 1, 2, 9, 1, 2])
    proposal = ngram_continuation(ids, max_ngram=2, num_tokens=4)
    assert proposal.match_length == 2 and proposal.tokens.tolist() == [3, 4, 1, 2]  # (1, 2) at 1 and 5: 1 continues longest
    assert ngram_continuation(ids, 2, 3).tokens.tolist() == [9, 1, 2]  # equally long continuations: the most recent
    assert ngram_continuation(ids, 2, 4, eos_token_ids=torch.tensor([4])).tokens.tolist() == [3, 4]  # ends after EOS
    one = ngram_continuation(torch.tensor([5, 6, 8, 6]), max_ngram=3, num_tokens=4)
    assert one.match_length == 1 and one.tokens.tolist() == [8, 6]
    assert ngram_continuation(torch.tensor([1, 2, 3]), 2, 4).match_length == 0
    with pytest.raises(ValueError, match="one sequence"):
        ngram_continuation(ids[None], 2, 3)


def test_slot_acceptance_and_anchored_survival():
    acceptance = SlotAcceptance(3, decay=1.0)
    assert acceptance.survival(2, 3) == [0.5, 0.25, 0.125]  # the Beta(1, 1) prior
    acceptance.record(2, verified=3, accepted=1)  # slot 1 accepted, slot 2 rejected, slot 3 never reached
    assert acceptance.conditional(2) == [2 / 3, 1 / 3, 0.5] and acceptance.conditional(1) == [0.5] * 3
    assert anchored_survival(0.4, [0.8, 0.4, 0.2], 3) == pytest.approx([0.4, 0.2, 0.1])
    assert anchored_survival(0.4, None, 2) == [0.4, 0.4]


def test_chooser_prices_both_proposals_on_the_cost_table():
    chooser = HybridChooser(VERIFY, DraftCost.from_dict({1: [0.05] * 4}), max_ngram=2, num_ngram_tokens=4)
    proposal = ngram_continuation(torch.tensor([1, 2, 3, 1, 2]), 2, 4)
    ngram = chooser.ngram_option(proposal)
    assert ngram.kind == "ngram" and ngram.length >= 1
    assert not chooser.skip_drafter(ngram, 4, None)  # nothing known of the drafter yet: try it
    assert chooser.skip_drafter(ngram, 4, [0.9, 0.8, 0.7, 0.6])  # a drafter call costs five verify forwards
    cheap = HybridChooser(VERIFY, FREE, max_ngram=2, num_ngram_tokens=4)
    assert not cheap.skip_drafter(cheap.ngram_option(proposal), 4, [0.9, 0.8, 0.7, 0.6])
    for _ in range(cheap.probe_interval - 1):
        cheap.record_choice("ngram")
    assert chooser.skip_drafter(ngram, 4, [0.0] * 4) and not cheap.skip_drafter(ngram, 4, [0.0] * 4)  # cheap: DSpark probe due
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens >= 1"):
        HybridChooser(VERIFY, FREE, max_ngram=2, num_ngram_tokens=0)


@pytest.mark.parametrize("truncation", ["fixed", "threshold", "cost"])
def test_hybrid_greedy_equals_target_with_both_proposals_verified(truncation):
    target = tiny_target()
    kinds = {"ngram": 0, "dspark": 0}
    for prompt in ([5, 17, 3, 44, 9, 21, 5, 17, 3, 44, 9, 21], [8, 2, 61, 33, 90, 14]):  # with and without matches
        prompt = torch.tensor([prompt])
        ref = target.generate(prompt, do_sample=False, max_new_tokens=80)
        drafter = tiny_drafter(target)
        out = target.generate(
            prompt, do_sample=False, max_new_tokens=80, assistant_model=drafter,
            **hybrid(dspark_truncation=truncation, dspark_confidence_threshold=0.1),
        )  # fmt: skip
        assert torch.equal(out, ref), truncation
        for r in drafter.last_stats.rounds:
            if r.proposal in kinds and r.verified:
                kinds[r.proposal] += 1
                assert r.accepted <= r.verified
    assert min(kinds.values()) >= 1, kinds
    share = drafter.last_stats.proposal_share()
    assert set(share) <= {"ngram", "dspark", "plain"} and sum(share.values()) == pytest.approx(1.0)


def sample_hybrid(target, drafter, gen, samples=SAMPLES):
    torch.manual_seed(0)
    counts, verified, accepted = {}, {"ngram": 0, "dspark": 0}, {"ngram": [], "dspark": []}
    for _ in range(samples):
        out = target.generate(PROMPT, generation_config=gen, assistant_model=drafter)
        key = tuple(out[0, PROMPT.shape[1] :].tolist())
        counts[key] = counts.get(key, 0) + 1
        for r in drafter.last_stats.rounds:
            if r.proposal in verified and r.verified:
                verified[r.proposal] += 1
                accepted[r.proposal].append(r.accepted / r.verified)
    return counts, verified, accepted


def hybrid_sampling_setup():
    """The anchor's confidence c_1 spreads from 0.02 to 0.98 across tokens, so round 1's stage-2 choice keeps the
    drafted block after some anchors and verifies the n-gram after others."""
    target = peaked_target()
    drafter = token_dependent_confidence(tiny_drafter(target, seed=7))
    return target, drafter, config(**hybrid(lookup=3, dspark_truncation="fixed"), top_k=3)


def test_hybrid_sampling_matches_target():
    target, drafter, gen = hybrid_sampling_setup()
    counts, verified, accepted = sample_hybrid(target, drafter, gen)
    assert min(verified.values()) >= SAMPLES // 10, f"both proposals must be verified often: {verified}"
    for kind, rates in accepted.items():
        assert 0 < sum(rates) < len(rates), f"{kind}: both acceptance and rejection must occur"
    top3 = exact_distribution(target, top_k=3)
    assert chi_square_pvalue(counts, top3, SAMPLES) > 1e-3


def test_a_choice_reading_this_rounds_sampled_tokens_is_detected(monkeypatch):
    def realised(self, survival, depth):
        """Mutation: keep the drafted block only when the confidence of slot 2, which reads the sampled x_1, is high."""
        keep = survival is not None and len(survival) > 1 and survival[1] / survival[0] > 0.5
        return [1.0 if keep else 0.0] * depth

    monkeypatch.setattr(DSparkCandidateGenerator, "_choice_survival", realised)
    target, drafter, gen = hybrid_sampling_setup()
    samples = SAMPLES
    counts, verified, _ = sample_hybrid(target, drafter, gen, samples)
    assert min(verified.values()) >= samples // 10, verified
    assert chi_square_pvalue(counts, exact_distribution(target, top_k=3), samples) < 1e-3


def test_hybrid_choice_reads_the_survival_as_corrected(monkeypatch):
    """Hybrid rounds feed the planner the verified blocks' survival and accepted drafts, and both stages of the
    choice price the block on the survival scaled by them, as cost truncation does: an untrained drafter that
    promises survival near 1 is priced at what it yields. The output stays the target's."""
    from generation.scheduling import depth_planner

    monkeypatch.setattr(depth_planner.DepthPlanner, "ACCEPTANCE_DECAY", 1.0)
    target = tiny_target()
    prompt = torch.tensor([[5, 17, 3, 44, 9, 21, 5, 17, 3, 44, 8, 2, 61]])
    ref = target.generate(prompt, do_sample=False, max_new_tokens=80)
    drafter = confident(tiny_drafter(target))
    gen = GenerationConfig(do_sample=False, max_new_tokens=80, **{**hybrid(lookup=4, dspark_truncation="fixed"), "dspark_adapt_costs": True})
    planner, _ = depth_planner.generate_planner(target, drafter, gen)
    priced = []

    def spy(method):
        def wrapper(self, ngram, depth, survival):
            if survival is not None:
                priced.append((survival, planner.survival_scales))
            return method(self, ngram, depth, survival)

        return wrapper

    monkeypatch.setattr(HybridChooser, "skip_drafter", spy(HybridChooser.skip_drafter))
    monkeypatch.setattr(HybridChooser, "prefer_ngram", spy(HybridChooser.prefer_ngram))
    out = target.generate(prompt, generation_config=gen, assistant_model=drafter)
    assert torch.equal(out, ref)
    rounds, accepted, expected = verified_block_sums(drafter)
    assert len(rounds) >= 2
    assert sum(s[0] for s in planner.slot_sums) == accepted and sum(s[1] for s in planner.slot_sums) == pytest.approx(expected)
    assert any(max(scales) < 0.9 for _, scales in priced), "the correction never took effect during the choices"
    assert all(a <= f + 1e-9 for survival, scales in priced for a, f in zip(survival, scales))


def test_hybrid_settings_are_checked():
    target = tiny_target()
    prompt = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="positive integers"):
        target.generate(prompt, max_new_tokens=4, assistant_model=tiny_drafter(target), **hybrid(lookup=0))
    with pytest.raises(ValueError, match="positive integers"):
        target.generate(prompt, max_new_tokens=4, assistant_model=tiny_drafter(target), max_matching_ngram_size=0, **hybrid())


def test_plain_prompt_lookup_is_left_to_transformers():
    target = tiny_target()
    prompt = torch.tensor([[5, 17, 3, 44, 9, 21, 5, 17]])
    out = target.generate(prompt, generation_config=GenerationConfig(do_sample=False, max_new_tokens=30, prompt_lookup_num_tokens=4))
    assert torch.equal(out, target.generate(prompt, do_sample=False, max_new_tokens=30))


def test_eagle3_assistant_refuses_prompt_lookup():
    from tiny_models import tiny_eagle3

    target = tiny_target()
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens cannot be combined with an Eagle3 assistant"):
        target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, assistant_model=tiny_eagle3(target), prompt_lookup_num_tokens=3)
