"""Confidence head of DSpark (Eq. 7) and the prefix survival it feeds.

``c_k = sigmoid(w^T [h_k ; W1[x_{k-1}]] / T_k)``: the probability that draft token k is accepted given that
every earlier token of the block was accepted. ``T_k`` are the Sequential Temperature Scaling
temperatures (1 until calibrated). It reads the previously *sampled* token only, so a truncation
decision for position k never looks at the token it admits.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["DSparkConfidenceHead", "calibrated_confidence", "prefix_survival"]


class DSparkConfidenceHead(nn.Module):
    def __init__(self, hidden_size: int, markov_rank: int = 0):
        super().__init__()
        self.proj = nn.Linear(hidden_size + markov_rank, 1, bias=True)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [..., d] h_k after the final norm
        prev_embeddings: torch.Tensor | None = None,  # [..., r] W1[x_{k-1}], None without a Markov head
    ) -> torch.Tensor:
        """Confidence *logits* [...] (before temperature scaling and sigmoid)."""
        features = hidden_states if prev_embeddings is None else torch.cat([hidden_states, prev_embeddings.to(hidden_states.dtype)], -1)
        return self.proj(features).squeeze(-1).float()


def calibrated_confidence(logits: torch.Tensor, temperatures=None, position: int | None = None) -> torch.Tensor:
    """Eq. 7 with the STS temperatures: ``c_k = sigmoid(z_k / T_k)`` from the head's logits ``z_k`` (no temperatures:
    all 1). ``position`` is the 0-based slot of a single position; ``None``: the last axis runs over slots."""
    if temperatures is None:
        return torch.sigmoid(logits)
    if position is not None:
        return torch.sigmoid(logits / temperatures[position])
    t = torch.as_tensor(temperatures[: logits.shape[-1]], dtype=logits.dtype, device=logits.device)
    return torch.sigmoid(logits / t)


def prefix_survival(confidences: torch.Tensor) -> torch.Tensor:
    """Prefix survival ``a_k = prod_{i<=k} c_i`` along the last axis, in float64 (a product of up to a block of
    probabilities near 1 that thresholds and schedulers compare)."""
    return torch.cumprod(confidences.double(), dim=-1)
