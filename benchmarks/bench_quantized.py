"""CPU benchmark: weight-only int8 / int4 GEMMs against float32 at the decode step's shapes.

SmolLM2-135M's GEMMs (K x N: the fused step's q/k/v 576x960, o_proj 576x576, gate/up 576x3072, down
1536x576, k/v 576x192, the lm_head 576x49152) at M = 1..16 rows: float32 `torch.mm` on K-major weights
(the fused step's layout), lmq's float32 small-M kernel where calibration chose it (`small_m_mm`), torch's
weight-only kernels (`_weight_int8pack_mm` per channel, `_weight_int4pack_mm_for_cpu` groups of 32) and
lmq's (`QuantizedLinear.mm`: kernels/cpu/qgemm.c, int8 and int4 (as Q4_1) with groups of 32).
Weights come from a ring of copies larger than the last-level cache (a decode step reads each layer's weights
cold); the sides alternate sample by sample; process CPU time per call (the host is shared: CPU time moves
less with the load than wall time; the clock ticks in ms, so a sample is 16 calls), median of `--reps`.

With `--decode`: decode steps of the default model through the engine at float32, int8 and int4 (its shipped
Q4_1), batch 1 and 8 concurrent queries (a ~450-token prompt each, 32 new tokens), the dtypes alternating
for `--rounds` rounds; median ms per step (`on_step`), wall.

With `--quality`: what the quantization costs, on ~840 tokens of the benchmark texts fed to each model at once
(teacher forcing): top-1 agreement with lmq float32 and the mean KL divergence from it, for lmq int8, int4 and,
when llama-cpp-python is installed, llama.cpp on the same GGUF as F32 and as its shipped Q4_1.

Run:  python benchmarks/bench_quantized.py [--rows 1,2,4,8,16] [--reps 7] [--threads 2] [--decode] [--quality]
                                           [--no-gemm]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads as W  # noqa: E402

from lmq_backend.engine.quantize import QuantizedLinear  # noqa: E402
from lmq_kernels import cpu  # noqa: E402

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 192), (576, 49152)]
RING_BYTES = 256 * 2**20  # more than any last-level cache here


def host_line() -> str:
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {W.cpu_host()}; torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads; load {load}; command: {' '.join(sys.argv)}")


def sides(k: int, n: int, rows: int) -> dict[str, list]:
    """Per side, a ring of callables f(x) over distinct weight copies (x up to `rows` rows)."""
    copies = max(2, RING_BYTES // (k * n * 4))
    out: dict[str, list] = {"fp32": [], "lmq": [], "t-int8": [], "t-int4": [], "int8": [], "int4": []}
    o = torch.empty(rows, n)
    for _ in range(min(copies, 8)):
        w = torch.randn(n, k) * 0.05
        wk = w.t().contiguous().t()                       # K-major, as fused/weights.py lays it out
        out["fp32"].append(lambda x, wk=wk: torch.mm(x, wk.t()))
        out["lmq"].append(lambda x, wk=wk, o=o: cpu.small_m_mm(x, wk.t(), o[: x.shape[0]]) or torch.mm(x, wk.t()))
        q8, q4 = QuantizedLinear.quantize(w, None, "int8"), QuantizedLinear.quantize(w, None, "int4")
        s8 = w.abs().amax(1) / 127                        # torch's int8 kernel: a scale per output channel
        t8 = torch.round(w / s8[:, None]).to(torch.int8)
        out["t-int8"].append(lambda x, q=t8, s=s8: torch.ops.aten._weight_int8pack_mm(x, q, s))
        out["t-int4"].append(torch_int4(w))
        out["int8"].append(lambda x, q=q8, o=o: q.mm(x, o[: x.shape[0]]))
        out["int4"].append(lambda x, q=q4, o=o: q.mm(x, o[: x.shape[0]]))
    return out


def torch_int4(w: torch.Tensor):
    """torch's int4 kernel on w's Q4_1-style groups of 32 (zero = m + 8 d, see engine/quantize.py)."""
    n, k = w.shape
    g = w.view(n, k // 32, 32)
    lo, d = g.amin(-1), (g.amax(-1) - g.amin(-1)) / 15
    q = torch.round((g - lo[..., None]) / d[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack([d.t(), (lo + 8 * d).t()], -1).contiguous()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)


def measure(rows: list[int], reps: int, calls: int = 16) -> None:
    cpu.configure(Path.home() / ".cache" / "lmq" / "kernels")
    names = ("fp32", "lmq", "t-int8", "t-int4", "int8", "int4")
    print(f"{'K x N':>11} {'M':>3} " + " ".join(f"{s:>8}" for s in names)
          + "   int8/fp32 int4/fp32  (ms per call: CPU time of the process over threads, median of samples of "
          f"{calls} calls; fp32 = the faster of fp32 and lmq; torch's kernels (t-) at M <= 4 only)")
    for k, n in SHAPES:
        fns = sides(k, n, max(rows))
        for m in rows:
            x = torch.randn(m, k)
            run = {s: f for s, f in fns.items() if not (s.startswith("t-") and (m > 4 or n > 10_000 and m > 1))}
            cpu_t: dict[str, list[float]] = {s: [] for s in run}
            for r in range(reps):
                for s, ring in run.items():
                    c = time.process_time()
                    for i in range(calls):
                        ring[(r + i) % len(ring)](x)
                    cpu_t[s].append((time.process_time() - c) / calls)
            med = {s: statistics.median(v) * 1e3 for s, v in cpu_t.items()}
            fp = min(med["fp32"], med["lmq"])
            print(f"{k:>5}x{n:<5} {m:>3} " + " ".join(f"{med[s]:8.3f}" if s in med else f"{'-':>8}" for s in names)
                  + f"   {med['int8'] / fp:9.2f} {med['int4'] / fp:9.2f}", flush=True)


def decode(rounds: int) -> None:
    import lmq_backend as lmq

    sys.path.insert(0, str(Path(__file__).parent))
    from workloads import w1_reviews, w1_shots

    shots, reviews = w1_shots(16), w1_reviews(8)
    backends = {d: lmq.HFBackend("default", device="cpu", dtype=d, name=f"bench-{d}")
                for d in ("float32", "int8", "int4")}
    steps: list = []
    for b in backends.values():
        b.on_step(steps.append)

    async def run(backend, n: int):
        q = lmq.Query('"{shots}Review: {review}\\nA reply to this review:[R]" where len(TOKENS(R)) < 33',
                      model=backend)
        await asyncio.gather(*(q.run({"shots": shots, "review": r}) for r in reviews[:n]))

    print(f"decode steps, SmolLM2-135M, ~{len(backends['int8'].tokenizer(shots).input_ids) + 20}-token rows, "
          "median ms per step, wall (one line per round; dtypes alternate; the first round warms up)")
    for r in range(rounds + 1):
        line = []
        for n in (1, 8):
            for dtype, backend in backends.items():
                steps.clear()
                asyncio.run(run(backend, n))
                t = [s.seconds for s in steps if s.kind == "decode" and s.batch_size == n]
                line.append(f"B={n} {dtype:>7}: {statistics.median(t) * 1e3:6.1f}" if t else f"B={n} {dtype}: -")
        print(("  warm-up " if r == 0 else "  ") + " | ".join(line), flush=True)


def quality() -> None:
    import lmq_backend as lmq
    from lmq_backend.backend.default_model import gguf_path

    sys.path.insert(0, str(Path(__file__).parent))
    import workloads as W

    text = W.w1_shots(16) + "\n" + W.W2_SYSTEM + " " + " ".join(W.W2_TURNS)
    backends = {d: lmq.HFBackend("default", device="cpu", dtype=d) for d in ("float32", "int8", "int4")}
    ids = backends["float32"].tokenizer.encode(text)[:1000]

    def logp(logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits.float(), -1)

    with torch.no_grad():
        lps = {f"lmq {d}": logp(b.model(torch.tensor([ids])).logits[0]) for d, b in backends.items()}
    try:
        import llama_cpp
        import numpy as np
        from bench_llama_cpp import f32_gguf

        for name, path in (("llama.cpp F32", f32_gguf()), ("llama.cpp Q4_1", gguf_path())):
            llm = llama_cpp.Llama(str(path), n_ctx=2048, n_threads=torch.get_num_threads(), logits_all=True,
                                  verbose=False)
            llm.eval(ids)
            lps[name] = logp(torch.tensor(np.array(llm.scores[:len(ids)])))
    except ImportError:
        print("(llama-cpp-python is not installed: lmq only)")
    ref = lps.pop("lmq float32")
    print(f"quality against lmq float32 over {len(ids)} tokens (teacher forcing): top-1 agreement, mean KL")
    for name, lp in lps.items():
        agree = (lp.argmax(-1) == ref.argmax(-1)).float().mean().item()
        kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
        print(f"  {name:16s} {agree:7.4f} {kl:9.5f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--no-gemm", action="store_true")
    ap.add_argument("--quality", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(host_line())
    if not args.no_gemm:
        measure([int(r) for r in args.rows.split(",")], args.reps)
    if args.decode:
        decode(args.rounds)
    if args.quality:
        quality()
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
