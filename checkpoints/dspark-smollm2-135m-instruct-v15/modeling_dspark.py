"""The DSpark drafter (arXiv 2607.05147, SPEC sections 2-4), built from Transformers' Qwen3 blocks.

Reading order follows the architecture: attention over [context ; block], decoder layer, pretrained
base, then the model with its context projection (Eq. 2), the block embedding (anchor + masks), the
sequential head (Eqs. 5-6) and the confidence head (Eq. 7).

The target's embedding and LM head are never parameters of the drafter: callers pass them in, so a
saved drafter holds only its own weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    eager_attention_forward,
    repeat_kv,
    rotate_half,
)
from transformers.utils import ModelOutput

from .confidence_head import DSparkConfidenceHead, calibrated_confidence, prefix_survival
from .configuration_dspark import DSparkConfig
from .draft_vocab import DraftVocabMixin
from .markov_head import build_markov_head
from .remote_code import RemoteCodeMixin

__all__ = [
    "DSparkModel",
    "DSparkModelOutput",
    "DSparkPreTrainedModel",
    "build_from_target",
    "build_target_layer_ids",
    "install_generate_hook",
    "target_compatibility_problems",
    "target_geometry",
]


def install_generate_hook() -> None:
    """Route ``target.generate(assistant_model=<drafter>)`` to DSpark drafting; called when a drafter is built (the
    hook is guarded and idempotent), so importing the model package does not import the decoding package, and a
    drafter loaded with remote code routes ``generate()`` with the copy its folder carries."""
    from .hooks import install_generate_hook as install

    install()


def build_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Evenly spread feature layers, DFlash's rule ``round(1 + i (L - 4) / (n - 1))``, kept below the last layer."""
    last = num_target_layers - 2  # the last layer's HF hidden state is post-norm
    if last < 0:
        raise ValueError(f"a target with {num_target_layers} layer(s) has no usable feature layer")
    if num_features == 1:
        return [min(1, last)]
    span = max(num_target_layers - 4, 0)
    ids = sorted({min(last, round(1 + i * span / (num_features - 1))) for i in range(num_features)})
    return ids


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE for one tensor [B, heads, S, hd]; queries and keys have different lengths here."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


@dataclass
class DSparkModelOutput(ModelOutput):
    """
    last_hidden_state: [B, Q, d] the block's hidden states ``h`` after the drafter's final norm.
    context_projection: [B, C, d] ``RMSNorm(W_c [H^(l1); ...; H^(lm)])`` of the new context (Eq. 2).
    hidden_states: per-layer block outputs before the final norm, when requested.
    cache: the drafter's context cache (projected, k-normed, rotated context keys/values).
    """

    last_hidden_state: torch.Tensor | None = None
    context_projection: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    cache: Cache | None = None


def block_sparse_attention(query, key, value, block_context_mask, scaling: float) -> torch.Tensor:
    """Training's attention pattern without its zeros: N blocks of G queries each, block n seeing the context
    positions ``block_context_mask[:, n]`` and its own G slots (bidirectionally), in one softmax per query.

    ``query`` [B, H, N G, hd]; ``key`` / ``value`` [B, KV, C + N G, hd] (context first). Equal to dense attention
    under :func:`modeling_dspark.training.loss.build_block_attention_mask`, at ``(C + G) / (C + N G)`` of its cost (N is
    hundreds with dense anchors). Returns [B, N G, H, hd], as the attention interfaces do."""
    bsz, heads, q_len, head_dim = query.shape
    num_blocks, ctx_len = block_context_mask.shape[1], block_context_mask.shape[2]
    gamma = q_len // num_blocks
    groups = heads // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    ctx_k, blk_k = key[:, :, :ctx_len], key[:, :, ctx_len:].reshape(bsz, heads, num_blocks, gamma, head_dim)
    ctx_v, blk_v = value[:, :, :ctx_len], value[:, :, ctx_len:].reshape(bsz, heads, num_blocks, gamma, head_dim)
    query = query * scaling  # on the small tensor, not on the scores
    ctx_scores = torch.matmul(query, ctx_k.transpose(-1, -2))  # [B, H, N G, C]
    sees = block_context_mask.repeat_interleave(gamma, dim=1)[:, None]  # [B, 1, N G, C]
    ctx_scores.masked_fill_(~sees, torch.finfo(ctx_scores.dtype).min)  # in place: matmul's backward does not read its output
    q_blocks = query.reshape(bsz, heads, num_blocks, gamma, head_dim)
    blk_scores = torch.matmul(q_blocks, blk_k.transpose(-1, -2))  # [B, H, N, G, G]
    scores = torch.cat([ctx_scores.view(bsz, heads, num_blocks, gamma, ctx_len), blk_scores.to(ctx_scores.dtype)], dim=-1)
    # in the scores' dtype: a bf16 softmax accumulates in fp32 (on CPU and CUDA), so the probabilities equal those of
    # an fp32 softmax rounded to bf16 without writing the [B, H, N, G, C + G] scores out in fp32 and back
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    # split, not sliced: a slice's backward writes a zero tensor of the scores' whole shape per slice
    ctx_probs, blk_probs = probs.split([ctx_len, gamma], dim=-1)
    out = torch.matmul(ctx_probs.reshape(bsz, heads, q_len, ctx_len), ctx_v)
    out = out + torch.matmul(blk_probs, blk_v).reshape(bsz, heads, q_len, head_dim)
    return out.transpose(1, 2)


class DSparkAttention(nn.Module):
    """Block queries attend to [context ; block] keys (Eq. 3): the projected context is prepended to every layer's
    keys and values. No causal mask: inside a block attention is bidirectional, and the context is only ever the
    tokens before the anchor."""

    def __init__(self, config: DSparkConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = False
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [B, Q, d] normed block
        context: torch.Tensor,  # [B, C, d] projected new context (not layer-normed, as in DeepSpec)
        position_embeddings: tuple[torch.Tensor, torch.Tensor],  # cos/sin [B, C + Q, hd]
        attention_mask: torch.Tensor | None = None,  # [B, 1, Q, past + C + Q] or None (see everything)
        cache: Cache | None = None,
        block_context_mask: torch.Tensor | None = None,  # [B, N, C] bool: training's N blocks of block_size queries
    ) -> torch.Tensor:
        bsz, q_len, _ = hidden_states.shape
        kv_input = torch.cat([context, hidden_states], dim=1)
        query = self.q_norm(self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim)).transpose(1, 2)
        key = self.k_norm(self.k_proj(kv_input).view(bsz, kv_input.shape[1], -1, self.head_dim)).transpose(1, 2)
        value = self.v_proj(kv_input).view(bsz, kv_input.shape[1], -1, self.head_dim).transpose(1, 2)

        cos, sin = position_embeddings
        query = apply_rotary(query, cos[:, -q_len:], sin[:, -q_len:])
        key = apply_rotary(key, cos, sin)

        if cache is not None:
            # Only the context is cached; the block's keys are rebuilt every round.
            ctx_len = context.shape[1]
            ctx_key, ctx_value = cache.update(key[:, :, :ctx_len], value[:, :, :ctx_len], self.layer_idx)
            key = torch.cat([ctx_key, key[:, :, ctx_len:]], dim=2)
            value = torch.cat([ctx_value, value[:, :, ctx_len:]], dim=2)

        if block_context_mask is not None:
            attn_output = block_sparse_attention(query, key, value, block_context_mask, self.scaling)
            return self.o_proj(attn_output.reshape(bsz, q_len, -1).contiguous())
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, _ = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
        )
        return self.o_proj(attn_output.reshape(bsz, q_len, -1).contiguous())


class DSparkDecoderLayer(GradientCheckpointingLayer):
    """A pre-norm Qwen3 decoder layer whose attention also reads the projected context."""

    def __init__(self, config: DSparkConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DSparkAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, context, position_embeddings, attention_mask=None, cache=None, block_context_mask=None):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), context, position_embeddings, attention_mask, cache, block_context_mask
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DSparkPreTrainedModel(PreTrainedModel):
    config: DSparkConfig
    config_class = DSparkConfig
    base_model_prefix = ""
    main_input_name = "block_embeds"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DSparkDecoderLayer"]
    _supports_sdpa = True
    _supports_flex_attn = False
    _supports_flash_attn = False
    _supports_attention_backend = True

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, DSparkModel) and module.mask_embedding is not None:
            nn.init.normal_(module.mask_embedding, std=self.config.initializer_range)


class DSparkModel(RemoteCodeMixin, DraftVocabMixin, DSparkPreTrainedModel):
    """DSpark drafter: parallel backbone + sequential head + confidence head.

    Call it with the block embeddings (see :meth:`embed_block`) and the target's context features
    (see :meth:`context_features`); apply the target's LM head to ``last_hidden_state`` to get the base
    logits ``U`` (:meth:`draft_base_logits`, over the draft vocabulary where the drafter has one), then
    :attr:`markov_head` and :meth:`confidence_logits`.
    """

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        num_features = len(config.target_layer_ids)
        self.fc = nn.Linear(num_features * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DSparkDecoderLayer(config, i) for i in range(config.num_draft_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.mask_embedding = nn.Parameter(torch.empty(config.hidden_size)) if config.mask_token_id is None else None
        self.markov_head = build_markov_head(config)
        rank = config.markov_rank if self.markov_head is not None and config.confidence_with_markov else 0
        self.confidence_head = DSparkConfidenceHead(config.hidden_size, rank) if config.confidence_head else None
        self.last_stats = None  # filled by the candidate generator after each generate()
        self._init_draft_vocab()
        self.post_init()
        install_generate_hook()

    # ----------------------------------------------------------------------------------------------- inputs
    def context_features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Concatenate the chosen target layers' hidden states (HF tuple: index i + 1 is layer i's output)."""
        return torch.cat([hidden_states[i + 1] for i in self.config.target_layer_ids], dim=-1)

    def project_context(self, context_features: torch.Tensor) -> torch.Tensor:
        """Eq. 2: the context the draft layers attend to, ``RMSNorm(W_c [H^(l_1); ...; H^(l_m)])`` [..., d]."""
        return self.hidden_norm(self.fc(context_features.to(self.dtype)))

    def embed_block(self, anchor_ids: torch.LongTensor, input_embeddings: nn.Module) -> torch.Tensor:
        """Block inputs [B, N * block_size, d]: each anchor token followed by ``block_size - 1`` mask embeddings.

        ``anchor_ids`` is [B] (one block per row) or [B, N] (N blocks per row, training)."""
        if anchor_ids.dim() == 1:
            anchor_ids = anchor_ids[:, None]
        bsz, num_blocks = anchor_ids.shape
        gamma = self.config.block_size
        if self.mask_embedding is None:
            ids = anchor_ids.new_full((bsz, num_blocks, gamma), self.config.mask_token_id)
            ids[..., 0] = anchor_ids
            embeds = input_embeddings(ids.view(bsz, -1)).to(self.dtype)
            return embeds
        anchors = input_embeddings(anchor_ids).to(self.dtype)[:, :, None]  # [B, N, 1, d]
        masks = self.mask_embedding.to(self.dtype).expand(bsz, num_blocks, gamma - 1, -1)
        return torch.cat([anchors, masks], dim=2).view(bsz, num_blocks * gamma, -1)

    # ----------------------------------------------------------------------------------------------- forward
    def forward(
        self,
        block_embeds: torch.Tensor | None = None,  # [B, Q, d]
        context_features: torch.Tensor | None = None,  # [B, C, m * d_target] new context since the cache
        position_ids: torch.LongTensor | None = None,  # [B, C + Q] positions of [new context ; block]
        attention_mask: torch.Tensor | None = None,  # [B, 1, Q, past + C + Q], bool (True = attend) or additive
        cache: Cache | None = None,
        output_hidden_states: bool = False,
        dspark_loss_inputs: dict | None = None,
        block_context_mask: torch.Tensor | None = None,  # [B, N, C] bool, instead of attention_mask: Q = N blocks
    ) -> DSparkModelOutput:
        if dspark_loss_inputs is not None:
            # The training objective runs inside forward() so data-parallel wrappers see every parameter's use.
            from .loss import compute_dspark_loss

            return compute_dspark_loss(self, **dspark_loss_inputs)
        bsz, q_len, _ = block_embeds.shape
        hidden = block_embeds.to(self.dtype)
        if context_features is not None and context_features.shape[1] > 0:
            context = self.project_context(context_features)
        else:
            context = hidden.new_zeros(bsz, 0, hidden.shape[-1])
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + context.shape[1] + q_len, device=hidden.device)[None].expand(bsz, -1)
        if attention_mask is not None and attention_mask.dtype == torch.bool and self.config._attn_implementation != "sdpa":
            attention_mask = torch.zeros(attention_mask.shape, dtype=hidden.dtype, device=hidden.device).masked_fill(
                ~attention_mask, torch.finfo(hidden.dtype).min
            )
        position_embeddings = self.rotary_emb(hidden, position_ids)
        layer_outputs = []
        for layer in self.layers:
            hidden = layer(hidden, context, position_embeddings, attention_mask, cache, block_context_mask)
            layer_outputs.append(hidden)
        return DSparkModelOutput(
            last_hidden_state=self.norm(hidden),
            context_projection=context,
            hidden_states=tuple(layer_outputs) if output_hidden_states else None,
            cache=cache,
        )

    # ----------------------------------------------------------------------------------------------- heads
    def confidence_logits(
        self, hidden_states: torch.Tensor, prev_ids: torch.LongTensor, prev_embeddings: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Raw confidence logits ``w^T [h_k ; W1[x_{k-1}]]`` (Eq. 7), same leading shape as ``prev_ids`` (target ids);
        ``prev_embeddings`` are ``W1[x_{k-1}]`` when the caller has them already."""
        if self.confidence_head is None:
            raise ValueError("this drafter has no confidence head (config.confidence_head=False)")
        with_markov = self.markov_head is not None and self.config.confidence_with_markov
        prev = None
        if with_markov:
            prev = self.markov_head.get_prev_embeddings(self.draft_index(prev_ids)) if prev_embeddings is None else prev_embeddings
        return self.confidence_head(hidden_states, prev)

    def calibrated_confidence(self, logits: torch.Tensor, position: int | None = None) -> torch.Tensor:
        """``c_k = sigmoid(z_k / T_k)`` with this drafter's STS temperatures (:func:`calibrated_confidence`)."""
        return calibrated_confidence(logits, self.config.confidence_temperatures, position)

    def survival(self, logits: torch.Tensor) -> torch.Tensor:
        """Calibrated prefix survival ``a_k = prod_{i<=k} c_i`` [..., D] of confidence logits [..., D] (float64)."""
        return prefix_survival(self.calibrated_confidence(logits.float()))

    # ----------------------------------------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Our own folders, and DeepSpec-format folders (detected from their config.json), see ``convert``."""
        from .deepspec import is_deepspec_folder, load_deepspec

        if is_deepspec_folder(pretrained_model_name_or_path):
            return load_deepspec(cls, pretrained_model_name_or_path, **kwargs)
        with weights_named_on_error(pretrained_model_name_or_path):
            return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    # ----------------------------------------------------------------------------------------------- target
    @classmethod
    def from_target(cls, target: PreTrainedModel, **config_overrides) -> "DSparkModel":
        """A freshly initialised drafter whose geometry matches ``target`` (a causal LM), on its device and dtype.

        ``config_overrides`` set any :class:`DSparkConfig` field (``block_size``, ``num_draft_layers``,
        ``target_layer_ids``, ``markov_head_type``, ...); ``draft_vocab_ids`` (target ids, e.g. from
        :func:`modeling_dspark.checkpoint.draft_vocab.select_draft_vocab`) gives the drafter a draft vocabulary."""
        return build_from_target(cls, DSparkConfig, target, config_overrides)

    def check_compatible(self, target: PreTrainedModel) -> None:
        """Raise a clear `ValueError` if this drafter cannot draft for ``target``."""
        cfg = self.config
        problems = target_compatibility_problems(cfg, target)
        embed = target.get_input_embeddings()
        if cfg.mask_token_id is not None and not 0 <= cfg.mask_token_id < embed.weight.shape[0]:
            problems.append(f"mask_token_id {cfg.mask_token_id} is outside the target vocabulary")
        if problems:
            raise ValueError(f"DSpark drafter is incompatible with {type(target).__name__}: " + "; ".join(problems))


@contextlib.contextmanager
def weights_named_on_error(folder_or_repo):
    """safetensors' own errors ("incomplete metadata", "header too large") do not say which file; say it."""
    try:
        yield
    except Exception as err:
        if type(err).__name__ != "SafetensorError":
            raise
        files = sorted(str(f) for f in Path(folder_or_repo).glob("*.safetensors")) if Path(folder_or_repo).is_dir() else []
        where = ", ".join(files) or f"the safetensors weights of {folder_or_repo}"
        raise OSError(f"could not read {where}: {err} (the file is truncated or corrupt; save or download it again)") from err


def target_geometry(target: PreTrainedModel) -> dict:
    """Config fields a drafter copies from its target: width, heads, rotary settings, vocabulary, layer count."""
    text = target.config.get_text_config()
    num_layers = text.num_hidden_layers
    rope = getattr(text, "rope_parameters", None)
    if isinstance(rope, dict) and "full_attention" in rope:  # per-layer-type rope (Gemma 3)
        rope = rope["full_attention"]
    num_heads = text.num_attention_heads
    return dict(
        vocab_size=target.get_output_embeddings().weight.shape[0],
        hidden_size=text.hidden_size,
        target_hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_attention_heads=num_heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // num_heads,
        hidden_act=getattr(text, "hidden_act", None) or getattr(text, "hidden_activation", "silu"),
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
        rope_parameters=dict(rope) if rope else None,
        max_position_embeddings=text.max_position_embeddings,
        initializer_range=getattr(text, "initializer_range", 0.02),
        num_target_layers=num_layers,
        target_model_type=text.model_type,
        target_layer_ids=build_target_layer_ids(num_layers, 5),
    )


def build_from_target(model_class, config_class, target: PreTrainedModel, config_overrides: dict):
    """``model_class(config_class(target geometry + overrides))`` on the target's device (and dtype unless given)."""
    unknown = set(config_overrides) - set(config_class.__dataclass_fields__) - {"dtype", "draft_vocab_ids"}
    if unknown:
        raise ValueError(f"unknown {config_class.__name__} field(s): {sorted(unknown)}")
    overrides = dict(config_overrides)
    dtype = overrides.pop("dtype", None) or target.dtype
    draft_vocab_ids = overrides.pop("draft_vocab_ids", None)
    if draft_vocab_ids is not None:
        draft_vocab_ids = torch.as_tensor(draft_vocab_ids, dtype=torch.long).flatten()
        given = overrides.setdefault("draft_vocab_size", draft_vocab_ids.numel())
        if given != draft_vocab_ids.numel():
            raise ValueError(f"draft_vocab_size={given} but draft_vocab_ids has {draft_vocab_ids.numel()} ids")
    elif overrides.get("draft_vocab_size") is not None:
        raise ValueError("draft_vocab_size needs draft_vocab_ids (the target ids of the draft vocabulary)")
    config = config_class(**{**target_geometry(target), **overrides})
    drafter = model_class(config)
    if draft_vocab_ids is not None:
        drafter.set_draft_vocab(draft_vocab_ids)
    drafter = drafter.to(device=target.device, dtype=dtype)
    drafter.check_compatible(target)
    return drafter


def target_compatibility_problems(cfg, target: PreTrainedModel) -> list[str]:
    """What stops a drafter with config ``cfg`` (reading ``cfg.target_layer_ids``) from drafting for ``target``."""
    text = target.config.get_text_config()
    head, embed = target.get_output_embeddings(), target.get_input_embeddings()
    if head is None or embed is None:
        return [f"{type(target).__name__} has no input embedding / LM head to share with the drafter"]
    problems = []
    if head.weight.shape[0] != cfg.vocab_size or embed.weight.shape[0] < cfg.vocab_size:
        problems.append(
            f"vocabulary: drafter has {cfg.vocab_size}, target LM head has {head.weight.shape[0]} and embedding "
            f"{embed.weight.shape[0]}"
        )
    if text.hidden_size != cfg.target_hidden_size:
        problems.append(f"hidden size: drafter reads target features of width {cfg.target_hidden_size}, target has {text.hidden_size}")
    if head.weight.shape[1] != cfg.hidden_size:
        problems.append(f"hidden size: the target LM head reads width {head.weight.shape[1]}, drafter outputs {cfg.hidden_size}")
    num_layers = text.num_hidden_layers
    if cfg.target_layer_ids[-1] >= num_layers - 1 or cfg.target_layer_ids[0] < -1:
        problems.append(
            f"target_layer_ids {cfg.target_layer_ids} must lie in [-1, {num_layers - 2}] for a {num_layers}-layer "
            "target (its last layer is returned after the final norm)"
        )
    if cfg.num_target_layers is not None and cfg.num_target_layers != num_layers:
        problems.append(f"layers: drafter was built for a {cfg.num_target_layers}-layer target, this one has {num_layers}")
    return problems
