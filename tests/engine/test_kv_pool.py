"""`KVPool.shares_prefixes`: whether the rows' page tables share prefixes in blocks (the GPU's cascade
attention reads such tiles once for a block of rows)."""
import numpy as np
import torch

from lmq_backend.cache.kv_store import KVStore
from lmq_backend.engine.kv_pool import KVPool


def _pool(rows: list[int]) -> KVPool:
    """A pool whose rows each hold a trie prefix of `rows[i]` tokens of one shared prefix (0: none)
    followed by 20 tokens of their own."""
    store = KVStore(1, 1, 4, torch.float32, torch.device("cpu"), 4096)
    trie = store.alloc(400)  # the prefix's slots, as a trie would hold them
    pool = KVPool(store, rows=len(rows), columns=512)
    pool.make_room(len(rows), max(rows) + 20, extra=2)
    slots = pool.add_rows([n + 20 for n in rows])
    for slot, n in zip(slots, rows):
        pool.set_row(slot, trie[:n], 20)
    return pool


def test_rows_with_a_common_prefix_share():
    assert _pool([300] * 8).shares_prefixes()
    assert _pool([300, 300, 300, 300, 200, 200, 200, 200]).shares_prefixes()


def test_rows_of_their_own_do_not():
    assert not _pool([0] * 8).shares_prefixes()
    assert not _pool([300] + [0] * 7).shares_prefixes()
    # a prefix shorter than the depth compared is not a tile to share
    assert not _pool([100] * 8).shares_prefixes(depth=128)


def test_the_answer_follows_the_rows():
    pool = _pool([300] * 4 + [0] * 4)
    assert pool.shares_prefixes()  # 3 of 6 followers share their block's first row's prefix
    pool.remove_row(1)             # the last row (its own tokens) moves into slot 1
    assert not pool.shares_prefixes()


def test_a_rows_own_slots_are_freed_and_nothing_else():
    """KVStore.free_rows: of a row's table (zero slot, trie slots, its own), only its own go back, lowest on
    top of the free list; a slot listed twice is an error, not freed twice."""
    import numpy as np
    import pytest

    store = KVStore(1, 1, 4, torch.float32, "cpu", capacity=64)
    trie = store.alloc(5)
    store.take(trie)
    own = store.alloc(7)
    table = np.concatenate([[0, 0], trie, own[::-1]]).astype(np.int32)
    free_before = store.free_slots
    assert store.free_rows(table) == 7
    assert store.free_slots == free_before + 7
    store.check(trie_slots=[trie])
    assert (store.alloc(7) == np.sort(own)).all()  # the lowest first, as before
    twice = store.alloc(3)
    with pytest.raises(AssertionError):
        store.free_rows(np.concatenate([twice, twice[:1]]).astype(np.int32))


def test_a_shift_within_the_table_keeps_it():
    """Rows longer than `end` after `clear()` (the next call of a few-shot query) shift the table in place when
    it is large enough: the same tensor, so that what was built on it (the fused decoder) stays; a row that
    stays is moved with its slots; a larger table is a new one."""
    store = KVStore(1, 1, 4, torch.float32, torch.device("cpu"), 8192)
    pool = KVPool(store, rows=2, columns=256)
    pool.make_room(1, 300, extra=2)                      # regrown: 300 tokens do not fit left of end 128
    grown = pool.table
    assert grown.shape[1] % 16 == 0                      # (the GPU kernels' alignment, see COLUMN_ALIGN)
    pool.add_rows([300])
    pool.clear()
    pool.make_room(1, 300, extra=2)                      # end is back at the headroom: a shift
    assert pool.table is grown and pool.end >= 300
    slot, = pool.add_rows([300])
    pool.set_row(slot, store.alloc(280), 20)             # a trie prefix of 280 slots, 20 of its own
    kept = pool.table[slot, pool.start[slot]:pool.end].clone()
    assert int((kept != 0).sum()) == 300
    pool.make_room(2, 400, extra=2)                      # a longer row joins: the first one shifts with its slots
    assert pool.table is grown
    assert torch.equal(pool.table[slot, pool.start[slot]:pool.end], kept)
    assert int((pool.table[slot] != 0).sum()) == 300     # ZERO_SLOT elsewhere
    pool.make_room(4, 400, extra=2)                      # more rows than it has: a new table
    assert pool.table is not grown


def test_the_device_table_is_the_host_table_in_every_live_row(monkeypatch):
    """What the kernels read through the device's copy of the table (`device_table`) is the host's table in
    every live row, columns [0, ahead): left of a row's start the zero slot, never the slots of a row that held
    that slot before; and the host's table is the zero slot outside the live rows' columns, while rows join
    (of random lengths, after random cached prefixes), step, leave and shift in place. Without a GPU the
    device's copy is a second host tensor."""
    import numpy as np

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    store = KVStore(1, 1, 4, torch.float32, device, 1 << 15)
    trie = store.alloc(700)
    store.take(trie)
    pool = KVPool(store, rows=4, columns=256)
    if pool.mirror is None:
        pool.mirror = torch.zeros_like(pool.table)
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t.clone())
    rng = np.random.default_rng(0)
    for _ in range(400):
        op = rng.integers(5)
        if op < 2 and pool.rows < 12:                      # a prefill of 1-3 rows
            lengths = rng.integers(2, 650, rng.integers(1, 4)).tolist()
            pool.make_room(pool.rows + len(lengths), max(lengths), extra=2)
            for slot, n in zip(pool.add_rows(lengths), lengths):
                cached = int(rng.integers(0, n))
                pool.set_row(slot, trie[:cached], n - cached)
        elif op == 2 and pool.rows:                        # a decode step
            pool.make_room(pool.rows, 0, extra=2)
            pool.reserve(2)
            pool.end += 1
        elif op == 3 and pool.rows:                        # a row leaves
            pool.remove_row(int(rng.integers(pool.rows)))
        elif op == 4 and rng.random() < 0.2:
            pool.clear()
        mirror = pool.device_table().cpu()
        live = torch.zeros_like(pool.table, dtype=torch.bool)
        for r in range(pool.rows):
            assert torch.equal(mirror[r, :pool.ahead], pool.table[r, :pool.ahead]), r
            live[r, pool.start[r]:pool.ahead] = True
        assert not pool.table[~live].any()


def test_a_failed_prefills_rows_go_but_a_long_prompts_parts_done_stay():
    """`Batch.drop_unjoined`: of two rows a failed prefill added on one trie prefix, the one whose request holds
    its prefix and a part done (a long prompt's last part) keeps those, the other frees every slot of its own."""
    from lmq_backend.engine.rows import Batch

    store = KVStore(1, 1, 4, torch.float32, torch.device("cpu"), 4096)
    trie = store.alloc(50)
    store.take(trie)
    held = np.concatenate([trie, store.alloc(16)]).astype(np.int32)  # the prefix, then the part done
    pool = KVPool(store, rows=2, columns=512)
    pool.make_room(2, 100, extra=2)
    slots = pool.add_rows([len(held) + 10, len(trie) + 30])
    pool.set_row(slots[0], held, 10)
    pool.set_row(slots[1], trie, 30)
    Batch(pool).drop_unjoined([held])
    assert pool.rows == 0
    store.check(trie_slots=[trie], row_tables=[held])
