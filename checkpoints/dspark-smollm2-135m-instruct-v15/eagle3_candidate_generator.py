"""`Eagle3CandidateGenerator`: the Eagle3 baseline on the same candidate-generator protocol as DSpark.

Each round it appends one step-0 entry per newly committed token to the draft cache (target features of
position s with token ``x_{s+1}``), then drafts up to ``ttt_length`` tokens autoregressively, one draft-layer
forward per token, and finally crops the chain entries off the cache (DeepSpec's evaluator does the same; it
is exact because the drafter has a single layer). Like DSpark it returns the processed logits each token was
sampled from, so verification stays lossless.
"""

from __future__ import annotations

import time

import torch

from .candidate_generator import HiddenStateCandidateGenerator
from .drafting import draft_token
from .stats import DSparkRound

__all__ = ["Eagle3CandidateGenerator"]


class Eagle3CandidateGenerator(HiddenStateCandidateGenerator):
    """Drafts for ``target.generate(..., assistant_model=<Eagle3 drafter>)`` (batch size 1). The number of drafts
    per round defaults to ``ttt_length`` and can be lowered with the ``dspark_num_draft_tokens`` attribute."""

    kind = "Eagle3"

    def _embed(self, ids: torch.LongTensor) -> torch.Tensor:
        return self.input_embeddings(ids.to(self.input_embeddings.weight.device)).to(self.drafter.device)

    def _propose(self, input_ids, model_outputs):
        start = time.perf_counter()
        max_tokens = min(self.num_draft_tokens, self.max_length - input_ids.shape[1] - 1)
        if max_tokens <= 0:
            return input_ids, None
        if model_outputs is None or getattr(model_outputs, "hidden_states", None) is None:
            raise ValueError("Eagle3 drafting needs the target's hidden states of the last forward")
        drafter = self.drafter
        committed = self.cache.get_seq_length()
        anchor_pos = input_ids.shape[1] - 1
        num_new = anchor_pos - committed
        features = drafter.context_features(model_outputs.hidden_states)
        if num_new > features.shape[1] or num_new < 1:
            raise ValueError(f"Eagle3 drafter context is out of sync: {num_new} new tokens, {features.shape[1]} hidden states")
        device = drafter.device
        # step 0: entries (features of s, token x_{s+1}) for the newly committed positions s
        hidden, normed = drafter(
            input_embeds=self._embed(input_ids[:, committed + 1 : anchor_pos + 1]),
            hidden=drafter.fc(features[:, :num_new].to(device=device, dtype=drafter.dtype)),
            position_ids=torch.arange(committed, anchor_pos, device=device)[None],
            cache=self.cache,
        )
        hidden, normed = hidden[:, -1:], normed[:, -1:]
        ids = input_ids
        tokens, logits = [], []
        for k in range(max_tokens):
            step = drafter.draft_base_logits(normed[:, -1], self.lm_head)  # [1, Vd]
            token, step = draft_token(drafter, step, not self.do_sample, self.logits_processor, ids)
            tokens.append(token)
            logits.append(step)
            ids = torch.cat([ids, token[None].to(ids.device)], dim=-1)
            if self.eos_token_ids is not None and torch.isin(token, self.eos_token_ids.to(token.device)).any():
                break
            if k + 1 < max_tokens:  # chain step k + 1 at rotary position t + k + 1, t = anchor_pos - 1
                hidden, normed = drafter(
                    input_embeds=self._embed(token[None]),
                    hidden=hidden,
                    position_ids=torch.tensor([[anchor_pos + k]], device=device),
                    cache=self.cache,
                )
        extra = self.cache.get_seq_length() - anchor_pos
        if extra > 0:
            self.cache.crop(-extra)  # keep only the committed step-0 entries
        drafted = len(tokens)
        self._pending_round = DSparkRound(drafted=drafted, verified=drafted, draft_seconds=time.perf_counter() - start)
        candidates = torch.stack(tokens, dim=1).to(input_ids.device)
        return torch.cat([input_ids, candidates], dim=-1), torch.stack(logits, dim=1)
