"""Configuration of the Eagle3 baseline drafter (the paper's autoregressive baseline, SPEC section 8).

An Eagle3 drafter is one causal decoder layer whose attention reads ``[RMSNorm(emb(x_{t+1})) ; RMSNorm(h_t)]``,
where ``h_t`` is either the projected target features of position t (the first step) or the layer's own
output at the previous draft step. It drafts ``ttt_length`` tokens one at a time and is trained with
*training-time test* over the same number of steps (the DeepSpec / SpecForge recipe).
"""

from __future__ import annotations

from transformers.configuration_utils import PreTrainedConfig

from .configuration_dspark import DSPARK_FIELD_TYPES, check_draft_vocab_size, check_field_types

__all__ = ["Eagle3DrafterConfig"]


class Eagle3DrafterConfig(PreTrainedConfig):
    r"""
    Args:
        ttt_length (`int`, defaults to 7):
            Draft steps per round, and training-time-test steps during training.
        step_loss_decay (`float`, defaults to 0.8):
            Training weight of step i is ``step_loss_decay ** i`` (i 0-based).
        target_layer_ids (`list[int]`):
            Target decoder layers whose outputs are fused into the first step's hidden state (HF convention:
            layer ``i`` is ``hidden_states[i + 1]``). The target's last layer is not allowed.
        num_target_layers (`int`):
            Number of decoder layers of the target, used to validate `target_layer_ids`.
        target_hidden_size (`int`):
            Width of the target's hidden states.
        num_anchors (`int`, defaults to 512):
            Supervised positions per training sequence (the DSpark trainer's anchors; each starts a chain of
            ``ttt_length`` predictions), so both drafters see the same number of supervised tokens.
        draft_vocab_size (`int`, *optional*):
            Size of the draft vocabulary (``d2t`` buffer, as DSpark's); `None` drafts over the whole vocabulary.
        The remaining fields describe the draft layer and default to the target's values.
    """

    model_type = "eagle3_drafter"

    ttt_length: int = 7
    step_loss_decay: float = 0.8
    target_layer_ids: list[int] | None = None
    num_target_layers: int | None = None
    target_hidden_size: int | None = None
    target_model_type: str | None = None
    num_anchors: int = 512
    draft_vocab_size: int | None = None
    # geometry of the draft layer (copied from the target)
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
        shared = ("target_layer_ids", "num_target_layers", "num_anchors", "draft_vocab_size", "vocab_size", "hidden_size")
        check_field_types(self, {"ttt_length": DSPARK_FIELD_TYPES["block_size"], "step_loss_decay": DSPARK_FIELD_TYPES["confidence_threshold"], **{k: DSPARK_FIELD_TYPES[k] for k in shared}})
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        super().__post_init__(**kwargs)
        if self.ttt_length < 1:
            raise ValueError(f"ttt_length must be >= 1, got {self.ttt_length}")
        ids = self.target_layer_ids
        if not ids or any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < -1:
            raise ValueError(f"target_layer_ids must be a non-empty, strictly increasing list of ids >= -1, got {ids}")
        if self.num_target_layers is not None and ids[-1] >= self.num_target_layers - 1:
            raise ValueError(f"target_layer_ids {ids} must stay below the target's last layer ({self.num_target_layers - 1})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        check_draft_vocab_size(self)

    @property
    def num_hidden_layers(self) -> int:
        return 1

    @property
    def block_size(self) -> int:
        # Tokens drafted per round: the name the shared evaluation and statistics code reads.
        return self.ttt_length
