"""DSpark training objective (SPEC section 7, Eqs. 8-12), as DeepSpec computes it.

A training sequence opens a block at each sampled *anchor* p: the block input is ``[x_p, MASK x (B-1)]``, slot
k predicts ``x_{p+k+1}``, the context is every target feature strictly before p. With position weights
``w_k = exp(-k / decay)`` (k 0-based) on a contiguous supervised prefix of each block:

    L = ce_alpha * sum w CE + l1_alpha * sum w ||p_d - p_t||_1 + conf_alpha * sum w BCE(c_k, c*_k),  each / sum w

with the Markov bias applied (teacher-forced previous tokens) before every term, the full L1 (in [0, 2]) and the
confidence target ``c*_k = clamp(1 - 0.5 L1, 0, 1)`` detached. Full-vocabulary logits are only ever formed for
``chunk_size`` blocks at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = [
    "DSparkLossOutput",
    "build_block_attention_mask",
    "build_block_targets",
    "build_loss_weights",
    "compute_block_loss_terms",
    "compute_dspark_loss",
    "sample_anchor_positions",
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
    replacement and sorted; missing slots are dummy blocks (position 0, keep False). Returns (anchors, keep)."""
    bsz, seq_len = loss_mask.shape
    mask = loss_mask.bool()
    candidates = torch.zeros_like(mask)
    candidates[:, :-1] = mask[:, :-1] & mask[:, 1:]
    scores = torch.rand(bsz, seq_len, generator=generator, device=loss_mask.device)
    order = scores.masked_fill(~candidates, 2.0).argsort(dim=1)[:, :num_anchors]  # candidates first, at random
    chosen = torch.where(candidates.gather(1, order), order, torch.full_like(order, seq_len))
    anchors = chosen.sort(dim=1).values  # dummies (= seq_len) sort last
    keep = anchors < seq_len
    anchors = anchors.masked_fill(~keep, 0)
    if anchors.shape[1] < num_anchors:  # shorter sequences than num_anchors
        pad = num_anchors - anchors.shape[1]
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


def build_loss_weights(eval_mask: torch.Tensor, decay: float) -> torch.Tensor:
    """``w_k = exp(-k / decay)`` on supervised slots (k 0-based), zero elsewhere."""
    k = torch.arange(eval_mask.shape[-1], device=eval_mask.device, dtype=torch.float32)
    return eval_mask.float() * torch.exp(-k / decay)


def compute_block_loss_terms(draft_logits, target_logits, target_ids, confidence_logits, weights, ce_target: str = "label"):
    """Weighted sums of the three terms over the given blocks (any leading shape, last axes [B, V]).

    ``ce_target="label"`` is Eq. 9 (CE of the sampled response token); ``"distribution"`` is the cross-entropy to the
    target's whole next-token distribution (distillation, what Eagle3 trains with; equal to KL + the target's entropy).
    Returns (ce_num, l1_num, confidence_num, accept_rate) with accept_rate = clamp(1 - 0.5 L1, 0, 1) per slot."""
    draft_logits, target_logits = draft_logits.float(), target_logits.float()
    target_probs = target_logits.softmax(-1)
    if ce_target == "label":
        ce = F.cross_entropy(draft_logits.flatten(0, -2), target_ids.flatten(), reduction="none").view_as(weights)
    elif ce_target == "distribution":
        ce = -(target_probs * draft_logits.log_softmax(-1)).sum(-1)
    else:
        raise ValueError(f"ce_target must be 'label' or 'distribution', got {ce_target!r}")
    l1 = (draft_logits.softmax(-1) - target_probs).abs().sum(-1)
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
) -> DSparkLossOutput:
    """One drafter forward over every anchor block of the batch, then the loss in chunks of blocks.

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
        attention_mask=build_block_attention_mask(anchors, keep, seq_len, gamma),
    )
    h = out.last_hidden_state.view(bsz, num_blocks, gamma, -1)
    weights = build_loss_weights(eval_mask, decay)
    use_confidence = drafter.confidence_head is not None and confidence_alpha > 0

    def chunk_terms(h_c, prev_c, tgt_c, idx_c, w_c, b):
        base = lm_head(h_c.to(lm_head.weight.dtype))
        draft = drafter.markov_head.apply_block_logits(base, prev_c, h_c) if drafter.markov_head is not None else base
        tgt_hidden = target_last_hidden[b].index_select(0, idx_c.flatten()).view(*idx_c.shape, -1)
        target_logits = lm_head(tgt_hidden.to(lm_head.weight.dtype)).detach()
        conf = drafter.confidence_logits(h_c, prev_c) if use_confidence else None
        ce_n, l1_n, conf_n, accept = compute_block_loss_terms(draft, target_logits, tgt_c, conf, w_c, ce_target)
        extras = (draft, target_logits, conf) if return_logits else ()
        return (ce_n, l1_n, conf_n, accept, *extras)

    totals = [h.new_zeros((), dtype=torch.float32) for _ in range(3)]
    accept_rates, drafts, targets, confs = [], [], [], []
    for b in range(bsz):
        for start in range(0, num_blocks, chunk_size):
            sl = slice(start, start + chunk_size)
            args = (h[b, sl], prev_ids[b, sl], target_ids[b, sl], logit_index[b, sl], weights[b, sl], b)
            # with several chunks, recompute each chunk's logits in backward instead of keeping them all alive
            if num_blocks > chunk_size and torch.is_grad_enabled() and drafter.training and not return_logits:
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
