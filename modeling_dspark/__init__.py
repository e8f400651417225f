"""The DSpark drafters: what a checkpoint is (``modeling_dspark.checkpoint``) and how it is trained
(``modeling_dspark.training``), with the embedded default targets.

Importing this package registers ``model_type="dspark"`` and ``"eagle3_drafter"`` with ``AutoConfig`` /
``AutoModel``. Building or loading a drafter installs the guarded hook that routes
``target.generate(assistant_model=drafter)`` to DSpark drafting (``generation.decoding.hooks``).
"""

from .cpu_blas import prefer_mkl_small_row_path

prefer_mkl_small_row_path()  # before the process's first matrix product: MKL reads it once (see cpu_blas)

from transformers import AutoConfig, AutoModel  # noqa: E402

from .checkpoint.confidence_head import DSparkConfidenceHead, calibrated_confidence, prefix_survival
from .checkpoint.config import DSparkConfig
from .checkpoint.eagle3_config import Eagle3DrafterConfig
from .checkpoint.eagle3_model import Eagle3DrafterModel
from .checkpoint.markov_head import RNNMarkovHead, SequentialHead, VanillaMarkovHead, build_markov_head
from .checkpoint.model import DSparkModel, DSparkModelOutput, DSparkPreTrainedModel, build_target_layer_ids
from .targets import KNOWN_TARGETS, load_target, locate_gguf

# model_type -> drafter class (Eagle3: the paper's autoregressive baseline)
DRAFTER_CLASSES = {"dspark": DSparkModel, "eagle3_drafter": Eagle3DrafterModel}
for _model_type, _model_class in DRAFTER_CLASSES.items():
    AutoConfig.register(_model_type, _model_class.config_class, exist_ok=True)
    AutoModel.register(_model_class.config_class, _model_class, exist_ok=True)
del _model_type, _model_class

_LAZY = {"DSparkCollator": "training.trainer", "DSparkTrainer": "training.trainer", "DSparkTrainingArguments": "training.trainer"}


def __getattr__(name):
    # the Trainer stack (accelerate, datasets) is imported only by those who train
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"modeling_dspark.{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DRAFTER_CLASSES",
    "DSparkCollator",
    "DSparkConfidenceHead",
    "DSparkConfig",
    "DSparkModel",
    "DSparkModelOutput",
    "DSparkPreTrainedModel",
    "DSparkTrainer",
    "DSparkTrainingArguments",
    "Eagle3DrafterConfig",
    "Eagle3DrafterModel",
    "KNOWN_TARGETS",
    "RNNMarkovHead",
    "SequentialHead",
    "VanillaMarkovHead",
    "build_markov_head",
    "build_target_layer_ids",
    "calibrated_confidence",
    "load_target",
    "locate_gguf",
    "prefix_survival",
]
