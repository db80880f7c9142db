"""`HostArena`: the host tier's memory on a GPU machine: one block of pinned memory, allocated once, handed out in
aligned regions.

Pinning memory costs far more than using it (the driver locks every page: milliseconds for a prefix's tens of MB),
and torch's pinned allocator rounds each block up to a power of two bytes. The arena pins the host tier's whole
budget once, when the backend is made, and hands out regions of the size asked (first fit over the free regions,
which merge when given back): a segment moving down costs its copy only, and the budget holds as many segments as
their bytes allow.

    kv = arena.tensor((L, 2, T, H, D), torch.bfloat16)   # None: no free region that large
    ...                                                  # the region is free again once `kv` is garbage

A region is given back when the tensor `tensor` returned dies (a segment holds it as its `kv`): a tensor made from
it (a slice, a view) must not outlive it. Copies the device still runs into or out of a region are the caller's
to order before its next use (`cache/tiers.py` queues every copy down after the copies up). Thread-safe (a disk
tier's writer thread may drop the last reference).
"""
from __future__ import annotations

import bisect
import math
import threading
import weakref

import torch

ALIGN = 4096  # bytes: regions start on a page


def region_bytes(nbytes: int) -> int:
    """The bytes a region for `nbytes` takes (rounded up to ALIGN)."""
    return max(1, -(-nbytes // ALIGN)) * ALIGN


class HostArena:
    def __init__(self, nbytes: int, pinned: bool = True):
        """`nbytes` (rounded down to ALIGN) of host memory, pinned (`pinned`; False: plain memory, as tests on a
        machine without a GPU use)."""
        nbytes = nbytes // ALIGN * ALIGN
        if nbytes <= 0:
            raise ValueError(f"a host arena needs at least {ALIGN} bytes")
        self.nbytes, self.pinned = nbytes, pinned
        try:
            self.data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        except RuntimeError as e:  # (the driver could not lock that much memory)
            raise MemoryError(f"could not {'pin' if pinned else 'allocate'} {nbytes:,} bytes of host memory for "
                              f"the host cache tier ({e}); give host_cache= a smaller size") from e
        self.bytes_in_use = 0
        self._starts: list[int] = [0]        # the free regions' offsets, sorted
        self._sizes: dict[int, int] = {0: nbytes}
        self._lock = threading.Lock()

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor of `shape` and `dtype` in a free region (uninitialized), or None where no free region is that
        large; the region is free again when the tensor is garbage."""
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        size = region_bytes(nbytes)
        with self._lock:
            offset = next((o for o in self._starts if self._sizes[o] >= size), None)
            if offset is None:
                return None
            rest = self._sizes.pop(offset) - size
            self._starts.remove(offset)
            if rest:
                self._sizes[offset + size] = rest
                bisect.insort(self._starts, offset + size)
            self.bytes_in_use += size
        out = self.data[offset:offset + nbytes].view(dtype).view(shape)
        weakref.finalize(out, self._give_back, offset, size)
        return out

    def _give_back(self, offset: int, size: int) -> None:
        with self._lock:
            self.bytes_in_use -= size
            i = bisect.bisect(self._starts, offset)
            # merge with the free region after it, then with the one before it
            if i < len(self._starts) and self._starts[i] == offset + size:
                size += self._sizes.pop(self._starts.pop(i))
            if i > 0 and self._starts[i - 1] + self._sizes[self._starts[i - 1]] == offset:
                self._sizes[self._starts[i - 1]] += size
            else:
                self._starts.insert(i, offset)
                self._sizes[offset] = size

    def largest_free(self) -> int:
        """The largest free region's bytes."""
        with self._lock:
            return max(self._sizes.values(), default=0)

    def check(self) -> None:
        """Assert the bookkeeping (for tests): free regions sorted, disjoint, never adjacent, and what they leave
        is in use."""
        with self._lock:
            assert self._starts == sorted(self._sizes)
            for a, b in zip(self._starts, self._starts[1:]):
                assert a + self._sizes[a] < b
            assert sum(self._sizes.values()) + self.bytes_in_use == self.nbytes
