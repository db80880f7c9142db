"""`KVBuffer`: the K/V of a batch of rows in one preallocated tensor, in the layout the prefix trie and
the decode kernel share (see `lmq_backend/cache/trie.py`):

    data: [L, 2, B, H_kv, S, D]    layer, K/V, row, kv head, column, head dim

Rows are left-padded: every row's valid tokens end at the same column (`length`); forwards append new
columns in place. Per layer, `data[l, 0]` and `data[l, 1]` are the `[B, H_kv, S, D]` K and V caches.
"""
from __future__ import annotations

import torch


class KVBuffer:
    def __init__(self, layers: int, heads: int, head_dim: int, batch: int, capacity: int,
                 dtype: torch.dtype, device: torch.device):
        self.data = torch.empty(layers, 2, batch, heads, capacity, head_dim, dtype=dtype, device=device)

    @classmethod
    def from_segments(cls, segments: list[torch.Tensor], extra: int, like: torch.Tensor | None = None,
                      shape: tuple[int, int, int] | None = None, dtype=None, device=None) -> "KVBuffer":
        """A one-row buffer holding the concatenation of trie segments ([L, 2, H, T, D] each), with room for
        `extra` more columns. With no segments, `shape` = (L, H, D), `dtype` and `device` describe it."""
        n = sum(s.shape[3] for s in segments)
        if segments:
            layers, _, heads, _, head_dim = segments[0].shape
            dtype, device = segments[0].dtype, segments[0].device
        else:
            layers, heads, head_dim = shape
        buf = cls(layers, heads, head_dim, 1, n + extra, dtype, device)
        col = 0
        for s in segments:
            buf.data[:, :, 0, :, col:col + s.shape[3]].copy_(s)
            col += s.shape[3]
        return buf

    @property
    def capacity(self) -> int:
        return self.data.shape[4]

    def reserve(self, columns: int) -> None:
        """Make room for `columns` columns (doubling, so appends cost amortised O(1))."""
        if columns <= self.capacity:
            return
        grown = torch.empty(*self.data.shape[:4], max(columns, 2 * self.capacity), self.data.shape[5],
                            dtype=self.data.dtype, device=self.data.device)
        grown[:, :, :, :, : self.capacity].copy_(self.data)
        self.data = grown

    def segment(self, row: int, start: int, end: int) -> torch.Tensor:
        """Columns [start, end) of one row in the trie layout [L, 2, H, T, D] (a view)."""
        return self.data[:, :, row, :, start:end]
