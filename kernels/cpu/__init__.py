"""lmq's CPU kernels, in C: built once per machine with its C compiler into one library, called through ctypes.

    small_m_mm(x, w_t, out, accumulate=False, bias=None) -> bool     out (+)= x @ w_t      (gemm.c)
    quantized_mm(x, q, scale, zero, out, accumulate=False) -> bool   out (+)= x @ W^T, W int8/int4 (qgemm.c,
    dequantize(q, scale, zero, out) -> bool                          out = W as float32    via quantized.py)
    attention(q, k, v, table, start, out, scale) -> bool             one query a row, GQA (attention.c)
    prefill_attention(q, k, v, table, start, new, end, out, scale)   T new tokens a row, causal GQA
                                                                     (prefill_attention.c)
    rmsnorm(x, w, eps, out), silu_mul(gu, out), rope_append(...) -> bool   the step's small ops (ops.c)
    masked_argmax(logits, masks, out) -> bool                        a step's greedy picks (picks.c)

`small_m_mm`: `x` [M, K] and `out` [M, N] float32 with contiguous rows, `w_t` [K, N] float32 contiguous (a
Linear weight stored K-major, transposed). `attention`: float32 q [B, Hq, D], k and v [slots, Hkv, D] (one layer
of the paged K/V store, any strides but the last) read through int32 page tables [B, S], out [B, Hq, D];
row b attends to columns [start[b], S). The small
ops take float32 rows with a contiguous last dimension (see each). Each returns False, computing nothing,
when it cannot run (no C compiler, a failed build, not Linux, LMQ_CPU_KERNELS=0, operands it does not take,
a row count outside its range) or where torch's counterpart is the faster on this machine: the caller then
uses torch.

Which of the two runs is decided by measurement (calibration.py): the first call of an op on a class
of operands (thread count, row bucket, size classes) times lmq's kernel against torch's on representative
operands (benches.py) and keeps the faster; the choice is cached in a JSON file next to the library.
`LMQ_CPU_KERNELS`: `auto` (the default) calibrated, `1` lmq's kernels wherever they take the operands, `0`
torch everywhere. `choose(op, shape_class, bench)` applies the same rule to another op; `choices()` lists
what was chosen.

The library (build.py) goes to `<build_dir>/cpu_kernels-<key>.so`, the key covering the sources, the
flags, the target, the compiler's version and the CPU's flags, so a different machine or source builds its
own. The engine's library is built for the host (-march=native: AVX-512, AVX2+FMA, NEON or generic
vectors, see simd.h; `LMQ_CPU_MARCH` names another target); `build(march)` builds another target's
variant (tests run the AVX2 one on any x86-64-v3 host), `use(kernels)` runs the module's functions on it.
When the library cannot be built or loaded, one line is logged (`build_error()` says why) and torch runs
every op.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import tempfile
import threading
from pathlib import Path
from typing import Iterator

import torch

from . import benches as _benches
from .build import build_library, isa
from .calibration import Bench, Calibration

__all__ = ["small_m_mm", "quantized_mm", "dequantize", "quantized_layout_ok", "attention", "prefill_attention",
           "rmsnorm", "silu_mul", "rope_append", "masked_argmax", "available", "build", "build_error", "use", "mode",
           "choose", "choices", "configure", "isa", "target", "gemm_shape"]

log = logging.getLogger("lmq_kernels.cpu")

# The rows the float32 GEMM takes (calibration then decides per row bucket whether it or BLAS runs them): up
# to 1,024. Over panel-major weights it keeps up with a blocked BLAS GEMM to about that many rows on
# SmolLM2's shapes, and a prefill's rows then get the decode step's FMA chains; over K-major weights BLAS is
# the faster at many rows: calibration picks.
MIN_ROWS, GEMM_MAX_ROWS = 1, 1024

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_calibration: Calibration | None = None
_tried: dict[tuple[Path, str], tuple[ctypes.CDLL | None, str | None, str]] = {}  # (dir, march) -> lib, error, key
_build_dir: Path | None = None
_override: ctypes.CDLL | None = None        # use(): the module's functions run this library, uncalibrated
_local = threading.local()                  # .forced: a calibration is timing lmq's side


def configure(build_dir: Path) -> None:
    """Where the shared library is built and kept (the engine passes lmq's cache directory)."""
    global _build_dir
    _build_dir = Path(build_dir)


def mode() -> str:
    """LMQ_CPU_KERNELS: "0" (torch everywhere), "1" (lmq's kernels wherever they take the operands) or
    "auto" (the default, and any other value: calibrated)."""
    value = os.environ.get("LMQ_CPU_KERNELS", "auto")
    return value if value in ("0", "1") else "auto"


def target() -> str:
    """The compiler target of the engine's library: `LMQ_CPU_MARCH` (say "x86-64-v3", to run the AVX2
    variant end to end on an AVX-512 host and measure it), else "native" (the host's own instruction set)."""
    return os.environ.get("LMQ_CPU_MARCH") or "native"


def _directory() -> Path:
    return _build_dir or Path(tempfile.gettempdir()) / "lmq-kernels"


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    c_long, c_int, ptr = ctypes.c_long, ctypes.c_int, ctypes.c_void_p
    lib.lmq_small_m_gemm.argtypes = [ptr, c_long, ptr, c_long, ptr, c_long, c_int, c_long, c_long,
                                     c_int, c_int]
    lib.lmq_small_m_gemm.restype = None
    lib.lmq_small_m_gemm_panels.argtypes = lib.lmq_small_m_gemm.argtypes
    lib.lmq_small_m_gemm_panels.restype = None
    lib.lmq_attention.argtypes = [ptr, c_long, c_long, ptr, c_long, c_long, ptr, c_long, c_long,
                                  ptr, c_long, ptr, ptr, c_long, c_long,
                                  c_int, c_int, c_int, c_long, c_int, ctypes.c_float, c_int]
    lib.lmq_attention.restype = None
    lib.lmq_prefill_attention.argtypes = [ptr, c_long, c_long, ptr, c_long, c_long, ptr, c_long, c_long,
                                          ptr, c_long, ptr, ptr, c_long, c_int, c_int, ptr, c_long, c_long,
                                          c_int, c_int, c_int, ctypes.c_float, c_int]
    lib.lmq_prefill_attention.restype = None
    f32 = ctypes.c_float
    lib.lmq_rmsnorm.argtypes = [ptr, c_long, ptr, ptr, c_long, c_int, c_int, f32, c_int]
    lib.lmq_silu_mul.argtypes = [ptr, c_long, ptr, c_long, c_int, c_int, c_int]
    lib.lmq_rope_append.argtypes = [ptr, c_long, ptr, ptr, ptr, ptr, ptr, f32, ptr, c_long, c_long,
                                    ptr, c_long, c_long, ptr, c_long, c_long, ptr, c_long,
                                    c_long, c_int, c_long, c_int, c_int, c_int, c_int, c_int]
    for f in (lib.lmq_rmsnorm, lib.lmq_silu_mul, lib.lmq_rope_append):
        f.restype = None
    for f in (lib.lmq_qgemm_i8, lib.lmq_qgemm_i4):
        f.argtypes = [ptr, c_long, ptr, ptr, *([ptr] if f is lib.lmq_qgemm_i4 else []), ptr, c_long,
                      c_int, c_long, c_long, c_int, c_int]
        f.restype = None
    lib.lmq_dequant_i8.argtypes = [ptr, ptr, ptr, c_long, c_long, c_int, c_int]
    lib.lmq_dequant_i4.argtypes = [ptr, ptr, ptr, ptr, c_long, c_long, c_int, c_int]
    lib.lmq_dequant_i8.restype = lib.lmq_dequant_i4.restype = None
    lib.lmq_masked_argmax.argtypes = [ptr, c_long, ptr, c_int, c_long, ptr, c_int]
    lib.lmq_masked_argmax.restype = None
    lib.lmq_gemm_shape.argtypes = [ptr]
    lib.lmq_gemm_shape.restype = None
    return lib


def _build_and_open(march: str, directory: Path | None = None) -> tuple[ctypes.CDLL | None, str | None, str]:
    """(library, error, key) for `march` under `directory`, built at most once a process (a failure is not
    retried)."""
    where = (Path(directory) if directory is not None else _directory(), march)
    with _lock:
        if where not in _tried:
            if platform.system() != "Linux":
                _tried[where] = (None, f"not Linux ({platform.system()})", "")
            else:
                built = build_library(where[0], march)
                lib, error = None, built.error
                if built.path is not None:
                    try:
                        lib = _bind(ctypes.CDLL(str(built.path)))
                    except (OSError, AttributeError) as e:
                        error = f"loading {built.path}: {e}"
                _tried[where] = (lib, error, built.key)
        return _tried[where]


def build(march: str = "native", directory: Path | None = None) -> ctypes.CDLL | None:
    """The kernels built for `march` ("native", or a compiler target such as "x86-64-v3"), None when the
    build or the load failed (`build_error(march)` says why). A library built for an instruction set this
    CPU lacks loads, but its functions must not be called here."""
    return _build_and_open(march, directory)[0]


def build_error(march: str = "native", directory: Path | None = None) -> str | None:
    """Why the kernels for `march` could not be built or loaded (None: they were)."""
    return _build_and_open(march, directory)[1]


def gemm_shape(kernels: ctypes.CDLL) -> dict[str, int]:
    """The GEMM's blocking in a built library: vector lanes, rows and vectors per register block, registers, and
    the block over panels at more than 4 rows (gemm.c)."""
    out = (ctypes.c_int * 6)()
    kernels.lmq_gemm_shape(out)
    return dict(zip(("lanes", "rows", "vectors", "registers", "rows_many", "vectors_many"), out))


def _load() -> ctypes.CDLL | None:
    global _lib, _calibration
    if _override is not None:
        return _override
    if mode() == "0":
        return None
    if _lib is not None:
        return _lib
    directory = _directory()
    first = (directory, target()) not in _tried
    lib, error, key = _build_and_open(target())
    if lib is None:
        if first:
            log.warning("lmq: CPU kernels unavailable, torch runs every CPU op: %s", (error or "").splitlines()[0])
        return None
    with _lock:
        if _lib is None:
            # keyed by the library and by what the calibration times (benches.py): a changed benchmark
            # measures again
            _calibration = Calibration(directory / f"cpu_kernels-{key}.calibration.json", f"{key}-{_benches_key()}")
            _lib = lib
    return _lib


def _benches_key() -> str:
    try:
        return hashlib.sha256(Path(_benches.__file__).read_bytes()).hexdigest()[:8]
    except OSError:
        return ""


def available() -> bool:
    """Whether the kernels are built (or can be built now) on this machine."""
    return _load() is not None


@contextlib.contextmanager
def use(kernels: ctypes.CDLL) -> Iterator[None]:
    """Within the block, the module's functions run `kernels` (from `build`), wherever they take the
    operands: no calibration, whatever LMQ_CPU_KERNELS says (tests and benchmarks of a variant)."""
    global _override
    before, _override = _override, kernels
    try:
        yield
    finally:
        _override = before


def choose(op: str, shape_class: tuple, bench: Bench) -> bool:
    """Whether lmq's kernel runs `op` on operands of `shape_class`: always under LMQ_CPU_KERNELS=1 or `use`,
    else the calibration's choice (measured with `bench` on first sight, see calibration.py). Only
    meaningful once the library loaded (`available()`)."""
    if _override is not None or getattr(_local, "forced", False) or mode() == "1":
        return True
    return _calibration is not None and _calibration.choose(op, shape_class, bench)


def choices(used: bool = False) -> dict[str, dict]:
    """The calibration's choices on this machine ("op/class" -> {"use": "lmq" | "torch", timings}); `used`:
    only those this process asked for."""
    return _calibration.choices(used) if _calibration is not None else {}


def _forced(fn):
    """`fn` with the calibration bypassed: what a calibration times as lmq's side."""
    def run(*args, **kwargs):
        _local.forced = True
        try:
            return fn(*args, **kwargs)
        finally:
            _local.forced = False
    return run


def _up(n: int) -> int:
    """The power of two at or above n: the size classes of the calibration."""
    return 1 << max(0, int(n) - 1).bit_length()


def small_m_mm(x: torch.Tensor, w_t: torch.Tensor, out: torch.Tensor, accumulate: bool = False,
               bias: torch.Tensor | None = None, rows: tuple[int, int] = (MIN_ROWS, GEMM_MAX_ROWS),
               panels: torch.Tensor | None = None) -> bool:
    """out (+)= x @ w_t with the small-M kernel (with `bias`: out = bias + x @ w_t, each sum starting from
    the bias); False (nothing computed, `out` untouched) if it cannot run these operands or x's row count
    is outside `rows` (inclusive). `panels`: w_t's panel-major copy (`cpu_step.panel_major`), read instead
    where given (the same bits; two threads stream it faster than the K-major rows)."""
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
    threads = torch.get_num_threads()
    p = panels.shape[2] if panels is not None and panels.dim() == 3 else 0
    if p and not (panels.shape == (n // p, k, p) and n % p == 0 and panels.is_contiguous()
                  and panels.dtype == torch.float32):
        p = 0
    # the panels' own class: they stream faster than the K-major rows, so they win classes those lose
    if not choose("gemm_panels" if p else "gemm", (threads, _up(m), _up(k), _up(n)),
                  lambda: _benches.gemm(_forced(small_m_mm), _up(m), k, n, panel=p)):
        return False
    if bias is not None:
        out.copy_(bias.expand_as(out))
        accumulate = True
    if p:
        lib.lmq_small_m_gemm_panels(x.data_ptr(), x.stride(0), panels.data_ptr(), panels.shape[2], out.data_ptr(),
                                    out.stride(0), m, k, n, int(accumulate), threads)
        return True
    lib.lmq_small_m_gemm(x.data_ptr(), x.stride(0), w_t.data_ptr(), w_t.stride(0), out.data_ptr(), out.stride(0),
                         m, k, n, int(accumulate), threads)
    return True


def _rows_ok(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor) -> bool:
    """out = w * (x * rsqrt(mean(x^2) + eps)) for the rows of x [M, N] (HF's RMSNorm in float32)."""
    lib = _load()
    if lib is None or x.dim() != 2 or out.shape != x.shape or w.shape != x.shape[1:] or not w.is_contiguous() \
            or not _rows_ok(x, w, out):
        return False
    m, n = x.shape
    if not choose("rmsnorm", (torch.get_num_threads(), _up(m), _up(n)),
                  lambda: _benches.rmsnorm(_forced(rmsnorm), _up(m), n)):
        return False
    lib.lmq_rmsnorm(x.data_ptr(), x.stride(0), w.data_ptr(), out.data_ptr(), out.stride(0), x.shape[0], x.shape[1],
                    float(eps), torch.get_num_threads())
    return True


def silu_mul(gu: torch.Tensor, out: torch.Tensor) -> bool:
    """out = silu(gu[:, :I]) * gu[:, I:] for gu [M, 2 I], out [M, I]."""
    lib = _load()
    if lib is None or gu.dim() != 2 or out.dim() != 2 or gu.shape != (out.shape[0], 2 * out.shape[1]) \
            or not _rows_ok(gu, out):
        return False
    m, i = out.shape
    if not choose("silu_mul", (torch.get_num_threads(), _up(m), _up(i)),
                  lambda: _benches.silu_mul(_forced(silu_mul), _up(m), i)):
        return False
    lib.lmq_silu_mul(gu.data_ptr(), gu.stride(0), out.data_ptr(), out.stride(0), out.shape[0], out.shape[1],
                     torch.get_num_threads())
    return True


def rope_append(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float, q: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, tokens: int, end: int,
                nrows: int) -> bool:
    """The fused step's RoPE + K/V append (the contract of its Triton kernel, `_rope_append_kernel`): qkv
    [N, (Hq + 2 Hkv) D] holds N = rows x `tokens` tokens, row-major; q [N, Hq, D] gets rope(qnorm(q)); token
    t of row b writes rope(knorm(k)) and v to the store's k_cache/v_cache [slots, Hkv, D] at the slot of
    column end - (tokens - 1) + t of its page table (`table` int32 [rows, S], unit column stride), unless its
    position (int32 [N]) is negative or b >= nrows. cos, sin [N, D/2]: RoPE's angles per token (rotate-half)."""
    lib = _load()
    if lib is None:
        return False
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    norms = [x for x in (q_norm, k_norm) if x is not None]
    if (qkv.shape != (n, (hq + 2 * hkv) * d) or cos.shape != (n, d // 2) or sin.shape != cos.shape
            or not cos.is_contiguous() or not sin.is_contiguous() or positions.dtype != torch.int32
            or positions.numel() < n or not positions.is_contiguous() or v_cache.shape != k_cache.shape
            or k_cache.dim() != 3 or k_cache.shape[2] != d or (q_norm is None) != (k_norm is None)
            or table.dtype != torch.int32 or table.dim() != 2 or table.stride(1) != 1
            or not all(x.shape == (d,) and x.is_contiguous() for x in norms)
            or q.stride(2) != 1 or not _rows_ok(qkv, cos, sin, q, k_cache, v_cache, *norms)):
        return False
    if not choose("rope_append", (torch.get_num_threads(), _up(n), hq, hkv, d, int(bool(norms)), int(tokens > 1)),
                  lambda: _benches.rope_append(_forced(rope_append), _up(n), hq, hkv, d, bool(norms))):
        return False
    lib.lmq_rope_append(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                        q_norm.data_ptr() if q_norm is not None else None,
                        k_norm.data_ptr() if k_norm is not None else None, float(eps),
                        q.data_ptr(), q.stride(0), q.stride(1),
                        k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                        v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1),
                        table.data_ptr(), table.stride(0),
                        n, tokens, end, nrows, hq, hkv, d, torch.get_num_threads())
    return True


# The attention, pick and quantized ops live in attention.py, picks.py and quantized.py (imported
# last: they read this module's loader and calibration)
from .attention import HEAD_DIMS as ATTENTION_HEAD_DIMS, attention, prefill_attention  # noqa: E402
from .picks import masked_argmax  # noqa: E402
from .quantized import dequantize, layout_ok as quantized_layout_ok, quantized_mm  # noqa: E402
