"""Sequential heads of DSpark (SPEC section 3): the Markov head (Eq. 5) and the RNN head (Eq. 6).

Both add a bias ``B_k`` to the parallel backbone's logits ``U_k`` before an ordinary softmax (Eq. 4), so
every per-token draft probability is exact, which lossless rejection sampling needs. Each head has
two verbs: ``apply_step_logits`` for one position given the previously sampled token (the drafting loop,
``generation.decoding.drafting.draft_block``) and ``apply_block_logits``, the teacher-forced form used in training.
Both index tokens by their *draft* index (``DraftVocabMixin.draft_index``): ``W2`` produces logits over the
draft vocabulary, and with a reduced one ``W1`` has an extra last row shared by every token outside it.
"""

from __future__ import annotations

import torch
from torch import nn

from .draft_vocab import cached, tensor_key

__all__ = ["SequentialHead", "VanillaMarkovHead", "RNNMarkovHead", "build_markov_head"]


class SequentialHead(nn.Module):
    """What both heads share: the previous token's embedding ``W1`` in R^{V_in x r}, also read by the confidence
    head (Eq. 7), and the output map ``W2`` in R^{r x V} to a bias over the draft vocabulary ``V`` (``V_in`` is it
    or, with a reduced one, ``V + 1``). Each head adds its bias to the backbone's logits through ``initial_state``,
    ``apply_step_logits`` (one slot) and ``apply_block_logits`` (teacher forced)."""

    def __init__(self, vocab_size: int, markov_rank: int, num_inputs: int | None = None):
        super().__init__()
        self.markov_w1 = nn.Embedding(num_inputs or vocab_size, markov_rank)
        self.markov_w2 = nn.Linear(markov_rank, vocab_size, bias=False)

    def get_prev_embeddings(self, prev_ids: torch.LongTensor) -> torch.Tensor:
        """``W1[x_{k-1}]``, also read by the confidence head (Eq. 7)."""
        return self.markov_w1(prev_ids)


class VanillaMarkovHead(SequentialHead):
    """``B(x_{k-1}, .) = W1[x_{k-1}] W2`` (Eq. 5).

    Drafting reads one row of the bigram table ``W1 W2`` per slot. Where the table is at most ``max_table_bytes``
    (an 8k draft vocabulary: 134 MB in bf16, 268 MB in fp32) it is materialised once for inference and each slot
    reads its row, instead of a rank-r product over the draft vocabulary per slot, which reads all of ``W2``: on a
    2-core AVX2 CPU in fp32 the table takes a drafting round from 18-19 to 14-15 ms (rank 256, 7 slots; the README's
    ``speed_v14_avx2``)."""

    max_table_bytes = 320 * 2**20

    def __init__(self, vocab_size: int, markov_rank: int, num_inputs: int | None = None):
        super().__init__(vocab_size, markov_rank, num_inputs)
        self._bigram_cache: dict[str, tuple] = {}  # W1 W2 under its weights' key: not a buffer, never saved

    def bigram_bias(self, prev_ids: torch.LongTensor) -> torch.Tensor:
        """``B(x_{k-1}, .)`` [..., V] for previous tokens [...] (draft indices): a row of the table at inference,
        the factored product otherwise (training, gradients, or a table over ``max_table_bytes``)."""
        table = self._bigram_table()
        if table is None:
            return self.markov_w2(self.markov_w1(prev_ids))
        return table[prev_ids]

    def _bigram_table(self) -> torch.Tensor | None:
        w1, w2 = self.markov_w1.weight, self.markov_w2.weight
        if self.training or torch.is_grad_enabled() or w1.shape[0] * w2.shape[0] * w2.element_size() > self.max_table_bytes:
            return None
        # rebuilt when the weights change (loaded, moved, trained)
        return cached(self._bigram_cache, "table", (tensor_key(w1), tensor_key(w2)), lambda: w1 @ w2.T)

    def initial_state(self, hidden_states: torch.Tensor) -> None:
        return None

    def apply_step_logits(
        self,
        logits: torch.Tensor,  # [..., V] base logits U_k
        prev_ids: torch.LongTensor,  # [...] previously sampled token x_{k-1}
        hidden_states: torch.Tensor,  # [..., d] h_k (unused by this head)
        state: None = None,
    ) -> tuple[torch.Tensor, None]:
        return logits + self.bigram_bias(prev_ids).to(logits.dtype), None

    def apply_block_logits(
        self,
        logits: torch.Tensor,  # [..., K, V]
        prev_ids: torch.LongTensor,  # [..., K] teacher-forced previous tokens
        hidden_states: torch.Tensor,  # [..., K, d]
        prev_embeddings: torch.Tensor | None = None,  # [..., K, r] W1[prev_ids], when the caller has them
    ) -> torch.Tensor:
        prev = self.markov_w1(prev_ids) if prev_embeddings is None else prev_embeddings
        return logits + self.markov_w2(prev).to(logits.dtype)


class RNNMarkovHead(SequentialHead):
    """Gated recurrent bias (Eq. 6): ``z_k = [s_{k-1}; W1[x_{k-1}]; h_k]``, one linear map to gate/candidate/output,
    ``s_k = sig(g) * s_{k-1} + (1 - sig(g)) * tanh(c)``, ``B_k = W2 tanh(o)``, ``s_0 = 0``."""

    def __init__(self, vocab_size: int, markov_rank: int, hidden_size: int, num_inputs: int | None = None):
        super().__init__(vocab_size, markov_rank, num_inputs)
        self.markov_rank = markov_rank
        self.joint_proj = nn.Linear(2 * markov_rank + hidden_size, 3 * markov_rank, bias=True)

    def initial_state(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.new_zeros(*hidden_states.shape[:-1], self.markov_rank)

    def _step(self, state, prev_ids, hidden_states, prev_embeddings=None):
        prev = self.markov_w1(prev_ids) if prev_embeddings is None else prev_embeddings
        z = torch.cat([state, prev.to(state.dtype), hidden_states.to(state.dtype)], dim=-1)
        gate, candidate, output = self.joint_proj(z).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(output)), state

    def apply_step_logits(self, logits, prev_ids, hidden_states, state=None):
        if state is None:
            state = self.initial_state(hidden_states)
        bias, state = self._step(state, prev_ids, hidden_states)
        return logits + bias.to(logits.dtype), state

    def apply_block_logits(self, logits, prev_ids, hidden_states, prev_embeddings=None):
        state = self.initial_state(hidden_states[..., 0, :])
        biases = []
        for k in range(logits.shape[-2]):
            emb = None if prev_embeddings is None else prev_embeddings[..., k, :]
            bias, state = self._step(state, prev_ids[..., k], hidden_states[..., k, :], emb)
            biases.append(bias)
        return logits + torch.stack(biases, dim=-2).to(logits.dtype)


def build_markov_head(config) -> SequentialHead | None:
    """The head named by ``config.markov_head_type``; ``None`` gives the plain parallel (DFlash) drafter."""
    if config.markov_head_type is None:
        return None
    size = config.draft_vocab_size or config.vocab_size
    num_inputs = size + 1 if config.draft_vocab_size is not None else size  # + the row of tokens outside it
    if config.markov_head_type == "vanilla":
        return VanillaMarkovHead(size, config.markov_rank, num_inputs)
    return RNNMarkovHead(size, config.markov_rank, config.hidden_size, num_inputs)
