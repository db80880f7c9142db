"""lmq's attention for the model's forwards (`engine.attention.grouped_attention`) against an explicit
masked softmax: strided pool views, grouped-query heads, padding rows, and the causal case aligned to the
last column (on a GPU too, where it is flash attention with a lower-right causal bias); and the mask
function that hands it no mask when nothing is padded (`compat.pool_mask`)."""
from __future__ import annotations

import math

import pytest
import torch

from lmq_backend.engine import compat
from lmq_backend.engine.attention import grouped_attention

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def reference(q, k, v, allowed):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    return (probs @ v).transpose(1, 2)


@pytest.mark.parametrize("device", DEVICES)
def test_matches_masked_softmax_on_pool_views(device):
    torch.manual_seed(0)
    pool = torch.randn(2, 5, 2, 40, 16, device=device)  # K/V, row slots, kv heads, columns, head dim
    k, v = pool[0, 1:4, :, 7:31], pool[1, 1:4, :, 7:31]  # 3 rows, 24 columns: strided views
    q = torch.randn(3, 6, 5, 16, device=device)       # 6 query heads: 3 per kv head
    starts = torch.tensor([0, 4, 11], device=device)
    cols, last = torch.arange(24, device=device), torch.arange(19, 24, device=device)
    allowed = (cols[None, None] >= starts[:, None, None]) & (cols[None, None] <= last[None, :, None])
    allowed[2, 0] = False                             # a padding query: attends to nothing
    got, _ = grouped_attention(None, q, k, v, allowed[:, None])
    torch.testing.assert_close(got, reference(q, k, v, allowed[:, None]), atol=1e-5, rtol=1e-5)
    assert torch.equal(got[2, 0], torch.zeros_like(got[2, 0]))


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32),
                                          *(pytest.param("cuda", t, marks=pytest.mark.gpu) for t in (torch.float32,
                                                                                                  torch.bfloat16))])
def test_no_mask_is_causal_to_the_last_column(device, dtype):
    torch.manual_seed(1)
    q, k, v = (torch.randn(*shape, device=device, dtype=dtype) for shape in ((2, 4, 3, 16), (2, 2, 10, 16),
                                                                               (2, 2, 10, 16)))
    allowed = torch.arange(10, device=device)[None, :] <= torch.arange(7, 10, device=device)[:, None]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    got, _ = grouped_attention(None, q, k, v, None)
    want = reference(q.float(), k.float(), v.float(), allowed[None, None])
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    one, _ = grouped_attention(None, q[:, :, -1:], k, v, None)   # a single query sees every column
    torch.testing.assert_close(one.float(), got[:, -1:].float(), atol=tol, rtol=tol)


def test_no_padding_no_mask():
    """After a cache hit (3 new queries over 8 columns) transformers' sdpa mask is an explicit [3, 8] tensor;
    lmq's mask function gives None then, and transformers' mask whenever a row is padded."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    args = dict(batch_size=2, q_length=3, kv_length=8, q_offset=5, kv_offset=0, mask_function=causal_mask_function,
                attention_mask=None, allow_is_causal_skip=True, device="cpu")
    assert sdpa_mask(**args) is not None
    assert compat.pool_mask(**args) is None
    padded = dict(args, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8]))
    assert torch.equal(compat.pool_mask(**padded), sdpa_mask(**padded))


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
