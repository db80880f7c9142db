"""`KVPool`: the K/V of the running batch in one tensor, in the layout the prefix trie and the decode
kernel share (see `lmq_backend/cache/trie.py` and `kernels/decode_attention.py`):

    data: [L, 2, R, H_kv, S, D]     layer, K/V, row slot, kv head, column, head dim

Rows live in slots 0..rows-1 and are left-padded: row r's valid tokens occupy columns
[start[r], end), with `end` common to every row. A prefill writes the new rows' tokens so that they
end at `end` too, a decode step writes column `end` of every row and advances it. The pool keeps
free columns on the left (`headroom`) so that a joining row longer than the others rarely forces a
shift, and free columns on the right for decode steps; both are restored by `make_room`, which shifts
or regrows the tensor.

Invariant: every row's columns from the pool's first valid column (the smallest `start`) to `end` hold
finite values (its own K/V, zeros or stale K/V), because attention reads that whole range and a masked
NaN would still poison the softmax-weighted sum. The tensor itself is allocated uninitialised (zeroing
gigabytes on every regrow costs seconds on a CPU); `add_rows` zeroes what the range newly takes in.
"""
from __future__ import annotations

import torch


class KVPool:
    def __init__(self, layers: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 rows: int = 4, columns: int = 256, headroom: int = 128):
        self.shape = (layers, heads, head_dim)
        self.dtype, self.device = dtype, device
        self.headroom = headroom
        self.data = torch.empty(layers, 2, rows, heads, columns, head_dim, dtype=dtype, device=device)
        self.rows = 0                 # slots in use: 0..rows-1
        self.start: list[int] = []    # per slot: first valid column
        self.end = headroom           # common end of every row's valid columns
        self.version = 0              # bumped by every change but a decode step's column (run-ahead keys)

    # ----- geometry ---------------------------------------------------------------------------------

    @property
    def row_capacity(self) -> int:
        return self.data.shape[2]

    @property
    def column_capacity(self) -> int:
        return self.data.shape[4]

    def length(self, slot: int) -> int:
        return self.end - self.start[slot]

    def make_room(self, rows: int, longest: int, extra: int) -> None:
        """Ensure `rows` slots, that a row of `longest` tokens fits left of `end`, and `extra` free columns
        right of `end`: shift the rows in place, or regrow the tensor, keeping every row's contents."""
        used_from = min(self.start[: self.rows], default=self.end)
        need_left = max(longest - self.end, 0)
        if rows <= self.row_capacity and need_left == 0 and self.end + extra <= self.column_capacity:
            return
        self.version += 1
        span = self.end - used_from                          # columns holding valid tokens
        new_end = max(span, longest) + self.headroom
        needed = new_end + extra + self.headroom
        # Grow geometrically: a regrow allocates and zeroes the whole pool, so it must stay rare.
        columns = max(needed, 5 * self.column_capacity // 4) if needed > self.column_capacity else self.column_capacity
        row_capacity = max(3 * self.row_capacity // 2, rows) if rows > self.row_capacity else self.row_capacity
        if rows <= self.row_capacity and new_end + extra <= self.column_capacity:
            # Shift the rows inside the same tensor (the pool's address stays: CUDA graphs keep working).
            self.data[:, :, :, :, new_end - span:new_end] = self.data[:, :, :, :, used_from:self.end].clone()
        else:
            grown = torch.empty(*self.data.shape[:2], row_capacity, self.shape[1], columns, self.shape[2],
                                dtype=self.dtype, device=self.device)
            grown[:, :, : self.rows, :, new_end - span:new_end] = self.data[:, :, : self.rows, :, used_from:self.end]
            self.data = grown
        shift = self.end - new_end
        self.start = [s - shift for s in self.start]
        self.end = new_end

    # ----- rows -------------------------------------------------------------------------------------

    def add_rows(self, lengths: list[int]) -> list[int]:
        """Reserve slots for rows of the given lengths (ending at `end`); returns their slots."""
        self.version += 1
        slots = list(range(self.rows, self.rows + len(lengths)))
        old_first = min(self.start, default=self.end)
        starts = [self.end - n for n in lengths]
        first = min(old_first, *starts)
        if first < old_first and self.rows:  # the range read by attention grows to the left
            self.data[:, :, : self.rows, :, first:old_first].zero_()
        for slot, s in zip(slots, starts):
            self.data[:, :, slot, :, first:s].zero_()
        self.start.extend(starts)
        self.rows += len(lengths)
        return slots

    def write_segments(self, slot: int, segments: list[torch.Tensor], first_column: int) -> None:
        """Copy trie segments ([L, 2, H, T, D] each) into a slot, from `first_column` on."""
        self.version += 1
        col = first_column
        for s in segments:
            self.data[:, :, slot, :, col:col + s.shape[3]].copy_(s)
            col += s.shape[3]

    def clear(self) -> None:
        """Drop every row (the tensor stays allocated for the next ones)."""
        self.rows, self.start, self.end = 0, [], self.headroom
        self.version += 1

    def remove_row(self, slot: int) -> int | None:
        """Free a slot, moving the last row into it to keep slots dense; returns the moved row's old
        slot (its new slot is `slot`), or None. Only the moved row's valid columns are copied: the
        slot's columns left of them still hold the freed row's finite values (the invariant above)."""
        self.version += 1
        last = self.rows - 1
        moved = None
        if slot != last:
            s = self.start[last]
            self.data[:, :, slot, :, s:self.end].copy_(self.data[:, :, last, :, s:self.end])
            self.start[slot] = self.start[last]
            moved = last
        self.start.pop()
        self.rows -= 1
        if self.rows == 0:
            self.clear()
        return moved

    def segment(self, slot: int, start: int, end: int) -> torch.Tensor:
        """Tokens [start, end) of a row (positions in the row, not columns), trie layout [L, 2, H, T, D]:
        a view, which the trie copies."""
        base = self.start[slot]
        return self.data[:, :, slot, :, base + start:base + end]
