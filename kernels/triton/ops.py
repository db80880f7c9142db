"""The fused step's Triton kernels: RMSNorm, SiLU-and-multiply, and RoPE + K/V append into the store
(`rope_append` launches it).

Each kernel rounds where Hugging Face's Llama modules round (to the model's dtype between ops), so that the
fused step's logits track the model's forward; their CPU counterparts are in `lmq_kernels.cpu`.
"""
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(X, W, Y, N, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    # one program per row: y = (x * rsqrt(mean(x^2) + eps)).to(dtype) * w  (HF LlamaRMSNorm rounding)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(W + offs, mask=mask, other=0.0)
    y = (x * rstd).to(W.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
    tl.store(Y + row * stride_y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(GU, OUT, I, stride_gu, stride_out, BLOCK: tl.constexpr):
    # grid (rows, cdiv(I, BLOCK)): out = silu(gate) * up, gu = [gate | up]
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(GU + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + I + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)  # HF rounds silu(g) first
    tl.store(OUT + row * stride_out + offs, (act * u).to(OUT.dtype.element_ty), mask=mask)


def rmsnorm(x, w, eps: float, out) -> None:
    """Launch `_rmsnorm_kernel`: out = rmsnorm(x) * w over the rows of x [rows, n]."""
    rows, n = x.shape
    _rmsnorm_kernel[(rows,)](x, w, out, n, x.stride(0), out.stride(0), eps,
                             BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 4096 else 8)


def silu_mul(gu, out) -> None:
    """Launch `_silu_mul_kernel`: out = silu(gate) * up over the rows of gu = [gate | up] [rows, 2 I]."""
    rows, i = out.shape
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(i, block))](gu, out, i, gu.stride(0), out.stride(0), BLOCK=block, num_warps=4)


@triton.jit(do_not_specialize=["T", "N"])  # one compiled kernel for every prefill length
def _rope_append_kernel(
    QKV, POS, INV_FREQ, QN_W, KN_W, Q_OUT, K_CACHE, V_CACHE, TABLE, END, NROWS, T, N,
    stride_qkv, stride_qo_b, stride_qo_h, stride_tb,
    stride_kn, stride_kh, stride_vn, stride_vh,
    eps,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr, QK_NORM: tl.constexpr,
):
    # grid (cdiv(N, BLOCK_T), HQ + 2 HKV): program (i, h) takes head h of tokens r = i BLOCK_T .. + BLOCK_T
    # of the QKV projection ([N, (HQ + 2 HKV) D]). Token r is new token t = r % T of batch row b = r // T;
    # its K/V go to column c = END - (T - 1) + t (a decode step: T = 1, r = b, c = END) of the row's page
    # table, i.e. to store slot s = TABLE[b, c]. Tokens with a negative position (a prefill's left padding)
    # and rows b >= NROWS (a graph bucket's padding) write nothing to the cache.
    #   h <  HQ          : q head -> (norm) -> rope -> Q_OUT[r, h]
    #   h <  HQ + HKV    : k head -> (norm) -> rope -> K_CACHE[s, h - HQ]        (K_CACHE [slots, HKV, D])
    #   else             : v head ->                   V_CACHE[s, h - HQ - HKV]
    r = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)                  # [BLOCK_T] token rows
    h = tl.program_id(1)
    r64 = r.to(tl.int64)
    b64 = r64 // T
    offs = tl.arange(0, BLOCK_H)
    inside = r < N
    mask = inside[:, None] & (offs < HALF)[None, :]                        # [BLOCK_T, BLOCK_H]
    src = QKV + r64[:, None] * stride_qkv + h * D + offs[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = Q_OUT.dtype.element_ty
    col = tl.load(END).to(tl.int64) - (T - 1) + r64 % T
    pos = tl.load(POS + r, mask=inside, other=-1)
    keep = inside & (b64 < tl.load(NROWS).to(tl.int64)) & (pos >= 0)
    write = mask & keep[:, None]
    slot = tl.load(TABLE + b64 * stride_tb + col, mask=keep, other=0).to(tl.int64)
    if h >= HQ + HKV:
        dst = V_CACHE + slot[:, None] * stride_vn + (h - HQ - HKV).to(tl.int64) * stride_vh + offs[None, :]
        tl.store(dst, x1.to(dtype), mask=write)
        tl.store(dst + HALF, x2.to(dtype), mask=write)
    else:
        if QK_NORM:
            if h < HQ:
                wp = QN_W
            else:
                wp = KN_W
            rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
            w1 = tl.load(wp + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
            w2 = tl.load(wp + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
            x1 = (x1 * rstd).to(dtype).to(tl.float32) * w1
            x2 = (x2 * rstd).to(dtype).to(tl.float32) * w2
            x1 = x1.to(dtype).to(tl.float32)
            x2 = x2.to(dtype).to(tl.float32)
        freq = pos.to(tl.float32)[:, None] * tl.load(INV_FREQ + offs, mask=offs < HALF, other=0.0)[None, :]
        c = tl.cos(freq)
        s = tl.sin(freq)
        o1 = x1 * c - x2 * s
        o2 = x2 * c + x1 * s
        if h < HQ:
            dst = Q_OUT + r64[:, None] * stride_qo_b + h * stride_qo_h + offs[None, :]
            tl.store(dst, o1.to(dtype), mask=mask)
            tl.store(dst + HALF, o2.to(dtype), mask=mask)
        else:
            dst = K_CACHE + slot[:, None] * stride_kn + (h - HQ).to(tl.int64) * stride_kh + offs[None, :]
            tl.store(dst, o1.to(dtype), mask=write)
            tl.store(dst + HALF, o2.to(dtype), mask=write)


def rope_append(qkv, positions, inv_freq, q_norm, k_norm, eps: float, q, k_store, v_store, table, end, nrows,
                tokens: int, rows: int, hq: int, hkv: int) -> None:
    """Launch `_rope_append_kernel` over `rows` rows of `tokens` new tokens each (`qkv` [rows x tokens,
    (hq + 2 hkv) D]; `q_norm`, `k_norm` None without QK-norm; `end`, `nrows` one-element int32 device tensors)."""
    d = q.shape[-1]
    n = rows * tokens
    block_t = 1 if tokens == 1 else 16  # a decode step: a program per row and head, as many as can be
    _rope_append_kernel[(triton.cdiv(n, block_t), hq + 2 * hkv)](
        qkv, positions, inv_freq, q_norm if q_norm is not None else inv_freq,
        k_norm if k_norm is not None else inv_freq,
        q, k_store, v_store, table, end, nrows, tokens, n,
        qkv.stride(0), q.stride(0), q.stride(1), table.stride(0),
        k_store.stride(0), k_store.stride(1), v_store.stride(0), v_store.stride(1),
        eps,
        HQ=hq, HKV=hkv, D=d, HALF=d // 2, BLOCK_H=triton.next_power_of_2(d // 2),
        BLOCK_T=block_t, QK_NORM=q_norm is not None, num_warps=1 if block_t == 1 else 4,
    )
