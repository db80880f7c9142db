"""`KVPool.shares_prefixes`: whether the rows' page tables share prefixes in blocks (the GPU's cascade
attention reads such tiles once for a block of rows)."""
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
