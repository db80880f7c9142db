"""The fused decode step and prefill of Llama-family models over the paged K/V store.

    weights.py   which models it runs (`supports`), their weights laid out for it (`decoder_weights`)
    weight_cache.py  the CPU layout of a model folder's weights, kept on disk
    ops.py       `LayerOps`: the layer loop's ops on the device's kernels (Triton: `lmq_kernels.triton.ops`,
                 lmq's C kernels, torch)
    prefill.py   `Prefill`: the layer loop over many new tokens per row
    decoder.py   `FusedDecoder`: the decode step (static buffers, CUDA graphs per batch bucket, the device's
                 picks and a step run ahead, the per-step entry points, CPU attention)
    cpu_step.py  a CPU step's layers in one C call (`lmq_kernels.cpu.step`) where calibration measured it faster
"""
from .decoder import FusedDecoder, bucket_for
from .weights import decoder_weights, supports

__all__ = ["supports", "FusedDecoder", "bucket_for", "decoder_weights"]
