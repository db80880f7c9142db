"""The CPU small-M GEMM (`cpu_gemm.c`): built once per machine with its C compiler, called through ctypes.

    small_m_mm(x, w_t, out, accumulate=False) -> bool      out (+)= x @ w_t

`x` [M, K] and `out` [M, N] float32 with contiguous rows, `w_t` [K, N] float32 contiguous (a Linear weight
stored K-major, transposed). Returns False, computing nothing, when the kernel is unavailable (no C
compiler, a failed build, not x86/ARM Linux, or LMQ_CPU_GEMM=0): the caller then uses torch.

The shared library goes to `<build_dir>/cpu_gemm-<hash>.so`, the hash covering the source, the flags, the
compiler's version and the CPU's flags, so a different machine or source builds its own.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_gemm.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC"]
# The rows the kernel takes: BLAS's GEMV is as fast at one row (a single weight stream; the kernel is ~1.5 ms
# slower over SmolLM2-135M's 30 layers), and its blocked GEMM is faster above 8 rows (one pass of the kernel)
MIN_ROWS, MAX_ROWS = 2, 8

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried: set[Path] = set()
_build_dir: Path | None = None


def configure(build_dir: Path) -> None:
    """Where the shared library is built and kept (the engine passes lmq's cache directory)."""
    global _build_dir
    _build_dir = Path(build_dir)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(directory: Path) -> Path | None:
    cc = _compiler()
    if cc is None:
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_flags()]).encode())
    target = directory / f"cpu_gemm-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:  # build aside, then move: concurrent builds are safe
        out = Path(tmp) / target.name
        try:
            done = subprocess.run([cc, *FLAGS, "-o", str(out), str(SOURCE)], capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return None
        if done.returncode != 0 or not out.exists():
            return None
        os.replace(out, target)
    return target


def _load() -> ctypes.CDLL | None:
    global _lib
    if os.environ.get("LMQ_CPU_GEMM", "1") == "0" or platform.system() != "Linux":
        return None
    if _lib is not None:
        return _lib
    directory = _build_dir or Path(tempfile.gettempdir()) / "lmq-kernels"
    with _lock:
        if _lib is None and directory not in _tried:  # one attempt per directory: a failure is not retried
            _tried.add(directory)
            path = _build(directory)
            try:
                lib = ctypes.CDLL(str(path)) if path is not None else None
            except OSError:
                lib = None
            if lib is not None:
                c_long, c_int, ptr = ctypes.c_long, ctypes.c_int, ctypes.c_void_p
                lib.lmq_small_m_gemm.argtypes = [ptr, c_long, ptr, c_long, ptr, c_long, c_int, c_long, c_long,
                                                 c_int, c_int]
                lib.lmq_small_m_gemm.restype = None
                _lib = lib
    return _lib


def available() -> bool:
    """Whether the kernel is built (or can be built now) on this machine."""
    return _load() is not None


def small_m_mm(x: torch.Tensor, w_t: torch.Tensor, out: torch.Tensor, accumulate: bool = False,
               bias: torch.Tensor | None = None, rows: tuple[int, int] = (MIN_ROWS, MAX_ROWS)) -> bool:
    """out (+)= x @ w_t with the small-M kernel (with `bias`: out = bias + x @ w_t, each sum starting from
    the bias); False (nothing computed, `out` untouched) if it cannot run these operands or x's row count
    is outside `rows` (inclusive)."""
    m, k = x.shape
    if not rows[0] <= m <= rows[1]:
        return False
    lib = _load()
    if lib is None:
        return False
    n = w_t.shape[1]
    if (x.dtype != torch.float32 or w_t.dtype != torch.float32 or out.dtype != torch.float32
            or x.device.type != "cpu" or w_t.shape[0] != k or out.shape != (m, n)
            or x.stride(1) != 1 or w_t.stride(1) != 1 or out.stride(1) != 1):
        return False
    if bias is not None:
        out.copy_(bias.expand_as(out))
        accumulate = True
    lib.lmq_small_m_gemm(x.data_ptr(), x.stride(0), w_t.data_ptr(), w_t.stride(0), out.data_ptr(), out.stride(0),
                         m, k, n, int(accumulate), torch.get_num_threads())
    return True
