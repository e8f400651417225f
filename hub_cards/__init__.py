"""Hub packaging of drafter folders: model cards built with ``huggingface_hub.ModelCard`` and the upload."""

from .cards import DEFAULT_TARGET_REPO, drafter_card, write_card
from .push import push_drafter, remote_code_files

__all__ = ["DEFAULT_TARGET_REPO", "drafter_card", "push_drafter", "remote_code_files", "write_card"]
