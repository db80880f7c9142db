"""The process's CPU kernel library: built once per machine, loaded once per process, and the calibration
that decides, per op and class of operands, whether lmq's kernel or torch's runs.

    configure(build_dir)            where the library and its calibration file are kept
    load() -> CDLL | None           the engine's library (built for `target()`), None: torch runs every op
    available() -> bool             whether it loaded
    build(march), build_error(march)  a variant for another target (tests and benchmarks of it)
    use(kernels)                    within the block, the ops run `kernels`, uncalibrated
    choose(op, shape_class, bench) -> bool   lmq's kernel runs `op` on operands of `shape_class`
    warming()                       within the block, `choose` measures what it has not (a warm-up)
    choices(used=False), guesses()  what was measured ("op/class" -> entry), what was met unmeasured

The ops (gemm.py, ops.py, attention.py, picks.py, quantized.py, step.py) call `load()` for the library and
`choose` for the choice, with `size_class` for the classes' sizes, `rows_ok` for their operands and `forced`
for what a calibration times as lmq's side.

`LMQ_CPU_KERNELS` (`mode()`): `auto` (the default) calibrated, `1` lmq's kernels wherever they take the
operands, `0` torch everywhere. The library (toolchain.py) goes to `<build_dir>/cpu_kernels-<key>.so`, the key
covering the sources, the flags, the target, the compiler's version and the CPU's flags; it is built for the
host (-march=native: AVX-512, AVX2+FMA, NEON or generic vectors, see simd.h) unless `LMQ_CPU_MARCH` names
another target. When it cannot be built or loaded, one line is logged (`build_error()` says why) and torch runs
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
from typing import Callable, Iterator

import torch

from . import benches
from .toolchain import build_library
from .calibration import Bench, Calibration, quiet

__all__ = ["configure", "mode", "target", "load", "available", "build", "build_error", "use", "choose",
           "warming", "quiet", "choices", "guesses", "forced", "size_class", "rows_ok"]

log = logging.getLogger("lmq_kernels.cpu")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_calibration: Calibration | None = None
_tried: dict[tuple[Path, str], tuple[ctypes.CDLL | None, str | None, str]] = {}  # (dir, march) -> lib, error, key
_build_dir: Path | None = None
_override: ctypes.CDLL | None = None        # use(): the ops run this library, uncalibrated
_local = threading.local()                  # .forced: a calibration is timing lmq's side; .warming: a warm-up


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


def load() -> ctypes.CDLL | None:
    """The library the ops run: `use`'s where one is in force, else the engine's (built for `target()` on
    first use, with its calibration), None under LMQ_CPU_KERNELS=0 or where it cannot be built."""
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
        return hashlib.sha256(Path(benches.__file__).read_bytes()).hexdigest()[:8]
    except OSError:
        return ""


def available() -> bool:
    """Whether the kernels are built (or can be built now) on this machine."""
    return load() is not None


@contextlib.contextmanager
def use(kernels: ctypes.CDLL) -> Iterator[None]:
    """Within the block, the ops run `kernels` (from `build`), wherever they take the operands: no
    calibration, whatever LMQ_CPU_KERNELS says (tests and benchmarks of a variant)."""
    global _override
    before, _override = _override, kernels
    try:
        yield
    finally:
        _override = before


def choose(op: str, shape_class: tuple, bench: Bench) -> bool:
    """Whether lmq's kernel runs `op` on operands of `shape_class`: always under LMQ_CPU_KERNELS=1 or `use`,
    else the calibration's choice (see calibration.py: measured with `bench` inside `warming`, or where the op
    has no measured class yet; else a class not measured takes its nearest measured neighbour's choice). Only
    meaningful once the library loaded (`available()`)."""
    if _override is not None or getattr(_local, "forced", False) or mode() == "1":
        return True
    return _calibration is not None and _calibration.choose(op, shape_class, bench,
                                                            measure=getattr(_local, "warming", False))


@contextlib.contextmanager
def warming() -> Iterator[None]:
    """Within the block (on this thread), `choose` measures the classes this machine has not measured (and
    those measured on a busy machine, when it is quiet now): a warm-up before any query (warmup.py)."""
    before, _local.warming = getattr(_local, "warming", False), True
    try:
        yield
    finally:
        _local.warming = before


def choices(used: bool = False) -> dict[str, dict]:
    """The calibration's choices on this machine ("op/class" -> {"use": "lmq" | "torch", timings}); `used`:
    only those this process asked for."""
    return _calibration.choices(used) if _calibration is not None else {}


def guesses() -> dict[str, str]:
    """The classes this process's calls met without a measurement ("op/class" -> the measured neighbour
    whose choice each took)."""
    return _calibration.guesses() if _calibration is not None else {}


def forced(fn: Callable) -> Callable:
    """`fn` with the calibration bypassed: what a calibration times as lmq's side."""
    def run(*args, **kwargs):
        _local.forced = True
        try:
            return fn(*args, **kwargs)
        finally:
            _local.forced = False
    return run


def size_class(n: int) -> int:
    """The power of two at or above n: the size classes of the calibration."""
    return 1 << max(0, int(n) - 1).bit_length()


def rows_ok(*tensors) -> bool:
    """Whether every tensor is float32 on the CPU with a contiguous last dimension (the ops' rows)."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)
