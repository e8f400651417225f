"""Confidence head of DSpark (Eq. 7) and the prefix survival it feeds.

``c_k = sigmoid(w^T [h_k ; W1[x_{k-1}]] / T_k)``: the probability that draft token k is accepted given that
every earlier token of the block was accepted. ``T_k`` are the Sequential Temperature Scaling
temperatures (1 until calibrated). It reads the previously *sampled* token only, so a truncation
decision for position k never looks at the token it admits.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["DSparkConfidenceHead", "cumulative_survival"]


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


def cumulative_survival(confidences: torch.Tensor) -> torch.Tensor:
    """Prefix survival ``a_k = prod_{i<=k} c_i`` along the last axis."""
    return torch.cumprod(confidences, dim=-1)
