"""Configuration of a DSpark drafter (arXiv 2607.05147).

A DSpark drafter is a small non-causal transformer that reads the hidden states of a few target layers
(the *context*), takes a *block* made of the anchor token plus ``block_size - 1`` mask embeddings, and
returns ``block_size`` draft positions in one forward. A light sequential head (Markov or RNN) adds a
bias to each position's logits from the previously sampled token, and a confidence head predicts the
probability that each drafted token survives verification.

The draft layers share the target's width, heads and rotary settings, so the geometry fields below are
copied from the target by :meth:`DSparkModel.from_target`.
"""

from __future__ import annotations

from transformers.configuration_utils import PreTrainedConfig

__all__ = ["DSparkConfig", "MARKOV_HEAD_TYPES", "TRUNCATION_MODES", "check_draft_vocab_size", "check_field_types"]

MARKOV_HEAD_TYPES = ("vanilla", "rnn")
TRUNCATION_MODES = ("fixed", "threshold")


class DSparkConfig(PreTrainedConfig):
    r"""
    Args:
        block_size (`int`, defaults to 7):
            Number of block positions, i.e. drafts per round: the anchor slot is the first prediction.
        num_draft_layers (`int`, defaults to 5):
            Number of draft decoder layers.
        target_layer_ids (`list[int]`):
            Target decoder layers whose outputs form the context features (HF convention: layer ``i`` is
            ``hidden_states[i + 1]``; ``-1`` is the embedding output). The target's last layer is not allowed,
            because Transformers returns it after the final norm.
        num_target_layers (`int`):
            Number of decoder layers of the target, used to validate `target_layer_ids`.
        target_hidden_size (`int`):
            Width of the target's hidden states (the context projection reads ``len(target_layer_ids)`` of them).
        target_model_type (`str`, *optional*):
            `model_type` of the target the drafter was built for (informational).
        markov_head_type (`str` or `None`, defaults to `"vanilla"`):
            `"vanilla"` (Eq. 5), `"rnn"` (Eq. 6) or `None` for a plain parallel (DFlash) drafter.
        markov_rank (`int`, defaults to 256):
            Rank ``r`` of the Markov embedding ``W1`` (V x r) and projection ``W2`` (r x V).
        confidence_head (`bool`, defaults to `True`):
            Whether the drafter has the confidence head of Eq. 7.
        confidence_with_markov (`bool`, defaults to `True`):
            Whether the confidence head also reads the Markov embedding ``W1[x_{k-1}]`` (Eq. 7) or ``h_k`` alone.
        mask_token_id (`int`, *optional*):
            If set, mask positions use the target's embedding row of this id (the DeepSpec convention).
            If `None`, the drafter learns its own mask embedding (targets rarely have a spare token).
        confidence_temperatures (`list[float]`, *optional*):
            Per-position temperatures of Sequential Temperature Scaling, filled by calibration.
        truncation (`str`, defaults to `"threshold"`):
            Default block truncation at inference: `"fixed"` (always draft `num_draft_tokens`) or `"threshold"`
            (stop before the first position whose cumulative survival falls below `confidence_threshold`).
        confidence_threshold (`float`, defaults to 0.0):
            Threshold on the cumulative survival ``prod_i c_i``; 0 keeps every position.
        num_anchors (`int`, defaults to 512):
            Anchors sampled per training sequence.
        draft_vocab_size (`int`, *optional*):
            Size of the draft vocabulary (the target ids in the ``d2t`` buffer, ``target_id = draft_id + d2t[draft_id]``):
            the drafter's logits and the Markov head live over these tokens only. `None` drafts over the whole
            target vocabulary.
        The remaining fields describe the draft layers and default to the target's values.
    """

    model_type = "dspark"

    # drafter
    block_size: int = 7
    num_draft_layers: int = 5
    target_layer_ids: list[int] | None = None
    num_target_layers: int | None = None
    target_hidden_size: int | None = None
    target_model_type: str | None = None
    markov_head_type: str | None = "vanilla"
    markov_rank: int = 256
    confidence_head: bool = True
    confidence_with_markov: bool = True
    mask_token_id: int | None = None
    num_anchors: int = 512
    draft_vocab_size: int | None = None
    # calibration and inference defaults
    confidence_temperatures: list[float] | None = None
    truncation: str = "threshold"
    confidence_threshold: float = 0.0
    # geometry of the draft layers (copied from the target)
    vocab_size: int = 32000
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_parameters: dict | None = None
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.target_layer_ids is None:
            self.target_layer_ids = [0]
        check_field_types(self, DSPARK_FIELD_TYPES)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        super().__post_init__(**kwargs)
        self.validate_dspark()

    @property
    def num_hidden_layers(self) -> int:
        # Transformers utilities (caches, device maps) look for this name.
        return self.num_draft_layers

    def validate_dspark(self) -> None:
        """Raise a `ValueError` for settings no drafter can run with."""
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_draft_layers < 1:
            raise ValueError(f"num_draft_layers must be >= 1, got {self.num_draft_layers}")
        if self.markov_head_type not in (None, *MARKOV_HEAD_TYPES):
            raise ValueError(f"markov_head_type must be one of {MARKOV_HEAD_TYPES} or None, got {self.markov_head_type!r}")
        if self.markov_head_type is not None and self.markov_rank < 1:
            raise ValueError(f"markov_rank must be >= 1 with a Markov head, got {self.markov_rank}")
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation must be one of {TRUNCATION_MODES}, got {self.truncation!r}")
        if not 0.0 <= self.confidence_threshold <= 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1], got {self.confidence_threshold}")
        ids = self.target_layer_ids
        if not ids or any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < -1:
            raise ValueError(f"target_layer_ids must be a non-empty, strictly increasing list of ids >= -1, got {ids}")
        if self.num_target_layers is not None and ids[-1] >= self.num_target_layers - 1:
            raise ValueError(
                f"target_layer_ids {ids} must stay below the target's last layer ({self.num_target_layers - 1}): "
                "Transformers returns the last layer's output after the final norm"
            )
        if self.confidence_temperatures is not None:
            if len(self.confidence_temperatures) != self.block_size:
                raise ValueError(
                    f"confidence_temperatures has {len(self.confidence_temperatures)} entries, block_size is {self.block_size}"
                )
            if any(t <= 0 for t in self.confidence_temperatures):
                raise ValueError(f"confidence_temperatures must be positive, got {self.confidence_temperatures}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        check_draft_vocab_size(self)


# field -> (what it must be, check); a config from code or a hand-edited config.json gets one clear error per field
_INT = ("an int", lambda v: isinstance(v, int) and not isinstance(v, bool))
_OPT_INT = ("an int or null", lambda v: v is None or _INT[1](v))
_NUMBER = ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
_BOOL = ("true or false", lambda v: isinstance(v, bool))
_INT_LIST = ("a list of ints", lambda v: isinstance(v, (list, tuple)) and all(_INT[1](i) for i in v))
DSPARK_FIELD_TYPES = {
    "block_size": _INT, "num_draft_layers": _INT, "target_layer_ids": _INT_LIST, "num_target_layers": _OPT_INT,
    "markov_rank": _INT, "confidence_head": _BOOL, "confidence_with_markov": _BOOL, "mask_token_id": _OPT_INT,
    "num_anchors": _INT, "draft_vocab_size": _OPT_INT, "confidence_threshold": _NUMBER, "vocab_size": _INT,
    "hidden_size": _INT, "num_attention_heads": _INT, "num_key_value_heads": _INT,
    "confidence_temperatures": ("a list of numbers or null", lambda v: v is None or (isinstance(v, (list, tuple)) and all(_NUMBER[1](t) for t in v))),
}  # fmt: skip


def check_field_types(config, types: dict) -> None:
    """A `ValueError` naming the field, its value and what is allowed, for a field of the wrong type."""
    for name, (allowed, ok) in types.items():
        value = getattr(config, name, None)
        if not ok(value):
            raise ValueError(f"{type(config).__name__}.{name} must be {allowed}, got {value!r} ({type(value).__name__})")


def check_draft_vocab_size(config) -> None:
    """``draft_vocab_size`` is None (the whole vocabulary) or in [1, vocab_size]."""
    size = config.draft_vocab_size
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= config.vocab_size):
        raise ValueError(f"draft_vocab_size must be None or an int in [1, vocab_size={config.vocab_size}], got {size!r}")
