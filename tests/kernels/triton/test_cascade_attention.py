"""Decode attention over page tables whose rows share a prefix (cascade: a shared tile read once for a block
of rows): equal to the reference, and each row's output bit for bit what it is alone."""
import pytest
import torch

from lmq_kernels.triton import decode_attention, decode_attention_reference


def _shared_case(lengths, shared, Hkv, G, D, dtype, device, seed):
    """Rows of the given lengths, left-padded to a common end; row b's first shared[b] tokens are the first
    tokens of a prefix that every row with shared > 0 draws from (the same store slots: a trie's pages), the
    rest are slots of its own. Returns q, the dense K/V per row (for the reference), the store, table, start,
    end. Store slots nobody reads hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    B, end = len(lengths), max(lengths) + 3
    S = end + 5
    n = 4 * B * S + 11
    order = torch.randperm(n, generator=gen)
    prefix, own = order[:S], order[S:]
    table = torch.zeros(B, S, dtype=torch.int32)
    start = torch.tensor([end - n_ for n_ in lengths], dtype=torch.int32)
    used = 0
    for b, (n_, s) in enumerate(zip(lengths, shared)):
        slots = torch.cat([prefix[:s], own[used:used + n_ - s]])
        used += n_ - s
        table[b, end - n_:end] = slots.to(torch.int32)
    kv = [torch.full((n, Hkv, D), float("nan")) for _ in range(2)]
    for x in kv:
        x[prefix] = torch.randn(S, Hkv, D, generator=gen)
        x[own] = torch.randn(len(own), Hkv, D, generator=gen)
    q = torch.randn(B, Hkv * G, D, generator=gen)
    dense = [x[table.long()].transpose(1, 2).clone() for x in kv]  # [B, Hkv, S, D]
    for x in dense:
        x.nan_to_num_(0.0)  # padding columns are masked by the reference
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return (cast(q), [cast(x) for x in dense], [cast(x) for x in kv], table.to(device), start.to(device),
            torch.tensor([end], dtype=torch.int32, device=device))


# rows 0-3 share 40 tokens (a tile and a half of 16), row 4 is a prefix of the others' shared part (its mask
# differs), rows 5-6 share none, row 7 shares 17
CASE = dict(lengths=[60, 71, 45, 52, 30, 33, 64, 41], shared=[40, 40, 40, 40, 30, 0, 0, 17])


@pytest.mark.interpreter
@pytest.mark.parametrize("G,rows", [(4, 4), (2, 8), (3, 4), (4, 2)])
def test_shared_prefix_matches_reference(G, rows):
    q, dense, store, table, start, end = _shared_case(**CASE, Hkv=2, G=G, D=16, dtype=torch.float32,
                                                     device="cpu", seed=G * 10 + rows)
    out = decode_attention(q, *store, start, end, table=table, rows=rows, num_splits=3, block_n=16)
    ref = decode_attention_reference(q, *dense, start, int(end), compute_dtype=torch.float64)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.interpreter
@pytest.mark.parametrize("splits", [1, 3])
def test_a_row_does_not_depend_on_its_neighbours(splits):
    """A row's output is the same bits whether the rows beside it in its program share its tiles (one read for
    all) or not (a read a row), and whatever their queries: each row's arithmetic is its own."""
    q, _, store, table, start, end = _shared_case(**CASE, Hkv=2, G=4, D=16, dtype=torch.float32, device="cpu",
                                                  seed=5)
    kw = dict(table=table, rows=4, num_splits=splits, block_n=16)
    shared = decode_attention(q, *store, start, end, **kw)
    gen = torch.Generator().manual_seed(6)
    n = store[0].shape[0]
    spare = torch.arange(n, n + table.numel(), dtype=torch.int32)  # slots the neighbours move to
    store = [torch.cat([x, torch.randn(len(spare), *x.shape[1:], generator=gen)]) for x in store]
    for b in (1, 4, 6):
        q2, table2 = q.clone(), table.clone()
        for n in range(4 * (b // 4), 4 * (b // 4) + 4):
            if n != b:  # other queries, and slots of their own: nothing shared with row b any more
                q2[n] = torch.randn(q.shape[1:], generator=gen)
                cols = slice(int(start[n]), int(end))
                table2[n, cols] = spare[n * table.shape[1]:][: cols.stop - cols.start]
        alone = decode_attention(q2, *store, start, end, **{**kw, "table": table2})
        assert torch.equal(alone[b], shared[b]), b


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_prefix_cuda(dtype):
    lengths = [1100 + 7 * i for i in range(64)]
    shared = [1060] * 60 + [0, 500, 1000, 1060]
    q, dense, store, table, start, end = _shared_case(lengths, shared, Hkv=8, G=4, D=64, dtype=dtype,
                                                     device="cuda", seed=9)
    out = decode_attention(q, *store, start, end, table=table)
    ref = decode_attention_reference(q, *dense, start, int(end), compute_dtype=torch.float64)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    if dtype == torch.float32:  # the same bits alone
        for b in (0, 31, 61, 63):
            alone = decode_attention(q[b:b + 1], *store, start[b:b + 1], end, table=table[b:b + 1], rows=1,
                                     num_splits=1)
            again = decode_attention(q, *store, start, end, table=table, num_splits=1)
            assert torch.equal(alone[0], again[b]), b

