"""CPU benchmark: lmq's C kernels per instruction set, against torch, and what calibration chose.

1. The host: CPU, ISA the kernels are built for (`cpu.isa()`), the GEMM's blocking, torch, threads, load.
2. The small-M GEMM on SmolLM2-135M's shapes (K x N: 576x1728, 1536x576, 576x576, 576x192, the lm_head
   576x49152, plus the fused step's 576x960 and 576x3072) at M rows: lmq's kernel (this tree's build for the
   host), optionally the kernel of an older commit (`--before REV`: its gemm.c built the same way), and
   torch.mm on the same K-major weights. Weights come from a ring of copies larger than the last-level cache
   (every layer of a decode step reads its own weights cold); the sides alternate call by call; ms, best and
   median of `--reps` calls.
3. The calibration's choices for those classes (LMQ_CPU_KERNELS=auto: measured on first use, cached next to
   the library), and every other choice already in the cache file (the engine's small ops, attention).
4. With `--picks`: a step's greedy picks over 49,152 tokens (SmolLM2's vocabulary) at 1, 8 and 256 rows,
   every token allowed or each row under its own mask: lmq's kernel (`cpu.masked_argmax`) against the
   engine's torch form (where, then argmax), timed as the calibration times them (best of alternating calls).
5. With `--decode`: decode steps of the default model (SmolLM2-135M fp32) through the engine, batch 1 and 8
   concurrent queries (a ~450-token prompt each, 32 new tokens), with LMQ_CPU_KERNELS auto / 1 / 0 and,
   with `--before`, "before" (the older GEMM in this tree's library, every C kernel on, the GEMM at 2-8
   rows: the engine before calibration) alternating in one process for `--rounds` rounds; median ms per
   step (`on_step`), per round.

Run:  python benchmarks/bench_cpu_kernels.py [--before REV] [--rows 1,2,4,8] [--picks] [--decode [--no-gemm]]
          [--threads 2]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads as W  # noqa: E402

from lmq_kernels import cpu  # noqa: E402
from lmq_kernels.cpu import benches as cpu_benches  # noqa: E402
from lmq_kernels.cpu.toolchain import FLAGS, HEADERS, SOURCES, build_library, compiler  # noqa: E402
from lmq_kernels.cpu.calibration import measure_pair as measure  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(576, 1728), (1536, 576), (576, 576), (576, 192), (576, 49152), (576, 960), (576, 3072)]


def host_lines() -> list[str]:
    kernels = cpu.build()
    shape = cpu.gemm_shape(kernels) if kernels is not None else cpu.build_error()
    return [f"date {datetime.datetime.now().isoformat(timespec='minutes')}, command: {' '.join(sys.argv)}",
            f"host {W.cpu_host()}, load average "
            f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}",
            f"GEMM blocking {shape}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"LMQ_CPU_KERNELS={os.environ.get('LMQ_CPU_KERNELS', 'auto')}"]


def old_gemm(rev: str):
    """lmq_small_m_gemm of commit `rev` (same signature; or of the gemm.c in the folder `rev`), built like
    the library (-march=native)."""
    tmp = Path(tempfile.mkdtemp(prefix="lmq-before-"))
    for name in ("gemm.c", "simd.h"):
        if Path(rev).is_dir():
            if (Path(rev) / name).exists():
                (tmp / name).write_text((Path(rev) / name).read_text())
            continue
        done = subprocess.run(["git", "show", f"{rev}:kernels/cpu/{name}"], cwd=ROOT, capture_output=True, text=True)
        if done.returncode == 0:
            (tmp / name).write_text(done.stdout)
    out = tmp / "gemm.so"
    subprocess.run([compiler(), *FLAGS, "-march=native", "-o", str(out), str(tmp / "gemm.c")], check=True)
    f = ctypes.CDLL(str(out)).lmq_small_m_gemm
    c_long, c_int, ptr = ctypes.c_long, ctypes.c_int, ctypes.c_void_p
    f.argtypes = [ptr, c_long, ptr, c_long, ptr, c_long, c_int, c_long, c_long, c_int, c_int]

    def run(x, w, out_):
        f(x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), out_.data_ptr(), out_.stride(0), x.shape[0],
          x.shape[1], w.shape[1], 0, torch.get_num_threads())
    return run


def old_library(rev: str):
    """The whole library with commit `rev`'s gemm.c (or the folder `rev`'s) and this tree's other
    sources, None if it does not build."""
    tmp = Path(tempfile.mkdtemp(prefix="lmq-before-lib-"))
    for f in SOURCES + HEADERS:
        (tmp / f.name).write_text(f.read_text())
    if Path(rev).is_dir():
        (tmp / "gemm.c").write_text((Path(rev) / "gemm.c").read_text())
    else:
        (tmp / "gemm.c").write_text(subprocess.run(["git", "show", f"{rev}:kernels/cpu/gemm.c"], cwd=ROOT,
                                                       capture_output=True, text=True, check=True).stdout)
    built = build_library(tmp / "out", sources=tmp)
    if built.path is None:
        print("the older library did not build:", built.error)
        return None
    lib = ctypes.CDLL(str(built.path))
    for name in ("lmq_small_m_gemm", "lmq_attention", "lmq_rmsnorm", "lmq_silu_mul", "lmq_rope_append"):
        getattr(lib, name).argtypes = getattr(cpu.build(), name).argtypes
        getattr(lib, name).restype = None
    return lib


@contextlib.contextmanager
def old_behaviour(lib):
    """The engine as it was before calibration: `lib`'s kernels everywhere they took the operands, the GEMM
    at 2-8 rows only (BLAS at one row and above 8)."""
    real = cpu.small_m_mm

    def small_m_mm(x, *args, **kwargs):
        return 2 <= x.shape[0] <= 8 and real(x, *args, **kwargs)

    cpu.small_m_mm = small_m_mm
    try:
        with cpu.use(lib):
            yield
    finally:
        cpu.small_m_mm = real


def bench_gemm(rows: list[int], reps: int, before) -> None:
    lmq = cpu.build(cpu.target())  # the engine's target (LMQ_CPU_MARCH)
    # one thread: the calling thread's CPU time (steady on a shared machine: time spent descheduled is not
    # counted, memory stalls are); more: wall time
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    print(f"\nsmall-M GEMM, ms (best / median, {clock.__name__}), weights cold from a ring of",
          cpu_benches.RING_BYTES >> 20, "MB")
    print(f"{'K x N':>11} {'M':>3} | {'lmq':>15} | {'before':>15} | {'torch.mm':>15} | torch/lmq  before/lmq")
    for k, n in SHAPES:
        ring = cpu_benches._ring((k, n))
        for m in rows:
            x, out = torch.randn(m, k), torch.empty(m, n)
            sides = {"lmq": None, "before": before, "torch": None}
            times = {s: [] for s, f in sides.items() if s != "before" or f is not None}
            i = 0
            count = max(4, reps // 8) if n > 10000 else reps
            with cpu.use(lmq):
                for r in range(count + 1):
                    order = list(times) if r % 2 == 0 else list(reversed(times))
                    for side in order:
                        w = ring[i % ring.shape[0]]
                        i += 1
                        t0 = clock()
                        if side == "lmq":
                            cpu.small_m_mm(x, w, out, rows=(1, 64))
                        elif side == "before":
                            before(x, w, out)
                        else:
                            torch.mm(x, w, out=out)
                        if r:  # the first round warms up
                            times[side].append(clock() - t0)
            cell = {s: f"{min(t) * 1e3:7.3f}/{statistics.median(t) * 1e3:7.3f}" for s, t in times.items()}
            best = {s: min(t) for s, t in times.items()}
            ratio_b = f"{best['before'] / best['lmq']:9.2f}" if "before" in best else ""
            print(f"{k:>5}x{n:<5} {m:>3} | {cell['lmq']} | {cell.get('before', '-'):>15} | {cell['torch']} | "
                  f"{best['torch'] / best['lmq']:9.2f} {ratio_b}", flush=True)
        del ring


def bench_picks() -> None:
    lmq = cpu.build(cpu.target())  # the engine's target (LMQ_CPU_MARCH)
    print("\ngreedy picks over 49,152 tokens, ms (best, as calibration times them: cpu_calibration.measure): "
          "lmq's kernel | torch's where + argmax | torch/lmq")
    for rows in (1, 8, 256):
        for masked in (False, True):
            with cpu.use(lmq):
                lmq_s, torch_s, _, _ = measure(*cpu_benches.masked_argmax(cpu.masked_argmax, rows, 49152, masked))
            print(f"  {rows:>3} rows, {'own masks' if masked else 'no mask  '} | {lmq_s * 1e3:7.3f} | "
                  f"{torch_s * 1e3:7.3f} | {torch_s / lmq_s:5.1f}", flush=True)


def calibrate(rows: list[int]) -> None:
    os.environ.setdefault("LMQ_CPU_KERNELS", "auto")
    if not cpu.available():
        print("\nno kernels:", cpu.build_error())
        return
    start = time.perf_counter()
    for k, n in SHAPES:
        w = torch.randn(k, n)
        for m in rows:
            cpu.small_m_mm(torch.randn(m, k), w, torch.empty(m, n))
    spent = time.perf_counter() - start
    print(f"\ncalibration choices of the GEMM ({spent:.1f} s for what was not cached yet):")
    print_choices()


def print_choices() -> None:
    """The choices this process used ("op/threads/row bucket/size classes"; unsettled: measured on a busy
    machine, measured again by the next process)."""
    for name, e in cpu.choices(used=True).items():
        note = "" if e.get("stable", True) else f"  (unsettled, load {e.get('load')})"
        print(f"  {name:<30} lmq {e['lmq_us']:>9.1f} us  torch {e['torch_us']:>9.1f} us  -> {e['use']}{note}")


def bench_decode(rounds: int, before_lib=None) -> None:
    import lmq_backend as lmq
    from lmq_backend.backend.default_model import default_model_dir

    backend = lmq.HFBackend(str(default_model_dir()), name="bench-cpu")
    shots, reviews = W.w1_shots(16), W.w1_reviews(8)
    q = lmq.Query('"{shots}Review: {review}\\nA reply to this review:[R]" where len(TOKENS(R)) < 33', model=backend)
    steps: list = []
    backend.on_step(steps.append)

    async def run(b: int):
        await asyncio.gather(*(q.run({"shots": shots, "review": r}) for r in reviews[:b]))

    print(f"\ndecode steps, SmolLM2-135M fp32, ~{len(backend.tokenizer(shots).input_ids) + 20}-token rows, "
          "median ms per step (one line per round; modes alternate)")
    for r in range(rounds):
        line = []
        for b in (1, 8):
            for mode in ("auto", "1", "0") + (("before",) if before_lib is not None else ()):
                os.environ["LMQ_CPU_KERNELS"] = "1" if mode == "before" else mode
                steps.clear()
                with old_behaviour(before_lib) if mode == "before" else contextlib.nullcontext():
                    asyncio.run(run(b))
                t = [s.seconds for s in steps if s.kind == "decode" and s.batch_size == b]
                line.append(f"B={b} {mode:>6}: {statistics.median(t) * 1e3:6.1f}" if t else f"B={b} {mode}: -")
        print("  " + " | ".join(line), flush=True)
    os.environ["LMQ_CPU_KERNELS"] = "auto"
    print("calibration choices used (GEMM and the step's other ops):")
    print_choices()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", help="a commit (or a folder) whose gemm.c to compare with")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--picks", action="store_true", help="the greedy picks' kernel against torch's")
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--no-gemm", action="store_true", help="skip the GEMM table and its calibration")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    try:  # the engine's build and calibration directory
        from lmq_backend.paths import cache_dir
        cpu.configure(cache_dir() / "kernels")
    except ImportError:  # lmq_backend's dependencies missing: a directory of the kernels' own
        pass
    rows = [int(m) for m in args.rows.split(",")]
    print("\n".join(host_lines()))
    if not args.no_gemm:
        bench_gemm(rows, args.reps, old_gemm(args.before) if args.before else None)
        calibrate(rows)
    if args.picks:
        bench_picks()
    if args.decode:
        bench_decode(args.rounds, old_library(args.before) if args.before else None)


if __name__ == "__main__":
    main()
