"""Batched, per-row sampling settings and the speculative verification rule for ragged drafts.

Rows decode greedily (``temperature == 0``) or sample from ``softmax(top_p(top_k(logits / T)))`` with their own
T, top-k and top-p, in Transformers' order and with its warpers' rules (top-k keeps the k largest logits and their
ties; top-p drops the smallest tokens whose total mass is at most ``1 - top_p``). Verification of row r's first ``l_r`` drafts: greedy rows accept while the draft is the
target's argmax; sampled rows accept draft x with probability ``min(1, p(x) / q(x))`` and on the first
rejection draw from ``norm(max(p - q, 0))`` (Leviathan et al.), else the bonus token from ``p``. The
output of every row is distributed as the row's processed target distribution.
"""

from __future__ import annotations

import torch

from generation.decoding.drafting import sample_categorical

__all__ = ["process_logits", "sample_tokens", "top_p_filter", "verify_drafts"]


def process_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor | None = None
) -> torch.Tensor:
    """``logits`` [R, ..., V] float; ``temperature`` / ``top_p`` / ``top_k`` [R] (top-k 0: off). Greedy rows (T = 0)
    are returned as is."""
    shape = (-1,) + (1,) * (logits.dim() - 1)
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).view(shape).to(logits.dtype)
    scaled = logits / t
    if top_k is not None and bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k, logits.shape[-1]).clamp(max=logits.shape[-1])
        kth = scaled.sort(dim=-1, descending=True).values.gather(-1, (k - 1).view(shape).expand(*scaled.shape[:-1], 1))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if bool((top_p < 1.0).any()):
        scaled = top_p_filter(scaled, top_p)
    return torch.where(greedy.view(shape), logits, scaled)


def top_p_filter(scaled: torch.Tensor, top_p: torch.Tensor, candidates: int = 256) -> torch.Tensor:
    """``scaled`` [R, ..., V] with -inf on the tokens Transformers' ``TopPLogitsWarper`` drops: those whose ascending
    cumulative probability is at most ``1 - top_p`` (at least the most likely token stays); rows with ``top_p >= 1``
    untouched.

    A token is dropped exactly when the tokens more likely than it already hold ``top_p`` of the mass, so the
    ``candidates`` most likely tokens decide every row whose candidates reach ``top_p``; only the other rows sort
    the whole vocabulary (sorting 49k logits per row was a fifth of a batched decoding step). Exact ties with the
    least likely kept token are kept."""
    shape = (-1,) + (1,) * (scaled.dim() - 1)
    threshold = (1 - top_p).view(shape).to(torch.float32)
    active = (top_p < 1.0).view(shape)
    k = min(candidates, scaled.shape[-1])
    values = scaled.topk(k, dim=-1).values  # descending
    probs = (values.float() - scaled.float().logsumexp(-1, keepdim=True)).exp()
    before = probs.cumsum(-1) - probs  # mass of the more likely candidates
    keep = (1 - before) > threshold
    keep[..., 0] = True
    # decided: a candidate was dropped (so is every less likely token), the row keeps everything, or k is all of V
    decided = ~keep[..., -1:] | ~active | (k == scaled.shape[-1])
    cutoff = values.masked_fill(~keep, float("inf")).amin(-1, keepdim=True)  # the least likely kept logit
    filtered = scaled.masked_fill((scaled < cutoff) & active, float("-inf"))
    if bool(decided.all()):
        return filtered
    sorted_logits, order = scaled.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    remove = cumulative <= threshold.to(cumulative.dtype)
    remove[..., -1] = False  # keep at least the most likely token
    remove = remove.scatter(-1, order, remove)
    return torch.where(decided, filtered, scaled.masked_fill(remove & active, float("-inf")))


def sample_tokens(processed: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """One token per row from processed logits [R, V]: argmax for greedy rows, a draw otherwise."""
    drawn = sample_categorical(processed.float().softmax(-1))
    return torch.where(greedy, processed.argmax(-1), drawn)


def verify_drafts(
    target_logits: torch.Tensor,  # [R, L + 1, V] processed target logits at the anchor and each draft position
    draft_logits: torch.Tensor | None,  # [R, L, V] processed logits the drafts were sampled from (q)
    drafts: torch.LongTensor,  # [R, L]
    lengths: torch.LongTensor,  # [R] drafts of each row sent for verification (l_r <= L)
    greedy: torch.Tensor,  # [R] bool
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Returns (accepted [R], next_token [R]): how many of each row's verified drafts are kept, and the token
    that follows them (the correction after a rejection, or the bonus token)."""
    num_rows, width = drafts.shape
    rows = torch.arange(num_rows, device=drafts.device)
    p = target_logits.float().softmax(-1)
    in_range = torch.arange(width, device=drafts.device)[None] < lengths[:, None]
    if width:
        p_draft = p[:, :width].gather(-1, drafts[..., None])[..., 0]
        greedy_ok = target_logits[:, :width].argmax(-1) == drafts
        if draft_logits is None:
            raise ValueError("verify_drafts needs the logits the drafts were sampled from")
        q = draft_logits.float().softmax(-1)
        q_draft = q.gather(-1, drafts[..., None])[..., 0]
        ratio = torch.where(q_draft > 0, p_draft / q_draft.clamp(min=1e-30), torch.zeros_like(p_draft))
        sample_ok = torch.rand_like(ratio) < ratio.clamp(max=1.0)
        ok = torch.where(greedy[:, None], greedy_ok, sample_ok) & in_range
        accepted = ok.long().cumprod(-1).sum(-1)
    else:
        accepted = torch.zeros(num_rows, dtype=torch.long, device=drafts.device)
    p_next = p[rows, accepted]  # [R, V] target distribution where the row stops
    rejected = accepted < lengths
    if width and bool((rejected & ~greedy).any()):
        q_next = q[rows, accepted.clamp(max=width - 1)]
        residual = (p_next - q_next).clamp(min=0)
        mass = residual.sum(-1, keepdim=True)
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
        p_next = torch.where((rejected & ~greedy)[:, None], residual, p_next)
    drawn = sample_categorical(p_next)
    next_token = torch.where(greedy, target_logits[rows, accepted].argmax(-1), drawn)
    return accepted, next_token
