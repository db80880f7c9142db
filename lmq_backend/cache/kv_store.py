"""`KVStore`: every token's K/V of a backend, in one paged store shared by the prefix trie and the running batch.

The K/V layout (the one place it is written down; the trie, the page-table pool, the runner and the
kernels all follow it)
----------------------------------------------------------------------------------------------------
    store.data: [L, 2, N, H_kv, D]     layer, 0=K / 1=V, slot, kv head, head dim   (model dtype, device)

A **slot** is a page of one token: one token's K (after RoPE) and V for every layer and kv head. Pages of
one token let the trie share any prefix down to a token boundary (a segment may end anywhere) with no
copy-on-write of partly filled pages, as SGLang's RadixAttention does; per layer the slots are the rows
of `data[l, k]`, `[N, H_kv, D]`, so a kernel reads a token's head vector at `slot * H_kv * D + h * D`.

Who holds a slot (`owner[slot]`):
    FREE     on the free list
    ROW      a running row's own K/V (written by its prefill or decode steps, or reserved for the next ones)
    TRIE     a trie node's (`TrieNode.slots`); running rows read them through their page tables while
             their query pins the node
    RESERVED slot 0: all zeros, the page that padding columns of a page table point to

A running row is a page table (see `engine/kv_pool.py`): column -> slot. A trie hit writes the cached
prefix's slots into the row's table and copies no K/V; a finished segment's slots pass from ROW to TRIE
(`take`); a row that leaves frees its ROW slots; trie eviction frees a node's slots. `check` asserts these
invariants for tests.

Memory: the store is allocated once at its full size (`capacity` slots) with `torch.empty`; on a CPU the
operating system commits pages only when they are first written, and free slots are handed out lowest
first, so a store sized for the worst case costs what is used. A first write to uncommitted pages costs a
page fault a page (a fresh page zeroed): `touch(n)` commits the lowest slots' pages ahead of their use (a
backend's load, for the slots a warm start from the disk tier fills), and `commit_ahead(nbytes)` keeps that
many bytes of slots committed beyond the highest slot handed out, in a thread (`pages.py`). On a GPU the size
is fixed up front (CUDA graphs capture its address).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from .pages import CommitAhead

LAYOUT_VERSION = 1  # of what a slot holds (above): K/V kept beyond a process (cache/disk_tier.py) is keyed by it
FREE, ROW, TRIE, RESERVED = 0, 1, 2, 3
ZERO_SLOT = 0


def token_bytes(layers: int, heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one slot: a token's K and V over every layer and kv head."""
    return 2 * layers * heads * head_dim * torch.empty(0, dtype=dtype).element_size()


class OutOfSlots(Exception):
    """The store cannot give that many slots now (even after evicting every unpinned trie leaf)."""


class KVStore:
    def __init__(self, layers: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int):
        if capacity < 2:
            raise ValueError("a KV store needs at least 2 slots")
        self.shape = (layers, heads, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.data = torch.empty(layers, 2, capacity, heads, head_dim, dtype=dtype, device=self.device)
        self.data[:, :, ZERO_SLOT].zero_()
        self.owner = np.zeros(capacity, dtype=np.int8)
        self.owner[ZERO_SLOT] = RESERVED
        # free slots as a stack, lowest on top: the lowest slots are reused first (a CPU store's untouched
        # pages stay uncommitted)
        self._free = np.arange(capacity - 1, 0, -1, dtype=np.int32)
        self._n_free = capacity - 1
        self.bytes_per_token = token_bytes(layers, heads, head_dim, dtype)
        # called with a slot count when the free list runs short: frees unpinned trie slots
        self.reclaim: Callable[[int], object] | None = None
        # how many slots evicting every unpinned trie node would free
        self.evictable: Callable[[], int] | None = None
        self.peak_used = 0
        self.touched = 1  # slots [0, touched) have their pages committed (`touch`)
        self._ahead: CommitAhead | None = None

    def touch(self, n: int) -> int:
        """Commit the pages of slots [0, n) (capped by the capacity) now, by writing zeros to them: a CPU store's
        memory is committed at the first write, and a page fault a page costs more than the copy it interrupts.
        Free slots only (their values are unused); on a GPU nothing (its memory is committed at allocation).
        Returns the slots committed so far (`touched`)."""
        n = min(int(n), self.capacity)
        if self.device.type == "cpu" and n > self.touched:
            owner = self.owner[self.touched:n]
            assert ((owner == FREE) | (owner == RESERVED)).all(), "touch writes free slots only"
            self.data[:, :, self.touched:n].zero_()
            self.touched = n
        return self.touched

    def commit_ahead(self, nbytes: int) -> CommitAhead | None:
        """(CPU) From now on keep about `nbytes` of slots committed beyond the highest slot handed out, in a
        thread that writes nothing (`pages.CommitAhead`, returned; None on a GPU): a copy into slots never used
        before (a prefix loaded from the disk tier) then takes no page faults."""
        if self.device.type == "cpu" and self._ahead is None and nbytes >= self.bytes_per_token:
            self._ahead = CommitAhead(self.data, nbytes // self.bytes_per_token, committed=self.touched)
        return self._ahead

    @property
    def capacity(self) -> int:
        return self.data.shape[2]

    def close(self) -> None:
        """Give the memory back (the backend was closed): an empty store with no slot to hand out."""
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None
        layers, _, _, heads, head_dim = self.data.shape
        self.data = self.data.new_empty((layers, 2, 0, heads, head_dim))
        self.owner, self._free, self._n_free = self.owner[:0], self._free[:0], 0
        self.reclaim = self.evictable = None

    @property
    def free_slots(self) -> int:
        return self._n_free

    @property
    def used_slots(self) -> int:
        return self.capacity - 1 - self._n_free

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer: [N, H_kv, D] each, views."""
        return self.data[layer, 0], self.data[layer, 1]

    # ----- slots ----------------------------------------------------------------------------------------

    def available(self) -> int:
        """Slots that `alloc` can give now, counting what evicting unpinned trie leaves would free."""
        return self._n_free + (self.evictable() if self.evictable is not None else 0)

    def alloc(self, n: int) -> np.ndarray:
        """n slots for a row (owner ROW), int32; evicts unpinned trie leaves if the free list is short;
        raises OutOfSlots (taking none) if that is still not enough."""
        if n <= 0:
            return np.empty(0, dtype=np.int32)
        if n > self._n_free and self.reclaim is not None:
            self.reclaim(n - self._n_free)
        if n > self._n_free:
            raise OutOfSlots(f"{n} K/V slots wanted, {self._n_free} free of {self.capacity - 1}")
        top = self._n_free
        slots = self._free[top - n:top][::-1].copy()
        self._n_free = top - n
        self.owner.put(slots, ROW)
        self.peak_used = max(self.peak_used, self.used_slots)
        if self._ahead is not None:
            self._ahead.reach(int(slots[-1]) + 1)  # (ascending)
        return slots

    def free(self, slots: np.ndarray) -> None:
        """Return slots to the free list (ROW or TRIE slots; each at most once)."""
        if len(slots) == 0:
            return
        owner = self.owner[slots]
        assert ((owner == ROW) | (owner == TRIE)).all(), "double free"
        self._push(np.sort(slots))

    def free_rows(self, slots: np.ndarray) -> int:
        """Free those of `slots` that a row owns (a row's table also points at trie and zero slots);
        returns how many."""
        mine = slots[self.owner.take(slots) == ROW]
        mine.sort()
        if len(mine):
            self._push(mine)
        return len(mine)

    def _push(self, ascending: np.ndarray) -> None:
        """Owned slots, sorted, back on the free list (lowest on top)."""
        assert (ascending[1:] != ascending[:-1]).all(), "a slot freed twice at once"
        self.owner.put(ascending, FREE)
        top = self._n_free
        self._free[top:top + len(ascending)] = ascending[::-1]
        self._n_free = top + len(ascending)

    def take(self, slots: np.ndarray) -> None:
        """ROW -> TRIE: a finished segment's slots now belong to a trie node."""
        assert _all_are(self.owner.take(slots), ROW), "the trie can only take a row's own slots"
        self.owner.put(slots, TRIE)

    # ----- K/V ------------------------------------------------------------------------------------------

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The K/V of `slots` (int, any shape S...) as [L, 2, S..., H_kv, D] (a copy)."""
        return self.data[:, :, slots.to(self.device, torch.long)]

    # ----- invariants -----------------------------------------------------------------------------------

    def check(self, trie_slots: list[np.ndarray] | None = None, row_tables: list[np.ndarray] | None = None) -> None:
        """Assert the ownership invariants: the free list holds exactly the FREE slots, each once; given the
        trie's node slots, they are exactly the TRIE slots, disjoint; given the running rows' table
        entries, every slot they use is owned (not FREE), and each ROW slot belongs to one row."""
        free = self._free[: self._n_free]
        assert len(np.unique(free)) == len(free), "a slot is twice on the free list"
        assert (self.owner[free] == FREE).all(), "a slot on the free list is owned"
        assert (self.owner == FREE).sum() == self._n_free, "a FREE slot is missing from the free list"
        assert self.owner[ZERO_SLOT] == RESERVED
        if trie_slots is not None:
            held = np.concatenate(trie_slots) if trie_slots else np.empty(0, dtype=np.int32)
            assert len(np.unique(held)) == len(held), "two trie nodes share a slot"
            assert (self.owner[held] == TRIE).all(), "a trie node holds a slot it does not own"
            assert (self.owner == TRIE).sum() == len(held), "a TRIE slot belongs to no node"
        if row_tables is not None:
            seen: set[int] = set()
            for table in row_tables:
                assert (self.owner[table] != FREE).all(), "a running row reads a free slot"
                own = set(np.unique(table[self.owner[table] == ROW]).tolist())
                assert not own & seen, "two rows own one slot"
                seen |= own
            assert len(seen) == (self.owner == ROW).sum(), "a ROW slot belongs to no running row"


def _all_are(owners: np.ndarray, who: int) -> bool:
    """Is every entry of `owners` (int8, a few slots') `who`? (Counted over its bytes: a reduction's call costs
    more than the count at a segment's size.)"""
    return owners.tobytes().count(who) == len(owners)
