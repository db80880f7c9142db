"""lmq's CPU kernels, in C: built once per machine with its C compiler into one library, called through ctypes.

    small_m_mm(x, w_t, out, accumulate=False, bias=None) -> bool     out (+)= x @ w_t      (cpu_gemm.c)
    attention(q, k, v, start, out, scale) -> bool                    one query a row, GQA (cpu_attention.c)

`small_m_mm`: `x` [M, K] and `out` [M, N] float32 with contiguous rows, `w_t` [K, N] float32 contiguous (a
Linear weight stored K-major, transposed). `attention`: float32 q [B, Hq, D], k and v [B, Hkv, S, D] (the
KV pool's views, any strides but the last), out [B, Hq, D]; row b attends to columns [start[b], S). Each
returns False, computing nothing, when it cannot run (no C compiler, a failed
build, not Linux, LMQ_CPU_KERNELS=0, operands it does not take, a row count outside its range): the caller
then uses torch.

The shared library goes to `<build_dir>/cpu_kernels-<hash>.so`, the hash covering the sources, the flags,
the compiler's version and the CPU's flags, so a different machine or source builds its own.
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

SOURCES = [Path(__file__).with_name(name) for name in ("cpu_gemm.c", "cpu_attention.c")]
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC"]
# The rows the GEMM takes: BLAS's GEMV is as fast at one row (a single weight stream; the kernel is ~1.5 ms
# slower over SmolLM2-135M's 30 layers), and its blocked GEMM is faster above 8 rows (one pass of the kernel)
MIN_ROWS, MAX_ROWS = 2, 8
# Attention: at least ATTENTION_MIN_ROWS rows (one row is only Hkv tasks, too few to share between the
# threads: torch's attention is as fast there), head dims it is built for
ATTENTION_MIN_ROWS, ATTENTION_HEAD_DIMS = 2, (64, 128, 256)

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
    key = hashlib.sha256("\0".join([*(s.read_text() for s in SOURCES), " ".join(FLAGS), version,
                                    _cpu_flags()]).encode())
    target = directory / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:  # build aside, then move: concurrent builds are safe
        out = Path(tmp) / target.name
        try:
            done = subprocess.run([cc, *FLAGS, "-o", str(out), *map(str, SOURCES)], capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return None
        if done.returncode != 0 or not out.exists():
            return None
        os.replace(out, target)
    return target


def _load() -> ctypes.CDLL | None:
    global _lib
    if os.environ.get("LMQ_CPU_KERNELS", "1") == "0" or platform.system() != "Linux":
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
                lib.lmq_attention.argtypes = [ptr, c_long, c_long, ptr, c_long, c_long, c_long,
                                              ptr, c_long, c_long, c_long, ptr, ptr, c_long, c_long,
                                              c_int, c_int, c_int, c_long, c_int, ctypes.c_float, c_int]
                lib.lmq_attention.restype = None
                _lib = lib
    return _lib


def available() -> bool:
    """Whether the kernels are built (or can be built now) on this machine."""
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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, out: torch.Tensor,
              scale: float) -> bool:
    """out = grouped-query attention of q [B, Hq, D] (one query a row) over k, v [B, Hkv, S, D], row b over
    its columns [start[b], S) (`start` int32 [B], clamped to [0, S]: a row without a column gets zeros);
    out [B, Hq, D]. False (nothing computed) if it cannot run these operands (see the module docstring)."""
    b, hq, d = q.shape
    if b < ATTENTION_MIN_ROWS or d not in ATTENTION_HEAD_DIMS:
        return False
    lib = _load()
    if lib is None:
        return False
    hkv, s = k.shape[1], k.shape[2]
    if (any(x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(-1) != 1 for x in (q, k, v, out))
            or k.shape != (b, hkv, s, d) or v.shape != k.shape or out.shape != q.shape or hq % hkv
            or start.dtype != torch.int32 or start.shape != (b,) or not start.is_contiguous()):
        return False
    lib.lmq_attention(q.data_ptr(), q.stride(0), q.stride(1),
                      k.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
                      v.data_ptr(), v.stride(0), v.stride(1), v.stride(2),
                      start.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1),
                      b, hq, hkv, s, d, float(scale), torch.get_num_threads())
    return True
