"""What a DSpark checkpoint is: configuration, drafter, heads, and the embedded default targets.

Importing this package registers ``model_type="dspark"`` with ``AutoConfig``/``AutoModel`` and installs the
guarded hook that routes ``target.generate(assistant_model=<DSpark drafter>)`` to DSpark drafting.
"""

from transformers import AutoConfig, AutoModel

from .configuration_dspark import DSparkConfig
from .configuration_eagle3 import Eagle3DrafterConfig
from .confidence_head import DSparkConfidenceHead, cumulative_survival
from .markov_head import RNNMarkovHead, VanillaMarkovHead, build_markov_head
from .modeling_dspark import DSparkModel, DSparkModelOutput, DSparkPreTrainedModel, build_target_layer_ids
from .modeling_eagle3 import Eagle3DrafterModel
from .targets import KNOWN_TARGETS, load_target, locate_gguf

AutoConfig.register("dspark", DSparkConfig, exist_ok=True)
AutoModel.register(DSparkConfig, DSparkModel, exist_ok=True)
AutoConfig.register("eagle3_drafter", Eagle3DrafterConfig, exist_ok=True)  # the paper's autoregressive baseline
AutoModel.register(Eagle3DrafterConfig, Eagle3DrafterModel, exist_ok=True)
# save_pretrained copies configuration_dspark.py / modeling_dspark.py and writes auto_map, so the folder
# loads with trust_remote_code where this package is not installed.
DSparkConfig.register_for_auto_class()
DSparkModel.register_for_auto_class("AutoModel")
Eagle3DrafterConfig.register_for_auto_class()
Eagle3DrafterModel.register_for_auto_class("AutoModel")

from generation.hooks import install_generate_hook  # noqa: E402  (needs the classes above)

install_generate_hook()

_LAZY = {"DSparkCollator": "trainer", "DSparkTrainer": "trainer", "DSparkTrainingArguments": "trainer"}


def __getattr__(name):
    # the Trainer stack (accelerate, datasets) is imported only by those who train
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
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
    "VanillaMarkovHead",
    "build_markov_head",
    "build_target_layer_ids",
    "cumulative_survival",
    "load_target",
    "locate_gguf",
]
