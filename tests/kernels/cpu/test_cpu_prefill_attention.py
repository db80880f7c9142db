"""lmq's CPU prefill attention (`lmq_kernels.cpu.prefill_attention`, prefill_attention.c): causal
grouped-query attention of T new tokens a row over the paged store, on every kernel variant this host runs
(`kernels`, see test_cpu_kernels.py): against a float64 reference, zeros for the padding, a row's bits the
same alone as in any batch and on any number of threads, and operands it declines."""
from __future__ import annotations

import pytest
import torch

from lmq_kernels import cpu
from support.cpu_targets import TARGETS  # noqa: F401 (the variants `kernels` runs)
from support.cpu_targets import kernels  # noqa: F401 (fixture)

pytestmark = pytest.mark.cpu_kernels


def case(new: list[int], cached: list[int], hq: int, hkv: int, d: int, seed: int, slots: int = 3000):
    """B left-padded rows ending at a common column `end`: row b has cached[b] columns then new[b] tokens;
    pages scattered through a store of `slots` slots (no two columns share a slot)."""
    g = torch.Generator().manual_seed(seed)
    b, t = len(new), max(new)
    end = max(c + n for c, n in zip(cached, new)) + 5
    k, v = torch.randn(slots, hkv, d, generator=g), torch.randn(slots, hkv, d, generator=g)
    table = torch.randperm(slots, generator=g)[: b * (end + 3)].to(torch.int32).view(b, end + 3)
    start = torch.tensor([end - c - n for c, n in zip(cached, new)], dtype=torch.int32)
    q = torch.randn(b, t, hq, d, generator=g)
    return q, k, v, table, start, torch.tensor(new, dtype=torch.int32), end


def reference(q, k, v, table, start, new, end, scale):
    b, t, hq, d = q.shape
    group = hq // k.shape[1]
    out = torch.zeros(b, t, hq, d, dtype=torch.float64)
    for r in range(b):
        for i in range(t - int(new[r]), t):
            cols = table[r, int(start[r]):end - t + i + 1].long()
            kk = k[cols].double().repeat_interleave(group, 1)                   # [n, Hq, D]
            vv = v[cols].double().repeat_interleave(group, 1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[r, i].double(), kk) * scale, -1)
            out[r, i] = torch.einsum("hn,nhd->hd", p, vv)
    return out


CASES = [([37, 5, 20, 1], [100, 0, 212, 3], 9, 3, 64),     # SmolLM2's heads; tiles of 16, chunks of 64
         ([1], [700], 8, 2, 128),                          # a decode-like row over many chunks
         ([70], [0], 4, 4, 64),                            # a cold prompt, no GQA
         ([3, 17], [64, 63], 16, 2, 256),                  # chunk boundaries, a group of 8
         ([33, 33, 2], [0, 31, 190], 6, 1, 64)]            # one kv head


@pytest.mark.parametrize("new,cached,hq,hkv,d", CASES)
def test_prefill_attention_matches_reference(new, cached, hq, hkv, d, kernels):
    q, k, v, table, start, m, end = case(new, cached, hq, hkv, d, seed=sum(new) + d)
    out = torch.full_like(q, float("nan"))
    assert cpu.prefill_attention(q, k, v, table, start, m, end, out, d ** -0.5)
    want = reference(q, k, v, table, start, m, end, d ** -0.5)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=1e-5)
    t = q.shape[1]
    for r, n in enumerate(new):
        assert torch.equal(out[r, : t - n], torch.zeros(t - n, hq, d))   # the padding: zeros


def test_prefill_attention_rows_are_independent_bitwise(kernels):
    """A row's tokens get the same bits alone (no padding) as in a padded batch, and on one thread."""
    new, cached = [37, 5, 20, 1, 16], [100, 0, 212, 3, 64]
    q, k, v, table, start, m, end = case(new, cached, 9, 3, 64, seed=11)
    full = torch.empty_like(q)
    assert cpu.prefill_attention(q, k, v, table, start, m, end, full, 0.125)
    t = q.shape[1]
    for r, n in enumerate(new):
        alone = torch.empty(1, n, 9, 64)
        assert cpu.prefill_attention(q[r:r + 1, t - n:].contiguous(), k, v, table[r:r + 1], start[r:r + 1],
                                     m[r:r + 1], end, alone, 0.125)
        assert torch.equal(alone[0], full[r, t - n:]), r
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = torch.empty_like(q)
        assert cpu.prefill_attention(q, k, v, table, start, m, end, one_thread, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, full)


def test_prefill_attention_declines(kernels):
    q, k, v, table, start, m, end = case([4, 2], [10, 3], 4, 2, 64, seed=5)
    out = torch.zeros_like(q)
    assert not cpu.prefill_attention(q.double(), k.double(), v.double(), table, start, m, end, out.double(), 0.1)
    assert not cpu.prefill_attention(q, k, v, table.long(), start, m, end, out, 0.1)
    assert not cpu.prefill_attention(q, k, v, table, start.long(), m, end, out, 0.1)
    assert not cpu.prefill_attention(q[..., :32], k[..., :32], v[..., :32], table, start, m, end, out[..., :32], 0.1)
    assert not cpu.prefill_attention(q[:, :, :3], k, v, table, start, m, end, out[:, :, :3], 0.1)   # 3 % 2 heads
    assert not cpu.prefill_attention(q, k, v, table, start, m, table.shape[1] + 1, out, 0.1)      # past the table
    rows_apart = torch.randn(2, 5, 4, 64)[:, :4]                       # rows further apart than T tokens
    assert not cpu.prefill_attention(rows_apart, k, v, table, start, m, end, out, 0.1)
    assert torch.equal(out, torch.zeros_like(q))
