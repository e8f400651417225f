"""The engine's top-p filter drops exactly the tokens Transformers' ``TopPLogitsWarper`` drops, whether the most
likely candidates decide a row or it needs the full sort."""

import torch
from transformers import TopPLogitsWarper

from generation.serving.verification import process_logits, top_p_filter


def transformers_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    return TopPLogitsWarper(top_p)(None, logits.clone())


def test_top_p_filter_equals_transformers_warper_on_peaked_and_flat_rows():
    torch.manual_seed(0)
    vocab = 3000
    peaked = torch.randn(6, vocab) * 4  # a few hundred candidates hold the mass
    flat = torch.randn(6, vocab) * 0.05  # the top-p set is far wider than the candidates: the full sort decides
    for logits in (peaked, flat, torch.cat([peaked, flat])):
        for p in (0.5, 0.9, 0.99):
            top_p = torch.full((logits.shape[0],), p)
            ours = top_p_filter(logits, top_p, candidates=64)
            assert torch.equal(torch.isinf(ours), torch.isinf(transformers_top_p(logits, p)))
            assert torch.equal(ours[~torch.isinf(ours)], logits[~torch.isinf(ours)])  # kept logits unchanged


def test_top_p_filter_per_row_settings_and_extra_dimensions():
    torch.manual_seed(1)
    logits = torch.randn(4, 3, 500) * 3
    top_p = torch.tensor([0.8, 1.0, 0.3, 0.95])
    ours = top_p_filter(logits, top_p, candidates=32)
    for r in range(4):
        expected = logits[r] if top_p[r] >= 1 else transformers_top_p(logits[r], float(top_p[r]))
        assert torch.equal(torch.isinf(ours[r]), torch.isinf(expected)), r
    assert not torch.isinf(ours[1]).any()  # top_p = 1 keeps every token
    # with a top-k cut first (-inf already present), through process_logits
    out = process_logits(logits, torch.ones(4), top_p, torch.tensor([5, 0, 50, 0]))
    assert (~torch.isinf(out[0])).sum(-1).le(5).all() and (~torch.isinf(out[2])).sum(-1).ge(1).all()


def test_the_most_likely_token_always_stays():
    logits = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    out = top_p_filter(logits, torch.tensor([0.01]), candidates=2)
    assert torch.equal(torch.isinf(out), torch.tensor([[False, True, True, True]]))
