"""GPU microbenchmark: lmq's paged attention kernels against FlashInfer's, same shapes, same K/V, same run.

Shapes (bf16, one layer): Llama-3.2-1B's attention (Hq 32, H_kv 8, D 64) and SmolLM2-135M's (Hq 9, H_kv 3,
D 64).

Decode (one query a row) at batch 1, 16, 64 and 256:
  shared    every row a 1,000-token prefix (the same store slots, a trie's pages) and 1-200 tokens of its own
            (the step's new token included), lengths varied
  distinct  every row a context of its own of 1,000-1,200 tokens
  lmq        `lmq_kernels.triton.decode_attention` over the store ``[slots, H_kv, D]`` and the int32 page
             table ``[B, S]`` (page size 1): ``rows=None`` (the engine's default: above a batch size, rows
             sharing a tile read it once) and ``rows=1`` (a row at a time)
  FI decode  FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` over the same store viewed as pages of one
             token (``[slots, 1, H_kv, D]``, NHD; no copy), CUDA-core kernels and ``use_tensor_cores=True``
  FI cascade FlashInfer's ``MultiLevelCascadeAttentionWrapper`` (shared rows only): level 0 the prefix for all
             rows at once, level 1 each row's own tokens, merged
  floor      the K/V bytes a kernel must read once (the prefix once, each row's own tokens once) over the
             device's copy bandwidth measured in this run (bytes read + written per second)
Extend (T new tokens a row attending causally to a shared cached prefix and to themselves; B=2, T=20 after
1,100 tokens; B=8, T=32 and B=256, T=30 after 1,000):
  lmq        `lmq_kernels.triton.prefill_attention`
  FI prefill FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` (causal, page size 1)

Both sides read the same K/V and their outputs are compared (allclose at bf16 tolerance) before timing; a
FlashInfer variant that disagrees or fails is reported and not timed. Times: `triton.testing.do_bench`'s
median of one call, L2 flushed before each call (the K/V come from HBM, as in a decode step whose weights
pass through L2); FlashInfer's plan is done once per shape outside the timing, as a model does once per
step for all its layers. FlashInfer compiles its kernels with nvcc on first use (under
``FLASHINFER_WORKSPACE_BASE``, default /tmp/lmq_flashinfer): the script does that first for every kind at
once (a thread a module) and prints that time apart; a later run on the same machine loads them.

Without FlashInfer the lmq side runs alone. On a CPU, ``--tiny`` under ``TRITON_INTERPRET=1`` runs the lmq
side on small shapes through Triton's interpreter (a check of the script, no timings worth reading).

Run:  python benchmarks/bench_attention_peer.py [--quick] [--model 1b|135m|both] [--no-flashinfer]
      [--fi-backend auto|fa2|fa3]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/lmq_flashinfer")
os.environ.setdefault("TVM_FFI_CACHE_DIR", "/tmp/lmq_flashinfer/tvm-ffi")

import torch  # noqa: E402
import triton  # noqa: E402

from lmq_kernels.triton import decode_attention, decode_attention_reference  # noqa: E402
from lmq_kernels.triton.prefill_attention import prefill_attention, prefill_attention_reference  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import copy_bandwidth  # noqa: E402

MODELS = {"1b": ("Llama-3.2-1B", 32, 8, 64), "135m": ("SmolLM2-135M", 9, 3, 64)}
TOL = dict(atol=2e-2, rtol=2e-2)
WORKSPACE_BYTES = 256 << 20
KINDS = frozenset({"decode", "decode_tc", "cascade", "prefill"})  # FlashInfer's variants (--fi-kinds)


class Skipped(Exception):
    """A FlashInfer kind left out by ``--fi-kinds``."""


def _import_flashinfer():
    """(module, None) or (None, why not)."""
    try:
        import flashinfer
    except Exception as exc:  # ImportError, or a dependency failing at import
        return None, f"{type(exc).__name__}: {exc}"
    return flashinfer, None


@dataclass(slots=True)
class Layout:
    """One layer of a paged K/V store and the rows' page tables, in lmq's form and FlashInfer's.

    k, v: ``[slots, H_kv, D]``; table int32 ``[B, S]`` (row b's columns ``[start[b], end)``, left-padded);
    rows: each row's slots in column order; prefix: the shared slots (None: nothing shared); own: each row's
    slots after the prefix; unique_tokens: slots that any row reads."""
    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor
    start: torch.Tensor
    end: int
    rows: list[torch.Tensor]
    prefix: torch.Tensor | None
    own: list[torch.Tensor]
    unique_tokens: int

    def paged(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The store as FlashInfer's NHD pages of one token, ``[slots, 1, H_kv, D]`` (views, no copy)."""
        return self.k.unsqueeze(1), self.v.unsqueeze(1)


def build_layout(prefix_len: int, own_lens: list[int], H_kv: int, D: int, dtype: torch.dtype,
                 device: torch.device, gen: torch.Generator) -> Layout:
    """Rows of ``prefix_len`` shared tokens then ``own_lens[b]`` tokens of their own. The prefix takes slots
    [0, prefix_len); each row's own tokens take a contiguous run of slots, the runs in a random order of
    rows (a pool's allocations, not one row after another). The rows' order comes from ``gen``, the values
    from the device's (seeded) generator."""
    B = len(own_lens)
    n = prefix_len + sum(own_lens)
    order = torch.randperm(B, generator=gen).tolist()
    offsets, at = [0] * B, prefix_len
    for b in order:
        offsets[b] = at
        at += own_lens[b]
    prefix = torch.arange(prefix_len, dtype=torch.int32) if prefix_len else None
    own = [torch.arange(offsets[b], offsets[b] + own_lens[b], dtype=torch.int32) for b in range(B)]
    rows = [torch.cat([prefix, o]) if prefix is not None else o for o in own]
    end = max(len(r) for r in rows)
    table = torch.zeros(B, end, dtype=torch.int32)
    start = torch.empty(B, dtype=torch.int32)
    for b, r in enumerate(rows):
        table[b, end - len(r):] = r
        start[b] = end - len(r)
    k, v = (torch.randn(n, H_kv, D, device=device).to(dtype) for _ in range(2))  # the device's seeded RNG
    dev = lambda t: t.to(device)  # noqa: E731
    return Layout(k, v, dev(table), dev(start), end, [dev(r) for r in rows],
                  dev(prefix) if prefix is not None else None, [dev(o) for o in own], n)


def _csr(parts: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's (indptr, indices, last_page_len) for rows of one-token pages."""
    lens = torch.tensor([0] + [len(p) for p in parts], dtype=torch.int64)
    indptr = torch.cumsum(lens, 0).to(torch.int32).to(device)
    indices = torch.cat(parts).to(torch.int32).to(device)
    last = torch.ones(len(parts), dtype=torch.int32, device=device)
    return indptr, indices, last


# ---------------------------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_us(fn: Callable[[], object], device: torch.device, quick: bool) -> float:
    """Median microseconds of one call (L2 flushed before each on a GPU; one call on a CPU)."""
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 100,
                                       return_mode="median") * 1e3
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def _why(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def agree(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    """(allclose at bf16 tolerance, max abs difference)."""
    a, b = a.float(), b.float()
    return bool(torch.allclose(a, b, **TOL)), float((a - b).abs().max())


# ------------------------------------------------------------------------------------------ FlashInfer


class Peer:
    """FlashInfer's wrappers, planned for one shape. Every method returns a callable that runs the kernel (the
    plan done), or raises; the first plan of a kind compiles its kernels, timed into ``compile_s``."""

    def __init__(self, fi, device: torch.device, backend: str, kinds: set[str] = KINDS):
        self.fi, self.device, self.backend, self.prefill_backend = fi, device, backend, backend
        self.kinds = kinds                 # the kinds to run, of KINDS
        self.compile_s: dict[str, float] = {}
        self.broken: dict[str, str] = {}   # kind -> why its first call failed (not tried again)

    def warm_up(self, Hq: int, H_kv: int, D: int, gen: torch.Generator, notes: list[str]) -> float:
        """Compile (or load from the workspace) every kind's kernels at once: one thread a module, each build an
        nvcc subprocess. A kind that fails is recorded in ``broken`` and skipped afterwards; a prefill failing
        under the ``auto`` backend is tried once more on ``fa2`` (the module the tensor-core decode builds).
        Returns the wall seconds."""
        dtype = torch.bfloat16
        lay = build_layout(16, [3, 5], H_kv, D, dtype, self.device, gen)
        q = torch.randn(2, Hq, D, device=self.device).to(dtype)
        lay_e = build_layout(16, [4, 4], H_kv, D, dtype, self.device, gen)
        q_e = torch.randn(2, 4, Hq, D, device=self.device).to(dtype)

        def attempt(kind: str, make: Callable[[], object]) -> None:
            if kind not in self.kinds:
                return
            try:
                make()
            except Exception as exc:
                self.broken[kind] = _why(exc)
                text = str(exc).strip()
                print(f"FlashInfer {kind} failed ({type(exc).__name__}), the end of its message:\n"
                      f"{text[-3000:]}", flush=True)

        def prefill_then_cascade() -> None:
            attempt("prefill", lambda: self.prefill(q_e, lay_e))
            if "prefill" in self.broken and self.backend == "auto":
                first = self.broken.pop("prefill")
                self.prefill_backend = "fa2"
                attempt("prefill", lambda: self.prefill(q_e, lay_e))
                notes.append(f"FlashInfer prefill on backend auto failed ({first}); prefill tried on fa2")
            attempt("cascade", lambda: self.cascade(q, lay))

        jobs = [lambda: attempt("decode", lambda: self.decode(q, lay, False)),
                lambda: attempt("decode_tc", lambda: self.decode(q, lay, True)),
                prefill_then_cascade]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(jobs)) as ex:
            for f in [ex.submit(j) for j in jobs]:
                f.result()
        _sync(self.device)
        for kind, why in self.broken.items():
            notes.append(f"FlashInfer {kind}: {why}; not run")
        return time.perf_counter() - t0

    def _workspace(self) -> torch.Tensor:
        return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)

    def _usable(self, name: str) -> None:
        if name not in self.kinds:
            raise Skipped
        if name in self.broken:
            raise RuntimeError(f"its first call failed: {self.broken[name]}")

    def _first(self, name: str, plan: Callable[[], None], run: Callable[[], torch.Tensor]):
        if name in self.compile_s:
            plan()
            return run
        t0 = time.perf_counter()
        plan()
        run()
        _sync(self.device)
        self.compile_s[name] = time.perf_counter() - t0
        return run

    def decode(self, q: torch.Tensor, lay: Layout, tensor_cores: bool):
        self._usable("decode_tc" if tensor_cores else "decode")
        Hq, D, H_kv = q.shape[1], q.shape[2], lay.k.shape[1]
        w = self.fi.BatchDecodeWithPagedKVCacheWrapper(self._workspace(), "NHD", use_tensor_cores=tensor_cores,
                                                       backend=self.backend)
        indptr, indices, last = _csr(lay.rows, self.device)
        kv = lay.paged()
        out = torch.empty_like(q)

        def plan():
            w.plan(indptr, indices, last, Hq, H_kv, D, 1, q_data_type=q.dtype, kv_data_type=lay.k.dtype)

        return self._first("decode_tc" if tensor_cores else "decode", plan, lambda: w.run(q, kv, out=out))

    def cascade(self, q: torch.Tensor, lay: Layout):
        assert lay.prefix is not None
        self._usable("cascade")
        B, Hq, D = q.shape
        H_kv = lay.k.shape[1]
        w = self.fi.MultiLevelCascadeAttentionWrapper(2, self._workspace(), "NHD")
        top = _csr([lay.prefix], self.device)
        bottom = _csr(lay.own, self.device)
        qo = [torch.tensor([0, B], dtype=torch.int32, device=self.device),
              torch.arange(B + 1, dtype=torch.int32, device=self.device)]
        kv = lay.paged()

        def plan():
            w.plan(qo, [top[0], bottom[0]], [top[1], bottom[1]], [top[2], bottom[2]], Hq, H_kv, D, 1,
                   q_data_type=q.dtype, kv_data_type=lay.k.dtype)

        return self._first("cascade", plan, lambda: w.run(q, kv))

    def prefill(self, q: torch.Tensor, lay: Layout):
        self._usable("prefill")
        B, T, Hq, D = q.shape
        H_kv = lay.k.shape[1]
        w = self.fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace(), "NHD", backend=self.prefill_backend)
        indptr, indices, last = _csr(lay.rows, self.device)
        qo = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=self.device)
        kv = lay.paged()
        q2 = q.reshape(B * T, Hq, D)
        out = torch.empty_like(q2)

        def plan():
            w.plan(qo, indptr, indices, last, Hq, H_kv, D, 1, causal=True, q_data_type=q.dtype,
                   kv_data_type=lay.k.dtype)

        return self._first("prefill", plan, lambda: w.run(q2, kv, out=out).view(B, T, Hq, D))


# -------------------------------------------------------------------------------------------- the cases


@dataclass(slots=True)
class DecodeCase:
    model: str
    B: int
    shared: bool


@dataclass(slots=True)
class ExtendCase:
    model: str
    B: int
    T: int
    prefix: int


def decode_cases(models: list[str], quick: bool, tiny: bool) -> list[DecodeCase]:
    batches = [2, 33] if tiny else [1, 64] if quick else [1, 16, 64, 256]
    return [DecodeCase(m, b, s) for m in models for s in (True, False) for b in batches]


def extend_cases(models: list[str], quick: bool, tiny: bool) -> list[ExtendCase]:
    if tiny:
        shapes = [(2, 5, 30), (3, 4, 20)]
    elif quick:
        shapes = [(2, 20, 1100), (256, 30, 1000)]
    else:
        shapes = [(2, 20, 1100), (8, 32, 1000), (256, 30, 1000)]
    return [ExtendCase(m, *s) for m in models for s in shapes]


def _cell(x: float | str | None) -> str:
    if x is None:
        return "-"
    return x if isinstance(x, str) else f"{x:,.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if isinstance(a, float) and isinstance(b, float) and b > 0 else "-"


def _peer_variant(name: str, make: Callable[[], Callable[[], torch.Tensor]], ref: torch.Tensor,
                  reference: Callable[[], torch.Tensor], device: torch.device, quick: bool, notes: list[str],
                  label: str) -> float | str | None:
    """Time one FlashInfer variant after checking it against lmq's output ``ref``: microseconds, or why not.
    On a disagreement both sides are measured against the float32 torch ``reference``."""
    try:
        fn = make()
        got = fn()
        ok, err = agree(got, ref)
    except Skipped:
        return None
    except Exception as exc:
        if not str(exc).startswith("its first call failed"):
            notes.append(f"{label} {name}: {_why(exc)}")
        return "error"
    if not ok:
        exact = reference()
        notes.append(f"{label} {name}: disagrees with lmq (max abs diff {err:.3g}; against the float32 "
                     f"reference lmq {agree(ref, exact)[1]:.3g}, FlashInfer {agree(got, exact)[1]:.3g}); not timed")
        return "differs"
    return time_us(fn, device, quick)


def prepare_decode(case: DecodeCase, device: torch.device, tiny: bool, notes: list[str],
                   gen: torch.Generator) -> Callable[[Peer | None, float | None, bool], list[str]]:
    """Build the case's K/V and run lmq's kernels on it once (their compiles, and the output FlashInfer's is
    checked against); returns the measurement, which gives the table's row."""
    name, Hq, H_kv, D = MODELS[case.model]
    if tiny:
        prefix, own = (40, [int(x) for x in torch.randint(1, 11, (case.B,), generator=gen)]) if case.shared \
            else (0, [int(x) for x in torch.randint(40, 56, (case.B,), generator=gen)])
    elif case.shared:
        prefix, own = 1000, [int(x) for x in torch.randint(1, 201, (case.B,), generator=gen)]
    else:
        prefix, own = 0, [int(x) for x in torch.randint(1000, 1201, (case.B,), generator=gen)]
    lay = build_layout(prefix, own, H_kv, D, torch.bfloat16 if device.type == "cuda" else torch.float32,
                       device, gen)
    q = torch.randn(case.B, Hq, D, device=device).to(lay.k.dtype)
    label = f"{name} B={case.B} " + (f"prefix {prefix} + own {min(own)}-{max(own)}" if case.shared
                                     else f"distinct {min(own)}-{max(own)}")
    out, out1 = torch.empty_like(q), torch.empty_like(q)
    lmq = lambda: decode_attention(q, lay.k, lay.v, lay.start, lay.end, table=lay.table, out=out)  # noqa: E731
    lmq1 = lambda: decode_attention(q, lay.k, lay.v, lay.start, lay.end, table=lay.table, out=out1,  # noqa: E731
                                    rows=1)
    ref = lmq().clone()
    reference = lambda: decode_attention_reference(  # noqa: E731
        q, *(c[lay.table.long()].transpose(1, 2) for c in (lay.k, lay.v)), lay.start, lay.end)
    ok, err = agree(lmq1(), ref)
    if not ok:
        notes.append(f"{label}: lmq rows=1 and rows=None differ (max abs diff {err:.3g})")

    def measure(peer: Peer | None, bw: float | None, quick: bool) -> list[str]:
        t_lmq, t_lmq1 = time_us(lmq, device, quick), time_us(lmq1, device, quick)
        fi = {"decode": None, "decode_tc": None, "cascade": None}
        if peer is not None:
            check = (ref, reference, device, quick, notes, label)
            fi["decode"] = _peer_variant("decode", lambda: peer.decode(q, lay, False), *check)
            fi["decode_tc"] = _peer_variant("decode tc", lambda: peer.decode(q, lay, True), *check)
            if case.shared:
                fi["cascade"] = _peer_variant("cascade", lambda: peer.cascade(q, lay), *check)
        kv_bytes = 2 * lay.unique_tokens * H_kv * D * lay.k.element_size()
        floor = kv_bytes / bw * 1e6 if bw else None
        timed = [t for t in fi.values() if isinstance(t, float)]
        best_fi = min(timed) if timed else None
        return [label, f"{kv_bytes / 1e6:.1f}", _cell(floor), _cell(t_lmq), _cell(t_lmq1), _cell(fi["decode"]),
                _cell(fi["decode_tc"]), _cell(fi["cascade"]), _ratio(t_lmq, best_fi), _ratio(t_lmq, floor)]

    return measure


def prepare_extend(case: ExtendCase, device: torch.device, notes: list[str],
                   gen: torch.Generator) -> Callable[[Peer | None, float | None, bool], list[str]]:
    """As `prepare_decode`, for an extend case."""
    name, Hq, H_kv, D = MODELS[case.model]
    lay = build_layout(case.prefix, [case.T] * case.B, H_kv, D,
                       torch.bfloat16 if device.type == "cuda" else torch.float32, device, gen)
    q = torch.randn(case.B, case.T, Hq, D, device=device).to(lay.k.dtype)
    label = f"{name} B={case.B} T={case.T} prefix {case.prefix} (shared)"
    out = torch.empty_like(q)
    lmq = lambda: prefill_attention(q, lay.k, lay.v, lay.table, lay.start, lay.end, out=out)  # noqa: E731
    ref = lmq().clone()
    reference = lambda: prefill_attention_reference(q, lay.k, lay.v, lay.table, lay.start, lay.end)  # noqa: E731

    def measure(peer: Peer | None, bw: float | None, quick: bool) -> list[str]:
        t_lmq = time_us(lmq, device, quick)
        t_fi = None
        if peer is not None:
            t_fi = _peer_variant("prefill", lambda: peer.prefill(q, lay), ref, reference, device, quick, notes,
                                 label)
        return [label, _cell(t_lmq), _cell(t_fi), _ratio(t_lmq, t_fi)]

    return measure


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="Llama-3.2-1B's shape only, fewer batches, shorter timing")
    ap.add_argument("--model", choices=["1b", "135m", "both"], default="both")
    ap.add_argument("--no-flashinfer", action="store_true", help="lmq's side alone")
    ap.add_argument("--fi-backend", default="auto", help="FlashInfer's backend for decode and prefill (auto, fa2, fa3)")
    ap.add_argument("--fi-kinds", default=",".join(sorted(KINDS)),
                    help="FlashInfer's variants to run, of decode, decode_tc, cascade, prefill (each kind's "
                         "first use compiles its module: fewer kinds, a shorter warm-up)")
    ap.add_argument("--tiny", action="store_true", help="small shapes (a CPU check under TRITON_INTERPRET=1)")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    models = ["1b"] if args.quick and args.model == "both" else ["1b", "135m"] if args.model == "both" \
        else [args.model]
    peer = None
    if args.no_flashinfer:
        print("FlashInfer: not run (--no-flashinfer)")
    else:
        fi, why = _import_flashinfer()
        if fi is None:
            print(f"FlashInfer is missing ({why}): lmq's side alone")
        elif device.type != "cuda":
            print(f"FlashInfer {fi.__version__}: needs a CUDA device; lmq's side alone")
        else:
            kinds = {k.strip() for k in args.fi_kinds.split(",") if k.strip()}
            if not kinds <= KINDS:
                ap.error(f"--fi-kinds: unknown {sorted(kinds - KINDS)}; known {sorted(KINDS)}")
            peer = Peer(fi, device, args.fi_backend, kinds)
            print(f"FlashInfer {fi.__version__} (backend {args.fi_backend}), "
                  f"workspace {os.environ['FLASHINFER_WORKSPACE_BASE']}")
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; "
          f"torch {torch.__version__}, triton {triton.__version__}")
    bw = copy_bandwidth(device)
    if bw:
        print(f"copy bandwidth (read + write): {bw / 1e12:.2f} TB/s")

    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    notes: list[str] = []
    t0 = time.perf_counter()
    # FlashInfer's compiles (nvcc subprocesses) in the background while lmq's kernels compile on the cases
    with ThreadPoolExecutor(1) as ex:
        warm = None
        if peer is not None:
            _, Hq, H_kv, D = MODELS[models[0]]
            print("FlashInfer warm-up: compiling (or loading) its kernels ...", flush=True)
            warm = ex.submit(peer.warm_up, Hq, H_kv, D, torch.Generator().manual_seed(1), notes)
        dmeasure = [prepare_decode(c, device, args.tiny, notes, gen)
                    for c in decode_cases(models, args.quick, args.tiny)]
        emeasure = [prepare_extend(c, device, notes, gen) for c in extend_cases(models, args.quick, args.tiny)]
        _sync(device)
        print(f"lmq: cases built and first calls (Triton compiles) in {time.perf_counter() - t0:.1f} s", flush=True)
        if warm is not None:
            wall = warm.result()
            print(f"FlashInfer warm-up (nvcc compiles, or loads from the workspace), all kinds at once: {wall:.1f} s; "
                  + ", ".join(f"{k} {v:.1f} s" for k, v in peer.compile_s.items()), flush=True)
    t1 = time.perf_counter()
    drows = [m(peer, bw, args.quick) for m in dmeasure]
    erows = [m(peer, bw, args.quick) for m in emeasure]

    print("\n## Decode attention, one layer, bf16 (us; ratio = lmq / the fastest FlashInfer variant)\n")
    print(_table(["shape", "K/V MB", "floor us", "lmq us", "lmq rows=1 us", "FI decode us", "FI decode tc us",
                  "FI cascade us", "lmq/FI", "lmq/floor"], drows))
    print("\n## Extend (prefill over a cached prefix), one layer, bf16 (us)\n")
    print(_table(["shape", "lmq us", "FI prefill us", "lmq/FI"], erows))
    for n in notes:
        print(f"note: {n}")
    print(f"\nset-up and compiles {t1 - t0:.1f} s, measurements {time.perf_counter() - t1:.1f} s")


if __name__ == "__main__":
    main()
