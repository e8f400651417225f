"""MKL's single-precision matrix products with a few rows, on AMD CPUs.

Speculative decoding verifies a block of 2-8 tokens per forward, so its price on a CPU is that of matrix products
with a few rows. PyTorch's CPU wheels multiply fp32 matrices through MKL, and on an AMD EPYC (AVX2) MKL's default
code path makes such a product cost up to about twice a one-row one, while any conditional-numerical-reproducibility
mode (``MKL_CBWR``) takes a path where 2-8 rows cost little more than one: there SmolLM2-135M's 8-token forward
costs 1.91 one-token steps on the default path and 1.33 with ``MKL_CBWR=AUTO`` (``benchmarks/mkl_small_rows.py``,
results in ``benchmarks/results/mkl_small_rows_epyc``). ``AUTO`` keeps MKL's choice of instructions for the CPU.

MKL reads the variable once, at its first call, so it must be set before the process's first matrix product:
importing ``modeling_dspark`` does it, and only where it is unset and the CPU is AMD's (where it was measured).
``MKL_CBWR=`` (empty) keeps MKL's default path.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

__all__ = ["cpu_vendor", "cpuinfo_field", "prefer_mkl_small_row_path"]

# vendors whose CPUs were measured faster with MKL_CBWR set (benchmarks/mkl_small_rows.py)
SMALL_ROW_VENDORS = ("AuthenticAMD",)


def cpuinfo_field(name: str) -> str | None:
    """The first processor's ``name`` field of /proc/cpuinfo (``vendor_id``, ``flags``), or None where it cannot be
    read (not Linux, for example)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith(name)), None)


def cpu_vendor() -> str | None:
    """The CPU's ``vendor_id`` (``GenuineIntel``, ``AuthenticAMD``), or None where it cannot be read."""
    return cpuinfo_field("vendor_id")


_THIS_CPU = object()


def prefer_mkl_small_row_path(environ: MutableMapping[str, str] | None = None, vendor=_THIS_CPU) -> bool:
    """Set ``MKL_CBWR=AUTO`` where it is unset and the CPU (``vendor``: this one's by default, None when unknown) is
    one of ``SMALL_ROW_VENDORS``; True when it set it. Effective only before the process's first MKL call."""
    environ = os.environ if environ is None else environ
    vendor = cpu_vendor() if vendor is _THIS_CPU else vendor
    if "MKL_CBWR" in environ or vendor not in SMALL_ROW_VENDORS:
        return False
    environ["MKL_CBWR"] = "AUTO"
    return True
