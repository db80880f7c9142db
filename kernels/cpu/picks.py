"""The greedy pick of lmq's CPU kernels (part of `lmq_kernels.cpu`, which re-exports it; import it from there):

    masked_argmax(logits, masks, out) -> bool     out[r] = the greedy pick of logits[r] under masks[r]
                                                  (picks.c)

The same pick as torch's `torch.where(mask, logits, -inf).argmax(-1)` (the first maximal logit among the
allowed tokens; 0 where none is allowed), in one pass over a row instead of a copy written and read again, and
each row's mask read where it lies (no [R, V] stack of them). False (nothing computed) where it cannot run the
operands or calibration chose torch's form: see `lmq_kernels.cpu`.
"""
from __future__ import annotations

import ctypes

import torch

from . import benches as _benches


def masked_argmax(logits: torch.Tensor, masks: list[torch.Tensor | None] | None, out: torch.Tensor) -> bool:
    """out (int64 [R]) = per row of logits (float32 [R, V], unit column stride) the index of its largest logit
    among the tokens its mask allows: masks[r] bool [V] contiguous, None (or masks None): every token."""
    lib = cpu._load()
    if lib is None or logits.dim() != 2 or not len(logits) or not cpu._rows_ok(logits) or out.dtype != torch.int64 \
            or out.shape != logits.shape[:1] or not out.is_contiguous():
        return False
    r, v = logits.shape
    if masks is not None and (len(masks) != r or not all(
            m is None or (m.dtype == torch.bool and m.shape == (v,) and m.is_contiguous() and m.device.type == "cpu")
            for m in masks)):
        return False
    threads = torch.get_num_threads()
    masked = masks is not None and any(m is not None for m in masks)
    if not cpu.choose("masked_argmax", (threads, cpu._up(r), cpu._up(v), int(masked)),
                      lambda: _benches.masked_argmax(cpu._forced(masked_argmax), cpu._up(r), v, masked)):
        return False
    table = (ctypes.c_void_p * r)(*(None if m is None else m.data_ptr() for m in masks)) if masked else None
    lib.lmq_masked_argmax(logits.data_ptr(), logits.stride(0), table, r, v, out.data_ptr(), threads)
    return True


# last: lmq_kernels.cpu imports this module at its end (either may be imported first)
from lmq_kernels import cpu  # noqa: E402
