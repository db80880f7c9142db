"""The fused decode step and prefill of Llama-family models over the paged K/V store.

    weights.py   which models it runs (`supports`), their weights laid out for it (`decoder_weights`)
    kernels.py   the Triton kernels: RMSNorm, SiLU-and-multiply, RoPE + K/V append into the store
    ops.py       `LayerOps`: the layer loop's ops on the device's kernels (Triton, lmq's C kernels, torch)
    prefill.py   `Prefill`: the layer loop over many new tokens per row
    graphs.py    `GraphSteps`: CUDA-graph capture per batch bucket, greedy picks on the device, run-ahead
    decoder.py   `FusedDecoder`: the decode step (static buffers, the per-step entry points, CPU attention)
    cpu_step.py  a CPU step's layers in one C call (lmq_kernels.triton/step.c) where measured faster
"""
from .decoder import FusedDecoder
from .graphs import bucket_for
from .weights import decoder_weights, supports

__all__ = ["supports", "FusedDecoder", "bucket_for", "decoder_weights"]
