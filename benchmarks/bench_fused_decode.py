"""GPU benchmark: one decode step (1 new token per row) at 2k context, bf16, random-weight models.

For SmolLM2-135M- and Llama-3.2-1B-shaped models, batch 1 and 16:
  hf     HF forward (sdpa) of 1 token with a DynamicCache of 2047 tokens and an all-ones mask
  fused  lmq FusedDecoder.step (CUDA graphs) from device tensors, the whole step incl. its input copies;
         `step_host` = the engine's entry (inputs from host lists in one copy); `graph` = replay alone
  floor  (weight bytes + K/V bytes of the step) / the device's copy bandwidth, measured in the same run (bytes
         read + written per second by a 1 GiB device-to-device copy)
Then end-to-end on the 1B shape: a 2,050-token prompt + 32 greedy new tokens, HF `generate` vs
(lmq's fused prefill into the pool + 31 fused steps, argmax on the GPU), and the prefill alone: fused vs
HF forward (K/V copied into the pool).
Then a kernel-time breakdown of one eager fused step (torch.profiler) for the 1B shape.

Run:  python benchmarks/bench_fused_decode.py [--quick]
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
import types

import torch

HBM_BW = 0.0  # B/s, set by `main` from `copy_bandwidth()` on this run's device
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _import_engine():
    """compat and fused (the fused step); without running lmq_backend/__init__.py if its dependencies (lark, ...)
    are missing on this machine."""
    try:
        from lmq_backend.engine import compat, fused

        return compat, fused
    except ImportError:
        for name in [m for m in sys.modules if m == "lmq_backend" or m.startswith("lmq_backend.")]:
            del sys.modules[name]
        try:
            import lmq_kernels.triton  # noqa: F401
        except ImportError:
            spec = importlib.util.spec_from_file_location(
                "lmq_kernels.triton", os.path.join(ROOT, "lmq_kernels.triton", "__init__.py"),
                submodule_search_locations=[os.path.join(ROOT, "lmq_kernels.triton")])
            mod = importlib.util.module_from_spec(spec)
            sys.modules["lmq_kernels.triton"] = mod
            spec.loader.exec_module(mod)
        for name, path in (("lmq_backend", "lmq_backend"), ("lmq_backend.engine", "lmq_backend/engine")):
            pkg = types.ModuleType(name)
            pkg.__path__ = [os.path.join(ROOT, path)]
            sys.modules[name] = pkg
        return importlib.import_module("lmq_backend.engine.compat"), importlib.import_module(
            "lmq_backend.engine.fused")


compat, fused = _import_engine()
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from support.caches import paged_view  # noqa: E402
from workloads import copy_bandwidth  # noqa: E402
FusedDecoder = fused.FusedDecoder

SHAPES = {
    "SmolLM2-135M": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                         max_position_embeddings=8192),
    "Llama-3.2-1B": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192},
                         max_position_embeddings=131072),
}


def build(shape: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**SHAPES[shape])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once


def cuda_ms(fn, iters: int, reps: int = 5, sync_each: bool = False) -> float:
    """Median over reps of the mean time of `iters` calls of fn (CUDA events)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
            if sync_each:
                torch.cuda.synchronize()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return statistics.median(times)


@torch.inference_mode()
def bench_step(model, B: int, ctx: int, quick: bool):
    L, H, D = compat.kv_shape(model.config)
    dev = "cuda"
    # HF: DynamicCache of ctx-1 tokens, one new token (a fresh cache object per call: HF's cat copies K/V)
    kv = [(torch.randn(B, H, ctx - 1, D, device=dev, dtype=torch.bfloat16),
           torch.randn(B, H, ctx - 1, D, device=dev, dtype=torch.bfloat16)) for _ in range(L)]
    tok = torch.randint(0, model.config.vocab_size, (B, 1), device=dev)
    mask = torch.ones(B, ctx, dtype=torch.long, device=dev)
    pos = torch.full((B, 1), ctx - 1, device=dev)

    def hf():
        compat.forward(model, tok, mask, pos, compat.make_cache(kv))

    for _ in range(3):
        hf()
    t_hf = cuda_ms(hf, 5 if quick else 10, reps=3)
    del kv

    # fused: pool with capacity ctx + 64, rows full (start 0), the new token at column ctx - 1
    pool = torch.randn(L, 2, B, H, ctx + 64, D, device=dev, dtype=torch.bfloat16)
    dec = FusedDecoder(model, *paged_view(pool), max_batch=B, use_graphs=True)
    start = torch.zeros(B, dtype=torch.int32, device=dev)
    toks, poss = tok[:, 0].clone(), pos[:, 0].clone()

    def fused():
        dec.step(toks, poss, start, ctx - 1)

    fused()
    for _ in range(3):
        fused()
    t_fused = cuda_ms(fused, 50 if quick else 200)
    host_toks, host_starts = toks.tolist(), [0] * B

    def engine():  # the engine's entry: inputs from host lists, one copy from a pinned buffer
        dec.step_host(host_toks, host_starts, ctx - 1)

    engine()
    t_engine = cuda_ms(engine, 50 if quick else 200)
    graph = next(g for (bucket, *_), g in dec.graphs.items() if bucket == B)  # keyed (bucket, cascade)
    t_graph = cuda_ms(graph.replay, 50 if quick else 200)
    kv_bytes = L * 2 * B * H * ctx * D * 2
    t_floor = (weight_bytes(model) + kv_bytes) / HBM_BW * 1e3
    return t_hf, t_fused, t_engine, t_graph, t_floor, dec


def prefill_into_pool(model, ids, pool):
    """HF forward of the prompt (DynamicCache), K/V copied into pool row 0, columns [0, T).
    Returns the last position's logits [1, V]."""
    T = ids.shape[1]
    logits, cache = compat.forward(model, ids, torch.ones_like(ids), torch.arange(T, device=ids.device)[None],
                                   compat.make_cache(None))
    for l, (k, v) in enumerate(compat.cache_layers(cache)):
        pool[l, 0, 0, :, :T].copy_(k[0])
        pool[l, 1, 0, :, :T].copy_(v[0])
    return logits[:, -1]


@torch.inference_mode()
def bench_e2e(model, prompt_len: int, new: int):
    dev = "cuda"
    L, H, D = compat.kv_shape(model.config)
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len), device=dev)
    gen_kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    def hf():
        return model.generate(ids, attention_mask=torch.ones_like(ids), **gen_kw)

    pool = torch.zeros(L, 2, 1, H, prompt_len + new + 64, D, device=dev, dtype=torch.bfloat16)
    dec = FusedDecoder(model, *paged_view(pool), max_batch=1, use_graphs=True)
    start = torch.zeros(1, dtype=torch.int32, device=dev)

    rows = [(ids[0].tolist(), 0)]

    def fused_prefill():
        return dec.prefill(rows, 0, prompt_len)

    def fused():
        tok = fused_prefill().argmax(-1)
        out = [tok]
        pos = torch.full((1,), prompt_len, dtype=torch.long, device=dev)
        for i in range(new - 1):
            tok = dec.step(tok, pos + i, start, prompt_len + i).argmax(-1)
            out.append(tok)
        return torch.cat(out)

    def timed(fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        r = fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3, r

    t_first, _ = timed(fused)  # includes the graph capture
    hf()
    t_hf = min(timed(hf)[0] for _ in range(2))
    t_f = min(timed(fused)[0] for _ in range(3))
    out_hf = hf()[0, prompt_len:]
    out_f = fused()
    # prefill alone, for the split
    t_pre_hf = min(timed(lambda: prefill_into_pool(model, ids, pool))[0] for _ in range(3))
    t_pre = min(timed(fused_prefill)[0] for _ in range(3))
    same = int((out_hf == out_f).long().cumprod(0).sum())
    return t_hf, t_f, t_first, t_pre, t_pre_hf, same


@torch.inference_mode()
def profile_step(dec, B: int, ctx: int):
    """Kernel time per category of one eager step (no graph), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    dec.use_graphs = False
    toks = torch.zeros(B, dtype=torch.long, device="cuda")
    pos = torch.full((B,), ctx - 1, device="cuda")
    start = torch.zeros(B, dtype=torch.int32, device="cuda")
    for _ in range(3):
        dec.step(toks, pos, start, ctx - 1)
    torch.cuda.synchronize()
    n = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            dec.step(toks, pos, start, ctx - 1)
        torch.cuda.synchronize()
    dec.use_graphs = True
    cats: dict[str, list[float]] = {}
    from torch.autograd import DeviceType

    for ev in prof.key_averages():
        name = ev.key
        if getattr(ev, "device_type", DeviceType.CUDA) != DeviceType.CUDA:
            continue
        t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        if t <= 0 or ev.count == 0:
            continue
        low = name.lower()
        if "decode_stage" in low:
            cat = "attention"
        elif "rope_append" in low:
            cat = "rope+append"
        elif "rmsnorm" in low:
            cat = "rmsnorm"
        elif "silu" in low:
            cat = "silu_mul"
        elif "gemm" in low or "gemv" in low or "sm90" in low or "cutlass" in low or "nvjet" in low:
            cat = "gemm"
        elif "index" in low or "fill" in low or "copy" in low or "memcpy" in low or "memset" in low:
            cat = "copies/fills"
        else:
            cat = "other"
        c = cats.setdefault(cat, [0.0, 0])
        c[0] += t / n / 1e3  # ms per step
        c[1] += ev.count // n
    return cats, prof


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ctx", type=int, default=2048)
    args = ap.parse_args()
    global HBM_BW
    HBM_BW = copy_bandwidth()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, copy bandwidth (read + write) "
          f"{HBM_BW / 1e12:.2f} TB/s", flush=True)
    rows = []
    decs = {}
    for shape in SHAPES:
        model = build(shape)
        wb = weight_bytes(model)
        for B in (1, 16):
            t_hf, t_f, t_e, t_g, t_floor, dec = bench_step(model, B, args.ctx, args.quick)
            decs[(shape, B)] = dec
            rows.append((shape, B, t_hf, t_f, t_e, t_g, t_floor))
            print(f"{shape:13s} B={B:2d} ctx={args.ctx}: HF {t_hf:7.3f} ms | fused {t_f:6.3f} ms (engine's "
                  f"step_host {t_e:6.3f}, graph replay {t_g:6.3f}) | floor {t_floor:6.3f} ms | "
                  f"HF/fused {t_hf / t_f:5.1f}x | fused/floor "
                  f"{t_f / t_floor:4.2f}x   (weights {wb / 1e9:.3f} GB)", flush=True)
        if shape == "Llama-3.2-1B":
            for B in (1, 16):
                try:
                    cats, prof = profile_step(decs[(shape, B)], B, args.ctx)
                except Exception as exc:  # the profiler is a diagnostic only
                    print(f"  profile failed: {exc!r}")
                    continue
                tot = sum(c[0] for c in cats.values())
                print(f"  profile {shape} B={B}: kernel time {tot:.3f} ms/step (eager), graph replay "
                      f"{[r for r in rows if r[0] == shape and r[1] == B][0][5]:.3f} ms")
                for cat, (t, cnt) in sorted(cats.items(), key=lambda kv: -kv[1][0]):
                    print(f"    {cat:14s} {t:7.3f} ms  {cnt:4d} launches")
                if B == 1:
                    try:
                        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14))
                    except Exception as exc:
                        print(f"  profile table failed: {exc!r}")
            t_hf, t_f, t_first, t_pre, t_pre_hf, same = bench_e2e(model, 2050, 32)
            print(f"end-to-end {shape}, 2050-token prompt + 32 greedy tokens (B=1): HF generate {t_hf:.1f} ms | "
                  f"fused prefill + 31 fused steps {t_f:.1f} ms (prefill alone {t_pre:.1f} ms, HF forward prefill "
                  f"{t_pre_hf:.1f} ms; first run "
                  f"incl. graph capture {t_first:.1f} ms) | speed-up {t_hf / t_f:.2f}x | decode part "
                  f"{(t_hf - t_pre) / max(t_f - t_pre, 1e-6):.1f}x | identical leading tokens {same}/32", flush=True)
        del model, decs
        decs = {}
        torch.cuda.empty_cache()
    print("\n| model | B | HF sdpa (ms) | lmq step (ms) | lmq step_host (ms) | graph replay (ms) | floor (ms) | "
          "HF/step | step/floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape, B, t_hf, t_f, t_e, t_g, t_floor in rows:
        print(f"| {shape} | {B} | {t_hf:.3f} | {t_f:.3f} | {t_e:.3f} | {t_g:.3f} | {t_floor:.3f} | {t_hf / t_f:.1f}x | "
              f"{t_f / t_floor:.2f}x |")


if __name__ == "__main__":
    main()
