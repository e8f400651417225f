"""Stopping inside an accepted block: DSpark output ends exactly where plain generate() stops.

Assisted decoding checks stopping criteria after a whole accepted block, so without a cut the output would run
past a stop that fires in the middle of one. The oracle drafter (q == p) makes every block accepted whole, so
the stops below really fall inside accepted blocks (the tests assert that the last round drafted past them)."""

import pytest
import torch
from tiny_models import StopAfterTokens, bigram_target, char_tokenizer, oracle_drafter, tiny_drafter, tiny_target
from transformers import StoppingCriteriaList

from generation.decoding.candidate_generator import HiddenStateCandidateGenerator

PROMPT = torch.tensor([[5, 17, 42, 8, 63, 21, 9, 30, 77]])
NEW = 40


def uncut(self, input_ids, candidate_ids, candidate_logits):
    """Mutation of ``_cut_at_stop``: the proposal is left as it is."""
    return candidate_ids, candidate_logits


def free_run(target):
    return target.generate(PROMPT, do_sample=False, max_new_tokens=NEW)[0, PROMPT.shape[1] :].tolist()


def assert_same_stop(target, drafter, **kwargs):
    ref = target.generate(PROMPT, do_sample=False, max_new_tokens=NEW, **kwargs)
    out = target.generate(PROMPT, do_sample=False, max_new_tokens=NEW, assistant_model=drafter, **kwargs)
    assert torch.equal(ref, out), f"\nplain : {ref.tolist()}\ndspark: {out.tolist()}"
    assert out.shape[1] < PROMPT.shape[1] + NEW, "the stop must fire before the token limit"
    return out


def assert_stopped_inside_a_block(drafter):
    last = drafter.last_stats.rounds[-1]
    # every verified draft accepted; the last one, which fires the stop, stands where the bonus token would be
    assert last.drafted > last.verified and last.accepted + 1 == last.verified, (
        f"the last round must have drafted past the stop and been accepted up to it: {last}"
    )


@pytest.mark.parametrize("where", [3, 9, 11])
def test_custom_criterion_inside_an_accepted_block(where):
    target = bigram_target()
    drafter = oracle_drafter(target, block_size=6)
    free = free_run(target)
    stop = free[where]
    # the first occurrence decides where plain decoding stops
    criteria = StoppingCriteriaList([StopAfterTokens(stop)])
    out = assert_same_stop(target, drafter, stopping_criteria=criteria)
    assert out[0, -1] == stop
    assert_stopped_inside_a_block(drafter)


def test_multi_token_criterion_and_eos_list():
    target = bigram_target()
    drafter = oracle_drafter(target, block_size=6)
    free = free_run(target)
    criteria = StoppingCriteriaList([StopAfterTokens(free[10], free[11])])
    out = assert_same_stop(target, drafter, stopping_criteria=criteria)
    assert_stopped_inside_a_block(drafter)
    # a criterion and EOS tokens together: whichever fires first ends the output
    eos = [free[16], 1000 % 96]
    assert_same_stop(target, drafter, stopping_criteria=criteria, eos_token_id=eos)
    assert_same_stop(target, drafter, eos_token_id=[free[7], free[30]])
    assert out.shape[1] <= PROMPT.shape[1] + 12


def test_stop_strings_across_token_boundaries():
    target = bigram_target()
    drafter = oracle_drafter(target, block_size=6)
    tok = char_tokenizer()
    free = free_run(target)
    text = tok.decode(free)
    assert len(text) == len(free)
    for start in (3, 9):  # ends on draft slots 4 and 3 of the first two blocks
        stop = text[start : start + 2]  # ends on the token after `start`: spans two tokens
        out = assert_same_stop(target, drafter, stop_strings=[stop, "\x7f never"], tokenizer=tok)
        assert tok.decode(out[0, PROMPT.shape[1] :]).endswith(stop)
        assert_stopped_inside_a_block(drafter)


@pytest.mark.parametrize("truncation", ["fixed", "threshold", "cost"])
def test_stops_with_every_truncation_and_a_random_drafter(truncation):
    target = tiny_target()
    drafter = tiny_drafter(target, block_size=5)
    free = free_run(target)
    criteria = StoppingCriteriaList([StopAfterTokens(free[12])])
    assert_same_stop(target, drafter, stopping_criteria=criteria, dspark_truncation=truncation, dspark_confidence_threshold=0.05)


def test_hybrid_prompt_lookup_rounds_stop_too():
    target = bigram_target()
    drafter = oracle_drafter(target, block_size=4)
    free = free_run(target)
    prompt = torch.tensor([free[:12] + free[:3]])  # the n-gram proposal repeats the target's own continuation
    criteria = StoppingCriteriaList([StopAfterTokens(free[8])])
    ref = target.generate(prompt, do_sample=False, max_new_tokens=NEW, stopping_criteria=criteria)
    out = target.generate(
        prompt, do_sample=False, max_new_tokens=NEW, stopping_criteria=criteria, assistant_model=drafter,
        prompt_lookup_num_tokens=10,
    )  # fmt: skip
    assert torch.equal(ref, out) and out.shape[1] < prompt.shape[1] + NEW


def test_without_the_cut_the_output_runs_past_the_stop(monkeypatch):
    """The tests above can fail: with the cut disabled, DSpark keeps the block after the stop."""
    monkeypatch.setattr(HiddenStateCandidateGenerator, "_cut_at_stop", uncut)
    target = bigram_target()
    drafter = oracle_drafter(target, block_size=6)
    free = free_run(target)
    criteria = StoppingCriteriaList([StopAfterTokens(free[9])])
    ref = target.generate(PROMPT, do_sample=False, max_new_tokens=NEW, stopping_criteria=criteria)
    out = target.generate(PROMPT, do_sample=False, max_new_tokens=NEW, stopping_criteria=criteria, assistant_model=drafter)
    assert out.shape[1] > ref.shape[1]


def test_eagle3_stops_inside_its_chain():
    from tiny_models import tiny_eagle3

    target = tiny_target()
    drafter = tiny_eagle3(target)
    free = free_run(target)
    criteria = StoppingCriteriaList([StopAfterTokens(free[10])])
    assert_same_stop(target, drafter, stopping_criteria=criteria)
