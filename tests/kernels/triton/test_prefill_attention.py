"""The paged prefill-attention kernel (`lmq_kernels.triton.prefill_attention`) against an independent computation:
per row and token, softmax attention over exactly the columns the contract names, read from a dense copy
of the row's K/V (not through the kernel's page-table indexing).

CPU (`interpreter` tests): the kernel runs under Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1`` before triton is imported). GPU (`gpu` tests): compiled (``TRITON_INTERPRET`` unset)."""
import math

import pytest
import torch

from lmq_kernels.triton.prefill_attention import prefill_attention, prefill_attention_reference


def _case(B, T, Hkv, G, D, S, news, cached, device="cpu", dtype=torch.float32, seed=0):
    """Rows with `cached[b]` prefix columns and `news[b]` new tokens, ending at a common `end`; their slots
    scattered over a store (shared prefix slots where two rows have the same cached length, as the trie's);
    every slot that no row's valid column names holds NaN (must never be read)."""
    gen = torch.Generator().manual_seed(seed)
    end = max(c + n for c, n in zip(cached, news))
    assert end <= S and max(news) == T
    n_slots = 8 + sum(c + n for c, n in zip(cached, news)) * 2
    store_k = torch.full((n_slots, Hkv, D), float("nan"))
    store_v = torch.full((n_slots, Hkv, D), float("nan"))
    perm = torch.randperm(n_slots, generator=gen).tolist()
    table = torch.zeros(B, S, dtype=torch.int32)
    dense_k = torch.zeros(B, S, Hkv, D)
    dense_v = torch.zeros(B, S, Hkv, D)
    shared: dict[int, list[int]] = {}
    for b, (c, n) in enumerate(zip(cached, news)):
        first = end - c - n
        prefix = shared.setdefault(c, [perm.pop() for _ in range(c)])
        own = [perm.pop() for _ in range(n)]
        for i, slot in enumerate(prefix + own):
            col = first + i
            table[b, col] = slot
            if torch.isnan(store_k[slot, 0, 0]):
                store_k[slot] = torch.randn(Hkv, D, generator=gen)
                store_v[slot] = torch.randn(Hkv, D, generator=gen)
            dense_k[b, col], dense_v[b, col] = store_k[slot], store_v[slot]
    q = torch.randn(B, T, Hkv * G, D, generator=gen)
    start = torch.tensor([end - c - n for c, n in zip(cached, news)], dtype=torch.int32)
    to = dict(device=device)
    return (q.to(dtype=dtype, **to), store_k.to(dtype=dtype, **to), store_v.to(dtype=dtype, **to),
            table.to(**to), start.to(**to), end, dense_k, dense_v)


def _expected(q, dense_k, dense_v, start, end, news):
    """Row b, token t (column end - T + t, a real token when t >= T - news[b]) over columns [start, column]."""
    B, T, Hq, D = q.shape
    G = Hq // dense_k.shape[2]
    out = torch.zeros(B, T, Hq, D)
    for b in range(B):
        for t in range(T - news[b], T):
            col = end - T + t
            k = dense_k[b, int(start[b]):col + 1].repeat_interleave(G, dim=1)    # [n, Hq, D]
            v = dense_v[b, int(start[b]):col + 1].repeat_interleave(G, dim=1)
            w = torch.softmax(torch.einsum("hd,nhd->hn", q[b, t].float().cpu(), k) / math.sqrt(D), dim=-1)
            out[b, t] = torch.einsum("hn,nhd->hd", w, v)
    return out


def _check(out, expected, news, atol):
    T = out.shape[1]
    for b, n in enumerate(news):  # padding tokens' outputs are unspecified but finite
        torch.testing.assert_close(out[b, T - n:].float().cpu(), expected[b, T - n:], atol=atol, rtol=atol)
        assert torch.isfinite(out[b]).all()


CASES = [  # (B, T, Hkv, G, D, S, news, cached)
    (1, 5, 2, 2, 16, 32, [5], [0]),                       # a fresh prompt
    (3, 7, 2, 4, 16, 64, [7, 3, 1], [20, 20, 33]),        # shared prefix, ragged new parts
    (2, 9, 1, 3, 32, 96, [9, 4], [70, 0]),                # G = 3 (padded to 4), long and no prefix
    (4, 20, 2, 2, 16, 128, [20, 18, 1, 5], [65, 65, 65, 100]),  # more tokens than one block
]


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES)
def test_matches_independent_attention(case):
    B, T, Hkv, G, D, S, news, cached = case
    q, k, v, table, start, end, dk, dv = _case(*case)
    out = prefill_attention(q, k, v, table, start, end)
    _check(out, _expected(q, dk, dv, start, end, news), news, atol=1e-5)
    ref = prefill_attention_reference(q, k.nan_to_num(0), v.nan_to_num(0), table, start, end)
    _check(ref, _expected(q, dk, dv, start, end, news), news, atol=1e-5)


@pytest.mark.interpreter
@pytest.mark.parametrize("splits", [2, 4, 8])
@pytest.mark.parametrize("case", CASES)
def test_columns_split_into_parts_match(case, splits):
    """Each program's columns split into parts (few rows after a long prefix on a large GPU), their partial
    softmaxes combined: the same attention, also where a part has no column (more parts than tiles)."""
    B, T, Hq, G, D, S, news, cached = case
    q, k, v, table, start, end, dk, dv = _case(*case)
    out = prefill_attention(q, k, v, table, start, torch.tensor([end], dtype=torch.int32), splits=splits)
    _check(out, _expected(q, dk, dv, start, end, news), news, atol=1e-5)


def test_splits_only_where_programs_are_few_and_columns_many():
    from lmq_kernels.triton.prefill_attention import splits_for

    one_row = dict(B=2, T=20, Hq=32, H_kv=8, D=64, dtype=torch.bfloat16, sms=132)
    assert splits_for(**one_row, columns=1120) == 8          # 16 programs -> 128
    assert splits_for(**one_row, columns=40) == 1            # a short prompt: nothing to split
    assert splits_for(**{**one_row, "B": 256, "T": 30}, columns=1120) == 1   # programs fill the GPU


@pytest.mark.interpreter
def test_a_wrong_column_range_is_caught():
    """The comparison has teeth: the kernel run with every row's first column dropped (start + 1) fails it."""
    case = CASES[1]
    news = case[6]
    q, k, v, table, start, end, dk, dv = _case(*case)
    k, v = k.nan_to_num(0), v.nan_to_num(0)
    dropped = prefill_attention(q, k, v, table, start + 1, end)
    with pytest.raises(AssertionError):
        _check(dropped, _expected(q, dk, dv, start, end, news), news, atol=1e-5)


@pytest.mark.interpreter
def test_end_read_from_the_device_and_padding_past_the_first_column():
    """`end` as a one-element int32 tensor (what a captured prefill's replay reads) gives the int's result, also
    where the queries are left-padded to more tokens than the rows have columns before `end` (a graph's bucket
    of new tokens): the real tokens' outputs are the same, the padding's finite."""
    case = (2, 3, 2, 2, 16, 32, [3, 2], [2, 0])   # end = 5
    B, T, Hkv, G, D, S, news, cached = case
    q, k, v, table, start, end, dk, dv = _case(*case)
    k, v = k.nan_to_num(0), v.nan_to_num(0)
    want = prefill_attention(q, k, v, table, start, end)
    end_t = torch.tensor([end], dtype=torch.int32)
    assert torch.equal(prefill_attention(q, k, v, table, start, end_t), want)
    padded = torch.cat([torch.randn(B, 8 - T, *q.shape[2:]), q], dim=1)   # 8 tokens a row, end - 8 < 0
    out = prefill_attention(padded, k, v, table, start, end_t)
    torch.testing.assert_close(out[:, 8 - T:], want, atol=1e-6, rtol=0)
    assert torch.isfinite(out).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("case", CASES + [(8, 40, 8, 4, 64, 1280, [40, 33, 25, 40, 12, 40, 1, 30],
                                          [1100] * 6 + [1200, 0])])
def test_cuda_matches_independent_attention(case, dtype, atol):
    B, T, Hkv, G, D, S, news, cached = case
    q, k, v, table, start, end, dk, dv = _case(*case, device="cuda", dtype=dtype)
    out = prefill_attention(q, k, v, table, start, end)
    _check(out, _expected(q.float().cpu(), dk.to(dtype).float(), dv.to(dtype).float(), start.cpu(), end, news),
           news, atol=atol)
