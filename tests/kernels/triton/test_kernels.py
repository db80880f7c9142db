"""Tests of the Triton decode-attention kernel against the torch reference.

CPU (`interpreter` tests): the kernels run under Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1`` before triton is imported). GPU (`gpu` tests): the kernels compiled.
"""

import math

import pytest
import torch

from lmq_kernels.triton import choose_num_splits, decode_attention, decode_attention_reference


def _make(B, Hkv, G, S, D, end, dtype=torch.float32, device="cpu", gen=None, starts=None, poison=True):
    Hq = Hkv * G
    q = torch.randn(B, Hq, D, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(B, Hkv, S, D, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(device=device, dtype=dtype)
    if starts is None:
        starts = torch.randint(0, end, (B,), generator=gen).tolist()
        # always cover a full row and a row with a single valid token
        starts[0] = 0
        if B > 1:
            starts[1] = end - 1
    start = torch.tensor(starts, dtype=torch.int32, device=device)
    if poison:  # padding and columns past `end` must never be read
        cols = torch.arange(S, device=device).view(1, 1, S)
        pad = (cols < start.view(B, 1, 1)) | (cols >= end)
        k = k.masked_fill(pad.unsqueeze(-1), float("nan"))
        v = v.masked_fill(pad.unsqueeze(-1), float("inf"))
    return q, k, v, start


# ----------------------------------------------------------------------------- CPU (interpreter)

@pytest.mark.interpreter
@pytest.mark.parametrize(
    "B,Hkv,G,S,D,end,splits,end_as_tensor",
    [
        (3, 2, 1, 48, 16, 45, 3, True),
        (3, 2, 2, 40, 32, 40, None, True),
        (4, 1, 3, 70, 16, 61, 4, False),
        (3, 2, 4, 64, 64, 50, None, True),
        (2, 1, 8, 37, 16, 33, 2, True),
        (2, 1, 16, 50, 16, 47, 3, False),
        (2, 2, 3, 33, 24, 30, 2, True),  # head dim not a power of two
    ],
)
def test_decode_matches_reference_fp32(B, Hkv, G, S, D, end, splits, end_as_tensor):
    gen = torch.Generator().manual_seed(1000 * G + S)
    q, k, v, start = _make(B, Hkv, G, S, D, end, gen=gen)
    e = torch.tensor([end], dtype=torch.int32) if end_as_tensor else end
    out = decode_attention(q, k, v, start, e, num_splits=splits, block_n=16)
    ref = decode_attention_reference(q, k, v, start, end, compute_dtype=torch.float64)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def _scatter_pages(k, v, gen):
    """Dense K/V [B, Hkv, S, D] scattered into a paged store [N, Hkv, D] in a random slot order, with the page
    table [B, S] that reads them back (lmq_backend/cache/kv_store.py's layout); unused slots hold NaN."""
    B, Hkv, S, D = k.shape
    n = 3 * B * S + 7
    order = torch.randperm(n, generator=gen)[: B * S]
    table = order.view(B, S).to(torch.int32).to(k.device)
    stores = []
    for x in (k, v):
        store = torch.full((n, Hkv, D), float("nan"), dtype=x.dtype, device=x.device)
        store[table.long()] = x.transpose(1, 2)
        stores.append(store)
    return stores[0], stores[1], table


def _paged_case(B, Hkv, G, S, D, end, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, start = _make(B, Hkv, G, S, D, end, dtype=dtype, device=device, gen=gen)
    ks, vs, table = _scatter_pages(k, v, gen)
    return q, k, v, ks, vs, table, start


@pytest.mark.interpreter
@pytest.mark.parametrize("B,Hkv,G,S,D,end,splits", [(3, 2, 2, 40, 32, 40, None), (4, 1, 3, 70, 16, 61, 4),
                                                    (2, 2, 4, 64, 64, 50, 2)])
def test_paged_decode_reads_through_the_table(B, Hkv, G, S, D, end, splits):
    """The paged kernel over a store in random slot order equals the dense kernel's reference: a wrong slot
    lookup reads another row's K/V or a NaN slot."""
    q, k, v, ks, vs, table, start = _paged_case(B, Hkv, G, S, D, end, torch.float32, "cpu", 50 + S)
    out = decode_attention(q, ks, vs, start, torch.tensor([end], dtype=torch.int32), num_splits=splits,
                           block_n=16, table=table)
    ref = decode_attention_reference(q, k, v, start, end, compute_dtype=torch.float64)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def _new_token_case(B, nrows, Hkv, G, S, D, end, qk_norm, dtype, device, seed):
    """A decode step's inputs: the QKV projection [B, Hq + 2 Hkv, D], the rows' positions, RoPE's inv_freq,
    QK-norm weights, a paged store (random slot order, NaN where unread) and its table; rows >= nrows are a
    graph bucket's padding (start = S). The new token goes to column end - 1."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, ks, vs, table, start = _paged_case(B, Hkv, G, S, D, end, dtype, "cpu", seed)
    start = start.clamp(max=end - 1)
    start[nrows:] = S
    Hq = Hkv * G
    qkv = torch.randn(B, Hq + 2 * Hkv, D, generator=gen).to(dtype)
    positions = (end - 1 - start).to(torch.int32)
    positions[nrows:] = 0
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    norms = [(1 + 0.3 * torch.randn(D, generator=gen)).to(dtype) if qk_norm else None for _ in range(2)]
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return (to(qkv), to(ks), to(vs), to(table), to(start), to(positions), to(inv_freq), [to(n) for n in norms],
            torch.tensor([nrows], dtype=torch.int32, device=device))


def _rope_then_attend(qkv, ks, vs, table, start, end, positions, inv_freq, norms, nrows, **kw):
    """The step's two launches: the RoPE/append kernel (the engine's launch), then attention over the roped
    queries."""
    from lmq_kernels.triton.ops import rope_append

    B, heads, D = qkv.shape
    Hkv = ks.shape[1]
    Hq = heads - 2 * Hkv
    q = torch.empty(B, Hq, D, dtype=qkv.dtype, device=qkv.device)
    end_t = torch.tensor([end - 1], dtype=torch.int32, device=qkv.device)
    rope_append(qkv.view(B, -1), positions, inv_freq, norms[0], norms[1], 1e-6, q, ks, vs, table, end_t, nrows,
                1, B, Hq, Hkv)
    end_t = torch.tensor([end], dtype=torch.int32, device=qkv.device)
    return decode_attention(q, ks, vs, start, end_t, table=table, **kw)


def _fused_new_token(qkv, ks, vs, table, start, end, positions, inv_freq, norms, nrows, **kw):
    from lmq_kernels.triton import NewToken

    Hq = qkv.shape[1] - 2 * ks.shape[1]
    end_t = torch.tensor([end], dtype=torch.int32, device=qkv.device)
    return decode_attention(qkv[:, :Hq], ks, vs, start, end_t, table=table,
                            new_token=NewToken(positions, inv_freq, norms[0], norms[1], 1e-6, nrows), **kw)


NEW_TOKEN_CASES = [  # B, nrows, Hkv, G, S, D, end, qk_norm, splits, rows
    (3, 3, 2, 2, 40, 32, 37, False, None, 1),
    (4, 3, 1, 4, 70, 16, 61, True, 4, 1),
    (4, 4, 2, 2, 64, 32, 50, True, 3, 2),     # two rows a program (cascade), their new columns in other chunks
    (5, 4, 2, 4, 48, 16, 48, False, 1, 4),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("B,nrows,Hkv,G,S,D,end,qk_norm,splits,rows", NEW_TOKEN_CASES)
def test_attention_appends_the_new_token_as_the_rope_kernel_does(B, nrows, Hkv, G, S, D, end, qk_norm, splits, rows):
    """decode_attention(new_token=...) (QK-norm, RoPE and the K/V append inside the attention's programs) gives
    the two-launch step's bits: the same output, the same store (the new column written, padding rows and every
    other slot untouched)."""
    args = _new_token_case(B, nrows, Hkv, G, S, D, end, qk_norm, torch.float32, "cpu", 7 * S + D)
    kw = dict(num_splits=splits, block_n=16, rows=rows)
    ks2, vs2 = args[1].clone(), args[2].clone()
    ref = _rope_then_attend(*args[:5], end, *args[5:], **kw)
    out = _fused_new_token(args[0], ks2, vs2, *args[3:5], end, *args[5:], **kw)
    assert torch.isfinite(out[:nrows]).all()
    assert torch.equal(out[:nrows], ref[:nrows])
    for a, b in ((ks2, args[1]), (vs2, args[2])):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    new = args[3][torch.arange(nrows), end - 1].long()
    assert torch.isfinite(ks2[new]).all() and torch.isfinite(vs2[new]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,nrows,rows", [(1, 1, 1), (16, 13, 1), (64, 61, None)])
def test_attention_appends_the_new_token_cuda(dtype, B, nrows, rows):
    args = _new_token_case(B, nrows, 8, 4, 2048, 64, 1999, True, dtype, "cuda", 5 + B)
    ks2, vs2 = args[1].clone(), args[2].clone()
    ref = _rope_then_attend(*args[:5], 1999, *args[5:], rows=rows)
    out = _fused_new_token(args[0], ks2, vs2, *args[3:5], 1999, *args[5:], rows=rows)
    torch.cuda.synchronize()
    print(f"{dtype} B={B}: output bits equal {torch.equal(out[:nrows], ref[:nrows])}, max diff "
          f"{(out[:nrows].float() - ref[:nrows].float()).abs().max().item():.3e}")
    torch.testing.assert_close(out[:nrows], ref[:nrows], atol=_CUDA_TOL[dtype], rtol=0)
    for a, b in ((ks2, args[1]), (vs2, args[2])):
        torch.testing.assert_close(a.nan_to_num(7.0), b.nan_to_num(7.0), atol=_CUDA_TOL[dtype], rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_cuda(dtype):
    q, k, v, ks, vs, table, start = _paged_case(16, 8, 4, 2048, 64, 2000, dtype, "cuda", 3)
    out = decode_attention(q, ks, vs, start, torch.tensor([2000], dtype=torch.int32, device="cuda"), table=table)
    ref = decode_attention_reference(q, k, v, start, 2000, compute_dtype=torch.float64)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.interpreter
@pytest.mark.parametrize("G,use_dot", [(2, True), (16, False)])
def test_both_inner_products(G, use_dot):
    """tl.dot path and broadcast multiply-reduce path, each off its default G."""
    gen = torch.Generator().manual_seed(7 + G)
    B, Hkv, S, D, end = 2, 1, 40, 16, 38
    q, k, v, start = _make(B, Hkv, G, S, D, end, gen=gen)
    out = decode_attention(q, k, v, start, end, num_splits=3, block_n=16, use_dot=use_dot)
    ref = decode_attention_reference(q, k, v, start, end, compute_dtype=torch.float64)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.interpreter
def test_unfused_reduction_and_ticket_reset():
    """Separate merge kernel (fused_reduce=False) and repeated fused launches (tickets reset)."""
    gen = torch.Generator().manual_seed(21)
    B, Hkv, G, S, D, end = 3, 2, 4, 64, 16, 60
    q, k, v, start = _make(B, Hkv, G, S, D, end, gen=gen)
    ref = decode_attention_reference(q, k, v, start, end, compute_dtype=torch.float64)
    unfused = decode_attention(q, k, v, start, end, num_splits=4, block_n=16, fused_reduce=False)
    torch.testing.assert_close(unfused, ref, atol=1e-5, rtol=1e-5)
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, k, v, start, end, num_splits=4, block_n=16, out=out)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.interpreter
def test_out_param_strided_inputs_and_scale():
    gen = torch.Generator().manual_seed(3)
    B, Hkv, G, S, D, end = 3, 2, 2, 40, 16, 36
    q, k, v, start = _make(B, Hkv, G, S, D, end, gen=gen, poison=False)
    # q as a slice of a fused qkv projection, caches as views of a larger capacity
    qkv = torch.randn(B, Hkv * G + 2 * Hkv, D, generator=gen)
    qkv[:, : Hkv * G] = q
    q_view = qkv[:, : Hkv * G]
    big_k = torch.randn(B, Hkv, S + 8, D, generator=gen)
    big_v = torch.randn(B, Hkv, S + 8, D, generator=gen)
    big_k[:, :, :S] = k
    big_v[:, :, :S] = v
    k_view, v_view = big_k[:, :, :S], big_v[:, :, :S]
    out = torch.full((B, Hkv * G, D), float("nan"))
    res = decode_attention(q_view, k_view, v_view, start, end, sm_scale=0.3, out=out, num_splits=2, block_n=16)
    assert res is out
    ref = decode_attention_reference(q, k, v, start, end, sm_scale=0.3, compute_dtype=torch.float64)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.interpreter
def test_default_split_heuristic_many_splits():
    """B * H_kv small: the default heuristic must split the range (num_splits > 1)."""
    gen = torch.Generator().manual_seed(11)
    B, Hkv, G, S, D, end = 2, 1, 4, 96, 16, 90
    splits, chunk = choose_num_splits(B, Hkv, S, 16)
    assert splits > 1
    q, k, v, start = _make(B, Hkv, G, S, D, end, gen=gen, starts=[0, 89])
    out = decode_attention(q, k, v, start, torch.tensor([end], dtype=torch.int32), block_n=16)
    ref = decode_attention_reference(q, k, v, start, end, compute_dtype=torch.float64)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_choose_num_splits_shape_only():
    for B in (1, 2, 4, 16, 64):
        for S in (1, 17, 512, 2048, 4096, 32768):
            for bn in (16, 32, 64):
                splits, chunk = choose_num_splits(B, 8, S, bn)
                assert splits >= 1 and chunk % bn == 0
                assert splits * chunk >= S and (splits - 1) * chunk < S
    # enough programs to fill an H200 at batch 1, one split when the batch alone fills it
    assert choose_num_splits(1, 8, 2048, 64)[0] * 8 >= 132
    assert choose_num_splits(64, 8, 2048, 64)[0] == 1


def test_reference_masks_padding():
    gen = torch.Generator().manual_seed(5)
    B, Hkv, G, S, D, end = 2, 1, 2, 12, 8, 10
    q, k, v, start = _make(B, Hkv, G, S, D, end, gen=gen, starts=[3, 9])
    ref = decode_attention_reference(q, k, v, start, end)
    # row 1 has a single valid token: the output is its value
    torch.testing.assert_close(ref[1], v[1, :, 9].repeat_interleave(G, 0))
    # row 0 equals plain attention over the valid slice
    kk = k[0, :, 3:end].repeat_interleave(G, 0)
    vv = v[0, :, 3:end].repeat_interleave(G, 0)
    p = torch.softmax((q[0].unsqueeze(1) @ kk.transpose(1, 2)).squeeze(1) / math.sqrt(D), -1)
    torch.testing.assert_close(ref[0], (p.unsqueeze(1) @ vv).squeeze(1), atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- GPU

# max abs error (outputs are O(1); bf16 output rounding alone is up to 1.6e-2 at |x| in [4, 8))
_CUDA_TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}
# relative error ||out - ref|| / ||ref||
_CUDA_REL = {torch.float32: 1e-5, torch.bfloat16: 5e-3, torch.float16: 1e-3}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "B,Hkv,G,S,D,end",
    [
        (1, 8, 4, 2048, 64, 2048),
        (16, 8, 4, 2048, 64, 1999),
        (3, 3, 3, 1000, 64, 777),
        (5, 2, 2, 4096, 128, 3000),
        (2, 4, 1, 300, 128, 300),
        (4, 2, 8, 1024, 128, 1024),
        (7, 2, 16, 600, 64, 513),
        (64, 8, 4, 512, 64, 500),
    ],
)
def test_cuda_matches_reference(dtype, B, Hkv, G, S, D, end):
    gen = torch.Generator().manual_seed(B * 131 + S + G)
    q, k, v, start = _make(B, Hkv, G, S, D, end, dtype=dtype, device="cuda", gen=gen)
    out = torch.full_like(q, float("nan"))
    end_t = torch.tensor([end], dtype=torch.int32, device="cuda")
    decode_attention(q, k, v, start, end_t, out=out)
    unfused = decode_attention(q, k, v, start, end_t, fused_reduce=False)
    torch.testing.assert_close(unfused, out, atol=_CUDA_TOL[dtype], rtol=0)
    ref = decode_attention_reference(q, k, v, start, end, compute_dtype=torch.float64).double()
    err = (out.double() - ref).abs().max().item()
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    print(f"cuda {dtype} B={B} Hkv={Hkv} G={G} S={S} D={D} end={end}: max_abs={err:.3e} rel={rel:.3e}")
    assert torch.isfinite(out).all()
    assert err <= _CUDA_TOL[dtype], err
    assert rel <= _CUDA_REL[dtype], rel


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graph_replay_with_changing_end(dtype):
    B, Hkv, G, S, D = 4, 8, 4, 1024, 64
    gen = torch.Generator().manual_seed(99)
    q, k, v, _ = _make(B, Hkv, G, S, D, S, dtype=dtype, device="cuda", gen=gen, poison=False)
    start = torch.zeros(B, dtype=torch.int32, device="cuda")
    end = torch.tensor([10], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            decode_attention(q, k, v, start, end, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, k, v, start, end, out=out)
    for e, starts in [(10, [0, 3, 9, 5]), (500, [0, 499, 100, 250]), (1024, [1023, 0, 700, 64]), (65, [64, 1, 2, 3])]:
        end.fill_(e)
        start.copy_(torch.tensor(starts, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        ref = decode_attention_reference(q, k, v, start, e, compute_dtype=torch.float64).double()
        err = (out.double() - ref).abs().max().item()
        assert err <= _CUDA_TOL[dtype], (e, err)


# ----------------------------------------------------------------------------- the fused step's kernels

@pytest.mark.interpreter
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("in_attention", [True, False])
def test_fused_step_and_prefill_kernels_match_torch_ops(arch, in_attention):
    """The fused decoder's Triton kernels (RMSNorm, q/k norm + RoPE + K/V append for one and for many tokens
    a row with left padding, SiLU-mul, decode attention, which rotates and appends a step's new token itself
    or not) against the ops that serve the CPU (C or torch): a prefill of ragged rows, then decode steps, in
    float32."""
    from support.fused import assert_same_forwards, prefill_then_steps, tiny_llama, tiny_qwen3

    model = tiny_llama(seed=7) if arch == "llama" else tiny_qwen3(seed=7)

    def use_triton(decoder):
        decoder.triton = True
        decoder.new_token_in_attention = in_attention

    assert_same_forwards(prefill_then_steps(model, use_triton), prefill_then_steps(model))
