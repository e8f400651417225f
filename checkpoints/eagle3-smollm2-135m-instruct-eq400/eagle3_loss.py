"""Eagle3 training with training-time test (the DeepSpec / SpecForge Eagle3 recipe, SPEC section 8).

The supervised positions are the DSpark trainer's anchors p (``x_p`` and ``x_{p+1}`` are response tokens): a
chain starts from the step-0 entry of position ``t = p - 1`` (target features of t, token ``x_p``), and step i
predicts ``x_{p+1+i}``, the label of DSpark's block slot i, against the target's distribution at ``p + i``. Step i
feeds the teacher-forced token ``x_{p+i}`` with the drafter's own step i - 1 output, at rotary position t + i,
and attends to the step-0 entries of positions <= t plus its own chain entries at t (the "suffix diagonal" of
DeepSpec's mask). Only the anchors' chains are computed: every other position of steps > 0 cannot influence
them. Loss: soft cross-entropy to the target distribution (over the draft vocabulary where the drafter has one),
weighted ``step_loss_decay ** i``, normalised by the summed weights.
"""

from __future__ import annotations

import torch
from transformers.models.qwen3.modeling_qwen3 import repeat_kv

from .loss import DSparkLossOutput, build_block_targets, target_distribution

__all__ = ["attend_chain", "compute_eagle3_loss"]


def attend_chain(query, ctx_keys, ctx_values, ctx_mask, chain_keys, chain_values, scaling: float) -> torch.Tensor:
    """Attention of chain queries [B, H, N, hd] over the step-0 entries [B, KV, S, hd] allowed by ``ctx_mask``
    [B, 1, N, S] plus, for each query, its own chain entries (lists of [B, KV, N, hd]), in one softmax."""
    groups = query.shape[1] // ctx_keys.shape[1]
    q = query.float()
    scores = [torch.matmul(q, repeat_kv(ctx_keys, groups).float().transpose(-1, -2)) * scaling]
    scores[0] = scores[0].masked_fill(~ctx_mask, torch.finfo(scores[0].dtype).min)
    chain_k = [repeat_kv(k, groups).float() for k in chain_keys]
    chain_v = [repeat_kv(v, groups).float() for v in chain_values]
    scores += [(q * k).sum(-1, keepdim=True) * scaling for k in chain_k]
    probs = torch.cat(scores, dim=-1).softmax(-1)
    seq = ctx_keys.shape[2]
    out = torch.matmul(probs[..., :seq], repeat_kv(ctx_values, groups).float())
    for j, v in enumerate(chain_v):
        out = out + probs[..., seq + j : seq + j + 1] * v
    return out.to(query.dtype)


def compute_eagle3_loss(
    drafter,
    *,
    input_ids: torch.LongTensor,  # [bsz, S]
    loss_mask: torch.Tensor,  # [bsz, S]
    context_features: torch.Tensor,  # [bsz, S, m * d_target]
    target_last_hidden: torch.Tensor,  # [bsz, S, d]
    input_embeddings: torch.nn.Module,
    lm_head: torch.nn.Module,
    anchors: torch.LongTensor,  # [bsz, N]
    keep: torch.Tensor,  # [bsz, N] bool
    return_logits: bool = False,
    eps: float = 1e-6,
    **_dspark_weights,  # ce_alpha / l1_alpha / confidence_alpha / decay / chunk_size: Eagle3 has its own recipe
) -> DSparkLossOutput:
    cfg = drafter.config
    steps = cfg.ttt_length
    bsz, seq_len = input_ids.shape
    attn = drafter.self_attn
    keep = keep & (anchors >= 1)  # a chain needs the features of p - 1
    target_ids, eval_mask, prev_ids, logit_index = build_block_targets(input_ids, loss_mask, anchors, keep, steps)
    t = (anchors - 1).clamp(min=0)  # [bsz, N] position of each chain's step-0 entry

    # step 0 over the whole sequence: entry s = (features of s, token x_{s+1}) at position s
    hidden0 = drafter.fc(context_features[:, :-1].to(drafter.dtype))
    positions0 = torch.arange(seq_len - 1, device=input_ids.device)[None].expand(bsz, -1)
    cos, sin = drafter.rotary_emb(hidden0, positions0)
    q0, ctx_k, ctx_v = attn.project(drafter.step_inputs(input_embeddings(input_ids[:, 1:]), hidden0), cos, sin)

    def at_chain(x):  # [bsz, heads, S-1, hd] -> [bsz, heads, N, hd]
        return x.gather(2, t[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[-1]))

    ctx_mask = (positions0[:, None, :] <= t[:, :, None])[:, None]  # [bsz, 1, N, S-1]
    hidden = hidden0.gather(1, t[..., None].expand(-1, -1, hidden0.shape[-1]))
    out = attend_chain(at_chain(q0), ctx_k, ctx_v, ctx_mask, [], [], attn.scaling)
    hidden, normed = drafter.finish(hidden, attn.output(out))

    weights = eval_mask.float() * cfg.step_loss_decay ** torch.arange(steps, device=input_ids.device, dtype=torch.float32)
    batch_index = torch.arange(bsz, device=input_ids.device)[:, None].expand_as(anchors)
    target = target_distribution(drafter, target_last_hidden, lm_head, logit_index, eval_mask)
    chain_k, chain_v, drafts, targets = [], [], [], []
    ce_num = l1_num = hidden.new_zeros((), dtype=torch.float32)
    accept = []
    for i in range(steps):
        if i > 0:
            cos, sin = drafter.rotary_emb(hidden, t + i)
            q, k, v = attn.project(drafter.step_inputs(input_embeddings(prev_ids[..., i]), hidden), cos, sin)
            chain_k.append(k), chain_v.append(v)
            out = attend_chain(q, ctx_k, ctx_v, ctx_mask, chain_k, chain_v, attn.scaling)
            hidden, normed = drafter.finish(hidden, attn.output(out))
        draft = drafter.draft_base_logits(normed, lm_head).float()  # [bsz, N, Vd]
        idx = logit_index[..., i]
        target_probs, outside = target.at(batch_index, idx)  # over the draft vocabulary, and the mass outside it
        log_q = draft.log_softmax(-1)
        w = weights[..., i]
        ce_num = ce_num + (w * -(target_probs * log_q).sum(-1)).sum()
        l1 = ((log_q.exp() - target_probs).abs().sum(-1) + outside).detach()  # reported, not trained
        l1_num = l1_num + (w * l1).sum()
        accept.append((1.0 - 0.5 * l1).clamp(0.0, 1.0))
        if return_logits:
            tgt_hidden = target_last_hidden.gather(1, idx[..., None].expand(-1, -1, target_last_hidden.shape[-1]))
            drafts.append(drafter.to_target_vocab(draft)), targets.append(lm_head(tgt_hidden.to(lm_head.weight.dtype)).float())
    den = weights.sum()
    ce_loss, l1_loss = ce_num / (den + eps), l1_num / (den + eps)
    accept = torch.stack(accept, dim=-1)
    zero = ce_loss.new_zeros(())
    return DSparkLossOutput(
        loss=ce_loss,
        ce_loss=ce_loss,
        l1_loss=l1_loss,
        confidence_loss=zero,
        ce_num=ce_num,
        l1_num=l1_num,
        confidence_num=zero,
        weight_den=den,
        accept_rate_num=(accept * eval_mask).sum(dim=(0, 1)),
        accept_rate_den=eval_mask.sum(dim=(0, 1)),
        accept_rate=accept,
        eval_mask=eval_mask,
        draft_logits=torch.stack(drafts, dim=2) if return_logits else None,
        target_logits=torch.stack(targets, dim=2) if return_logits else None,
    )
