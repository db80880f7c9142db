"""`masked_argmax`, the one greedy pick of the runtime (`Greedy`), the runner's prefill picks and the fused
step's device picks: the first maximal allowed logit, alone or broadcast over masks and rows."""
from __future__ import annotations

import torch

from lmq_backend.engine.picks import masked_argmax
from lmq_backend.runtime.decoders import Greedy


def test_ties_go_to_the_first_maximal_allowed_logit():
    logits = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0])
    assert int(masked_argmax(logits, None)) == 1
    assert int(masked_argmax(logits, torch.tensor([True, False, True, True, True]))) == 2
    assert int(masked_argmax(logits, torch.tensor([True, False, False, True, False]))) == 3
    assert Greedy().select(logits, torch.tensor([True, False, False, False, True])) == 4


def test_masks_by_rows_is_each_pick_alone():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (5, 50), generator=gen).float()  # many ties
    masks = torch.rand(3, 50, generator=gen) < 0.5
    table = masked_argmax(logits[None], masks[:, None])  # [K, B]
    assert table.shape == (3, 5)
    for k in range(3):
        for b in range(5):
            assert int(table[k, b]) == Greedy().select(logits[b], masks[k])
            assert int(table[k, b]) == int(torch.where(masks[k], logits[b], float("-inf")).argmax())
