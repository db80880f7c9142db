"""The greedy pick of lmq's CPU kernels (part of `lmq_kernels.cpu`, which re-exports it; import it from there):

    masked_argmax(logits, masks, out) -> bool     out[r] = the greedy pick of logits[r] under masks[r]
                                                  (picks.c)

The same pick as torch's `torch.where(mask, logits, -inf).argmax(-1)` (the first maximal logit among the
allowed tokens; 0 where none is allowed), in one pass over a row instead of a copy written and read again, and
each row's mask read where it lies (no [R, V] stack of them). False (nothing computed) where it cannot run the
operands or calibration chose torch's form (`choose_masked_argmax`: its class).
"""
from __future__ import annotations

import ctypes

import torch

from . import benches
from .library import choose, forced, load, rows_ok, size_class

__all__ = ["masked_argmax", "choose_masked_argmax"]


def choose_masked_argmax(r: int, v: int, masked: bool) -> bool:
    """Whether lmq's pick runs r rows of v logits (`masked`: some row under a mask) here."""
    up = size_class
    return choose("masked_argmax", (torch.get_num_threads(), up(r), up(v), int(masked)),
                  lambda: benches.masked_argmax(forced(masked_argmax), up(r), v, masked))


def masked_argmax(logits: torch.Tensor, masks: list[torch.Tensor | None] | None, out: torch.Tensor) -> bool:
    """out (int64 [R]) = per row of logits (float32 [R, V], unit column stride) the index of its largest logit
    among the tokens its mask allows: masks[r] bool [V] contiguous, None (or masks None): every token."""
    lib = load()
    if lib is None or logits.dim() != 2 or not len(logits) or not rows_ok(logits) or out.dtype != torch.int64 \
            or out.shape != logits.shape[:1] or not out.is_contiguous():
        return False
    r, v = logits.shape
    if masks is not None and (len(masks) != r or not all(
            m is None or (m.dtype == torch.bool and m.shape == (v,) and m.is_contiguous() and m.device.type == "cpu")
            for m in masks)):
        return False
    threads = torch.get_num_threads()
    masked = masks is not None and any(m is not None for m in masks)
    if not choose_masked_argmax(r, v, masked):
        return False
    table = (ctypes.c_void_p * r)(*(None if m is None else m.data_ptr() for m in masks)) if masked else None
    lib.lmq_masked_argmax(logits.data_ptr(), logits.stride(0), table, r, v, out.data_ptr(), threads)
    return True
