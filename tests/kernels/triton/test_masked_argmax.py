"""The greedy pick under K masks in one pass (`lmq_kernels.triton.masked_argmax`) against the engine's own form
(`engine/picks.masked_argmax`, which `Greedy` picks with): the same index on every row and mask, ties to the
first index, 0 where a mask allows nothing.

CPU (`interpreter` tests): the kernel runs under Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1`` before triton is imported). GPU (`gpu` tests): compiled."""
import pytest
import torch

from lmq_backend.engine.picks import masked_argmax
from lmq_kernels.triton.masked_argmax import BLOCK, SPARSE_SHARE, MaskedPicks, masked_argmax_k


def _case(B, V, K, seed, dtype=torch.float32, device="cpu"):
    """Logits with many exact ties (small integers), including a tie between two tiles (two splits of V where
    rows are few); masks: everything, nothing, random, and one that allows only tokens past the first tile."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-4, 5, (B, V), generator=gen).to(dtype)
    logits[0, 3] = 9
    if V > BLOCK + 5:
        logits[0, BLOCK + 5] = 9  # the same maximum in two tiles: the first wins
    masks = torch.rand(K, V, generator=gen) < 0.5
    masks[0] = True
    if K > 1:
        masks[1] = False
    if K > 2:
        masks[2, :BLOCK] = False
    return logits.to(device), masks.to(device)


def _expected(logits, masks):
    return torch.stack([masked_argmax(logits.cpu(), m.cpu()) for m in masks])


CASES = [(1, 7, 1, 0), (3, BLOCK + 17, 3, 1), (5, 3 * BLOCK, 4, 2), (2, 2 * BLOCK + 1, 2, 3),
         (1, 5 * BLOCK + 3, 3, 6),   # one row: a split of V per tile, the maximum tied across splits
         (4, 2 * BLOCK + 5, 5, 7)]   # the engine's five masks (free steps', and within UTF-8 characters)


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES)
def test_matches_the_engines_pick(case):
    logits, masks = _case(*case)
    out = masked_argmax_k(logits, masks)
    assert torch.equal(out, _expected(logits, masks))
    assert out[0, 0] == 3 and (len(masks) < 2 or out[1].eq(0).all())


@pytest.mark.interpreter
def test_writes_into_a_strided_out():
    logits, masks = _case(3, BLOCK + 9, 2, 4)
    buf = torch.full((2, 8), -1, dtype=torch.int64)
    masked_argmax_k(logits, masks, out=buf[:, :3])
    assert torch.equal(buf[:, :3], _expected(logits, masks)) and buf[:, 3:].eq(-1).all()


def _sparse_case(B, V, seed, dtype=torch.float32, device="cpu"):
    """The engine's five masks: everything, most tokens, and three of few tokens (one ordered before a dense
    one), the maxima tied within them."""
    logits, _ = _case(B, V, 1, seed, dtype)
    gen = torch.Generator().manual_seed(seed)
    masks = torch.zeros(5, V, dtype=torch.bool)
    masks[0] = True
    masks[2] = torch.rand(V, generator=gen) < 0.7
    for k, n in ((1, V // SPARSE_SHARE), (3, 1), (4, 7)):
        masks[k, torch.randperm(V, generator=gen)[:n]] = True
    logits[:, masks[4]] = 9  # a tie across the few-token mask: its first token wins
    return logits.to(device), masks.to(device)


@pytest.mark.interpreter
@pytest.mark.parametrize("case", [(3, 2 * BLOCK + 5, 0), (1, 3 * BLOCK, 1)])
def test_few_token_masks_pick_from_their_tokens(case):
    logits, masks = _sparse_case(*case)
    picks = MaskedPicks(masks)
    assert len(picks.dense) == 2  # masks 1, 3, 4 gather
    out = torch.full((5, case[0]), -1, dtype=torch.int64)
    assert torch.equal(picks(logits, out), _expected(logits, masks))
    assert out[4].eq(masks[4].nonzero()[0, 0]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES + [(256, 128256, 2, 5), (256, 49152, 5, 8)])
def test_cuda_matches_the_engines_pick(case, dtype):
    logits, masks = _case(*case, dtype=dtype, device="cuda")
    assert torch.equal(masked_argmax_k(logits, masks).cpu(), _expected(logits, masks))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [(256, 128256, 0), (200, 49152, 1), (3, 2 * BLOCK + 5, 2)])
def test_cuda_few_token_masks_pick_from_their_tokens(case, dtype):
    logits, masks = _sparse_case(*case, dtype=dtype, device="cuda")
    out = torch.empty(5, case[0], dtype=torch.int64, device="cuda")
    assert torch.equal(MaskedPicks(masks)(logits, out).cpu(), _expected(logits, masks))
