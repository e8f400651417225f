"""The inverse-CDF sampler behind every sampled draft and verification draw: exact frequencies, never a
zero-probability token, any leading shape."""

import torch

from generation.decoding.drafting import sample_categorical


def test_inverse_cdf_sampler_has_the_right_frequencies_and_never_draws_zero_mass():
    torch.manual_seed(0)
    probs = torch.tensor([[0.1, 0.0, 0.2, 0.3, 0.4, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 2.0]])  # unnormalised row 2
    draws = sample_categorical(probs.repeat(100000, 1)).view(100000, 2)
    freq = torch.bincount(draws[:, 0], minlength=6).float() / 100000
    assert torch.allclose(freq, probs[0], atol=0.005) and freq[1] == 0 and freq[5] == 0
    assert bool((draws[:, 1] == 5).all())
    assert sample_categorical(torch.rand(2, 3, 7)).shape == (2, 3)
    # the last token with mass is returned even when the uniform lands on the total
    edge = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    assert all(int(sample_categorical(edge)) in (0, 1) for _ in range(200))
