"""`HostArena`: the host tier's memory on a GPU machine: pinned memory allocated once, handed out in aligned
regions.

Pinning memory costs far more than using it (the driver locks every page: milliseconds for a prefix's tens of MB),
and torch's pinned allocator rounds each block up to a power of two bytes. The arena pins the host tier's whole
budget once, when the backend is made, as blocks of power-of-two sizes (the budget's binary digits from
CHUNK_MIN up; what is left below CHUNK_MIN is not used, a budget below it is one block), so that no byte is
pinned beyond the budget, and hands out regions of the size asked (first fit over the free regions, which merge
when given back; a region never spans two blocks): a segment moving down costs its copy only, and the budget
holds as many segments as their bytes allow.

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

ALIGN = 4096          # bytes: regions start on a page
CHUNK_MIN = 64 << 20  # the smallest block the budget is cut into (a smaller budget is one block)


def tensor_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The bytes of a tensor of `shape` and `dtype`."""
    return math.prod(shape) * torch.empty(0, dtype=dtype).element_size()


def region_bytes(nbytes: int) -> int:
    """The bytes a region for `nbytes` takes (rounded up to ALIGN)."""
    return max(1, -(-nbytes // ALIGN)) * ALIGN


def chunk_sizes(nbytes: int) -> list[int]:
    """The blocks `nbytes` of budget is pinned as: its power-of-two parts of CHUNK_MIN or more, largest first (a
    budget below CHUNK_MIN: itself, rounded down to ALIGN)."""
    if nbytes < CHUNK_MIN:
        return [nbytes // ALIGN * ALIGN] if nbytes >= ALIGN else []
    return [1 << bit for bit in range(nbytes.bit_length() - 1, CHUNK_MIN.bit_length() - 2, -1) if nbytes >> bit & 1]


class HostArena:
    def __init__(self, nbytes: int, pinned: bool = True):
        """Up to `nbytes` of host memory (`chunk_sizes`), pinned (`pinned`; False: plain memory, as tests on a
        machine without a GPU use)."""
        sizes = chunk_sizes(nbytes)
        if not sizes:
            raise ValueError(f"a host arena needs at least {ALIGN} bytes")
        self.nbytes, self.pinned = sum(sizes), pinned
        try:
            self.chunks = [torch.empty(size, dtype=torch.uint8, pin_memory=pinned) for size in sizes]
        except RuntimeError as e:  # (the driver could not lock that much memory)
            raise MemoryError(f"could not {'pin' if pinned else 'allocate'} {self.nbytes:,} bytes of host memory "
                              f"for the host cache tier ({e}); give host_cache= a smaller size") from e
        # one space of offsets: block i at _bases[i], an ALIGN gap after each (never free: regions never merge
        # across blocks)
        self._bases = [sum(sizes[:i]) + i * ALIGN for i in range(len(sizes))]
        self.bytes_in_use = 0
        self._starts: list[int] = list(self._bases)  # the free regions' offsets, sorted
        self._sizes: dict[int, int] = dict(zip(self._bases, sizes))
        self._lock = threading.Lock()

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor of `shape` and `dtype` in a free region (uninitialized), or None where no free region is that
        large; the region is free again when the tensor is garbage."""
        nbytes = tensor_bytes(shape, dtype)
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
        block = bisect.bisect(self._bases, offset) - 1
        at = offset - self._bases[block]
        out = self.chunks[block][at:at + nbytes].view(dtype).view(shape)
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

    def offset(self, tensor: torch.Tensor) -> int:
        """Where `tensor` (one `tensor` handed out) begins, in the arena's space of offsets (for tests)."""
        for base, chunk in zip(self._bases, self.chunks):
            at = tensor.data_ptr() - chunk.data_ptr()
            if 0 <= at < chunk.numel():
                return base + at
        raise ValueError("not a tensor of this arena")

    def check(self) -> None:
        """Assert the bookkeeping (for tests): free regions sorted, disjoint, never adjacent, each inside one
        block, and what they leave is in use."""
        with self._lock:
            assert self._starts == sorted(self._sizes)
            for a, b in zip(self._starts, self._starts[1:]):
                assert a + self._sizes[a] < b
            for start in self._starts:
                block = bisect.bisect(self._bases, start) - 1
                assert start + self._sizes[start] <= self._bases[block] + self.chunks[block].numel()
            assert sum(self._sizes.values()) + self.bytes_in_use == self.nbytes
