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

    A token is dropped exactly when the tokens more likely than it already hold ``top_p`` of the mass. A row's
    candidates are its tokens more likely than ``1 / candidates`` (so at most ``candidates`` of them) and every other
    token is less likely than all of them: when the candidates hold ``top_p``, sorting them alone decides the row
    and only they can stay. The other rows sort the whole vocabulary. A threshold finds the candidates with one
    comparison per logit, where ``topk``, a ``logsumexp`` and a full-width ``masked_fill`` were a fifth of a
    batched sampling step on a 49k vocabulary. Exact ties with the least likely kept token are kept."""
    vocab = scaled.shape[-1]
    flat = scaled.reshape(-1, vocab)
    num_rows = flat.shape[0]
    row_top_p = top_p.repeat_interleave(num_rows // top_p.shape[0])
    threshold = (1 - row_top_p).to(torch.float32)
    active = row_top_p < 1.0
    probs = flat.softmax(-1, dtype=torch.float32)
    rows, cols = ((probs > 1 / candidates) & active[:, None]).nonzero(as_tuple=True)  # row-major order
    counts = torch.bincount(rows, minlength=num_rows)
    slot = torch.arange(rows.numel(), device=flat.device) - (counts.cumsum(0) - counts)[rows]
    width = max(int(counts.max()) if num_rows else 0, 1)
    candidate_logits = flat.new_full((num_rows, width), float("-inf"))
    candidate_logits[rows, slot] = flat[rows, cols]
    candidate_logits, order = candidate_logits.sort(dim=-1, descending=True)
    candidate_probs = probs.new_zeros(num_rows, width)
    candidate_probs[rows, slot] = probs[rows, cols]
    candidate_probs = candidate_probs.gather(-1, order)
    cumulative = candidate_probs.cumsum(-1)
    keep = (1 - (cumulative - candidate_probs)) > threshold[:, None]  # the more likely tokens hold less than top_p
    keep[:, 0] = True
    cutoff = candidate_logits.masked_fill(~keep, float("inf")).amin(-1)  # the least likely kept logit
    decided = (1 - cumulative[:, -1]) <= threshold  # the first token past the candidates is dropped
    out = flat.new_full(flat.shape, float("-inf"))
    kept = decided[rows] & (flat[rows, cols] >= cutoff[rows])
    out[rows[kept], cols[kept]] = flat[rows[kept], cols[kept]]
    untouched = (~active).nonzero(as_tuple=True)[0]
    out[untouched] = flat[untouched]
    undecided = (active & ~decided).nonzero(as_tuple=True)[0]
    if undecided.numel():
        rest = flat[undecided]
        sorted_logits, ascending_order = rest.sort(dim=-1, descending=False)
        ascending = sorted_logits.softmax(-1).cumsum(-1)
        remove = ascending <= threshold[undecided, None].to(ascending.dtype)
        remove[:, -1] = False  # keep at least the most likely token
        out[undecided] = rest.masked_fill(remove.scatter(-1, ascending_order, remove), float("-inf"))
    return out.reshape(scaled.shape)


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
