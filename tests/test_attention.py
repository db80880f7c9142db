"""The CPU attention (`engine.attention.grouped_attention`) against an explicit masked softmax: strided
pool views, grouped-query heads, padding rows, and the causal case aligned to the last column."""
from __future__ import annotations

import math

import torch

from lmq_backend.engine.attention import grouped_attention


def reference(q, k, v, allowed):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    return (probs @ v).transpose(1, 2)


def test_matches_masked_softmax_on_pool_views():
    torch.manual_seed(0)
    pool = torch.randn(2, 5, 2, 40, 16)               # K/V, row slots, kv heads, columns, head dim
    k, v = pool[0, 1:4, :, 7:31], pool[1, 1:4, :, 7:31]  # 3 rows, 24 columns: strided views
    q = torch.randn(3, 6, 5, 16)                      # 6 query heads: 3 per kv head
    starts = torch.tensor([0, 4, 11])
    cols, last = torch.arange(24), torch.arange(19, 24)
    allowed = (cols[None, None] >= starts[:, None, None]) & (cols[None, None] <= last[None, :, None])
    allowed[2, 0] = False                             # a padding query: attends to nothing
    got, _ = grouped_attention(None, q, k, v, allowed[:, None])
    torch.testing.assert_close(got, reference(q, k, v, allowed[:, None]), atol=1e-5, rtol=1e-5)
    assert torch.equal(got[2, 0], torch.zeros_like(got[2, 0]))


def test_no_mask_is_causal_to_the_last_column():
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    allowed = torch.arange(10)[None, :] <= torch.arange(7, 10)[:, None]
    got, _ = grouped_attention(None, q, k, v, None)
    torch.testing.assert_close(got, reference(q, k, v, allowed[None, None]), atol=1e-5, rtol=1e-5)
    one, _ = grouped_attention(None, q[:, :, -1:], k, v, None)   # a single query sees every column
    torch.testing.assert_close(one, got[:, -1:], atol=1e-5, rtol=1e-5)


def test_single_query_rows_fold_the_head_group():
    """A decode step (one query a row) reads each kv head once for its group of query heads; rows of
    different lengths (left padding) on strided pool views, 3 query heads per kv head."""
    torch.manual_seed(2)
    pool = torch.randn(2, 4, 3, 50, 16)
    k, v = pool[0, :, :, 5:45], pool[1, :, :, 5:45]   # 4 rows, 3 kv heads, 40 columns
    q = torch.randn(4, 9, 1, 16)
    allowed = (torch.arange(40)[None] >= torch.tensor([0, 13, 39, 7])[:, None])[:, None, None]  # [4, 1, 1, 40]
    got, _ = grouped_attention(None, q, k, v, allowed, 0.25)
    want = reference(q * 0.25 * 4, k, v, allowed)     # reference scales by 1/sqrt(16)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got.shape == (4, 1, 9, 16)
