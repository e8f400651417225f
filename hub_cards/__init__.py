"""Hub packaging of drafter folders: model cards built with ``huggingface_hub.ModelCard`` and the upload.

Run as ``python -m hub_cards.cards FOLDER`` / ``python -m hub_cards.push FOLDER REPO`` (or ``dspark card`` /
``dspark push``); the demo is ``hub_cards.space``."""

_EXPORTS = {"DEFAULT_TARGET_REPO": "cards", "drafter_card": "cards", "write_card": "cards", "push_drafter": "push", "remote_code_files": "push"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    # imported on first use, so ``python -m hub_cards.cards`` does not import its own module twice
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
