"""Committing a CPU store's pages ahead of their first write, off the caller's thread (`CommitAhead`).

An anonymous page is committed at its first write: a page fault that zeroes a fresh page, one per 4 KiB. A
copy into never-written slots (a prefix loaded from the disk tier) pays that inside the call. Linux's
MADV_POPULATE_WRITE takes those faults now without writing anything: the pages' values stay as they are, so
it may run in another thread while the store's slots are written (a slot handed out meanwhile is written by
its row as usual; its page is then committed by whichever comes first).

    ahead = CommitAhead(data, slots_ahead)    data: a CPU store's [L, 2, N, H_kv, D]
    ahead.reach(high)                         slots [0, high + slots_ahead) committed soon (a thread)
    ahead.committed -> int                    slots [0, committed) are committed

Where the kernel does not have it (not Linux, older than 5.14), nothing is committed ahead.
"""
from __future__ import annotations

import ctypes
import sys
import threading

import torch

MADV_POPULATE_WRITE = 23
PAGE = 4096


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _libc_madvise()


def available() -> bool:
    """Whether pages can be committed without writing them here (Linux's madvise; a kernel older than 5.14
    refuses MADV_POPULATE_WRITE at the first call)."""
    return _madvise is not None


def populate(data: torch.Tensor, lo: int, hi: int) -> bool:
    """Commit the pages of slots [lo, hi) of `data` ([L, 2, N, ...], contiguous) without writing them; False
    where the kernel cannot (then nothing is committed)."""
    if _madvise is None or hi <= lo:
        return _madvise is not None
    layers, two, n = data.shape[:3]
    per_slot = data[0, 0, 0].numel() * data.element_size()
    plane = n * per_slot
    base = data.data_ptr()
    for p in range(layers * two):
        start = base + p * plane + lo * per_slot
        end = base + p * plane + hi * per_slot
        aligned = start - start % PAGE
        if _madvise(aligned, end - aligned, MADV_POPULATE_WRITE) != 0:
            return False
    return True


class CommitAhead:
    """Keeps `slots_ahead` slots committed beyond the highest slot handed out (`reach`), in a daemon thread."""

    def __init__(self, data: torch.Tensor, slots_ahead: int, committed: int = 1):
        assert data.is_contiguous() and data.device.type == "cpu"
        self.data, self.slots_ahead = data, int(slots_ahead)
        self.committed = committed
        self._target = committed
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._failed = _madvise is None

    def reach(self, high: int) -> None:
        """Slots up to `high` are handed out: commit up to `high + slots_ahead` if less than half the margin is
        left (returns at once; the thread does it)."""
        if self._failed or high + self.slots_ahead // 2 <= self._target:
            return
        with self._wake:
            self._target = min(high + self.slots_ahead, self.data.shape[2])
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lmq-kv-commit", daemon=True)
                self._thread.start()
            self._wake.notify()

    def close(self) -> None:
        """Stop committing and let the memory go (the store's is going): waits for a commit under way."""
        with self._wake:
            self._failed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        self.data = None

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._failed and self._target <= self.committed:
                    self._wake.wait()
                if self._failed:
                    return
                lo, hi, data = self.committed, self._target, self.data
            if not populate(data, lo, hi):
                self._failed = True
                return
            self.committed = max(self.committed, hi)
