"""DSpark training objective (SPEC section 7, Eqs. 8-12), as DeepSpec computes it.

A training sequence opens a block at each sampled *anchor* p: the block input is ``[x_p, MASK x (B-1)]``, slot
k predicts ``x_{p+k+1}``, the context is every target feature strictly before p. With position weights
``w_k = exp(-k / decay)`` (k 0-based) on a contiguous supervised prefix of each block:

    L = ce_alpha * sum w CE + l1_alpha * sum w ||p_d - p_t||_1 + conf_alpha * sum w BCE(c_k, c*_k),  each / sum w

with the Markov bias applied (teacher-forced previous tokens) before every term, the full L1 (in [0, 2]) and the
confidence target ``c*_k = clamp(1 - 0.5 L1, 0, 1)`` detached.

Over a draft vocabulary (``config.draft_vocab_size``) the drafter's distribution is zero outside it, so
``||p_d - p_t||_1 = sum_{draft vocab} |p_d - p_t| + (target mass outside)``: the same number as over the whole
vocabulary without ever forming a full-vocabulary draft softmax. The CE of a label outside the draft vocabulary
would be infinite; such labels are left out of the CE term (they still count in L1 and the confidence label,
as the drafter's loss of acceptance there). The target's distribution is computed once per sequence position
(:func:`target_distribution`) and gathered for every block slot that predicts from it; draft logits exist for
``chunk_size`` blocks at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = [
    "DSparkLossOutput",
    "TargetDistribution",
    "build_block_attention_mask",
    "build_block_context_mask",
    "build_block_targets",
    "build_loss_weights",
    "compute_block_loss_terms",
    "compute_dspark_loss",
    "sample_anchor_positions",
    "target_distribution",
]


@dataclass
class DSparkLossOutput:
    loss: torch.Tensor  # scalar total (Eq. 12)
    ce_loss: torch.Tensor
    l1_loss: torch.Tensor
    confidence_loss: torch.Tensor
    ce_num: torch.Tensor  # sum w * CE
    l1_num: torch.Tensor  # sum w * L1
    confidence_num: torch.Tensor  # sum w * BCE
    weight_den: torch.Tensor  # sum w
    accept_rate_num: torch.Tensor  # [B] per slot: sum over kept blocks of eval_mask * (1 - 0.5 L1)
    accept_rate_den: torch.Tensor  # [B] per slot: number of supervised blocks
    accept_rate: torch.Tensor | None = None  # [bsz, N, B] detached 1 - 0.5 L1 of every slot
    eval_mask: torch.Tensor | None = None  # [bsz, N, B]
    draft_logits: torch.Tensor | None = None  # [bsz, N, B, V] when return_logits
    target_logits: torch.Tensor | None = None  # [bsz, N, B, V] when return_logits
    confidence_logits: torch.Tensor | None = None  # [bsz, N, B]


def sample_anchor_positions(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None):
    """Anchors p where x_p and x_{p+1} are both supervised, at most ``num_anchors`` per row, drawn without
    replacement and sorted; missing slots are dummy blocks (position 0, keep False). Returns (anchors, keep), as wide
    as the batch needs: ``min(num_anchors, most candidates in a row)`` (at least 1), so dense anchors do not pay
    for dummy blocks beyond the longest response."""
    bsz, seq_len = loss_mask.shape
    mask = loss_mask.bool()
    candidates = torch.zeros_like(mask)
    candidates[:, :-1] = mask[:, :-1] & mask[:, 1:]
    scores = torch.rand(bsz, seq_len, generator=generator, device=loss_mask.device)
    width = max(1, min(num_anchors, int(candidates.sum(1).max()) if bsz else 0))
    order = scores.masked_fill(~candidates, 2.0).argsort(dim=1)[:, :width]  # candidates first, at random
    chosen = torch.where(candidates.gather(1, order), order, torch.full_like(order, seq_len))
    anchors = chosen.sort(dim=1).values  # dummies (= seq_len) sort last
    keep = anchors < seq_len
    anchors = anchors.masked_fill(~keep, 0)
    if anchors.shape[1] < width:  # sequences shorter than the width
        pad = width - anchors.shape[1]
        anchors = F.pad(anchors, (0, pad))
        keep = F.pad(keep, (0, pad))
    return anchors, keep


def build_block_targets(input_ids, loss_mask, anchors, keep, block_size):
    """Labels, their validity and the target-logit index of every block slot.

    Returns ``target_ids`` [bsz, N, B] (slot k: ``x_{p+k+1}``), ``eval_mask`` [bsz, N, B] (label inside the sequence,
    supervised, block kept, then a cumulative product so only a contiguous prefix counts), ``prev_ids`` [bsz, N, B]
    (teacher forcing: ``[x_p, labels[:-1]]``) and ``logit_index`` [bsz, N, B] (position whose target logits predict
    the label, ``p + k``)."""
    bsz, seq_len = input_ids.shape
    offsets = torch.arange(1, block_size + 1, device=input_ids.device)
    label_index = anchors[..., None] + offsets  # [bsz, N, B]
    inside = label_index < seq_len
    label_index = torch.where(keep[..., None], label_index.clamp(max=seq_len - 1), torch.zeros_like(label_index))
    flat = label_index.view(bsz, -1)
    target_ids = input_ids.gather(1, flat).view_as(label_index)
    supervised = loss_mask.bool().gather(1, flat).view_as(label_index)
    eval_mask = (inside & supervised & keep[..., None]).long().cumprod(dim=-1).bool()
    anchor_ids = input_ids.gather(1, anchors)
    prev_ids = torch.cat([anchor_ids[..., None], target_ids[..., :-1]], dim=-1)
    logit_index = (label_index - 1).clamp(min=0)
    return target_ids, eval_mask, prev_ids, logit_index


def build_block_attention_mask(anchors, keep, seq_len: int, block_size: int) -> torch.Tensor:
    """[bsz, 1, N B, S + N B] bool: a block query sees context strictly before its anchor and its own block
    (bidirectionally). A dummy block sees only itself, which keeps its (unweighted) outputs finite."""
    bsz, num_blocks = anchors.shape
    q_block = torch.arange(num_blocks * block_size, device=anchors.device) // block_size  # [Q]
    ctx = torch.arange(seq_len, device=anchors.device)
    sees_ctx = ctx[None, None, :] < anchors[:, q_block, None]  # [bsz, Q, S]
    sees_ctx = sees_ctx & keep[:, q_block, None]
    kv_block = torch.arange(num_blocks * block_size, device=anchors.device) // block_size
    sees_block = (q_block[:, None] == kv_block[None, :]).expand(bsz, -1, -1)
    return torch.cat([sees_ctx, sees_block], dim=-1)[:, None]


def build_block_context_mask(anchors, keep, seq_len: int) -> torch.Tensor:
    """[bsz, N, S] bool: the context positions each block sees (strictly before its anchor; none for a dummy
    block). With its own block this is :func:`build_block_attention_mask`'s pattern, in the form the drafter's
    block-sparse attention takes."""
    ctx = torch.arange(seq_len, device=anchors.device)
    return (ctx[None, None, :] < anchors[:, :, None]) & keep[:, :, None]


def build_loss_weights(eval_mask: torch.Tensor, decay: float) -> torch.Tensor:
    """``w_k = exp(-k / decay)`` on supervised slots (k 0-based), zero elsewhere."""
    k = torch.arange(eval_mask.shape[-1], device=eval_mask.device, dtype=torch.float32)
    return eval_mask.float() * torch.exp(-k / decay)


@dataclass
class TargetDistribution:
    """The target's next-token distribution at the sequence positions a loss reads, over the draft vocabulary.

    ``probs`` [M + 1, Vd] (row 0 is an all-zero row for positions not computed), ``outside`` [M + 1] the mass the
    target puts outside the draft vocabulary, ``row`` [bsz, S] the row of each position."""

    probs: torch.Tensor
    outside: torch.Tensor
    row: torch.LongTensor

    def at(self, batch_index: torch.LongTensor, positions: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs [..., Vd], outside [...]) at ``positions`` of the sequences ``batch_index`` (same shapes)."""
        rows = self.row[batch_index, positions]
        return self.probs[rows], self.outside[rows]


@torch.no_grad()
def target_distribution(
    drafter, target_last_hidden: torch.Tensor, lm_head: torch.nn.Module, logit_index: torch.LongTensor, eval_mask: torch.Tensor,
    chunk_rows: int = 512,
) -> TargetDistribution:
    """``softmax(lm_head(h_t))`` once per position that a supervised slot predicts from (``logit_index`` [bsz, N, B]
    where ``eval_mask``), restricted to the drafter's draft vocabulary (and the mass outside it), in chunks of
    ``chunk_rows`` positions. Every slot that predicts from a position gathers it, instead of every covering anchor
    recomputing a full-vocabulary softmax."""
    bsz, seq_len = target_last_hidden.shape[:2]
    needed = torch.zeros(bsz, seq_len, dtype=torch.bool, device=logit_index.device)
    batch_index = torch.arange(bsz, device=logit_index.device).view(-1, *([1] * (logit_index.dim() - 1))).expand_as(logit_index)
    needed[batch_index[eval_mask], logit_index[eval_mask]] = True
    where = needed.nonzero(as_tuple=False)  # [M, 2]
    draft_ids = drafter.draft_token_ids
    width = drafter.num_draft_tokens_in_vocab
    probs = target_last_hidden.new_zeros(where.shape[0] + 1, width, dtype=torch.float32)
    outside = probs.new_zeros(where.shape[0] + 1)
    for start in range(0, where.shape[0], chunk_rows):
        idx = where[start : start + chunk_rows]
        hidden = target_last_hidden[idx[:, 0], idx[:, 1]]
        # softmax in the logits' dtype: a bf16 softmax accumulates in fp32 and rounds once, far below the rounding
        # the bf16 logits already carry, and fp32 is taken only of the draft vocabulary's columns
        full = torch.softmax(lm_head(hidden.to(lm_head.weight.dtype)), dim=-1)
        rows = slice(1 + start, 1 + start + idx.shape[0])
        if draft_ids is None:
            probs[rows] = full
        else:
            inside = full.index_select(-1, draft_ids.to(full.device)).float()
            probs[rows] = inside
            outside[rows] = (1.0 - inside.sum(-1)).clamp(min=0.0)
    row = torch.zeros(bsz, seq_len, dtype=torch.long, device=logit_index.device)
    row[where[:, 0], where[:, 1]] = torch.arange(1, where.shape[0] + 1, device=logit_index.device)
    return TargetDistribution(probs, outside, row)


class _CrossEntropyAndL1(torch.autograd.Function):
    """Per slot: the CE term (Eq. 9, or to the target's distribution) and ``sum |q - p_t|`` (Eq. 10 over the draft
    vocabulary) from the draft logits, with a hand-written backward: the gradient of the L1 is
    ``q * (s - sum(q s))`` with ``s = sign(q - p_t)``, that of the CE ``q - onehot(label)`` (or ``q - p_t``).
    Autograd's version of the same maths makes about three times as many passes over the [slots, vocabulary]
    tensors, which dominate a training step on a CPU."""

    @staticmethod
    def forward(ctx, logits, target_probs, labels, label_weight, distribution: bool):
        log_q = (logits if logits.dtype == torch.float64 else logits.float()).log_softmax(-1)
        q = log_q.exp()
        target_probs = target_probs.to(q.dtype)
        diff = q - target_probs
        l1 = diff.abs().sum(-1)
        if distribution:
            ce = -(target_probs * log_q).sum(-1)
        else:
            ce = -log_q.gather(-1, labels[..., None])[..., 0] * label_weight
        ctx.save_for_backward(q, diff > 0, target_probs if distribution else labels, label_weight)
        ctx.distribution = distribution
        ctx.logits_dtype = logits.dtype
        return ce, l1

    @staticmethod
    def backward(ctx, grad_ce, grad_l1):
        q, positive, target_or_labels, label_weight = ctx.saved_tensors
        sign = positive.float().mul_(2).sub_(1)  # ties (q == p_t exactly) have measure zero
        sign = sign.to(q.dtype)
        grad = sign.sub_((q * sign).sum(-1, keepdim=True)).mul_(q).mul_(grad_l1[..., None].to(q.dtype))
        if ctx.distribution:
            mass = target_or_labels.sum(-1, keepdim=True)
            grad.add_((q * mass - target_or_labels) * grad_ce[..., None].to(q.dtype))
        else:
            scale = (grad_ce * label_weight)[..., None].to(q.dtype)
            grad.add_(q * scale)
            grad.scatter_add_(-1, target_or_labels[..., None], -scale)
        return grad.to(ctx.logits_dtype), None, None, None, None


def compute_block_loss_terms(
    draft_logits,  # [..., B, Vd] drafter logits over its draft vocabulary (the whole vocabulary without one)
    target_probs,  # [..., B, Vd] the target's probabilities of the same tokens
    target_ids,  # [..., B] labels as draft indices (any value where ``label_in_vocab`` is False)
    confidence_logits,  # [..., B] or None
    weights,  # [..., B]
    ce_target: str = "label",
    outside_mass=None,  # [..., B] target mass outside the draft vocabulary (None: zero)
    label_in_vocab=None,  # [..., B] bool, labels inside the draft vocabulary (None: all)
):
    """Weighted sums of the three terms over the given blocks.

    ``ce_target="label"`` is Eq. 9 (CE of the sampled response token); ``"distribution"`` is the cross-entropy to the
    target's whole next-token distribution (distillation, what Eagle3 trains with; equal to KL + the target's entropy),
    over the draft vocabulary. Returns (ce_num, l1_num, confidence_num, accept_rate) with accept_rate =
    clamp(1 - 0.5 L1, 0, 1) per slot."""
    if ce_target not in ("label", "distribution"):
        raise ValueError(f"ce_target must be 'label' or 'distribution', got {ce_target!r}")
    inside = torch.ones_like(weights, dtype=torch.bool) if label_in_vocab is None else label_in_vocab
    labels = torch.where(inside, target_ids, torch.zeros_like(target_ids))
    ce, l1 = _CrossEntropyAndL1.apply(draft_logits, target_probs.float(), labels, inside.float(), ce_target == "distribution")
    if outside_mass is not None:
        l1 = l1 + outside_mass
    accept_rate = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()  # Eq. 8: a label, not a path for gradients
    ce_num, l1_num = (weights * ce).sum(), (weights * l1).sum()
    if confidence_logits is None:
        conf_num = ce_num.new_zeros(())
    else:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), accept_rate, reduction="none")
        conf_num = (weights * bce).sum()
    return ce_num, l1_num, conf_num, accept_rate


def compute_dspark_loss(
    drafter,
    *,
    input_ids: torch.LongTensor,  # [bsz, S]
    loss_mask: torch.Tensor,  # [bsz, S] 1 = response token
    context_features: torch.Tensor,  # [bsz, S, m * d_target] target features of every position
    target_last_hidden: torch.Tensor,  # [bsz, S, d] target's final (post-norm) hidden states
    input_embeddings: torch.nn.Module,
    lm_head: torch.nn.Module,
    anchors: torch.LongTensor,  # [bsz, N]
    keep: torch.Tensor,  # [bsz, N] bool
    ce_alpha: float = 0.1,
    l1_alpha: float = 0.9,
    confidence_alpha: float = 1.0,
    ce_target: str = "label",
    decay: float = 4.0,
    chunk_size: int = 64,
    return_logits: bool = False,
    eps: float = 1e-6,
    logits_memory_gb: float = 6.0,
) -> DSparkLossOutput:
    """One drafter forward over every anchor block of the batch, then the loss in chunks of blocks.

    The chunks' logits (and what backward keeps of them) stay alive up to about ``logits_memory_gb``; above it each
    chunk is recomputed in backward instead (activation checkpointing, a third more logit work).

    Also reachable as ``drafter(dspark_loss_inputs={...})``, the form to use under a data-parallel wrapper."""
    cfg = drafter.config
    gamma = cfg.block_size
    bsz, seq_len = input_ids.shape
    num_blocks = anchors.shape[1]
    target_ids, eval_mask, prev_ids, logit_index = build_block_targets(input_ids, loss_mask, anchors, keep, gamma)
    anchor_ids = input_ids.gather(1, anchors)
    if cfg.mask_token_id is not None:  # DeepSpec: a dummy block is all MASK
        anchor_ids = torch.where(keep, anchor_ids, torch.full_like(anchor_ids, cfg.mask_token_id))
    block_positions = (anchors[..., None] + torch.arange(gamma, device=anchors.device)).view(bsz, -1)
    positions = torch.cat([torch.arange(seq_len, device=anchors.device).expand(bsz, -1), block_positions], dim=1)
    out = drafter(
        block_embeds=drafter.embed_block(anchor_ids, input_embeddings),
        context_features=context_features,
        position_ids=positions,
        block_context_mask=build_block_context_mask(anchors, keep, seq_len),
    )
    h = out.last_hidden_state.view(bsz, num_blocks, gamma, -1)
    weights = build_loss_weights(eval_mask, decay)
    use_confidence = drafter.confidence_head is not None and confidence_alpha > 0
    target = target_distribution(drafter, target_last_hidden, lm_head, logit_index, eval_mask)
    label_in_vocab = drafter.in_draft_vocab(target_ids)
    target_ids, prev_draft = drafter.draft_index(target_ids), drafter.draft_index(prev_ids)

    def chunk_terms(h_c, emb_c, prev_c, prev_draft_c, tgt_c, inside_c, idx_c, w_c, b):
        base = drafter.draft_base_logits(h_c, lm_head)
        draft = drafter.markov_head.apply_block_logits(base, prev_draft_c, h_c, emb_c) if drafter.markov_head is not None else base
        probs, outside = target.at(torch.full_like(idx_c, b), idx_c)
        conf = drafter.confidence_logits(h_c, prev_c, emb_c) if use_confidence else None
        ce_n, l1_n, conf_n, accept = compute_block_loss_terms(draft, probs, tgt_c, conf, w_c, ce_target, outside, inside_c)
        if not return_logits:
            return ce_n, l1_n, conf_n, accept
        tgt_hidden = target_last_hidden[b].index_select(0, idx_c.flatten()).view(*idx_c.shape, -1)
        target_logits = lm_head(tgt_hidden.to(lm_head.weight.dtype)).detach()
        return ce_n, l1_n, conf_n, accept, drafter.to_target_vocab(draft), target_logits, conf

    totals = [h.new_zeros((), dtype=torch.float32) for _ in range(3)]
    accept_rates, drafts, targets, confs = [], [], [], []
    kept_bytes = 5 * 4 * int(eval_mask.any(-1).sum()) * gamma * drafter.num_draft_tokens_in_vocab  # ~5 fp32 [.., Vd] per slot
    recompute = num_blocks > chunk_size and kept_bytes > logits_memory_gb * 2**30
    # W1[x_{k-1}] once for the batch: an embedding's backward fills a dense [vocab, r] gradient per call
    prev_emb = drafter.markov_head.get_prev_embeddings(prev_draft) if drafter.markov_head is not None else None
    # split (not sliced per chunk): the backward of a slice fills a zero tensor of h's whole shape for every chunk
    h_rows, emb_rows = h.unbind(0), prev_emb.unbind(0) if prev_emb is not None else [None] * bsz
    for b in range(bsz):
        h_parts = h_rows[b].split(chunk_size)
        emb_parts = emb_rows[b].split(chunk_size) if emb_rows[b] is not None else [None] * len(h_parts)
        for start, h_c, emb_c in zip(range(0, num_blocks, chunk_size), h_parts, emb_parts):
            sl = slice(start, start + chunk_size)
            if not bool(eval_mask[b, sl].any()) and not return_logits:
                accept_rates.append(h.new_zeros(eval_mask[b, sl].shape, dtype=torch.float32))
                continue  # dummy blocks only: no weight, no gradient
            args = (h_c, emb_c, prev_ids[b, sl], prev_draft[b, sl], target_ids[b, sl], label_in_vocab[b, sl], logit_index[b, sl], weights[b, sl], b)
            # with several chunks, recompute each chunk's logits in backward instead of keeping them all alive
            if recompute and torch.is_grad_enabled() and drafter.training and not return_logits:
                result = checkpoint(chunk_terms, *args, use_reentrant=False)
            else:
                result = chunk_terms(*args)
            for i in range(3):
                totals[i] = totals[i] + result[i]
            accept_rates.append(result[3])
            if return_logits:
                drafts.append(result[4]), targets.append(result[5]), confs.append(result[6])
    ce_num, l1_num, conf_num = totals
    den = weights.sum()
    accept = torch.cat(accept_rates).view(bsz, num_blocks, gamma)
    ce_loss, l1_loss, conf_loss = ce_num / (den + eps), l1_num / (den + eps), conf_num / (den + eps)
    total = ce_alpha * ce_loss + l1_alpha * l1_loss + (confidence_alpha * conf_loss if use_confidence else 0.0)
    if torch.is_grad_enabled() and not total.requires_grad:  # every block a dummy: a zero loss that still backpropagates
        total = total + 0.0 * h.sum()

    def stack(parts):
        return torch.cat(parts).view(bsz, num_blocks, gamma, *parts[0].shape[2:]) if parts and parts[0] is not None else None

    return DSparkLossOutput(
        loss=total,
        ce_loss=ce_loss,
        l1_loss=l1_loss,
        confidence_loss=conf_loss,
        ce_num=ce_num,
        l1_num=l1_num,
        confidence_num=conf_num,
        weight_den=den,
        accept_rate_num=(accept * eval_mask).sum(dim=(0, 1)),
        accept_rate_den=eval_mask.sum(dim=(0, 1)),
        accept_rate=accept,
        eval_mask=eval_mask,
        draft_logits=stack(drafts) if return_logits else None,
        target_logits=stack(targets) if return_logits else None,
        confidence_logits=stack(confs) if return_logits and use_confidence else None,
    )
