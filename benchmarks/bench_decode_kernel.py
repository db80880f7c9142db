"""GPU microbenchmark: decode attention only (one new token per row), bf16.

Shapes: Llama-3.2-1B (Hq=32, H_kv=8, D=64, 16 layers) and SmolLM2-135M
(Hq=9, H_kv=3, D=64, 30 layers), batch 1 and 16, 2048-token context
(capacity S = 2048, all rows full, plus a ragged case with random left padding).

Methods, each captured in a CUDA graph that runs every layer of the model
(several copies of the layer stack when one stack would fit in L2, so K/V are
read from HBM as in a real decode step where the weights flush L2):
  triton   lmq_kernels.triton.decode_attention (default heuristic; sweep of variants too)
  sdpa     torch SDPA on the padded cache [:, :, :end] with a boolean pad mask, enable_gqa
  sdpa_nm  torch SDPA without mask (lower bound for what SDPA can do; wrong for padded rows)
  ref      decode_attention_reference (plain torch, fp32 math)
Per-layer time = graph time / number of layer calls.  Floor = bytes of the valid
K/V (+ q, out) / HBM_BW (a device-to-device copy bandwidth measured on the reference GPU).

Run:  python benchmarks/bench_decode_kernel.py [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F

HBM_BW = 4.3e12  # B/s


def _load_kernels():
    try:
        import lmq_kernels.triton as km  # noqa: F401

        return km
    except Exception:
        here = os.path.dirname(os.path.abspath(__file__))
        kdir = os.path.join(os.path.dirname(here), "lmq_kernels.triton")
        spec = importlib.util.spec_from_file_location(
            "lmq_kernels_bench", os.path.join(kdir, "__init__.py"), submodule_search_locations=[kdir]
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["lmq_kernels_bench"] = mod
        spec.loader.exec_module(mod)
        return mod


km = _load_kernels()


def graph_time_us(fn, reps=5, iters=20):
    """Median over `reps` of the mean replay time of a graph of fn()."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / iters)
    return statistics.median(times)


def make_case(B, Hq, Hkv, D, L, ctx, S, ragged, dtype=torch.bfloat16, min_bytes=256 << 20):
    per_layer = 2 * B * Hkv * S * D * torch.finfo(dtype).bits // 8
    copies = max(1, math.ceil(min_bytes / (per_layer * L)))
    n = L * copies
    gen = torch.Generator(device="cuda").manual_seed(0)
    ks = [torch.randn(B, Hkv, S, D, device="cuda", dtype=dtype, generator=gen) for _ in range(n)]
    vs = [torch.randn(B, Hkv, S, D, device="cuda", dtype=dtype, generator=gen) for _ in range(n)]
    qs = [torch.randn(B, Hq, D, device="cuda", dtype=dtype, generator=gen) for _ in range(n)]
    outs = [torch.empty(B, Hq, D, device="cuda", dtype=dtype) for _ in range(n)]
    if ragged:
        starts = torch.randint(0, ctx, (B,), device="cuda", generator=gen).to(torch.int32)
        starts[0] = 0
    else:
        starts = torch.zeros(B, dtype=torch.int32, device="cuda")
    start = starts
    end_t = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    valid_tokens = int((ctx - start.long()).sum().item())
    bytes_layer = 2 * Hkv * valid_tokens * D * 2 + 2 * B * Hq * D * 2
    mask = (torch.arange(ctx, device="cuda").view(1, ctx) >= start.view(B, 1).long()).view(B, 1, 1, ctx)
    return dict(ks=ks, vs=vs, qs=qs, outs=outs, start=start, end_t=end_t, n=n, mask=mask,
                bytes_layer=bytes_layer, ctx=ctx)


def run_triton(c, **kw):
    def fn():
        for i in range(c["n"]):
            km.decode_attention(c["qs"][i], c["ks"][i], c["vs"][i], c["start"], c["end_t"], out=c["outs"][i], **kw)
    return fn


def run_sdpa(c, masked=True):
    ctx = c["ctx"]

    def fn():
        for i in range(c["n"]):
            q = c["qs"][i].unsqueeze(2)
            o = F.scaled_dot_product_attention(
                q, c["ks"][i][:, :, :ctx], c["vs"][i][:, :, :ctx],
                attn_mask=c["mask"] if masked else None, enable_gqa=True)
            c["outs"][i].copy_(o.squeeze(2))
    return fn


def run_ref(c):
    ctx = c["ctx"]

    def fn():
        for i in range(c["n"]):
            c["outs"][i].copy_(km.decode_attention_reference(c["qs"][i], c["ks"][i], c["vs"][i], c["start"], ctx))
    return fn


def check(c, tol=2e-2):
    i = 0
    out = km.decode_attention(c["qs"][i], c["ks"][i], c["vs"][i], c["start"], c["end_t"])
    ref = km.decode_attention_reference(c["qs"][i], c["ks"][i], c["vs"][i], c["start"], c["ctx"],
                                        compute_dtype=torch.float64).double()
    err = (out.double() - ref).abs().max().item()
    assert err < tol, err
    return err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="no variant sweep")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    import triton
    print("triton", triton.__version__)

    models = {"llama3.2-1b": (32, 8, 64, 16), "smollm2-135m": (9, 3, 64, 30)}
    rows = []
    sweep_lines = []
    for mname, (Hq, Hkv, D, L) in models.items():
        for B, ragged in [(1, False), (16, False), (16, True)]:
            ctx = S = 2048
            c = make_case(B, Hq, Hkv, D, L, ctx, S, ragged)
            err = check(c)
            G = Hq // Hkv
            use_dot, g_pad, bn, nw = km.decode_attention.__globals__["_pick_config"](G, 64, torch.bfloat16)
            splits, chunk = km.choose_num_splits(B, Hkv, S, bn, torch.cuda.get_device_properties(0).multi_processor_count)
            n = c["n"]
            floor = c["bytes_layer"] / HBM_BW * 1e6
            res = {}
            res["triton"] = graph_time_us(run_triton(c)) / n
            best = ("default", res["triton"])
            if not args.quick:
                variants = [dict(fused_reduce=False), dict(use_dot=False, block_n=32)]
                for b in (32, 64, 128):
                    for w in (2, 4, 8):
                        variants.append(dict(block_n=b, num_warps=w))
                for ns in (max(1, splits // 2), splits * 2, splits * 4):
                    variants.append(dict(num_splits=ns))
                for kw in variants:
                    try:
                        t = graph_time_us(run_triton(c, **kw), reps=3, iters=10) / n
                    except Exception as exc:  # compile/resource failure of a variant
                        sweep_lines.append(f"{mname} B={B} rag={ragged} {kw}: FAILED {type(exc).__name__}")
                        continue
                    sweep_lines.append(f"{mname} B={B} rag={ragged} {kw}: {t:.2f} us")
                    if t < best[1]:
                        best = (str(kw), t)
            for name, f in [("sdpa", run_sdpa(c, True)), ("sdpa_nm", run_sdpa(c, False)), ("ref", run_ref(c))]:
                try:
                    res[name] = graph_time_us(f, reps=3, iters=5) / n
                except Exception as exc:
                    print(f"{name} failed: {exc!r}")
                    res[name] = float("nan")
            rows.append((mname, B, ragged, splits, chunk, floor, res, best, err, n))
            del c
            torch.cuda.empty_cache()

    if sweep_lines:
        print("\n# variant sweep (per-layer us)")
        for line in sweep_lines:
            print(line)
    print("\n# per-layer decode attention, bf16, ctx 2048 (us; BW = valid K/V + q/out bytes / time)")
    hdr = (f"{'model':13s} {'B':>3s} {'rag':>3s} {'splits':>6s} {'floor':>6s} {'triton':>7s} {'TB/s':>5s} "
           f"{'best':>6s} {'sdpa':>7s} {'sdpa_nm':>7s} {'ref':>7s} {'x_sdpa':>6s} {'err':>8s}  best-variant")
    print(hdr)
    for mname, B, ragged, splits, chunk, floor, res, best, err, n in rows:
        bw = (floor * 1e-6 * HBM_BW) / (res["triton"] * 1e-6) / 1e12
        print(f"{mname:13s} {B:3d} {('y' if ragged else 'n'):>3s} {splits:6d} {floor:6.2f} {res['triton']:7.2f} {bw:5.2f} "
              f"{best[1]:6.2f} {res['sdpa']:7.2f} {res['sdpa_nm']:7.2f} {res['ref']:7.2f} "
              f"{res['sdpa'] / res['triton']:6.1f} {err:8.1e}  {best[0]}")
    print("(per model step: multiply per-layer times by 16 layers for llama, 30 for smollm)")


if __name__ == "__main__":
    main()
