"""Building lmq's C kernels (gemm.c, attention.c, prefill_attention.c, ops.c,
qgemm.c, step.c, picks.c) into one shared library for a target.

    build_library(directory, march="native") -> Built(path, key, error)

`march` is the compiler's -march: "native" (the host's instruction set: what the engine uses) or a named
target such as "x86-64-v3" (AVX2 + FMA), "x86-64-v4" (AVX-512) or "x86-64" (SSE2: the portable 4-lane
shape), so that a host can build, and where its CPU can, run the variants other hosts get. The kernels pick
their vector width and register blocking from the target's macros (simd.h).

The library goes to `<directory>/cpu_kernels-<key>.so`; `key` hashes the sources, the flags (the target
included), the compiler's version and the CPU's flags, so a different machine, target or source builds its
own (and the calibration kept next to it, see calibration.py, is keyed the same). Built aside and moved
into place, so that concurrent builds are safe. A failure returns `path=None` and the reason in `error`
(no compiler, the compiler's own messages, a timeout); it never raises.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = [HERE / name for name in ("gemm.c", "attention.c", "prefill_attention.c", "ops.c",
                                    "qgemm.c", "step.c", "picks.c")]
HEADERS = [HERE / "simd.h"]
FLAGS = ["-O3", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-Wno-psabi"]


@dataclass(frozen=True)
class Built:
    """A build's outcome: the library's path (None when it failed), its key, and why it failed."""
    path: Path | None
    key: str
    error: str | None = None


def compiler() -> str | None:
    """The C compiler: $CC, else `cc` or `gcc` on the PATH; None without one."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cpu_flags() -> str:
    """The CPU's feature flags (x86 `flags`, ARM `Features` of /proc/cpuinfo), else the processor's name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def isa() -> str:
    """The host's vector instruction set as the kernels see it with -march=native: "avx512", "avx2",
    "neon", or "generic"."""
    flags = set(cpu_flags().split())
    if "avx512f" in flags:
        return "avx512"
    if "avx2" in flags and "fma" in flags:
        return "avx2"
    if "asimd" in flags or platform.machine() in ("aarch64", "arm64"):
        return "neon"
    return "generic"


def target_flags(march: str) -> list[str]:
    return [f"-march={march}"]


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def build_library(directory: Path, march: str = "native", defines: tuple[str, ...] = (),
                  sources: Path | None = None) -> Built:
    """Build (or find already built) the library for `march` under `directory`; `defines` are extra -D
    flags (measurements of other blockings), `sources` another folder holding the same files (a
    benchmark's older kernel)."""
    src = Path(sources) if sources is not None else HERE
    files, headers = [src / f.name for f in SOURCES], [src / h.name for h in HEADERS]
    cc = compiler()
    if cc is None:
        return Built(None, "", "no C compiler (set CC, or install gcc)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return Built(None, "", f"{cc} --version failed: {e}")
    flags = [*FLAGS, *target_flags(march), *(f"-D{d}" for d in defines)]
    try:
        texts = [s.read_text() for s in files + headers]
    except OSError as e:
        return Built(None, "", f"cannot read the kernels' sources: {e}")
    key = hashlib.sha256("\0".join([*texts, " ".join(flags), version, cpu_flags()]).encode()).hexdigest()[:16]
    target = Path(directory) / f"cpu_kernels-{key}.so"
    if target.exists():
        return Built(target, key)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # build aside, then move into place
            out = Path(tmp) / target.name
            cmd = [cc, *flags, "-I", str(src), "-o", str(out), *map(str, files)]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
            except subprocess.TimeoutExpired:
                return Built(None, key, f"{' '.join(cmd)}: timed out")
            if done.returncode != 0 or not out.exists():
                return Built(None, key, f"{' '.join(cmd)} exited {done.returncode}:\n{_tail(done.stderr)}")
            os.replace(out, target)
    except OSError as e:
        return Built(None, key, f"building in {target.parent}: {e}")
    return Built(target, key)
