"""Tiny randomly initialised targets and drafters for tests (no downloads)."""

from __future__ import annotations

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from modeling_dspark import DSparkModel

COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def tiny_target(family: str = "llama", *, vocab_size: int = 96, seed: int = 0, initializer_range: float = 0.02, **overrides):
    torch.manual_seed(seed)
    kwargs = {**COMMON, "vocab_size": vocab_size, "initializer_range": initializer_range, **overrides}
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kwargs))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=8, **kwargs))
    elif family == "gemma3":
        kwargs.update(num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8, query_pre_attn_scalar=16)
        model = Gemma3ForCausalLM(Gemma3TextConfig(**kwargs))
    else:
        raise ValueError(family)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def tiny_drafter(target, *, seed: int = 1, **overrides) -> DSparkModel:
    torch.manual_seed(seed)
    settings = dict(block_size=4, num_draft_layers=2, markov_rank=8)
    return DSparkModel.from_target(target, **{**settings, **overrides}).eval()


def bigram_target(*, vocab_size: int = 96, seed: int = 0, initializer_range: float = 0.02, family: str = "llama", **overrides):
    """A target whose next-token logits depend on the last token only (attention and MLP outputs zeroed):
    ``logits(x_t) = lm_head(norm(embed(x_t)))``. A Markov head can represent it exactly."""
    model = tiny_target(family, vocab_size=vocab_size, seed=seed, initializer_range=initializer_range, **overrides)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def oracle_drafter(target, **overrides) -> DSparkModel:
    """A drafter that shares the bigram target's predictions: zero backbone output (so ``U = 0``) and a Markov
    head ``W1[x] W2 = lm_head(norm(embed(x)))``."""
    hidden = target.config.hidden_size
    drafter = tiny_drafter(target, markov_rank=hidden, **overrides)
    with torch.no_grad():
        drafter.norm.weight.zero_()
        normed = target.model.norm(target.model.embed_tokens.weight)
        drafter.markov_head.markov_w1.weight.copy_(normed)
        drafter.markov_head.markov_w2.weight.copy_(target.lm_head.weight)
    return drafter
