"""Tiny randomly initialised targets and drafters, tiny tokenizers, stopping criteria and data for tests (no downloads)."""

from __future__ import annotations

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    StoppingCriteria,
)

from modeling_dspark import DSparkModel, Eagle3DrafterModel

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


def bigram_dataset(target, n=48, length=24, seed=0):
    """Sequences sampled from a bigram target, so the drafter has something learnable."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    with torch.no_grad():
        probs = torch.softmax(target(torch.arange(target.config.vocab_size)[:, None]).logits[:, 0], -1)
    for _ in range(n):
        ids = [int(torch.randint(1, target.config.vocab_size, (1,), generator=g))]
        for _ in range(length - 1):
            ids.append(int(torch.multinomial(probs[ids[-1]], 1, generator=g)))
        rows.append({"input_ids": ids, "loss_mask": [0] * 4 + [1] * (length - 4)})
    from datasets import Dataset

    return Dataset.from_list(rows)


def tiny_eagle3(target, seed=1, **overrides):
    torch.manual_seed(seed)
    return Eagle3DrafterModel.from_target(target, **{"ttt_length": 4, **overrides}).eval()


class StopAfterTokens(StoppingCriteria):
    """Fires when the sequence ends with ``tokens``."""

    def __init__(self, *tokens: int):
        self.tokens = torch.tensor(tokens)

    def __call__(self, input_ids, scores, **kwargs):
        n = len(self.tokens)
        if input_ids.shape[1] < n:
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)
        return (input_ids[:, -n:] == self.tokens).all(-1)


class StopAtLength(StoppingCriteria):
    """Fires once the sequence (prompt included) is ``length`` tokens long: a criterion that is not Transformers'
    ``MaxLengthCriteria``, so assisted decoding does not cut at it by itself."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def char_tokenizer(vocab_size: int = 96) -> PreTrainedTokenizerFast:
    """Id 0 is ``<unk>``, ids 1.. are the printable ASCII characters, one character per token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, **{chr(32 + i): i + 1 for i in range(vocab_size - 1)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


class ByteChat:
    """Stands in for a tokenizer: the chat template is the prompt's bytes folded into the vocabulary."""

    def __init__(self, vocab):
        self.vocab = vocab

    def apply_chat_template(self, messages, **_):
        return [1 + b % (self.vocab - 1) for b in messages[0]["content"].encode()[:10]]
