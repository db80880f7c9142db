"""`Segment`: the K/V of a run of a prefix's tokens, held below the device's trie (host memory, a file).

    seg.ids: int32 [end]              the prefix's token ids, from position 0 through the segment's last token
    seg.kv:  [L, 2, T, H_kv, D]       K (after RoPE) and V of tokens [start, end), T = end - start, model dtype

A token's K/V depends on every token before it, so a segment serves only a sequence whose ids begin with
`seg.ids[:start]`; then any first k of its tokens that the sequence continues with are valid there
(`continues`). The lower tiers never compare text, only these ids.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch


def prefix_key(ids: np.ndarray) -> str:
    """A 128-bit hash of token ids (int32), in hex: the name of a prefix in the lower tiers."""
    return hashlib.blake2b(np.ascontiguousarray(ids, dtype=np.int32).tobytes(), digest_size=16).hexdigest()


def continued(own: np.ndarray, start: int, ids: np.ndarray, limit: int) -> int:
    """How many of `own[start:]` continue `ids` at `start` (both int32), short of `limit`; 0 unless
    own[:start] == ids[:start]."""
    end = min(len(own), limit, len(ids))
    if end <= start or not np.array_equal(own[:start], ids[:start]):
        return 0
    differ = np.flatnonzero(own[start:end] != ids[start:end])
    return int(differ[0]) if len(differ) else end - start


@dataclass(slots=True, eq=False, weakref_slot=True)
class Segment:
    ids: np.ndarray            # int32 [end]
    start: int
    kv: torch.Tensor           # [L, 2, end - start, H_kv, D] in host memory
    key: str                   # prefix_key(ids): with `start`, names the segment
    ready: object = None       # a CUDA event after which `kv` holds its values (a copy still running); None: now

    @classmethod
    def of(cls, ids, start: int, kv: torch.Tensor, ready=None) -> "Segment":
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        assert 0 <= start < len(ids) and kv.shape[2] == len(ids) - start, (start, len(ids), tuple(kv.shape))
        return cls(ids, start, kv, prefix_key(ids), ready)

    @property
    def end(self) -> int:
        return len(self.ids)

    @property
    def tokens(self) -> int:
        return self.end - self.start

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def continues(self, ids: np.ndarray, limit: int) -> int:
        """How many of the segment's tokens continue `ids` (int32) at `start`, counting no position at or
        past `limit`: 0 unless ids[:start] is the segment's prefix."""
        return continued(self.ids, self.start, ids, limit)

    def wait(self) -> None:
        """Block until `kv` holds its values (a device-to-host copy may still be running)."""
        if self.ready is not None:
            self.ready.synchronize()
