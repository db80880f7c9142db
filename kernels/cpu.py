"""lmq's CPU kernels, in C: built once per machine with its C compiler into one library, called through ctypes.

    small_m_mm(x, w_t, out, accumulate=False, bias=None) -> bool     out (+)= x @ w_t      (cpu_gemm.c)
    attention(q, k, v, start, out, scale) -> bool                    one query a row, GQA (cpu_attention.c)
    rmsnorm(x, w, eps, out), silu_mul(gu, out), rope_append(...) -> bool   the step's small ops (cpu_ops.c)

`small_m_mm`: `x` [M, K] and `out` [M, N] float32 with contiguous rows, `w_t` [K, N] float32 contiguous (a
Linear weight stored K-major, transposed). `attention`: float32 q [B, Hq, D], k and v [B, Hkv, S, D] (the
KV pool's views, any strides but the last), out [B, Hq, D]; row b attends to columns [start[b], S). The small
ops take float32 rows with a contiguous last dimension (see each). Each returns False, computing nothing,
when it cannot run (no C compiler, a failed build, not Linux, LMQ_CPU_KERNELS=0, operands it does not take,
a row count outside its range): the caller then uses torch.

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

SOURCES = [Path(__file__).with_name(name) for name in ("cpu_gemm.c", "cpu_attention.c", "cpu_ops.c")]
HEADERS = [Path(__file__).with_name("cpu_simd.h")]
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
    key = hashlib.sha256("\0".join([*(s.read_text() for s in SOURCES + HEADERS), " ".join(FLAGS), version,
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
                f32 = ctypes.c_float
                lib.lmq_rmsnorm.argtypes = [ptr, c_long, ptr, ptr, c_long, c_int, c_int, f32]
                lib.lmq_silu_mul.argtypes = [ptr, c_long, ptr, c_long, c_int, c_int]
                lib.lmq_rope_append.argtypes = [ptr, c_long, ptr, ptr, ptr, ptr, ptr, f32, ptr, c_long, c_long,
                                                ptr, c_long, c_long, c_long, ptr, c_long, c_long, c_long,
                                                c_long, c_int, c_long, c_int, c_int, c_int, c_int, c_int]
                for f in (lib.lmq_rmsnorm, lib.lmq_silu_mul, lib.lmq_rope_append):
                    f.restype = None
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


def _rows_ok(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor) -> bool:
    """out = w * (x * rsqrt(mean(x^2) + eps)) for the rows of x [M, N] (HF's RMSNorm in float32)."""
    lib = _load()
    if lib is None or x.dim() != 2 or out.shape != x.shape or w.shape != x.shape[1:] or not w.is_contiguous() \
            or not _rows_ok(x, w, out):
        return False
    lib.lmq_rmsnorm(x.data_ptr(), x.stride(0), w.data_ptr(), out.data_ptr(), out.stride(0), x.shape[0], x.shape[1],
                    float(eps))
    return True


def silu_mul(gu: torch.Tensor, out: torch.Tensor) -> bool:
    """out = silu(gu[:, :I]) * gu[:, I:] for gu [M, 2 I], out [M, I]."""
    lib = _load()
    if lib is None or gu.dim() != 2 or out.dim() != 2 or gu.shape != (out.shape[0], 2 * out.shape[1]) \
            or not _rows_ok(gu, out):
        return False
    lib.lmq_silu_mul(gu.data_ptr(), gu.stride(0), out.data_ptr(), out.stride(0), out.shape[0], out.shape[1])
    return True


def rope_append(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float, q: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, tokens: int, end: int, nrows: int) -> bool:
    """The fused step's RoPE + K/V append (the contract of its Triton kernel, `_rope_append_kernel`): qkv
    [N, (Hq + 2 Hkv) D] holds N = rows x `tokens` tokens, row-major; q [N, Hq, D] gets rope(qnorm(q)); token
    t of row b writes rope(knorm(k)) and v to k_cache/v_cache [slots, Hkv, S, D] at slot b, column
    end - (tokens - 1) + t, unless its position (int32 [N]) is negative or b >= nrows. cos, sin [N, D/2]:
    RoPE's angles per token (rotate-half)."""
    lib = _load()
    if lib is None:
        return False
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    norms = [x for x in (q_norm, k_norm) if x is not None]
    if (qkv.shape != (n, (hq + 2 * hkv) * d) or cos.shape != (n, d // 2) or sin.shape != cos.shape
            or not cos.is_contiguous() or not sin.is_contiguous() or positions.dtype != torch.int32
            or positions.numel() < n or not positions.is_contiguous() or v_cache.shape != k_cache.shape
            or k_cache.shape[3] != d or (q_norm is None) != (k_norm is None)
            or not all(x.shape == (d,) and x.is_contiguous() for x in norms)
            or q.stride(2) != 1 or not _rows_ok(qkv, cos, sin, q, k_cache, v_cache, *norms)):
        return False
    lib.lmq_rope_append(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                        q_norm.data_ptr() if q_norm is not None else None,
                        k_norm.data_ptr() if k_norm is not None else None, float(eps),
                        q.data_ptr(), q.stride(0), q.stride(1),
                        k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                        v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                        n, tokens, end, nrows, hq, hkv, d, torch.get_num_threads())
    return True
