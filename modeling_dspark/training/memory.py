"""Process-wide memory settings for training on a CPU."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["keep_freed_memory"]

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1
_applied = False


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to serve every allocation from its heap and to keep what is freed there.

    By default glibc maps each block above 32 MB afresh and unmaps it when it is freed, so the large tensors of a
    training step (the drafter's attention scores, the [slots, draft vocabulary] logits of every chunk) fault in
    new zeroed pages on every step; on a 2-core CPU that is about a third of a step. With mapping off and the
    trim threshold at its maximum, each step reuses the pages the previous one freed. Idempotent; returns whether
    the settings are in force (False where the C library is not glibc)."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _INT_MAX))
    return _applied
