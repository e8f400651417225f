"""The Eagle3 baseline drafter (SPEC section 8), built from Transformers' Qwen3 blocks like the DSpark drafter.

One decoder layer; its attention input is ``[input_layernorm(emb(x)) ; hidden_norm(h)]`` (width 2d) and its
residual stream is ``h``. At draft step 0, ``h`` is ``fc`` of the fused target features of the last committed
position; at step i > 0 it is the layer's own (pre-norm) output at step i - 1. Logits are the target's LM head
on ``norm(output)``. As in DeepSpec, the embedding and LM head are the target's full-vocabulary ones, passed in
at call time and never saved with the drafter.

Attention of step i at position t sees the step-0 entries of positions <= t (one per committed token) and the
entries of steps 1..i at t itself: at inference those are exactly the draft cache's contents, in training
:func:`modeling_dspark.training.eagle3_loss.compute_eagle3_loss` builds the same pattern ("training-time test").
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, repeat_kv

from .draft_vocab import DraftVocabMixin
from .configuration_eagle3 import Eagle3DrafterConfig
from .modeling_dspark import (
    apply_rotary,
    build_from_target,
    install_generate_hook,
    target_compatibility_problems,
    weights_named_on_error,
)
from .remote_code import RemoteCodeMixin

__all__ = ["Eagle3DrafterModel", "attend"]


def attend(query, keys, values, mask, scaling: float) -> torch.Tensor:
    """Softmax attention of ``query`` [B, H, Q, hd] over ``keys``/``values`` [B, KV, S, hd] with a bool ``mask``
    [B, 1, Q, S] (True = attend) or None. Computed in fp32: the training-time-test pattern is not one a fused
    kernel takes, and one small layer does not need one."""
    groups = query.shape[1] // keys.shape[1]
    keys, values = repeat_kv(keys, groups), repeat_kv(values, groups)
    scores = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return torch.matmul(scores.softmax(-1), values.float()).to(query.dtype)


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3DrafterConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(width, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(width, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated queries [B, H, Q, hd], keys and values [B, KV, Q, hd] of the 2d-wide input ``x``."""
        bsz, q_len, _ = x.shape
        query = self.q_norm(self.q_proj(x).view(bsz, q_len, -1, self.head_dim)).transpose(1, 2)
        key = self.k_norm(self.k_proj(x).view(bsz, q_len, -1, self.head_dim)).transpose(1, 2)
        value = self.v_proj(x).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin), value

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        bsz, _, q_len, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(bsz, q_len, -1))


class Eagle3DrafterModel(RemoteCodeMixin, DraftVocabMixin, PreTrainedModel):
    """Eagle3 drafter: ``forward(input_embeds, hidden, position_ids, cache)`` runs one draft step for the given
    positions and returns ``(output, normed)``: ``output`` feeds the next step, ``lm_head(normed)`` its logits."""

    config: Eagle3DrafterConfig
    config_class = Eagle3DrafterConfig
    base_model_prefix = ""
    main_input_name = "input_embeds"
    _supports_sdpa = True
    _supports_attention_backend = True

    def __init__(self, config: Eagle3DrafterConfig):
        super().__init__(config)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.target_hidden_size, config.hidden_size, bias=False)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.last_stats = None  # filled by the candidate generator after each generate()
        self._init_draft_vocab()
        self.post_init()
        install_generate_hook()

    # the DSpark trainer and the shared evaluation code read these
    markov_head = None
    confidence_head = None

    def context_features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.cat([hidden_states[i + 1] for i in self.config.target_layer_ids], dim=-1)

    def step_inputs(self, input_embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The attention input ``[input_layernorm(emb) ; hidden_norm(h)]`` [B, Q, 2d]."""
        return torch.cat([self.input_layernorm(input_embeds.to(self.dtype)), self.hidden_norm(hidden.to(self.dtype))], dim=-1)

    def finish(self, hidden: torch.Tensor, attn_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual + MLP after attention; returns (output, norm(output))."""
        hidden = hidden.to(self.dtype) + attn_output
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, self.norm(hidden)

    def forward(
        self,
        input_embeds: torch.Tensor | None = None,  # [B, Q, d] embeddings of x_{t+1}
        hidden: torch.Tensor | None = None,  # [B, Q, d] fc(features) at step 0, the previous output after
        position_ids: torch.LongTensor | None = None,  # [B, Q]
        cache: Cache | None = None,
        dspark_loss_inputs: dict | None = None,
    ):
        if dspark_loss_inputs is not None:
            # The trainer's loss call (same entry point as DSparkModel's, so one Trainer serves both).
            from .eagle3_loss import compute_eagle3_loss

            return compute_eagle3_loss(self, **dspark_loss_inputs)
        bsz, q_len, _ = input_embeds.shape
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + q_len, device=input_embeds.device)[None].expand(bsz, -1)
        cos, sin = self.rotary_emb(hidden, position_ids)
        query, key, value = self.self_attn.project(self.step_inputs(input_embeds, hidden), cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, 0)
        # queries see every cached entry and, among themselves, the earlier ones (causal)
        mask = None
        if q_len > 1:
            total = key.shape[2]
            mask = torch.ones(q_len, total, dtype=torch.bool, device=key.device).tril(total - q_len)[None, None]
        attn = attend(query, key, value, mask, self.self_attn.scaling)
        return self.finish(hidden, self.self_attn.output(attn))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        with weights_named_on_error(pretrained_model_name_or_path):
            return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    @classmethod
    def from_target(cls, target: PreTrainedModel, **config_overrides) -> "Eagle3DrafterModel":
        """A freshly initialised Eagle3 drafter for ``target`` (same five feature layers as a DSpark drafter);
        ``draft_vocab_ids`` gives it a draft vocabulary, as :meth:`DSparkModel.from_target`."""
        return build_from_target(cls, Eagle3DrafterConfig, target, config_overrides)

    def check_compatible(self, target: PreTrainedModel) -> None:
        problems = target_compatibility_problems(self.config, target)
        if problems:
            raise ValueError(f"Eagle3 drafter is incompatible with {type(target).__name__}: " + "; ".join(problems))
