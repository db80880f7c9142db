"""A CPU store's pages for a warm start are committed at the backend's load (`KVStore.touch`, sized by the disk
tier's largest file: `DiskTier.most_tokens`), so the first call's copy from the disk tier writes committed
pages; the answers stay exact."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import lmq_backend as lmq
from lmq_backend.cache.disk_tier import DiskTier
from lmq_backend.cache.kv_store import FREE, KVStore
from lmq_backend.cache.segment import Segment, prefix_key
from support.caches import node_slots
from support.tiny import tiny_llama

SHAPE = (2, 2, 16)  # the tiny llama's layers, kv heads, head dim
PER_TOKEN = 2 * 2 * 2 * 16 * 4
QUERY = '''argmax
    "{shots}Q: {question}\\nA:[ANSWER]" where len(TOKENS(ANSWER)) < 6
'''
SHOTS = "".join(f"Q: what comes after {i}?\nA: {i + 1}\n\n" for i in range(30))


def test_touch_commits_free_slots_lowest_first_and_only_once():
    store = KVStore(*SHAPE, torch.float32, torch.device("cpu"), capacity=64)
    store.data[:, :, 1:].fill_(7.0)  # what was in the pages before (garbage: free slots' values are unused)
    assert store.touched == 1
    assert store.touch(10) == 10
    assert (store.data[:, :, :10] == 0).all() and (store.data[:, :, 10:] == 7).all()
    store.data[:, :, 1:10].fill_(3.0)
    assert store.touch(8) == 10 and (store.data[:, :, 1:10] == 3).all()  # committed already: not written again
    assert store.touch(10**6) == 64  # capped by the capacity
    store.check()
    assert (store.owner[1:] == FREE).all()


def test_touch_refuses_slots_a_row_or_the_trie_owns():
    store = KVStore(*SHAPE, torch.float32, torch.device("cpu"), capacity=64)
    store.alloc(5)
    with pytest.raises(AssertionError, match="free slots only"):
        store.touch(10)


def test_most_tokens_bounds_the_largest_file(tmp_path):
    tier = DiskTier(tmp_path, "ab" * 16, torch.float32, SHAPE, 1, 10**8)
    assert tier.most_tokens() == 0
    for tokens in (70, 300, 120):
        ids = np.arange(tokens, dtype=np.int32) + tokens
        seg = Segment.of(ids, 0, torch.zeros(2, 2, tokens, 2, 16))
        assert tier.write(seg, prefix_key(ids[:0]))
    tier.flush()
    # the file's ids, header and padding to whole 4 KiB blocks: a few tokens' worth more than its K/V
    assert 300 <= tier.most_tokens() <= 300 + 4096 * 2 // PER_TOKEN + 300 * 4 // PER_TOKEN + 1


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


async def test_a_backend_commits_the_window_its_warm_start_fills(model, tokenizer, tmp_path):
    def backend(**kw):
        return lmq.HFBackend.from_model(model, tokenizer, name="tiny", cache_budget="64MB", host_cache=0, **kw)

    calls = [{"shots": SHOTS, "question": q} for q in ("what comes after 40?", "what comes after 41?")]
    cold = backend(disk_cache=tmp_path)
    assert cold.store.touched == 1  # nothing on disk: nothing committed ahead
    reference = [r.prompt for r in [await lmq.Query(QUERY, model=cold).run(c) for c in calls]]
    cold.close()
    warm = backend(disk_cache=tmp_path)
    prompt_tokens = len(tokenizer(SHOTS).input_ids)
    assert warm.store.touched >= 1 + prompt_tokens
    q = lmq.Query(QUERY, model=warm)
    assert (await q.run(calls[0])).prompt == reference[0]
    assert warm.stats().tokens_from_disk >= prompt_tokens - 1
    (loaded,) = warm.trie.root.children.values()  # the prefix from disk (the call's tail: a child of it)
    assert len(loaded.ids) >= prompt_tokens - 1
    assert loaded.slots.max() < warm.store.touched  # the copy from disk wrote committed pages only
    warm.store.check(node_slots(warm.trie), [])
    assert (await q.run(calls[1])).prompt == reference[1]
    off = backend(disk_cache=None)
    assert off.store.touched == 1


def test_commit_ahead_commits_beyond_the_slots_handed_out_and_writes_nothing():
    import time

    from lmq_backend.cache import pages

    # where the kernel cannot commit pages without writing them (not Linux, or older than 5.14), nothing is
    # committed ahead, and still nothing is written
    works = pages.populate(torch.zeros(1, 2, 4096, 1, 64), 0, 4096)
    store = KVStore(*SHAPE, torch.float32, torch.device("cpu"), capacity=4096)
    ahead = store.commit_ahead(100 * store.bytes_per_token)
    first = ahead.committed
    slots = store.alloc(300)
    store.data[:, :, slots] = 5.0  # a row writes its slots while the thread commits around them
    deadline = time.monotonic() + (10 if works else 0.5)
    want = int(slots.max()) + 1 + 100  # the highest slot handed out, and 100 more
    while ahead.committed < want and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ahead.committed == (want if works else first)
    assert (store.data[:, :, slots] == 5).all()  # nothing written
    store.close()
    assert ahead.data is None  # the thread let the memory go
