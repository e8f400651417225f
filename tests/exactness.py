"""Shared checks of losslessness: greedy output equal to plain decoding, and the exact distribution of every
continuation on a 4-token vocabulary (enumerated from the target) against sampled counts (chi-square)."""

import itertools

import torch
from tiny_models import tiny_target
from transformers import GenerationConfig, LogitsProcessorList, TopKLogitsWarper

PROMPT_LENGTHS = (3, 9, 17)


def prompts(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (1, n), generator=g) for n in PROMPT_LENGTHS]


def assert_lossless(target, drafter, ids, **kwargs):
    ref = target.generate(ids, do_sample=False, **kwargs)
    out = target.generate(ids, do_sample=False, assistant_model=drafter, **kwargs)
    assert torch.equal(ref, out), f"\nplain : {ref.tolist()}\ndspark: {out.tolist()}"
    return out


VOCAB, NEW, SAMPLES = 4, 4, 2500
PROMPT = torch.tensor([[1, 3, 2, 2, 1]])  # no pad id (0): it would be masked out


def peaked_target():
    # two layers: 12,500 generate() calls in this file, and the target forward's Python overhead grows per layer
    return tiny_target(vocab_size=VOCAB, initializer_range=0.5, seed=3, num_hidden_layers=2)


def exact_distribution(target, top_k: int | None = None, processors=None, stop=None) -> dict[tuple, float]:
    """Probability of every continuation. ``processors``: a ``LogitsProcessorList`` applied at every position to
    the sequence so far, as ``generate()`` applies it (``top_k`` alone: Transformers' ``TopKLogitsWarper`` at
    temperature 1). ``stop``: a ``StoppingCriteria``; a continuation ends on the first token after which it fires,
    and the probabilities of the continuations that share that prefix add up."""
    if top_k is not None:
        processors = LogitsProcessorList([TopKLogitsWarper(top_k)])
    seqs = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW)))
    full = torch.cat([PROMPT.expand(len(seqs), -1), seqs], dim=1)
    start = PROMPT.shape[1] - 1
    with torch.no_grad():
        logits = target(full).logits.float()
        logp = torch.zeros(len(seqs), dtype=torch.float64)
        for t in range(NEW):
            step = logits[:, start + t]
            if processors is not None:
                step = processors(full[:, : start + 1 + t], step)
            logp += torch.log_softmax(step, dim=-1).gather(-1, seqs[:, t : t + 1]).squeeze(-1).double()
    probs = logp.exp()
    if stop is not None:
        ends = torch.full((len(seqs),), NEW)
        for t in range(NEW - 1, -1, -1):  # last to first: the first firing position wins
            ends = torch.where(stop(full[:, : PROMPT.shape[1] + t + 1], None), t + 1, ends)
    distribution: dict[tuple, float] = {}
    for i, (s, p) in enumerate(zip(seqs.tolist(), probs.tolist())):
        key = tuple(s[: int(ends[i])]) if stop is not None else tuple(s)
        distribution[key] = distribution.get(key, 0.0) + p
    return distribution


def chi_square_pvalue(counts: dict[tuple, int], expected: dict[tuple, float], n: int) -> float:
    """Pearson chi-square; cells with expected count < 5 are pooled into one."""
    stat, df, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for cell, p in expected.items():
        e, o = p * n, counts.get(cell, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
            continue
        stat, df = stat + (o - e) ** 2 / e, df + 1
    if pooled_exp > 0:
        stat, df = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, df + 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def sample_counts(target, drafter, config, samples=SAMPLES, seed=0):
    torch.manual_seed(seed)
    counts, drafted_rounds, accepted, lengths = {}, 0, [], set()
    for _ in range(samples):
        out = target.generate(PROMPT, generation_config=config, assistant_model=drafter)
        key = tuple(out[0, PROMPT.shape[1] :].tolist())
        counts[key] = counts.get(key, 0) + 1
        rounds = drafter.last_stats.rounds
        drafted_rounds += sum(r.drafted > 0 for r in rounds)
        accepted += [r.accepted for r in rounds if r.drafted > 0]
        lengths.add(rounds[0].drafted)
    return counts, drafted_rounds, accepted, lengths


def config(**settings):
    return GenerationConfig(**{"max_new_tokens": NEW, "do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "pad_token_id": 0, **settings})
