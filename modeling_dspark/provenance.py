"""The command line a result file records, so that anyone can rerun it as printed."""

from __future__ import annotations

import shlex
import sys

__all__ = ["command_line"]


def command_line(module: str, argv: list[str] | None = None) -> str:
    """``python -m module ARGS`` for ``argv`` (default: this process's arguments), shell-quoted.

    Quoting matters where an argument holds a space, e.g. an ablation label ``"dspark (rank 256)=FOLDER"``.
    """
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])
