"""The Triton programs of `decode_attention` (the layout, the launch and the heuristics are there).

Stage 1 (``_stage1_src``), grid ``(ceil(B / ROWS) * H_kv, num_splits)``: a program takes ``ROWS`` consecutive
rows, one KV head and one chunk. Chunks are counted from each row's own first column: chunk ``s`` of row
``b`` is its tokens ``[s * CHUNK, (s + 1) * CHUNK)``, columns ``[start[b] + s * CHUNK, ...)`` clipped to
``end``, so a token's chunk and tile depend on its position in the row, never on the other rows. The
``G`` query heads of each row that share the KV head are stacked into one block of ``M`` query rows
(``ROWS * GP``, padded to 16 for ``tl.dot``).

Cascade: the program first compares the rows' page-table entries tile by tile (``BLOCK_N`` positions). The
leading tiles where every row with tokens has as many there, starting and ending at the same store slots,
are a prefix the rows share in the trie (a slot holds one token of one trie path, so a row that reads it
at the same position reads the same slots before it: `cache/kv_store.py`); their K/V is loaded once and
scored against the whole block of queries. From the first tile that differs on, each row's tiles are
loaded and scored in turn (one pass a row). Either way every query row goes through the same operations
on the same tile (its own dot-product row, the same masks, the same online-softmax update), so a row's
result does not depend on which rows share its program: the same bits batched or alone, for a given
``CHUNK`` and ``BLOCK_N``.

New token (``NEW_TOKEN``, the fused decode step): ``Q`` is the step's QKV projection instead of roped
queries. Each program rotates its query heads itself (``_roped_heads``: QK-norm and RoPE, rounded as the
step's RoPE kernel rounds), and the program whose chunk holds a row's new column (``end - 1``) rotates that
row's k head and writes it and the v head to the row's slot there before it reads its tiles: one launch a
layer instead of a RoPE/append kernel and the attention.

It writes the normalised partial output and its log-sum-exp (base 2) per chunk; the last program of a
(block, KV head) to take a ticket (``acq_rel`` atomic) merges the chunks of its rows in chunk order and
writes the output (``FUSED_REDUCE``); ``_stage2_src`` is that merge as a separate kernel. With one chunk,
stage 1 writes the output directly.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile(q, k_base, v_base, stride_ks, stride_vs, slots, mask_n, upd, offs_d, mask_d, m_i, l_i, acc, qk_scale,
          USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr):
    """One tile of K/V (store slots `slots`, valid where `mask_n`) into the online softmax of the query rows
    `upd`; the other rows' state passes through unchanged (the same operations for a row whoever shares
    the tile)."""
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(k_base + slots[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + slots[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
    if USE_DOT:
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    else:
        qk = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
    qk = qk * qk_scale
    qk = tl.where(upd[:, None] & mask_n[None, :], qk, float("-inf"))
    m_new = tl.where(upd, tl.maximum(m_i, tl.max(qk, axis=1)), m_i)
    alpha = tl.where(upd, tl.exp2(m_i - m_new), 1.0)
    p = tl.where(upd[:, None], tl.exp2(qk - m_new[:, None]), 0.0)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if USE_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    else:
        pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _rope_table(pos, INV_FREQ, D: tl.constexpr, HALF: tl.constexpr):
    """RoPE's cos and sin at positions `pos` ([R]) for each of a head's D elements: [R, D] each."""
    offs = tl.arange(0, D)
    freq = pos.to(tl.float32)[:, None] * tl.load(INV_FREQ + tl.where(offs < HALF, offs, offs - HALF))[None, :]
    return tl.cos(freq), tl.sin(freq)


@triton.jit
def _roped_heads(SRC, rows64, ok, stride_row, stride_h, head, c, s, NORM_W, eps, dtype,
                 D: tl.constexpr, HALF: tl.constexpr, QK_NORM: tl.constexpr):
    """Head `head` of rows `rows64` of a QKV projection ([R] each; rows `stride_row`, heads `stride_h` apart),
    RMS-normed (QK_NORM) and rotated by RoPE (`c`, `s`: `_rope_table`'s, [R, D] or [1, D]), rounded to `dtype`
    where the fused step's RoPE kernel rounds (`kernels/triton/ops.py`): [R, D] in `dtype`."""
    offs = tl.arange(0, D)
    lo = offs < HALF
    pair = tl.where(lo, offs + HALF, offs - HALF)     # the other half of each rotated pair
    base = SRC + rows64[:, None] * stride_row + head[:, None] * stride_h
    m = ok[:, None] & (offs < D)[None, :]
    x = tl.load(base + offs[None, :], mask=m, other=0.0).to(tl.float32)
    xp = tl.load(base + pair[None, :], mask=m, other=0.0).to(tl.float32)
    if QK_NORM:
        sq = x * x
        rstd = tl.rsqrt((tl.sum(tl.where(lo[None, :], sq, 0.0), axis=1) +
                         tl.sum(tl.where(lo[None, :], 0.0, sq), axis=1)) / D + eps)[:, None]
        w = tl.load(NORM_W + offs).to(tl.float32)[None, :]
        wp = tl.load(NORM_W + pair).to(tl.float32)[None, :]
        x = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
        xp = ((xp * rstd).to(dtype).to(tl.float32) * wp).to(dtype).to(tl.float32)
    return tl.where(lo[None, :], x * c - xp * s, x * c + xp * s).to(dtype)


def _stage1_src(
    Q, K, V, TABLE, stride_tb, START, END_PTR, end_val,
    MID_O, MID_LSE, OUT, COUNTER,
    POS, INV_FREQ, QN_W, KN_W, NROWS, eps,  # NEW_TOKEN only
    qk_scale,  # sm_scale * log2(e)
    B, H_KV, CHUNK,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh,
    NUM_SPLITS,
    G: tl.constexpr, GP: tl.constexpr, ROWS: tl.constexpr, M: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    END_FROM_PTR: tl.constexpr, USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, FUSED_REDUCE: tl.constexpr, SPLIT_TILE: tl.constexpr,
    PAGED: tl.constexpr, NEW_TOKEN: tl.constexpr, QK_NORM: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    blk = pid // H_KV
    kvh = pid % H_KV
    kvh64 = kvh.to(tl.int64)
    if END_FROM_PTR:
        end = tl.load(END_PTR).to(tl.int32)
    else:
        end = end_val

    # the block's rows (r) and its stacked query rows (m = r * GP + head within the KV head's group)
    offs_r = tl.arange(0, ROWS)
    b_r = blk * ROWS + offs_r
    start_r = tl.load(START + b_r, mask=b_r < B, other=0).to(tl.int32)
    lo_r = start_r + split * CHUNK
    hi_r = tl.where(b_r < B, tl.minimum(lo_r + CHUNK, end), lo_r)
    offs_m = tl.arange(0, M)
    r_m = offs_m // GP
    b_m = blk * ROWS + r_m
    valid_m = (r_m < ROWS) & (offs_m % GP < G) & (b_m < B)
    heads_m = (kvh * G + offs_m % GP).to(tl.int64)
    b_m64 = b_m.to(tl.int64)
    start_m = tl.load(START + b_m, mask=valid_m, other=0).to(tl.int32)
    lo_m = start_m + split * CHUNK
    hi_m = tl.where(valid_m, tl.minimum(lo_m + CHUNK, end), lo_m)

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    if NEW_TOKEN:  # Q is the step's QKV projection: q heads rotated here
        if ROWS == 1:  # one position: one row of cos/sin for every query head (and the k head below)
            cos_r, sin_r = _rope_table(tl.load(POS + b_r, mask=b_r < B, other=0), INV_FREQ, D, D // 2)
            cos_m, sin_m = cos_r, sin_r
        else:
            cos_m, sin_m = _rope_table(tl.load(POS + b_m, mask=valid_m, other=0), INV_FREQ, D, D // 2)
        q = _roped_heads(Q, b_m64, valid_m, stride_qb, stride_qh, heads_m, cos_m, sin_m, QN_W, eps,
                         K.dtype.element_ty, D, D // 2, QK_NORM)
    else:
        q = tl.load(Q + b_m64[:, None] * stride_qb + heads_m[:, None] * stride_qh + offs_d[None, :],
                    mask=valid_m[:, None] & mask_d[None, :], other=0.0)
    if not USE_DOT:
        q = q.to(tl.float32)
    if PAGED:  # K/V [N, H_kv, D]: column c of row b is slot TABLE[b, c]
        k_base = K + kvh64 * stride_kh
        v_base = V + kvh64 * stride_vh
    else:  # dense [B, H_kv, S, D], one row a program (ROWS == 1): the "slot" is the column
        k_base = K + blk.to(tl.int64) * stride_kb + kvh64 * stride_kh
        v_base = V + blk.to(tl.int64) * stride_vb + kvh64 * stride_vh

    if NEW_TOKEN:
        # each row's new token (column end - 1) is in one chunk: that chunk's program rotates its k head and
        # writes it and its v head to the row's slot there, then reads them back with the other columns
        # (the barrier makes every thread's stores visible to the program's loads)
        new_col = end - 1
        new_r = (b_r < tl.load(NROWS)) & (start_r <= new_col) & ((new_col - start_r) // CHUNK == split)
        b_r64 = b_r.to(tl.int64)
        slot_r = tl.load(TABLE + b_r64 * stride_tb + new_col, mask=new_r, other=0).to(tl.int64)
        if ROWS > 1:
            cos_r, sin_r = _rope_table(tl.load(POS + b_r, mask=new_r, other=0), INV_FREQ, D, D // 2)
        k_head = H_KV * G + kvh64 + 0 * b_r64   # the k head of every row: one per row, as `_roped_heads` takes
        k_new = _roped_heads(Q, b_r64, new_r, stride_qb, stride_qh, k_head, cos_r, sin_r,
                             KN_W, eps, K.dtype.element_ty, D, D // 2, QK_NORM)
        v_src = Q + b_r64[:, None] * stride_qb + (H_KV * G + H_KV + kvh64) * stride_qh + offs_d[None, :]
        v_new = tl.load(v_src, mask=new_r[:, None] & mask_d[None, :], other=0.0)
        tl.store(k_base + slot_r[:, None] * stride_ks + offs_d[None, :], k_new, mask=new_r[:, None] & mask_d[None, :])
        tl.store(v_base + slot_r[:, None] * stride_vs + offs_d[None, :], v_new.to(V.dtype.element_ty),
                 mask=new_r[:, None] & mask_d[None, :])
        tl.debug_barrier()

    # the leading tiles every row with tokens in this chunk shares: as many tokens there, from the same
    # first and last slot
    span = tl.max(hi_r - lo_r)
    present = hi_r > lo_r
    ref = tl.min(tl.where(present, offs_r, ROWS))
    b_ref = blk * ROWS + ref
    if ROWS == 1:
        n_shared = span
    else:
        tab_r = TABLE + b_r.to(tl.int64) * stride_tb
        n_shared = span * 0
        still = span >= 0
        at_ref = offs_r == ref
        for t in range(0, span, BLOCK_N):
            n_r = tl.minimum(hi_r - lo_r - t, BLOCK_N)
            first_r = tl.load(tab_r + lo_r + t, mask=present & (n_r > 0), other=-1)
            last_r = tl.load(tab_r + lo_r + t + n_r - 1, mask=present & (n_r > 0), other=-1)
            n_ref = tl.sum(tl.where(at_ref, n_r, 0))
            f_ref = tl.sum(tl.where(at_ref, first_r, 0))
            l_ref = tl.sum(tl.where(at_ref, last_r, 0))
            odd = present & ((n_r != n_ref) | (first_r != f_ref) | (last_r != l_ref))
            still = still & (tl.max(odd.to(tl.int32)) == 0)
            n_shared += tl.where(still, tl.minimum(n_ref, BLOCK_N), 0)

    m_i = tl.full([M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([M], dtype=tl.float32)
    acc = tl.zeros([M, BLOCK_D], dtype=tl.float32)
    # the shared tiles: read once (the first present row's slots) for every row
    lo_ref = tl.load(START + b_ref, mask=ref < ROWS, other=0).to(tl.int32) + split * CHUNK
    hi_ref = tl.minimum(lo_ref + CHUNK, end)
    for t in range(0, n_shared, BLOCK_N):
        cols = lo_ref + t + tl.arange(0, BLOCK_N)
        mask_n = cols < hi_ref
        if PAGED:
            slots = tl.load(TABLE + b_ref.to(tl.int64) * stride_tb + cols, mask=mask_n, other=0).to(tl.int64)
        else:
            slots = cols.to(tl.int64)
        m_i, l_i, acc = _tile(q, k_base, v_base, stride_ks, stride_vs, slots, mask_n, valid_m & (lo_m + t < hi_m),
                              offs_d, mask_d, m_i, l_i, acc, qk_scale, USE_DOT, DOT_PREC)
    # the rest: a row at a time
    if ROWS > 1:
        for r in tl.static_range(ROWS):
            at_r = offs_r == r
            lo = tl.sum(tl.where(at_r, lo_r, 0))
            hi = tl.sum(tl.where(at_r, hi_r, 0))
            for t in range(n_shared, hi - lo, BLOCK_N):
                cols = lo + t + tl.arange(0, BLOCK_N)
                mask_n = cols < hi
                slots = tl.load(TABLE + (blk * ROWS + r).to(tl.int64) * stride_tb + cols, mask=mask_n,
                                other=0).to(tl.int64)
                m_i, l_i, acc = _tile(q, k_base, v_base, stride_ks, stride_vs, slots, mask_n,
                                      valid_m & (r_m == r) & (lo_m + t < hi_m),
                                      offs_d, mask_d, m_i, l_i, acc, qk_scale, USE_DOT, DOT_PREC)

    work_m = valid_m & (lo_m < hi_m)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    out_ptrs = OUT + b_m64[:, None] * stride_ob + heads_m[:, None] * stride_oh + offs_d[None, :]
    if SINGLE_SPLIT:
        tl.store(out_ptrs, o.to(OUT.dtype.element_ty), mask=valid_m[:, None] & mask_d[None, :])
    else:
        # MID_O: [B, Hq, NUM_SPLITS, BLOCK_D] fp32; MID_LSE: [B, Hq, NUM_SPLITS] fp32 (contiguous)
        row0 = (b_m64 * (H_KV * G) + heads_m) * NUM_SPLITS  # [M]
        tl.store(MID_O + (row0 + split)[:, None] * BLOCK_D + offs_d[None, :], o,
                 mask=work_m[:, None] & (offs_d < BLOCK_D)[None, :])
        tl.store(MID_LSE + row0 + split, m_i + tl.log2(l_safe), mask=work_m)
        if FUSED_REDUCE:
            # The last of this (block, kv head)'s programs to finish merges all partials. acq_rel: our
            # partial stores are released before the increment; the last program acquires everybody else's.
            ticket = tl.atomic_add(COUNTER + pid, 1, sem="acq_rel")
            if ticket == NUM_SPLITS - 1:
                tl.atomic_xchg(COUNTER + pid, 0, sem="relaxed")  # ready for the next launch
                length = end - start_m
                last = tl.where(valid_m & (length > 0), (length - 1) // CHUNK, -1)  # [M]
                m_run = tl.full([M], float("-inf"), dtype=tl.float32)
                den = tl.zeros([M], dtype=tl.float32)
                num = tl.zeros([M, BLOCK_D], dtype=tl.float32)
                for s0 in range(0, tl.max(last) + 1, SPLIT_TILE):
                    offs_s = s0 + tl.arange(0, SPLIT_TILE)
                    ms = offs_s[None, :] <= last[:, None]  # [M, SPLIT_TILE]
                    rows = row0[:, None] + offs_s[None, :]
                    lse_t = tl.load(MID_LSE + rows, mask=ms, other=float("-inf"))
                    o_t = tl.load(MID_O + rows[:, :, None] * BLOCK_D + offs_d[None, None, :],
                                  mask=ms[:, :, None] & (offs_d < BLOCK_D)[None, None, :], other=0.0)
                    m_new = tl.maximum(m_run, tl.max(lse_t, axis=1))
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = tl.exp2(m_run - m_safe)
                    w = tl.exp2(lse_t - m_safe[:, None])
                    den = den * alpha + tl.sum(w, axis=1)
                    num = num * alpha[:, None] + tl.sum(w[:, :, None] * o_t, axis=1)
                    m_run = m_new
                den = tl.where(den > 0.0, den, 1.0)
                tl.store(out_ptrs, (num / den[:, None]).to(OUT.dtype.element_ty),
                         mask=valid_m[:, None] & mask_d[None, :])


def _stage2_src(
    MID_O, MID_LSE, START, END_PTR, end_val, OUT,
    HQ, CHUNK, NUM_SPLITS,
    stride_ob, stride_oh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr,
    END_FROM_PTR: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // HQ
    h = pid % HQ
    if END_FROM_PTR:
        end = tl.load(END_PTR).to(tl.int32)
    else:
        end = end_val
    length = end - tl.load(START + b).to(tl.int32)
    last = tl.where(length > 0, (length - 1) // CHUNK, -1)

    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = (offs_s <= last) & (offs_s < NUM_SPLITS)
    base = pid.to(tl.int64) * NUM_SPLITS
    lse = tl.load(MID_LSE + base + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(mask_s, tl.exp2(lse - m), 0.0)
    o = tl.load(MID_O + (base + offs_s)[:, None] * BLOCK_D + offs_d[None, :], mask=mask_s[:, None], other=0.0)
    num = tl.sum(w[:, None] * o, axis=0)
    den = tl.sum(w, axis=0)
    den = tl.where(den > 0.0, den, 1.0)
    out = num / den
    tl.store(OUT + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + offs_d, out.to(OUT.dtype.element_ty),
             mask=offs_d < D)
