"""Routing ``target.generate(assistant_model=<DSpark drafter>)`` to :class:`DSparkCandidateGenerator`.

Transformers has no registry of candidate generators: ``GenerationMixin._get_candidate_generator`` is an
if/elif chain. :func:`install_generate_hook` wraps it once (guarded, idempotent) so that a DSpark assistant
gets our generator and every other assistant goes to the original chain unchanged; it also wraps
``_validate_generation_mode`` so an incompatible drafter gets our clear error before Transformers' own checks,
``_prepare_generation_config`` so ``dspark_*`` settings can be passed as keywords, and ``_assisted_decoding`` so
our generator sees the stopping criteria (to end a block on a stop). The no-patching form
is :func:`dspark_generate`, passed as ``generate(custom_generate=dspark_generate, dspark_model=drafter)``.

Building a drafter installs the hook (``DSparkModel`` / ``Eagle3DrafterModel`` call :func:`install_generate_hook`),
so a drafter loaded from its folder's remote code, where this module is one of the folder's files, routes
``generate()`` without the project installed.
"""

from __future__ import annotations

import functools
import inspect
import warnings

from packaging import version
from transformers import GenerationMixin
from transformers import __version__ as transformers_version

from .candidate_generator import DSparkCandidateGenerator
from .eagle3_candidate_generator import Eagle3CandidateGenerator

__all__ = [
    "TESTED_TRANSFORMERS",
    "dspark_generate",
    "install_generate_hook",
    "DRAFTER_GENERATORS",
    "is_hidden_state_drafter",
    "uninstall_generate_hook",
]

# The hook relies on private assisted-generation internals; keep in step with pyproject.toml.
TESTED_TRANSFORMERS = (">=5.24.0", "<5.25.0")
_HOOK_FLAG = "__dspark_hook__"


# model_type of a drafter -> its candidate generator. Routed by model_type, not class, so that a drafter
# loaded with trust_remote_code (its own copy of the classes) is routed by whichever copy installed the hook.
DRAFTER_GENERATORS = {"dspark": DSparkCandidateGenerator, "eagle3_drafter": Eagle3CandidateGenerator}


def _model_type(model) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None) if model is not None else None


def is_hidden_state_drafter(model) -> bool:
    """True for the drafters this project routes (DSpark, DFlash-as-DSpark, Eagle3)."""
    return _model_type(model) in DRAFTER_GENERATORS


def _build_generator(target, drafter, generation_config, input_ids, model_kwargs, logits_processor):
    return DRAFTER_GENERATORS[_model_type(drafter)](
        target=target,
        drafter=drafter,
        generation_config=generation_config,
        input_ids=input_ids,
        model_kwargs=model_kwargs,
        logits_processor=logits_processor,
    )


def _route_candidate_generator(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _get_candidate_generator(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs).arguments
        if is_hidden_state_drafter(call.get("assistant_model")):
            return _build_generator(
                self,
                call["assistant_model"],
                call["generation_config"],
                call["input_ids"],
                call["model_kwargs"],
                call["logits_processor"],
            )
        return original(self, *args, **kwargs)

    return _get_candidate_generator


def _check_dspark_assistant(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _validate_generation_mode(self, *args, **kwargs):
        # Transformers reads a vocabulary mismatch as "different tokenizers"; say what is really wrong first.
        call = signature.bind(self, *args, **kwargs).arguments
        mode_kwargs = call.get("generation_mode_kwargs") or {}
        assistant = mode_kwargs.get("assistant_model")
        if is_hidden_state_drafter(assistant):
            assistant.check_compatible(self)
            config = call.get("generation_config")
            if config is not None and (getattr(config, "num_beams", 1) or 1) > 1:
                # Transformers would warn and silently decode greedily
                raise ValueError(
                    f"num_beams={config.num_beams} cannot be combined with a {_model_type(assistant)} assistant: speculative "
                    "decoding verifies one sequence; use num_beams=1 (greedy or sampling)"
                )
        return original(self, *args, **kwargs)

    return _validate_generation_mode


def _accept_dspark_keywords(original):
    @functools.wraps(original)
    def _prepare_generation_config(self, *args, **kwargs):
        # generate(..., dspark_truncation="cost") like any generation argument: GenerationConfig keeps only the
        # attributes it knows, so ours would be left over as "model_kwargs not used by the model"
        generation_config, model_kwargs = original(self, *args, **kwargs)
        for key in [k for k in model_kwargs if k.startswith("dspark_") and k not in ("dspark_model", "dspark_streamer")]:
            setattr(generation_config, key, model_kwargs.pop(key))
        return generation_config, model_kwargs

    return _prepare_generation_config


def _hand_over_stopping_criteria(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _assisted_decoding(self, *args, **kwargs):
        # the candidate generator is built inside and is not given the criteria, which it needs to end a block
        # on a stop (assisted decoding checks them only after a whole block)
        call = signature.bind(self, *args, **kwargs).arguments
        if is_hidden_state_drafter(call.get("assistant_model")):
            call["generation_config"]._dspark_stopping_criteria = call["stopping_criteria"]
        return original(self, *args, **kwargs)

    return _assisted_decoding


# GenerationMixin method -> wrapper factory
_WRAPPERS = {
    "_assisted_decoding": _hand_over_stopping_criteria,
    "_get_candidate_generator": _route_candidate_generator,
    "_validate_generation_mode": _check_dspark_assistant,
    "_prepare_generation_config": _accept_dspark_keywords,
}


def install_generate_hook() -> bool:
    """Wrap the ``GenerationMixin`` methods in ``_WRAPPERS``; returns False if they were already wrapped."""
    if all(getattr(getattr(GenerationMixin, name), _HOOK_FLAG, False) for name in _WRAPPERS):
        return False
    low, high = (version.parse(spec.lstrip("<>=")) for spec in TESTED_TRANSFORMERS)
    if not low <= version.parse(transformers_version) < high:
        warnings.warn(
            f"dspark was tested with transformers {','.join(TESTED_TRANSFORMERS)}; found {transformers_version}. "
            "Assisted-generation internals may have changed.",
            stacklevel=2,
        )
    for name, make_wrapper in _WRAPPERS.items():
        original = getattr(GenerationMixin, name)
        if not getattr(original, _HOOK_FLAG, False):
            wrapper = make_wrapper(original)
            setattr(wrapper, _HOOK_FLAG, True)
            setattr(GenerationMixin, name, wrapper)
    return True


def uninstall_generate_hook() -> bool:
    """Restore the original methods; returns False if no hook was installed."""
    removed = False
    for name in _WRAPPERS:
        current = getattr(GenerationMixin, name)
        if getattr(current, _HOOK_FLAG, False):
            setattr(GenerationMixin, name, current.__wrapped__)
            removed = True
    return removed


def dspark_generate(
    model,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    dspark_model=None,
    dspark_streamer=None,
    synced_gpus: bool = False,
    **model_kwargs,
):
    """``custom_generate`` callable: DSpark assisted decoding without the global hook.

    ``generate()`` drops ``assistant_model`` and ``streamer`` for callables, hence ``dspark_model`` and
    ``dspark_streamer``. The candidate generator is attached to this ``model`` instance for the duration
    of the call only (not thread-safe for one model shared by several threads)."""
    if not is_hidden_state_drafter(dspark_model):
        raise ValueError("dspark_generate needs dspark_model=<a DSpark or Eagle3 drafter>")
    generation_config._dspark_stopping_criteria = stopping_criteria
    generator = _build_generator(model, dspark_model, generation_config, input_ids, model_kwargs, logits_processor)
    model._get_candidate_generator = lambda **_: generator
    try:
        return GenerationMixin._assisted_decoding(
            model,
            input_ids,
            logits_processor=logits_processor,
            stopping_criteria=stopping_criteria,
            generation_config=generation_config,
            synced_gpus=synced_gpus,
            streamer=dspark_streamer,
            assistant_model=dspark_model,
            **model_kwargs,
        )
    finally:
        del model._get_candidate_generator
