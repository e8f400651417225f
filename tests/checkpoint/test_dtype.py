"""Embedded targets: "auto" dtype takes bf16 where the CPU flags list native bf16, elsewhere only where this device
multiplies bf16 matrices about as fast as fp32; the de-quantised cache is built by one process at a time."""

import subprocess
import sys
import time

import pytest
import torch

from modeling_dspark import targets
from modeling_dspark.targets import (
    _cache_lock,
    _probed_dtype,
    dtype_label,
    fast_dtype,
    resolve_dtype,
)


def _with_clock(monkeypatch, ticks):
    monkeypatch.setattr(targets, "_cpu_has_native_bf16", lambda: False)  # the timing probe, whatever this CPU is
    clock = iter(ticks)
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    return _probed_dtype.__wrapped__("cpu")  # past the per-process cache


def test_fast_dtype_falls_back_to_fp32_where_bf16_products_are_slow(monkeypatch):
    # fp32 timed first, then bf16: a scalar bf16 fallback (AVX2-only CPUs) is ~100x slower
    assert _with_clock(monkeypatch, [0.0, 1.0, 0.0, 100.0]) == torch.float32
    assert _with_clock(monkeypatch, [0.0, 1.0, 0.0, 0.5]) == torch.bfloat16  # AMX / AVX512-BF16: bf16 is faster
    assert _with_clock(monkeypatch, [0.0, 1.0, 0.0, 1.9]) == torch.bfloat16  # within 2x: bf16 halves the bytes read


def test_native_bf16_flags_decide_without_timing(monkeypatch):
    monkeypatch.setattr(targets, "_cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(time, "perf_counter", lambda: pytest.fail("timed although the CPU flags decide"))
    assert _probed_dtype.__wrapped__("cpu") == torch.bfloat16


def test_cpu_flags_read_from_cpuinfo(monkeypatch, tmp_path):
    from modeling_dspark import cpu_blas  # the one reader of /proc/cpuinfo

    real_path = cpu_blas.Path
    for flags, expected in (("fpu avx2 avx512f", False), ("fpu avx512f avx512_bf16", True), ("fpu amx_tile amx_bf16", True)):
        (tmp_path / "cpuinfo").write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        monkeypatch.setattr(cpu_blas, "Path", lambda p: real_path(tmp_path / "cpuinfo") if p == "/proc/cpuinfo" else real_path(p))
        assert targets._cpu_has_native_bf16() is expected
    monkeypatch.setattr(cpu_blas, "Path", lambda p: real_path(tmp_path / "missing"))
    assert targets.cpu_flags() == [] and targets._cpu_has_native_bf16() is False


def test_resolve_dtype_names_and_errors():
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype("fp32") is torch.float32
    assert resolve_dtype("float16") is torch.float16
    assert resolve_dtype(torch.float64) is torch.float64
    assert resolve_dtype("auto") is fast_dtype() and resolve_dtype(None) is fast_dtype()
    assert fast_dtype() in (torch.bfloat16, torch.float32)
    # one probe per device and process, however it is asked for (a second probe could decide otherwise)
    assert fast_dtype() is fast_dtype("cpu") is resolve_dtype("auto", device="cpu")
    assert _probed_dtype.cache_info().currsize == 1
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float7")
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("Tensor")  # a torch attribute that is not a dtype
    assert [dtype_label(d) for d in (torch.bfloat16, torch.float32, torch.float16)] == ["bf16", "fp32", "fp16"]


def test_generate_warns_when_drafter_and_target_dtypes_differ():
    from tiny_models import tiny_drafter, tiny_target

    import modeling_dspark  # noqa: F401  (the generate() hook)

    target = tiny_target()
    drafter = tiny_drafter(target, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="load the drafter with dtype=target.dtype"):
        target.generate(torch.tensor([[3, 4, 5]]), do_sample=False, max_new_tokens=3, assistant_model=drafter)


@pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")
def test_target_cache_lock_excludes_other_processes(tmp_path):
    # two processes (pytest-xdist workers) loading the target at once: only one may build its cache
    lock = tmp_path / "smollm2.lock"
    probe = "import fcntl, sys\ntry:\n    fcntl.flock(open(sys.argv[1], 'w'), fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(3)"
    with _cache_lock(lock):
        assert subprocess.run([sys.executable, "-c", probe, str(lock)], check=False).returncode == 3
    assert subprocess.run([sys.executable, "-c", probe, str(lock)], check=False).returncode == 0


def test_mkl_small_row_path_is_preferred_on_amd_only_and_never_over_the_user():
    from modeling_dspark.cpu_blas import prefer_mkl_small_row_path

    env = {}
    assert prefer_mkl_small_row_path(env, vendor="AuthenticAMD") is True and env == {"MKL_CBWR": "AUTO"}
    for vendor in ("GenuineIntel", None):
        env = {}
        assert prefer_mkl_small_row_path(env, vendor=vendor) is False and env == {}
    for user_value in ("", "COMPATIBLE"):  # empty: MKL's default path, the documented opt-out
        env = {"MKL_CBWR": user_value}
        assert prefer_mkl_small_row_path(env, vendor="AuthenticAMD") is False and env == {"MKL_CBWR": user_value}


def test_cpu_vendor_read_from_cpuinfo(monkeypatch, tmp_path):
    from modeling_dspark import cpu_blas

    real_path = cpu_blas.Path
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2\n")
    monkeypatch.setattr(cpu_blas, "Path", lambda p: real_path(tmp_path / "cpuinfo") if p == "/proc/cpuinfo" else real_path(p))
    assert cpu_blas.cpu_vendor() == "AuthenticAMD"
    monkeypatch.setattr(cpu_blas, "Path", lambda p: real_path(tmp_path / "missing"))
    assert cpu_blas.cpu_vendor() is None


def test_importing_the_package_sets_mkl_cbwr_before_any_product():
    # a fresh interpreter: MKL reads the variable at its first call, so only import time is early enough
    code = "import os, modeling_dspark; from modeling_dspark.cpu_blas import cpu_vendor; print(os.environ.get('MKL_CBWR'), cpu_vendor())"
    env = {k: v for k, v in __import__("os").environ.items() if k != "MKL_CBWR"}
    value, vendor = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert value == ("AUTO" if vendor == "AuthenticAMD" else "None")
