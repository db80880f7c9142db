"""Flash-decoding attention for one new token per row over a left-padded KV cache.

Cache layout
------------
* Dense K/V (``table`` not given), per layer: ``k_cache, v_cache: [B, H_kv, S, D]``
  with ``S`` the capacity.  Rows are LEFT-padded: row ``b``'s valid tokens occupy
  columns ``[start[b], end)``; ``end`` is common to all rows (after each step
  every row's valid tokens end at the same column).
* K is stored after RoPE.
* The new token of a decode step is written at column ``end``, then
  ``end += 1``.  This kernel attends over ``[start[b], end)`` exactly as
  passed: a caller that has already appended the new token's K/V at the old
  ``end`` passes ``end + 1``.
* Query head ``h`` uses KV head ``h // G`` with ``G = Hq // H_kv`` (Hugging
  Face ``repeat_kv`` order).
* Columns outside ``[start[b], end)`` are never loaded, so their contents
  (stale data, NaN, inf) do not matter.

Paged K/V (the engine's case, ``table`` given)
-----------------------------------------------
With ``table`` (int32 ``[B, S]``), k_cache and v_cache are the backend's K/V
store for one layer, ``[N, H_kv, D]`` (one token per slot, see
``lmq_backend/cache/kv_store.py``), and column ``c`` of row ``b`` is slot
``table[b, c]``: the same left-padded columns, read through the row's page
table. Only columns in ``[start[b], end)`` are looked up.

Kernel design (the programs: ``decode_kernels.py``)
--------------------------------------------------
Stage 1, grid ``(ceil(B / rows) * H_kv, num_splits)``: a program takes ``rows``
consecutive rows, one KV head and one chunk of ``chunk`` tokens (a multiple
of ``BLOCK_N``) counted from each row's first column, with an online softmax
over tiles of ``BLOCK_N``. The ``G`` query heads of every row that share the
KV head are stacked (``tl.dot`` with at least 16 query rows, or a broadcast
multiply-reduce in fp32; ``_pick_config``). A tile whose page-table entries
are the same for every row that has it (a prefix the rows share in the
trie) is read once for all of them (cascade attention); other tiles are read
a row at a time. A row's arithmetic is the same either way, so its output
does not depend on the rows beside it. ``rows`` is 1 below
``CASCADE_MIN_BATCH`` rows (nothing to share, and splits fill the GPU) and
``16 // G`` (rounded to powers of two) above.

Reduction (fused, default): after writing its partials, each program takes a
ticket with an ``acq_rel`` atomic add on a per-(block, kv head) counter; the
program that draws the last ticket merges each row's chunks (log-sum-exp
weighting, 8 chunks per step), writes the output in ``q``'s dtype and resets
the counter to 0 for the next launch. One launch per layer instead of two
(at batch 1 launch latency dominates).
``fused_reduce=False`` uses a separate kernel (``_decode_stage2``, grid
``(B * Hq,)``) instead.  When ``num_splits == 1`` stage 1 writes the final
output directly.  The counters are a persistent per-device buffer, so
launches on one device must not run concurrently on different streams.

CUDA graphs: ``num_splits`` and ``rows`` depend only on ``B``, ``H_kv``, ``S`` and ``D``
(never on ``end``), and ``end`` may be a 1-element int32 device tensor that
the kernels read from memory, so a graph captured once per batch-size bucket
stays valid while ``end`` and ``start`` change between replays.  With
``end`` as a Python int the value is passed as an unspecialised scalar.

On CPU tensors the same kernels run through Triton's interpreter when
``TRITON_INTERPRET=1`` was set before ``triton`` was imported (slow, for tests);
otherwise CPU calls fall back to the torch reference.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from .decode_kernels import _stage1_src, _stage2_src

__all__ = ["decode_attention", "choose_num_splits", "interpreter_active", "NewToken"]


class NewToken(NamedTuple):
    """What `decode_attention` needs to rotate the step's new token itself and append its K/V (the fused
    step's one launch a layer): positions int32 ``[B]`` (the new token's, device), RoPE's inv_freq fp32
    ``[D/2]``, the QK-norm weights ``[D]`` (None: no QK-norm) and epsilon, and ``nrows`` (int32 ``[1]``, device:
    rows ``b >= nrows`` are a graph bucket's padding and write nothing)."""
    positions: torch.Tensor
    inv_freq: torch.Tensor
    q_norm: Optional[torch.Tensor]
    k_norm: Optional[torch.Tensor]
    eps: float
    nrows: torch.Tensor


_JIT_KW = {"_decode_stage1": dict(do_not_specialize=["end_val", "B", "CHUNK", "NUM_SPLITS", "eps"]),
           "_decode_stage2": dict(do_not_specialize=["end_val", "CHUNK", "NUM_SPLITS"])}

_decode_stage1 = triton.jit(**_JIT_KW["_decode_stage1"])(_stage1_src)
_decode_stage2 = triton.jit(**_JIT_KW["_decode_stage2"])(_stage2_src)


def interpreter_active() -> bool:
    """True when Triton's interpreter was enabled (``TRITON_INTERPRET=1``) before
    ``triton`` was first imported; only then can the kernels run on CPU tensors
    (Triton's own ``tl`` helpers are bound to the mode at import time)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        return False
    return isinstance(tl.zeros, InterpretedFunction)


@functools.lru_cache(maxsize=None)
def _interpreted_kernels():
    """Interpreter versions of the kernels, for CPU tensors."""
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(_decode_stage1, InterpretedFunction):
        return _decode_stage1, _decode_stage2
    return (InterpretedFunction(_stage1_src, **_JIT_KW["_decode_stage1"]),
            InterpretedFunction(_stage2_src, **_JIT_KW["_decode_stage2"]))


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The device's multiprocessors (the kernels size their grids by it)."""
    if device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 132  # a large GPU's count, so that CPU tests run the split schedule a GPU would


def _pick_config(G: int, block_d: int, dtype: torch.dtype) -> Tuple[bool, int, int]:
    """(use_dot, BLOCK_N, num_warps) for the stage-1 kernel.

    tl.dot with the query heads padded to 16 rows is faster than the broadcast
    multiply-reduce for every group size measured (bf16, D=64), at batch 1 and
    more so at batch 16, so tl.dot is the default. BLOCK_N / 4 warps: for D=64,
    BLOCK_N=128 is faster than 64 with ragged rows and level with full rows;
    wider heads keep 64 (D=128) or 32 so the K/V tiles fit.
    """
    return True, (128 if block_d <= 64 else 64 if block_d <= 128 else 32), 4


def _mr_block_n(m: int, block_d: int) -> int:
    """BLOCK_N of the multiply-reduce path: the [M, BLOCK_N, BLOCK_D] fp32 product near 8K elements."""
    return max(16, min(64, 8192 // (m * block_d)))


CASCADE_MIN_BATCH = 32


def rows_per_program(B: int, G: int, paged: bool) -> int:
    """Rows a stage-1 program takes: 1 for small batches and dense caches (nothing to share), else as many
    as stack ``G`` query heads each into 16 query rows (the smallest ``tl.dot`` tile)."""
    if not paged or B < CASCADE_MIN_BATCH:
        return 1
    return max(1, 16 // triton.next_power_of_2(G))


_COUNTERS: dict = {}
_MIN_COUNTERS = 8192


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Persistent zeroed int32 tickets for the fused reduction, one per (row, kv head).

    Each launch leaves them at zero again.  Allocated on first use (do one eager
    call before CUDA-graph capture, as usual for warm-up); one decode_attention
    launch at a time per device (launches on one stream are fine).
    """
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decode_attention: call it once eagerly before CUDA-graph capture "
                               f"(ticket buffer of {n} entries not allocated yet)")
        buf = torch.zeros(max(n, _MIN_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def choose_num_splits(B: int, H_kv: int, S: int, block_n: int, num_sms: int = 132) -> Tuple[int, int]:
    """(num_splits, chunk) for capacity ``S``: a function of shapes only, never of ``end``.

    ``B``: the stage-1 programs' blocks of rows. Aims for about 2 programs per SM over ``B * H_kv * num_splits`` stage-1
    programs, with chunks of at least ``max(block_n, 64)`` columns and a multiple of
    ``block_n``.
    """
    S = max(int(S), 1)
    target = 2 * num_sms
    per_split = max(B * H_kv, 1)
    splits = max(1, -(-target // per_split))
    min_chunk = max(block_n, 64)
    splits = min(splits, max(1, -(-S // min_chunk)), 256)
    chunk = -(-S // splits)
    chunk = -(-chunk // block_n) * block_n
    splits = -(-S // chunk)
    return splits, chunk


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: torch.Tensor,
    end: Union[int, torch.Tensor],
    sm_scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    *,
    num_splits: Optional[int] = None,
    block_n: Optional[int] = None,
    use_dot: Optional[bool] = None,
    num_warps: Optional[int] = None,
    fused_reduce: bool = True,
    table: Optional[torch.Tensor] = None,
    rows: Optional[int] = None,
    new_token: Optional[NewToken] = None,
) -> torch.Tensor:
    """Decode attention of one query token per row over a left-padded KV cache.

    q ``[B, Hq, D]`` (RoPE applied); k_cache, v_cache ``[B, H_kv, S, D]`` (last
    dim contiguous), or with ``table`` (int32 ``[B, S]``, device) the paged store's
    ``[N, H_kv, D]`` of one layer, read through it; start int32 ``[B]`` (device
    tensor); end: int32 ``[1]`` device tensor (read by the kernel, CUDA-graph
    safe) or Python int. Attends row ``b`` over columns ``[start[b], end)``.
    Returns ``out`` ``[B, Hq, D]`` in ``q.dtype`` (written in place when given).

    With ``new_token`` (paged only, ``D`` a power of two), ``q`` is the first ``Hq`` heads of the step's QKV
    projection ``[B, Hq + 2 H_kv, D]`` (rows ``q.stride(0)``, heads ``q.stride(1)`` apart), before QK-norm and
    RoPE: the kernel rotates the queries, and writes each row's rotated k head and its v head to the slot of
    column ``end - 1`` of its page table before attending over ``[start[b], end)``.

    The keyword-only knobs override the heuristics (benchmarks/tests only).
    """
    paged = table is not None
    assert q.dim() == 3 and k_cache.dim() == (3 if paged else 4) and v_cache.shape == k_cache.shape
    B, Hq, D = q.shape
    if paged:
        assert table.dim() == 2 and table.shape[0] >= B and table.stride(1) == 1 and table.device == q.device
        Bk, S = B, table.shape[1]
        H_kv, Dk = k_cache.shape[1:]
        # strides as [B, H_kv, S, D] of the dense layout: the kernel's row stride is unused, its column
        # stride is the slot stride
        k_strides = (0, k_cache.stride(1), k_cache.stride(0))
        v_strides = (0, v_cache.stride(1), v_cache.stride(0))
    else:
        Bk, H_kv, S, Dk = k_cache.shape
        k_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
        v_strides = (v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    assert Bk == B and Dk == D, (q.shape, k_cache.shape)
    assert Hq % H_kv == 0, "Hq must be a multiple of H_kv"
    G = Hq // H_kv
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert k_cache.dtype == v_cache.dtype
    assert start.shape == (B,) and start.device == q.device
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    if out is None:
        out = torch.empty_like(q)
    else:
        assert out.shape == q.shape and out.stride(-1) == 1

    block_d = triton.next_power_of_2(D)
    cfg_dot, cfg_bn, cfg_warps = _pick_config(G, block_d, q.dtype)
    rows = rows_per_program(B, G, paged) if rows is None else rows
    assert rows >= 1 and rows & (rows - 1) == 0 and (paged or rows == 1), "rows: a power of two (1 when dense)"
    gp = triton.next_power_of_2(G)
    m = rows * gp
    if use_dot is not None and use_dot != cfg_dot:
        cfg_dot = use_dot
        if not use_dot:
            cfg_bn = _mr_block_n(m, block_d)
    if cfg_dot:
        m = max(m, 16)
    if block_n is not None:
        cfg_bn = block_n
    if num_warps is not None:
        cfg_warps = num_warps
    blocks = -(-B // rows)
    if num_splits is None:
        splits, chunk = choose_num_splits(blocks, H_kv, S, cfg_bn, sm_count(q.device))
    else:
        splits = max(1, min(int(num_splits), -(-S // cfg_bn)))
        chunk = -(-(-(-S // splits)) // cfg_bn) * cfg_bn
        splits = -(-S // chunk)

    if isinstance(end, torch.Tensor):
        assert end.device == q.device and end.numel() >= 1
        end_from_ptr, end_ptr, end_val = True, end, 0
    else:
        end_from_ptr, end_ptr, end_val = False, start, int(end)
        assert 0 <= end_val <= S

    if new_token is not None:
        assert paged and D == block_d and new_token.positions.device == q.device, "new_token: paged, D a power of two"
        pos, inv_freq, eps, nrows = new_token.positions, new_token.inv_freq, float(new_token.eps), new_token.nrows
        qn = new_token.q_norm if new_token.q_norm is not None else inv_freq
        kn = new_token.k_norm if new_token.k_norm is not None else inv_freq
    else:
        pos = inv_freq = qn = kn = nrows = start  # unused
        eps = 0.0
    if q.device.type == "cuda":
        stage1, stage2 = _decode_stage1, _decode_stage2
    elif interpreter_active():
        stage1, stage2 = _interpreted_kernels()
    else:
        # CPU without Triton's interpreter: the kernels cannot run; use the torch reference.
        from .reference import decode_attention_reference

        if new_token is not None:
            raise NotImplementedError("decode_attention(new_token=...) runs the Triton kernel only")
        if paged:  # the dense [B, H_kv, S, D] view of the rows' columns
            k_cache, v_cache = (c[table[:B].long()].transpose(1, 2) for c in (k_cache, v_cache))
        out.copy_(decode_attention_reference(q, k_cache, v_cache, start, end, sm_scale))
        return out

    single = splits == 1
    if single:
        mid_o = mid_lse = out  # unused
    else:
        mid_o = torch.empty((B, Hq, splits, block_d), device=q.device, dtype=torch.float32)
        mid_lse = torch.empty((B, Hq, splits), device=q.device, dtype=torch.float32)

    fused = fused_reduce and not single
    counter = _counters(q.device, blocks * H_kv) if fused else start  # dummy when unused

    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    stage1[(blocks * H_kv, splits)](
        q, k_cache, v_cache, table if paged else start, table.stride(0) if paged else 0, start, end_ptr, end_val,
        mid_o, mid_lse, out, counter,
        pos, inv_freq, qn, kn, nrows, eps,
        float(sm_scale) * 1.4426950408889634,
        B, H_kv, chunk,
        q.stride(0), q.stride(1),
        *k_strides, *v_strides,
        out.stride(0), out.stride(1),
        splits,
        G=G, GP=gp, ROWS=rows, M=m, D=D, BLOCK_D=block_d, BLOCK_N=cfg_bn,
        END_FROM_PTR=end_from_ptr, USE_DOT=cfg_dot, DOT_PREC=dot_prec,
        SINGLE_SPLIT=single, FUSED_REDUCE=fused, SPLIT_TILE=8, PAGED=paged,
        NEW_TOKEN=new_token is not None, QK_NORM=new_token is not None and new_token.q_norm is not None,
        num_warps=cfg_warps,
    )
    if not single and not fused:
        stage2[(B * Hq,)](
            mid_o, mid_lse, start, end_ptr, end_val, out,
            Hq, chunk, splits,
            out.stride(0), out.stride(1),
            D=D, BLOCK_D=block_d, SPLITS_PAD=triton.next_power_of_2(splits),
            END_FROM_PTR=end_from_ptr,
            num_warps=4 if block_d * triton.next_power_of_2(splits) >= 4096 else 2,
        )
    return out
