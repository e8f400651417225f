"""Conversion between DeepSpec's DSpark checkpoint format and ours.

DeepSpec (deepseek-ai/DeepSpec) saves a drafter as the target's HF config plus DSpark fields
(``architectures=["Qwen3DSparkModel"]``, ``model_type="qwen3"``) and a state dict that also stores exact
copies of the target's ``embed_tokens`` and ``lm_head``. vLLM and SGLang serve that format. Ours keeps the
same parameter names without the two copies (they are passed in from the target at call time).

Deliberate differences, and how the DeepSpec path still reproduces DeepSpec exactly:
- mask positions: DeepSpec embeds a reserved ``mask_token_id`` with the frozen target embedding; ours may
  instead learn a ``mask_embedding`` (``mask_token_id=None``). Loading a DeepSpec folder keeps its
  ``mask_token_id``; exporting a learned mask writes it into the exported ``embed_tokens`` row of a chosen
  id and as ``mask_embedding.pt`` (which vLLM reads as the MASK row override).
- embed/LM head: not stored by us; on load they are dropped after checking they have the shapes the config
  promises, on export they are copied from the target.
- draft vocabulary: exported as EAGLE-3 / speculators checkpoints carry one, ``draft_vocab_size`` in the config
  and the ``d2t`` offsets in the state dict, with ``lm_head.weight`` holding only the draft vocabulary's rows and
  ``markov_w2`` its draft-vocabulary columns. ``markov_w1``, which engines index by target id, is expanded to the
  whole vocabulary (every id outside the draft vocabulary gets the shared outside row), so it is exact for them;
  loading folds it back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .configuration_dspark import DSparkConfig

__all__ = ["deepspec_config_to_dspark", "load_deepspec", "is_deepspec_folder", "to_deepspec"]

_SHARED_KEYS = ("embed_tokens.weight", "lm_head.weight")
# target-geometry fields shared by both formats under the same name
_GEOMETRY = (
    "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "rms_norm_eps", "rope_parameters", "max_position_embeddings", "attention_bias",
    "attention_dropout", "initializer_range",
)  # fmt: skip


def _read_config(folder: str | os.PathLike) -> dict | None:
    path = Path(folder) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def is_deepspec_folder(folder: str | os.PathLike) -> bool:
    """A local folder whose config is DeepSpec's (``*DSparkModel`` architecture on a target ``model_type``)."""
    cfg = _read_config(folder) if Path(folder).is_dir() else None
    if cfg is None or cfg.get("model_type") == "dspark":
        return False
    return any(str(a).endswith("DSparkModel") for a in cfg.get("architectures") or [])


def deepspec_config_to_dspark(cfg: dict) -> DSparkConfig:
    if "rope_parameters" not in cfg and "rope_theta" in cfg:  # transformers 4.x checkpoints
        cfg = {**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": cfg["rope_theta"]}}
    for key in ("target_layer_ids", "block_size", "mask_token_id", "markov_rank"):
        if key not in cfg:
            raise ValueError(f"DeepSpec config is missing {key!r}")
    rank = int(cfg["markov_rank"])
    head = cfg.get("markov_head_type", "vanilla") if rank > 0 else None
    if head not in (None, "vanilla", "rnn"):
        raise ValueError(f"DeepSpec Markov head {head!r} is not supported (vanilla and rnn are)")
    return DSparkConfig(
        **{k: cfg[k] for k in _GEOMETRY if k in cfg},
        block_size=cfg["block_size"],
        num_draft_layers=cfg["num_hidden_layers"],
        target_layer_ids=cfg["target_layer_ids"],
        num_target_layers=cfg.get("num_target_layers"),
        target_hidden_size=cfg.get("target_hidden_size", cfg["hidden_size"]),
        target_model_type=cfg.get("target_model_type", cfg.get("model_type")),
        markov_head_type=head,
        markov_rank=rank if rank > 0 else 256,
        confidence_head=bool(cfg.get("enable_confidence_head", False)),
        confidence_with_markov=bool(cfg.get("confidence_head_with_markov", False)),
        mask_token_id=cfg["mask_token_id"],
        num_anchors=cfg.get("num_anchors", 512),
        draft_vocab_size=cfg.get("draft_vocab_size"),
        # DeepSpec's evaluator drafts the whole block (its threshold defaults to off).
        truncation="fixed",
    )


def _load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    state = {}
    for name in files:
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} is missing")
        state.update(load_file(folder / name))
    return state


def load_deepspec(model_class, folder: str | os.PathLike, *, dtype: torch.dtype | None = None, device=None, **_):
    """A DeepSpec-format drafter folder as a ``model_class`` (``DSparkModel``; no copy of the embedding / LM head
    kept). Users call ``DSparkModel.from_pretrained(folder)``, which detects the format."""
    folder = Path(folder)
    raw = _read_config(folder)
    config = deepspec_config_to_dspark(raw)
    state = _load_state_dict(folder)
    vocab, width = config.vocab_size, config.hidden_size
    draft_vocab = config.draft_vocab_size or vocab
    for key, rows in zip(_SHARED_KEYS, (vocab, draft_vocab)):
        if key in state and tuple(state[key].shape) != (rows, width):
            raise ValueError(f"{key} in {folder} has shape {tuple(state[key].shape)}, config says {(rows, width)}")
        state.pop(key, None)
    w1 = "markov_head.markov_w1.weight"
    if config.draft_vocab_size is not None and w1 in state and "d2t" in state:
        ids = torch.arange(config.draft_vocab_size) + state["d2t"].long()
        outside = torch.ones(vocab, dtype=torch.bool)
        outside[ids] = False
        shared = state[w1][outside.nonzero()[0, 0]] if bool(outside.any()) else state[w1][0]
        state[w1] = torch.cat([state[w1][ids], shared[None]])  # draft rows, then the shared outside row
    model = model_class(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rotary_emb.")]
    if missing or unexpected:
        raise ValueError(f"DeepSpec checkpoint {folder} does not match its config: missing {missing}, unexpected {unexpected}")
    dtype = dtype if dtype is not None and dtype != "auto" else next(v.dtype for v in state.values() if v.is_floating_point())
    return model.to(device=device, dtype=dtype).eval()


def to_deepspec(drafter, target, folder: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16, mask_token_id: int | None = None) -> Path:
    """Write ``drafter`` in DeepSpec's format (config + safetensors with embed/LM head copies from ``target``).

    A drafter with a learned mask embedding needs a vocabulary row to carry it: ``mask_token_id`` (default:
    the last id). That row of the exported ``embed_tokens`` is overwritten, so an anchor equal to that id
    would be embedded as MASK in engines that read the export; pick an id the target never emits."""
    drafter.check_compatible(target)
    cfg = drafter.config
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    embed = target.get_input_embeddings().weight.detach().to("cpu", dtype).clone()
    state = {k: (v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().cpu()).contiguous() for k, v in drafter.state_dict().items() if k != "mask_embedding"}
    mask_id = cfg.mask_token_id
    if drafter.mask_embedding is not None:
        mask_id = cfg.vocab_size - 1 if mask_token_id is None else mask_token_id
        embed[mask_id] = drafter.mask_embedding.detach().to("cpu", dtype)
        torch.save(drafter.mask_embedding.detach().to("cpu", dtype).clone(), folder / "mask_embedding.pt")
    state["embed_tokens.weight"] = embed.contiguous()
    head = target.get_output_embeddings().weight.detach().to("cpu", dtype)
    if drafter.has_draft_vocab:
        ids = drafter.draft_token_ids.cpu()
        head = head[ids]  # the draft vocabulary's rows, as EAGLE-3 checkpoints store their LM head
        w1 = "markov_head.markov_w1.weight"
        if w1 in state:  # engines index W1 by target id: one row per target token
            state[w1] = state[w1][drafter.draft_index(torch.arange(cfg.vocab_size, device=drafter.d2t.device)).cpu()].contiguous()
        state["d2t"] = drafter.d2t.detach().cpu().contiguous()
    state["lm_head.weight"] = head.contiguous().clone()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})

    text = target.config.get_text_config().to_dict()
    family = text.get("model_type", "qwen3")
    arch = {"gemma4_text": "Gemma4DSparkModel", "gemma4": "Gemma4DSparkModel"}.get(family, "Qwen3DSparkModel")
    out = {k: v for k, v in text.items() if not k.startswith("_")}
    out.update({k: getattr(cfg, k) for k in _GEOMETRY})
    out.update(
        architectures=[arch],
        num_hidden_layers=cfg.num_draft_layers,
        num_target_layers=cfg.num_target_layers or target.config.get_text_config().num_hidden_layers,
        block_size=cfg.block_size,
        tie_word_embeddings=False,
        layer_types=["full_attention"] * cfg.num_draft_layers,
        mask_token_id=mask_id,
        target_layer_ids=list(cfg.target_layer_ids),
        num_anchors=cfg.num_anchors,
        enable_confidence_head=cfg.confidence_head,
        markov_rank=cfg.markov_rank if cfg.markov_head_type is not None else 0,
        dtype=str(dtype).removeprefix("torch."),
    )
    if cfg.draft_vocab_size is not None:
        out["draft_vocab_size"] = cfg.draft_vocab_size
    out.pop("auto_map", None)
    if cfg.confidence_head:
        out["confidence_head_with_markov"] = cfg.confidence_with_markov and cfg.markov_head_type is not None
    if cfg.markov_head_type is not None:
        out["markov_head_type"] = cfg.markov_head_type
    (folder / "config.json").write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    return folder
