"""The attention ops of lmq's CPU kernels (part of `lmq_kernels.cpu`, which re-exports them; import them
from there), on the paged K/V store read through page tables:

    attention(q, k, v, table, start, out, scale) -> bool                  one query a row (attention.c)
    prefill_attention(q, k, v, table, start, new, end, out, scale) -> bool   T new tokens a row, causal
                                                                          (prefill_attention.c)

Both take float32 operands, k and v [slots, Hkv, D] (one layer of the store, any strides but the last),
int32 page tables [rows, columns] (column -> slot, unit column stride), and return False (nothing
computed) where they cannot run the operands or calibration chose torch's form (gather the rows' columns,
then torch's fused attention): `choose_attention` and `choose_prefill_attention` are their classes.
"""
from __future__ import annotations

import torch

from . import benches
from .library import choose, forced, load, rows_ok, size_class

__all__ = ["attention", "prefill_attention", "choose_attention", "choose_prefill_attention", "HEAD_DIMS"]

# any row count (calibration decides; one row is only Hkv tasks to share between the threads, but torch's
# side gathers the row's columns first), the head dims the kernels are built for
MIN_ROWS, HEAD_DIMS = 1, (64, 128, 256)


def _store_ok(k: torch.Tensor, v: torch.Tensor, d: int) -> bool:
    return k.dim() == 3 and k.shape[2] == d and v.shape == k.shape and rows_ok(k, v)


def _table_ok(table: torch.Tensor, rows: int) -> bool:
    return table.dtype == torch.int32 and table.dim() == 2 and table.shape[0] >= rows and table.stride(1) == 1


def _ints_ok(x: torch.Tensor, rows: int) -> bool:
    return x.dtype == torch.int32 and x.shape == (rows,) and x.is_contiguous()


def choose_attention(b: int, hq: int, hkv: int, d: int, s: int) -> bool:
    """Whether lmq's decode attention runs b rows over s columns of this head shape here."""
    up = size_class
    return choose("attention", (torch.get_num_threads(), up(b), hq, hkv, d, up(s)),
                  lambda: benches.attention(forced(attention), up(b), hq, hkv, d, up(s)))


def choose_prefill_attention(b: int, t: int, hq: int, hkv: int, d: int, span: int) -> bool:
    """Whether lmq's prefill attention runs b rows of t new tokens reading `span` columns (the longest
    row's) of this head shape here. The class is by the columns the rows read, not by the end column: the
    pool's end column moves on with every decode step, and a class of it would be new to calibration long
    after the first calls."""
    up = size_class
    return choose("prefill_attention", (torch.get_num_threads(), up(b), up(t), hq, hkv, d, up(span)),
                  lambda: benches.prefill_attention(forced(prefill_attention), up(b), up(t), hq, hkv, d,
                                                    up(span)))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, start: torch.Tensor,
              out: torch.Tensor, scale: float) -> bool:
    """out = grouped-query attention of q [B, Hq, D] (one query a row) over the paged store's k, v [slots,
    Hkv, D] of one layer, read through the page tables `table` (int32 [B, S], column -> slot, unit column
    stride): row b over its columns [start[b], S) (`start` int32 [B], clamped to [0, S]: a row without a
    column gets zeros); out [B, Hq, D]. False (nothing computed) if it cannot run these operands (see the
    module docstring)."""
    b, hq, d = q.shape
    if b < MIN_ROWS or d not in HEAD_DIMS:
        return False
    lib = load()
    if lib is None:
        return False
    hkv, s = k.shape[1] if k.dim() == 3 else 0, table.shape[1]
    if (not _store_ok(k, v, d) or hkv == 0 or hq % hkv or out.shape != q.shape or not rows_ok(q, out)
            or not _table_ok(table, b) or not _ints_ok(start, b)):
        return False
    if not choose_attention(b, hq, hkv, d, s):
        return False
    lib.lmq_attention(q.data_ptr(), q.stride(0), q.stride(1),
                      k.data_ptr(), k.stride(1), k.stride(0), v.data_ptr(), v.stride(1), v.stride(0),
                      table.data_ptr(), table.stride(0), start.data_ptr(), out.data_ptr(), out.stride(0),
                      out.stride(1), b, hq, hkv, s, d, float(scale), torch.get_num_threads())
    return True


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, start: torch.Tensor,
                      new: torch.Tensor, end: int, out: torch.Tensor, scale: float) -> bool:
    """out = causal grouped-query attention of the T new tokens of B left-padded rows, q [B, T, Hq, D] (any
    strides but the last), over the store's k, v [slots, Hkv, D] through the page tables `table` (int32
    [B, S]): token t of row b is column end - T + t and attends to the row's columns [start[b], end - T + t];
    only the last new[b] tokens of a row are real (`start`, `new`: int32 [B]), the padding before them gets
    zeros. out like q. A row's result does not depend on the batch (see prefill_attention.c)."""
    if q.dim() != 4:
        return False
    b, t, hq, d = q.shape
    if b < MIN_ROWS or d not in HEAD_DIMS:
        return False
    lib = load()
    if lib is None:
        return False
    hkv = k.shape[1] if k.dim() == 3 else 0
    if (not _store_ok(k, v, d) or hkv == 0 or hq % hkv or out.shape != q.shape
            or not rows_ok(q, out)
            or (b > 1 and (q.stride(0) != t * q.stride(1) or out.stride(0) != t * out.stride(1)))
            or not _table_ok(table, b) or not t <= end <= table.shape[1]
            or not _ints_ok(start, b) or not _ints_ok(new, b)):
        return False
    if not choose_prefill_attention(b, t, hq, hkv, d, max(end - max(int(start.min()), 0), t)):
        return False
    lib.lmq_prefill_attention(q.data_ptr(), q.stride(1), q.stride(2), k.data_ptr(), k.stride(0), k.stride(1),
                              v.data_ptr(), v.stride(0), v.stride(1), table.data_ptr(), table.stride(0),
                              start.data_ptr(), new.data_ptr(), end, b, t, out.data_ptr(), out.stride(1),
                              out.stride(2), hq, hkv, d, float(scale), torch.get_num_threads())
    return True
