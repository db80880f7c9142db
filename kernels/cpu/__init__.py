"""lmq's CPU kernels, in C: built once per machine with its C compiler into one library, called through ctypes.

    small_m_mm(x, w_t, out, accumulate=False, bias=None) -> bool     out (+)= x @ w_t      (gemm.py, gemm.c)
    quantized_mm(x, q, scale, zero, out, accumulate=False) -> bool   out (+)= x @ W^T, W int8/int4
    dequantize(q, scale, zero, out) -> bool                          out = W as float32    (quantized.py, qgemm.c)
    attention(q, k, v, table, start, out, scale) -> bool             one query a row, GQA  (attention.py)
    prefill_attention(q, k, v, table, start, new, end, out, scale)   T new tokens a row, causal GQA
    rmsnorm(x, w, eps, out), silu_mul(gu, out), rope_append(...) -> bool   the step's small ops (ops.py, ops.c)
    masked_argmax(logits, masks, out) -> bool                        a step's greedy picks (picks.py, picks.c)
    decode_layers(plan, x, ...) -> bool                              a decode step's layers in one call (step.py)

Each op returns False, computing nothing, when it cannot run (no C compiler, a failed build, not Linux,
LMQ_CPU_KERNELS=0, operands it does not take, a row count outside its range) or where torch's counterpart is
the faster on this machine: the caller then uses torch. Which of the two runs is decided by measurement
(calibration.py, through `choose`; each op's `choose_<op>` names its class), kept per machine in a file next to
the library; `warm_up(shape)` measures the classes a model's steps meet before its first query.

The library itself (build, load, the calibration's state, `use` for a variant) is library.py.
"""
from __future__ import annotations

from .attention import HEAD_DIMS as ATTENTION_HEAD_DIMS
from .attention import attention, choose_attention, choose_prefill_attention, prefill_attention
from .toolchain import isa
from .gemm import GEMM_MAX_ROWS, MIN_ROWS, choose_gemm, gemm_shape, small_m_mm
from .library import (available, build, build_error, choices, choose, configure, forced, guesses, load, mode,
                      quiet, rows_ok, size_class, target, use, warming)
from .ops import choose_rmsnorm, choose_rope_append, choose_silu_mul, rmsnorm, rope_append, silu_mul
from .picks import choose_masked_argmax, masked_argmax
from .quantized import choose_quantized, dequantize, quantized_mm
from .quantized import layout_ok as quantized_layout_ok
from .warmup import ModelShape, warm_up

__all__ = ["small_m_mm", "quantized_mm", "dequantize", "quantized_layout_ok", "attention", "prefill_attention",
           "rmsnorm", "silu_mul", "rope_append", "masked_argmax", "available", "build", "build_error", "use", "mode",
           "choose", "choices", "configure", "isa", "target", "gemm_shape", "load", "forced", "size_class",
           "rows_ok", "choose_gemm", "choose_quantized", "choose_attention", "choose_prefill_attention",
           "choose_rmsnorm", "choose_silu_mul", "choose_rope_append", "choose_masked_argmax", "MIN_ROWS",
           "GEMM_MAX_ROWS", "ATTENTION_HEAD_DIMS", "ModelShape", "warm_up", "warming", "guesses", "quiet"]
