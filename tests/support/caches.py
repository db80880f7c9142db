"""Test helpers over the prefix trie and the paged K/V store: what production code never asks."""
from __future__ import annotations

import numpy as np
import torch

from lmq_backend.cache.trie import PrefixTrie


def node_slots(trie: PrefixTrie) -> list[np.ndarray]:
    """Every node's slots (for `KVStore.check`)."""
    out, stack = [], list(trie.root.children.values())
    while stack:
        node = stack.pop()
        out.append(node.slots)
        stack.extend(node.children.values())
    return out


def paged_view(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense batch cache `[L, 2, B, H_kv, S, D]` (unit last stride, rows a whole number of columns apart)
    seen as a K/V store and page tables, for tests that fill K/V by row and column: returns
    (kv [L, 2, N, H_kv, D], a strided view of `dense`, and table int32 [B, S] on its device) with
    kv[:, :, table[b, s]] == dense[:, :, b, :, s]."""
    L, two, B, H, S, D = dense.shape
    s0, s1, sb, sh, ss, sd = dense.stride()
    assert sd == 1 and sb % ss == 0
    kv = dense.as_strided((L, two, (B - 1) * (sb // ss) + S, H, D), (s0, s1, ss, sh, 1))
    table = torch.arange(B, dtype=torch.int32)[:, None] * (sb // ss) + torch.arange(S, dtype=torch.int32)[None]
    return kv, table.to(dense.device)
