"""`KVPool`: the running batch as page tables into the backend's `KVStore` (layout: `cache/kv_store.py`).

    table: [R, S] int32      row slot, column -> store slot (host; a device mirror on a GPU)

Rows live in slots 0..rows-1 and are left-padded: row r's tokens occupy columns [start[r], end), with `end`
common to every row, and column c of row r holds the K/V of store slot table[r, c]. A row's cached prefix
is the trie's slots written into its table (no K/V is copied); its new tokens get slots of their own
(owner ROW). Columns left of a row's start point at the store's zero slot, so attention that reads a
batch from its first column (the torch paths) reads zeros there, never stale memory. Columns
[end, ahead) of every row already have slots (a decode step writes column `end`, and a GPU step run ahead
writes `end + 1` before the host sees it).

Geometry: free columns on the left (`headroom`) let a joining row
longer than the others in without a shift; `make_room` shifts or regrows the table; `remove_row` moves
the last row's table row into the freed slot, so slots stay dense.
"""
from __future__ import annotations

import numpy as np
import torch

from ..cache.kv_store import ZERO_SLOT, KVStore

# The table's columns are a multiple of this: its row stride and every row's address keep the alignment the
# GPU kernels were compiled for (Triton compiles a kernel again, which takes long, when an int32 stride stops
# being a multiple of 16 or a pointer of 16 bytes).
COLUMN_ALIGN = 16


class KVPool:
    def __init__(self, store: KVStore, rows: int = 4, columns: int = 256, headroom: int = 128):
        assert columns % COLUMN_ALIGN == 0, columns
        self.store = store
        self.shape = store.shape
        self.dtype, self.device = store.dtype, store.device
        self.headroom = headroom
        self.table = torch.full((rows, columns), ZERO_SLOT, dtype=torch.int32)
        self.mirror = None if self.device.type == "cpu" else torch.full_like(self.table, ZERO_SLOT, device=self.device)
        self.rows = 0                 # slots in use: 0..rows-1
        self.start: list[int] = []    # per slot: first valid column
        self.end = headroom           # common end of every row's valid columns
        self.ahead = headroom         # columns [end, ahead) of every row have slots
        self.version = 0              # bumped by every change but a decode step's column (run-ahead keys)
        self._dirty: list[tuple[int, int, int, int]] = []  # (row lo, row hi, col lo, col hi) not yet mirrored
        self._shares = (-1, False)    # (version, shares_prefixes())

    @property
    def table(self) -> torch.Tensor:
        return self._table

    @table.setter
    def table(self, table: torch.Tensor) -> None:
        self._table = table
        self._np = table.numpy()      # the same memory: the host's row work indexes it (a numpy slice costs
                                      # a tenth of a torch one)

    @property
    def data(self) -> torch.Tensor:
        """The store's K/V ([L, 2, N, H_kv, D])."""
        return self.store.data

    # ----- geometry ---------------------------------------------------------------------------------

    @property
    def row_capacity(self) -> int:
        return self.table.shape[0]

    @property
    def column_capacity(self) -> int:
        return self.table.shape[1]

    def length(self, slot: int) -> int:
        return self.end - self.start[slot]

    def make_room(self, rows: int, longest: int, extra: int) -> None:
        """Ensure `rows` slots, that a row of `longest` tokens fits left of `end`, and `extra` free columns
        right of `end` (plus one for a step run ahead): shift the table's rows, or regrow it."""
        used_from = min(self.start[: self.rows], default=self.end)
        need_left = max(longest - self.end, 0)
        if rows <= self.row_capacity and need_left == 0 and self.ahead + extra + 1 <= self.column_capacity:
            return
        self.version += 1
        span = self.ahead - used_from
        new_end = max(self.end - used_from, longest) + self.headroom
        shift = self.end - new_end
        needed = new_end + (self.ahead - self.end) + extra + 1 + self.headroom
        columns = max(needed, 5 * self.column_capacity // 4) if needed > self.column_capacity else self.column_capacity
        columns = -(-columns // COLUMN_ALIGN) * COLUMN_ALIGN
        row_capacity = max(3 * self.row_capacity // 2, rows) if rows > self.row_capacity else self.row_capacity
        lo = used_from - shift
        if (row_capacity, columns) == tuple(self.table.shape):
            # a shift within the same table (every row dropped since, or rows longer than `end`): in place,
            # so that whatever was built on the table (a fused decoder, its CPU plan) stays valid. Only the
            # live rows' block moves: every other entry is the zero slot already (a single query's cached
            # prompt on a GPU: no fill and no copy of the whole table on its path)
            block = self._np[: self.rows, used_from:self.ahead]
            kept = block.copy()
            block[:] = ZERO_SLOT
            self._np[: self.rows, lo:lo + span] = kept
            if self.rows:
                self._mark(0, self.rows, 0, max(self.ahead, lo + span))
        else:
            new = torch.full((row_capacity, columns), ZERO_SLOT, dtype=torch.int32)
            new[: self.rows, lo:lo + span] = self.table[: self.rows, used_from:self.ahead]
            self.table = new
            if self.mirror is not None:
                if self.mirror.shape != self.table.shape:
                    self.mirror = torch.full_like(self.table, ZERO_SLOT, device=self.device)
                self._dirty = [(0, row_capacity, 0, columns)]
        self.start = [s - shift for s in self.start]
        self.end, self.ahead = new_end, self.ahead - shift

    def reserve(self, columns: int) -> None:
        """Give every row slots for columns [end, end + columns) (decode steps, and one run ahead)."""
        hi = self.end + columns
        if hi <= self.ahead or not self.rows:
            return
        assert hi <= self.column_capacity, "make_room first"
        width = hi - self.ahead
        slots = self.store.alloc(self.rows * width)
        self._np[: self.rows, self.ahead:hi] = slots.reshape(self.rows, width)
        self._mark(0, self.rows, self.ahead, hi)
        self.ahead = hi

    def reserve_width(self, columns: int) -> int:
        """The slots a row takes from the store in `reserve(columns)`."""
        return max(self.end + columns - self.ahead, 0)

    # ----- rows -------------------------------------------------------------------------------------

    def add_rows(self, lengths: list[int]) -> list[int]:
        """Reserve slots for rows of the given lengths (ending at `end`); returns their slots. Their tables
        point at the zero slot until `set_row` fills them."""
        self.version += 1
        slots = list(range(self.rows, self.rows + len(lengths)))
        self.start.extend(self.end - n for n in lengths)
        self.rows += len(lengths)
        return slots

    def set_row(self, slot: int, cached: np.ndarray, new: int) -> None:
        """Row `slot`'s table: the `cached` prefix's trie slots, then `new` slots of its own for its tokens past
        them and for the columns [end, ahead) every row has. Raises `OutOfSlots` (nothing taken)."""
        s = self.start[slot]
        own = self.store.alloc(new + self.ahead - self.end)
        row = self._np[slot]
        row[s:s + len(cached)] = cached
        row[s + len(cached):self.ahead] = own
        # from column 0: the device's copy of a slot a released row held keeps that row's slots until now
        self._mark(slot, slot + 1, 0, self.ahead)

    def row_slots(self, slot: int) -> np.ndarray:
        """Every store slot row `slot` points at (its prefix's, its own, those reserved ahead)."""
        return self._np[slot, self.start[slot]:self.ahead]

    def release_row(self, slot: int, keep: int = 0) -> None:
        """Free the slots the row owns (not the trie's), but those of its first `keep` tokens: before
        `remove_row`, or when a failed prefill's rows are dropped."""
        self.store.free_rows(self.row_slots(slot)[keep:])
        self._np[slot, self.start[slot]:self.ahead] = ZERO_SLOT

    def clear(self) -> None:
        """Drop every row, freeing their slots (the table stays allocated for the next ones)."""
        for slot in range(self.rows):
            self.release_row(slot)
        self.rows, self.start, self.end, self.ahead = 0, [], self.headroom, self.headroom
        self.version += 1

    def remove_row(self, slot: int, keep: int = 0) -> int | None:
        """Free a row's slots (but its first `keep` tokens': a prompt's part prefilled, which the next part
        reads as its cached prefix) and its table row, moving the last row into it to keep rows dense;
        returns the moved row's old slot (its new slot is `slot`), or None."""
        self.version += 1
        self.release_row(slot, keep)
        last = self.rows - 1
        moved = None
        if slot != last:
            s, table = self.start[last], self._np
            table[slot, s:self.ahead] = table[last, s:self.ahead]
            table[slot, :s] = ZERO_SLOT
            table[last, s:self.ahead] = ZERO_SLOT
            self._mark(slot, slot + 1, 0, self.ahead)
            self.start[slot] = s
            moved = last
        self.start.pop()
        self.rows -= 1
        if self.rows == 0:
            self.clear()
        return moved

    def segment(self, slot: int, start: int, end: int) -> np.ndarray:
        """The store slots of tokens [start, end) of a row (positions in the row, not columns): a copy."""
        base = self.start[slot]
        return self._np[slot, base + start:base + end].copy()

    def segment_kv(self, slot: int, start: int, end: int) -> torch.Tensor:
        """The K/V of tokens [start, end) of a row, [L, 2, H_kv, T, D] (a copy, for scoring)."""
        return self.store.gather(torch.from_numpy(self.segment(slot, start, end))).transpose(2, 3)

    def shares_prefixes(self, block: int = 4, depth: int = 128) -> bool:
        """Whether most rows share their first `depth` tokens (the same store slots: a trie prefix) with the
        first row of their block of `block` consecutive slots: the GPU's decode attention then reads such
        tiles once for a block of rows (cascade), which costs rows that share nothing. Cached per `version`
        (a decode step's new column changes no prefix)."""
        if self._shares[0] == self.version:
            return self._shares[1]
        n = self.rows
        first = np.arange(n) // block * block
        starts = np.asarray(self.start[:n], dtype=np.int64)
        deep = self.end - starts >= depth
        slots = self._np[np.arange(n), np.minimum(starts + depth - 1, self.column_capacity - 1)]
        follower = np.arange(n) != first
        same = follower & deep & deep[first] & (slots == slots[first])
        shares = bool(2 * same.sum() >= max(follower.sum(), 1)) if n else False
        self._shares = (self.version, shares)
        return shares

    # ----- what the kernels read --------------------------------------------------------------------

    def device_table(self) -> torch.Tensor:
        """The table on the store's device, with every change made since the last call.

        The changed regions go up in one copy of their bounding box where it is not much larger than they
        are (a step's new column of every row; a prefill's rows), from a pinned copy of the host's values
        taken now, without waiting: a copy from pageable memory would wait for the device to finish the
        steps queued before it (one running ahead included) on every step."""
        if self.mirror is None or not self._dirty:
            return self.table if self.mirror is None else self.mirror
        dirty, self._dirty = self._dirty, []
        r0, r1 = min(d[0] for d in dirty), max(d[1] for d in dirty)
        c0, c1 = min(d[2] for d in dirty), max(d[3] for d in dirty)
        if (r1 - r0) * (c1 - c0) <= 2 * sum((d[1] - d[0]) * (d[3] - d[2]) for d in dirty) + 65536:
            dirty = [(r0, r1, c0, c1)]
        for r0, r1, c0, c1 in dirty:
            self.mirror[r0:r1, c0:c1].copy_(self.table[r0:r1, c0:c1].pin_memory(), non_blocking=True)
        return self.mirror

    def columns(self, rows: slice, first: int, end: int) -> torch.Tensor:
        """Store slots of columns [first, end) of rows `rows`, [B, end - first] int64 on the device."""
        return self.table[rows, first:end].to(self.device, torch.long)

    def _mark(self, r0: int, r1: int, c0: int, c1: int) -> None:
        if self.mirror is not None:
            self._dirty.append((r0, r1, c0, c1))
