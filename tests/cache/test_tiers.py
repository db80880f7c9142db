"""The cache tiers under the trie (cache/tiers.py): host memory and disk files.

The tiers' own contracts (budgets, LRU, a file's checks, two writer processes), then exactness through them
on a tiny model: greedy float32 answers identical with the tiers on and off, after round trips through host
memory and disk, after damaged or foreign files (with a warning), and in a new process."""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import lmq_backend as lmq
from lmq_backend.cache.disk_tier import CacheFileWarning, DiskTier, Layout, clear, model_key, usage
from lmq_backend.cache.fingerprint import describe_device
from lmq_backend.cache.host_arena import ALIGN, CHUNK_MIN, HostArena, chunk_sizes
from lmq_backend.cache.host_tier import HostTier
from lmq_backend.cache.kv_store import ROW
from lmq_backend.cache.segment import Segment, prefix_key
from lmq_backend.cache.stats import CacheStats, format_table
from lmq_backend.cache.tiers import MIN_TOKENS, CacheTiers
from support.caches import node_slots
from support.tiny import tiny_llama

SHAPE = (2, 2, 16)  # layers, kv heads, head dim: the tiny llama's
PER_TOKEN = 2 * 2 * 2 * 16 * 4  # its K/V bytes a token (float32)
PREFIX = 200 * PER_TOKEN        # a prompt's (~200 tokens of shots)


def segment(ids, start: int, seed: int = 0, dtype=torch.float32) -> Segment:
    g = torch.Generator().manual_seed(seed)
    L, H, D = SHAPE
    kv = torch.randn(L, 2, len(ids) - start, H, D, generator=g).to(dtype)
    return Segment.of(np.asarray(ids, dtype=np.int32), start, kv)


def disk(folder: Path, key: str = "ab" * 16, budget: int = 10**8, dtype=torch.float32) -> DiskTier:
    return DiskTier(folder, key, dtype, SHAPE, 1, budget, description={"name": "test"})


def put_on_disk(tier: DiskTier, seg: Segment) -> Path:
    start_key = prefix_key(seg.ids[:seg.start])
    assert tier.write(seg, start_key)
    tier.flush()
    return tier.path(start_key, seg.key)


def files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*/*/*.kv"))


# ----- the host tier -------------------------------------------------------------------------------------

def test_host_tier_keeps_its_budget_least_recently_used_first():
    segs = [segment(list(range(100 * i, 100 * i + 40)), 0, seed=i) for i in range(4)]
    host = HostTier(3 * segs[0].nbytes)
    for s in segs[:3]:
        assert host.put(s) == []
    assert host.find(list(segs[0].ids), None, 0, 40) == (segs[0], 40)  # touched: segs[1] is now the oldest
    assert host.put(segs[3]) == [segs[1]]
    host.check()
    assert host.bytes_in_use <= host.budget_bytes and len(host) == 3
    assert host.put(segs[3]) == []  # held already: touched, not added twice
    big = segment(list(range(1000, 1200)), 0)
    assert host.put(big) == [big] and len(host) == 3  # larger than the budget: straight down


def test_host_arena_hands_out_aligned_regions_first_fit_and_merges_them_back():
    arena = HostArena(10 * ALIGN, pinned=False)
    a = arena.tensor((ALIGN // 4,), torch.float32)               # one page
    b = arena.tensor((3, ALIGN // 2), torch.bfloat16)            # three pages
    c = arena.tensor((10,), torch.int8)                          # rounded up to a page
    assert arena.bytes_in_use == 5 * ALIGN and arena.largest_free() == 5 * ALIGN
    assert [arena.offset(t) for t in (a, b, c)] == [0, ALIGN, 4 * ALIGN]
    assert arena.tensor((6 * ALIGN,), torch.uint8) is None        # no region that large
    b.fill_(1.5)
    assert torch.all(b == 1.5) and torch.all(arena.chunks[0][ALIGN:4 * ALIGN].view(torch.bfloat16) == 1.5)
    del b                                                          # its region is free again, between a and c
    arena.check()
    d = arena.tensor((2 * ALIGN,), torch.uint8)                   # first fit: in b's old place
    assert arena.offset(d) == ALIGN
    del a, c, d                                                    # all back, merged into one region
    arena.check()
    assert arena.bytes_in_use == 0 and arena.largest_free() == 10 * ALIGN
    with pytest.raises(MemoryError, match="host_cache"):               # more than the machine has: said so
        HostArena(1 << 60, pinned=False)


def test_a_host_arena_is_power_of_two_blocks_that_regions_never_span():
    """torch's pinned allocator rounds a block up to a power of two: the budget is cut into its power-of-two
    parts (from CHUNK_MIN), so nothing is pinned beyond it; a region lies inside one block."""
    assert chunk_sizes(6 << 30) == [4 << 30, 2 << 30]
    assert chunk_sizes(CHUNK_MIN * 5 + 12345) == [CHUNK_MIN * 4, CHUNK_MIN]  # (the rest below CHUNK_MIN: unused)
    assert chunk_sizes(CHUNK_MIN - 1) == [CHUNK_MIN - ALIGN] and chunk_sizes(ALIGN - 1) == []
    arena = HostArena(3 * CHUNK_MIN, pinned=False)
    assert [c.numel() for c in arena.chunks] == [2 * CHUNK_MIN, CHUNK_MIN] and arena.nbytes == 3 * CHUNK_MIN
    a = arena.tensor((2 * CHUNK_MIN - ALIGN,), torch.uint8)
    b = arena.tensor((2 * ALIGN,), torch.uint8)   # does not fit what is left of the first block: the second
    assert arena.offset(a) == 0 and arena.offset(b) == 2 * CHUNK_MIN + ALIGN
    assert b.data_ptr() == arena.chunks[1].data_ptr()
    c = arena.tensor((ALIGN,), torch.uint8)       # first fit: the first block's last page
    assert arena.offset(c) == 2 * CHUNK_MIN - ALIGN
    del a, c
    arena.check()
    assert arena.largest_free() == 2 * CHUNK_MIN  # merged within the first block, not with the second
    assert arena.tensor((2 * CHUNK_MIN + ALIGN,), torch.uint8) is None
    del b
    arena.check()
    assert arena.bytes_in_use == 0


def test_a_host_tier_with_an_arena_makes_room_by_dropping_the_oldest_segments():
    shape, dtype = tuple(segment(list(range(40)), 0).kv.shape), torch.float32  # 40 x 512 bytes: five pages
    arena = HostArena(3 * 5 * ALIGN, pinned=False)
    host = HostTier(0, arena)
    assert host.budget_bytes == 15 * ALIGN
    disk: list[Segment] = []  # what went down, held (as a disk tier holds a segment until it is written)

    def keep(i: int, shape=shape, down=disk.append) -> torch.Tensor:
        kv, n = host.reserve(shape, dtype, down), shape[2]
        kv.copy_(segment(list(range(100 * i, 100 * i + n)), 0, seed=i).kv)
        assert host.put(Segment.of(np.arange(100 * i, 100 * i + n), 0, kv)) == []
        return kv

    in_arena = [arena.offset(keep(i)) for i in range(3)]
    assert in_arena == [0, 5 * ALIGN, 10 * ALIGN] and disk == []
    keep(3)  # the oldest goes down; its region is still held there: the new one gets memory of its own
    assert [int(d.ids[0]) for d in disk] == [0]
    host.check()
    assert len(host) == 3 and host.bytes_in_use == 15 * ALIGN == arena.bytes_in_use
    ids = list(range(300, 340))
    assert torch.equal(host.find(ids, None, 0, 40)[0].kv, segment(ids, 0, seed=3).kv)
    disk.clear()  # written: the regions are free again, and the next segment takes one
    kv = keep(4)
    assert [int(d.ids[0]) for d in disk] == [100] and arena.offset(kv) == 0
    del kv
    disk.clear()
    # a segment that needs two adjacent free regions: the oldest go until there are (dropped for good here)
    keep(5)
    disk.clear()  # (held: 300 in memory of its own, 400 at pages 0-5, 500 at 5-10)
    gone: list[int] = []
    kv = keep(6, (2, 2, 60, 2, 16), lambda seg: gone.append(int(seg.ids[0])))  # eight pages
    assert gone == [300, 400, 500] and arena.offset(kv) == 0
    del kv
    host.check()
    arena.check()
    assert host.reserve((2 * 15 * ALIGN // 4,), dtype, disk.append) is None  # larger than the budget
    host.clear()
    assert arena.bytes_in_use == 0 and arena.largest_free() == 15 * ALIGN


def test_host_tier_finds_the_longest_exact_continuation():
    host = HostTier(10**6)
    prefix = list(range(10, 30))
    a = segment(prefix + [1, 2, 3, 4, 5, 6], 20)
    b = segment(prefix + [1, 2, 9], 20, seed=1)
    other = segment([99] + prefix[1:] + [1, 2, 3, 4, 5, 6, 7, 8], 20, seed=2)  # another prefix: never used
    for s in (a, b, other):
        host.put(s)
    ids = prefix + [1, 2, 3, 4, 7, 7, 7]
    assert host.find(ids, None, 20, len(ids)) == (a, 4)
    assert host.find(ids, None, 20, 22)[1] == 2  # no further than the limit
    assert host.find(ids, None, 20, len(ids), past=22) == (a, 4)  # beyond position 22: only a does
    assert host.find(ids, None, 20, len(ids), past=24) == (None, 0)
    assert host.find(ids, None, 19, len(ids)) == (None, 0)
    assert host.find([99] + ids[1:], None, 20, 27)[0] is other


def test_host_tier_holds_a_run_of_tokens_once():
    """A node evicted after a split (its tokens a part of a held segment) is held already; a segment that holds
    all of an older one replaces it."""
    host = HostTier(10**6)
    ids = list(range(10, 90))
    whole = segment(ids, 10)
    host.put(whole)
    assert host.covering(np.asarray(ids[:60], dtype=np.int32), 30) is whole       # a part, from inside it
    assert host.covering(np.asarray(ids, dtype=np.int32), 5) is None              # it begins later than that
    assert host.covering(np.asarray(ids[:59] + [7], dtype=np.int32), 30) is None  # another last token
    longer = segment(ids + [1, 2, 3], 0, seed=1)
    assert host.put(longer) == [] and list(host) == [longer]                      # `whole` is in it: gone
    other = segment(ids[:40] + [5] * 10, 20, seed=2)                              # shares only a prefix: kept
    host.put(other)
    assert list(host) == [longer, other]
    host.check()


# ----- the disk tier --------------------------------------------------------------------------------------

def test_disk_round_trip_is_exact(tmp_path):
    tier = disk(tmp_path)
    ids = list(range(500, 700))
    seg = segment(ids, 120, dtype=torch.bfloat16)
    tier = disk(tmp_path, dtype=torch.bfloat16)
    path = put_on_disk(tier, seg)
    found, k = tier.find(np.asarray(ids[:150] + [1, 2], dtype=np.int32), 120, 152)
    assert found == path and k == 30
    assert tier.find(np.asarray(ids, dtype=np.int32), 120, 200, past=180) == (path, 80)
    assert tier.find(np.asarray(ids[:150] + [1, 2], dtype=np.int32), 120, 152, past=150) == (None, 0)
    back = tier.read(path)
    assert back.start == 120 and np.array_equal(back.ids, seg.ids)
    assert torch.equal(back.kv, seg.kv) and back.kv.dtype == torch.bfloat16
    assert tier.find(np.asarray([7] + ids[1:], dtype=np.int32), 120, 200) == (None, 0)  # another prefix
    assert not tier.write(seg, prefix_key(seg.ids[:120]))  # on disk already


def damage(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "payload byte":
        raw[len(raw) // 2] ^= 0x10
    elif how == "ids byte":
        raw[300] ^= 0x01
    elif how == "truncated":
        raw = raw[: len(raw) - 5000]
    elif how == "empty":
        raw = bytearray()
    elif how == "end":
        raw[-30] ^= 0xFF
    elif how == "not ours":
        raw = bytearray(b"hello world" * 100)
    elif how == "two sign bits":  # (of two 64-bit words of one 4 KiB block: a sum of the words misses it)
        (n,) = struct.unpack_from("<I", raw, 8)
        at = Layout.of(json.loads(raw[12:12 + n]), n, 4).payload_at
        for word in (1, 100):
            raw[at + 8 * word + 7] ^= 0x80
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["payload byte", "ids byte", "truncated", "empty", "end", "not ours",
                                 "two sign bits"])
def test_disk_ignores_a_damaged_file_with_a_warning(tmp_path, how):
    tier = disk(tmp_path)
    ids = list(range(300))
    path = put_on_disk(tier, segment(ids, 0))
    damage(path, how)
    fresh = disk(tmp_path)  # (a process that has not seen the file's head yet)
    with pytest.warns(CacheFileWarning, match="ignored the K/V cache file"):
        found, k = fresh.find(np.asarray(ids, dtype=np.int32), 0, 300)
        seg = fresh.read(found) if found is not None else None
    assert seg is None and fresh.rejected == 1
    assert not path.exists()  # removed: it never warns twice


@pytest.mark.parametrize("other", ["model", "dtype", "layout"])
def test_disk_ignores_a_foreign_file(tmp_path, other):
    ids = list(range(200))
    theirs = {"model": disk(tmp_path / "a", key="cd" * 16), "dtype": disk(tmp_path / "a", dtype=torch.float64),
              "layout": DiskTier(tmp_path / "a", "ab" * 16, torch.float32, SHAPE, 2, 10**8)}[other]
    seg = segment(ids, 0, dtype=theirs.dtype)
    path = put_on_disk(theirs, seg)
    ours = disk(tmp_path / "b")
    target = ours.path(prefix_key(seg.ids[:0]), seg.key)
    target.parent.mkdir(parents=True)
    shutil.copy(path, target)  # in our folder, under the right name
    with pytest.warns(CacheFileWarning, match=f"another {other}"):
        assert ours.find(np.asarray(ids, dtype=np.int32), 0, 200) == (None, 0)
    assert ours.rejected == 1 and not target.exists()


def test_model_key_names_everything_that_makes_kv_differ():
    base = model_key("weights", "float32", "cpu:x86_64", 1, SHAPE)
    assert base == model_key("weights", "float32", "cpu:x86_64", 1, SHAPE)
    for other in (model_key("weights2", "float32", "cpu:x86_64", 1, SHAPE),
                  model_key("weights", "bfloat16", "cpu:x86_64", 1, SHAPE),
                  model_key("weights", "float32", "cuda:H100", 1, SHAPE),
                  model_key("weights", "float32", "cpu:x86_64", 2, SHAPE),
                  model_key("weights", "float32", "cpu:x86_64", 1, (2, 2, 32))):
        assert other != base


def test_the_device_in_a_key_names_the_cpu_kernels(monkeypatch):
    """K/V a CPU computed with other kernels (lmq's or torch's, built for another instruction set) may differ in
    its last bits: a disk tier's files are not shared between them."""
    cpu = torch.device("cpu")
    monkeypatch.setenv("LMQ_CPU_KERNELS", "1")
    monkeypatch.delenv("LMQ_CPU_MARCH", raising=False)
    ours = describe_device(cpu)
    monkeypatch.setenv("LMQ_CPU_KERNELS", "0")
    assert describe_device(cpu) != ours
    monkeypatch.setenv("LMQ_CPU_KERNELS", "1")
    monkeypatch.setenv("LMQ_CPU_MARCH", "x86-64-v3")
    assert describe_device(cpu) != ours


def test_disk_budget_holds_and_evicts_least_recently_used(tmp_path):
    segs = [segment(list(range(1000 * i, 1000 * i + 100)), 0, seed=i) for i in range(6)]
    probe = disk(tmp_path / "probe")
    size = put_on_disk(probe, segs[0]).stat().st_size
    tier = disk(tmp_path / "kv", budget=3 * size + 100)
    paths = [put_on_disk(tier, s) for s in segs[:3]]
    os.utime(paths[1], (1, 1))
    os.utime(paths[2], (2, 2))
    assert tier.read(paths[0]) is not None  # used now: the newest
    for s in segs[3:5]:
        put_on_disk(tier, s)
        assert sum(p.stat().st_size for p in files(tmp_path / "kv")) <= tier.budget_bytes
    left = files(tmp_path / "kv")
    assert paths[0] in left and paths[1] not in left and paths[2] not in left and len(left) == 3
    assert not tier.write(segment(list(range(5000)), 0), "x")  # larger than the whole budget: not written


def _write_many(folder: str, worker: int, budget: int) -> None:
    tier = DiskTier(Path(folder), "ab" * 16, torch.float32, SHAPE, 1, budget)
    for i in range(24):
        # the shared ones first, then this worker's own: both processes write the same files at once
        n = i if i < 12 else 100 * (worker + 1) + i
        tier.write(segment(list(range(n * 1000, n * 1000 + 150)), 0, seed=n), prefix_key(np.zeros(0, np.int32)))
    tier.flush()


def test_two_processes_writing_one_folder_never_corrupt_it(tmp_path):
    size = put_on_disk(disk(tmp_path / "probe"), segment(list(range(150)), 0)).stat().st_size
    budget = 14 * size
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_many, args=(str(tmp_path / "kv"), w, budget)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    left = files(tmp_path / "kv")
    assert 0 < len(left) <= 14
    assert sum(p.stat().st_size for p in left) <= budget
    assert list((tmp_path / "kv" / "tmp").iterdir()) == []
    reader = disk(tmp_path / "kv")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for path in left:
            assert reader.read(path) is not None
    assert usage(tmp_path / "kv")[0].files == len(left)
    total = sum(p.stat().st_size for p in left)
    assert clear(tmp_path / "kv") == (len(left), total) and files(tmp_path / "kv") == []


def test_the_disk_tier_counts_and_removes_only_its_own_files(tmp_path):
    """A folder the cache shares with other files (a user's `disk_cache=` or `--dir`): eviction and `clear`
    count and remove only lmq's (a model folder holding its model.json, its start folders, `<end>.kv` files, all
    named by 32 hex digits); a folder named like one without a model.json, and other files, stay."""
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "a.jpg").write_bytes(b"jpg" * 1000)
    (tmp_path / "notes.txt").write_text("notes")
    lookalike = tmp_path / ("ef" * 16) / ("01" * 16)  # lmq's names, no model.json
    lookalike.mkdir(parents=True)
    (lookalike / f"{'23' * 16}.kv").write_bytes(b"user data" * 10**5)
    os.utime(lookalike / f"{'23' * 16}.kv", (1, 1))  # (the oldest: evicted first, were it counted)
    size = put_on_disk(disk(tmp_path / "probe"), segment(list(range(100)), 0)).stat().st_size
    shutil.rmtree(tmp_path / "probe")
    tier = disk(tmp_path, budget=2 * size + 100)
    written = [put_on_disk(tier, segment(list(range(1000 * i, 1000 * i + 100)), 0, seed=i)) for i in range(4)]
    (tier.model_folder / "README").write_text("mine")  # (a file of the user's inside lmq's folder)
    ours = [p for p in written if p.exists()]
    assert len(ours) == 2 and [u.files for u in usage(tmp_path)] == [2]
    assert clear(tmp_path) == (2, sum(size for _ in ours)) and not any(p.exists() for p in written)
    assert (tmp_path / "photos" / "a.jpg").exists() and (tmp_path / "notes.txt").exists()
    assert (lookalike / f"{'23' * 16}.kv").exists() and (tier.model_folder / "README").exists()
    theirs = tmp_path / "photos"  # a folder lmq wrote nothing in: cleared, it gets no file of lmq's either
    assert clear(theirs) == (0, 0) and sorted(p.name for p in theirs.iterdir()) == ["a.jpg"]


def test_a_file_that_evicts_the_last_of_its_own_start_folder_is_kept(tmp_path):
    """Two files continuing one prefix (one start folder), a budget for one: the second evicts the first, the
    folder's last file, and is put in its place (the folder is not removed under it)."""
    shared = list(range(100))
    first, second = segment(shared + list(range(500, 600)), 100, seed=1), segment(shared + list(range(700, 800)), 100)
    size = put_on_disk(disk(tmp_path / "probe"), first).stat().st_size
    tier = disk(tmp_path / "kv", budget=size + 100)
    put_on_disk(tier, first)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = put_on_disk(tier, second)
    assert files(tmp_path / "kv") == [path] and tier.read(path) is not None


def test_a_temp_file_a_dead_writer_left_goes_at_the_next_write(tmp_path):
    """A writer killed while it wrote leaves its temp file: the next write removes it where its process (of this
    host) is gone; another host's, whose process may be alive, stays until it is an hour old."""
    pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                             text=True, check=True).stdout)
    (tmp_path / "tmp").mkdir()
    dead = tmp_path / "tmp" / f"{socket.gethostname()}-{pid}-1-{'ab' * 16}.part"
    remote = tmp_path / "tmp" / f"elsewhere-{pid}-1-{'cd' * 16}.part"
    for path in (dead, remote):
        path.write_bytes(b"x" * 1000)
    put_on_disk(disk(tmp_path), segment(list(range(100)), 0))
    assert not dead.exists() and remote.exists()


def test_a_disk_folder_that_is_no_folder_is_a_clear_error(model, tokenizer, tmp_path):
    (tmp_path / "afile").write_text("hi")
    with pytest.raises(lmq.LMQBackendError, match="afile is not a folder"):
        backend(model, tokenizer, disk_cache=tmp_path / "afile")
    b = backend(model, tokenizer, disk_cache="")  # ("" is off, as $LMQ_DISK_CACHE="" is)
    assert b.tiers is None or b.tiers.disk is None


# ----- exactness through the tiers, on a tiny model -------------------------------------------------------

QUERY = '''argmax
    "{shots}Q: {question}\\nA:[ANSWER]" where len(TOKENS(ANSWER)) < 6
'''


def shots(i: int) -> str:
    rng = random.Random(i)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "seven", "apple", "night"]
    return "".join(f"Q: {' '.join(rng.choices(words, k=8))}\nA: {rng.choice(words)}\n\n" for _ in range(12))


CALLS = [(i % 4, f"what is {w}?") for i, w in enumerate(["one", "two", "three", "four", "five", "six", "seven",
                                                          "eight", "one", "two", "nine", "ten"])]


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def backend(model, tokenizer, **kw) -> lmq.HFBackend:
    kw.setdefault("cache_budget", "64MB")
    return lmq.HFBackend.from_model(model, tokenizer, name="tiny", **kw)


async def run(b: lmq.HFBackend, calls=CALLS) -> list[str]:
    q = lmq.Query(QUERY, model=b)
    out = []
    for shot, question in calls:
        r = await q.run({"shots": shots(shot), "question": question})
        out.append(r.prompt)
        b.trie.check()
        assert b.trie.pinned_nodes() == 0
        if b.tiers is not None and b.tiers.host is not None:
            b.tiers.host.check()
    return out


@pytest.fixture(scope="module")
async def reference(model, tokenizer):
    return await run(backend(model, tokenizer, cache_budget=0))


async def test_exact_through_host_round_trips(model, tokenizer, reference, tmp_path):
    b = backend(model, tokenizer, cache_budget=int(1.5 * PREFIX), host_cache="16MB")
    assert b.store.bytes_per_token == PER_TOKEN
    assert b.tiers.disk is None
    assert await run(b) == reference
    s = b.stats()
    assert s.evictions > 0 and s.bytes_to_host > 0
    assert s.host_hits > 0 and s.tokens_from_host > 0 and s.bytes_from_host > 0
    assert s.tokens_reused > s.tokens_from_host  # the device trie served the rest
    assert 0 < s.host_bytes_in_use <= 16 * 10**6
    # the calls' own tails (a question: a few tokens each) were evicted too, and are in no tier
    assert all(seg.tokens >= MIN_TOKENS for seg in b.tiers.host)


async def test_a_prefix_the_trie_has_no_room_for_goes_down_a_tier(model, tokenizer):
    """Two calls at once on two prefixes, a trie that holds one of them: the prefix it has no room for (the other
    is pinned by its running call) goes to the host tier, and a later call on it loads it from there."""
    calls, later = [(0, "what is one?"), (1, "what is two?")], (1, "what is three?")
    expected = await run(backend(model, tokenizer, cache_budget=0), [*calls, later])
    b = backend(model, tokenizer, cache_budget=int(1.5 * PREFIX), host_cache="16MB")
    q = lmq.Query(QUERY, model=b)
    first = await asyncio.gather(*(q.run({"shots": shots(s), "question": t}) for s, t in calls))
    assert [r.prompt for r in first] == expected[:2]
    s = b.stats()
    assert s.evictions == 0 and s.bytes_to_host >= PREFIX  # refused, not evicted
    assert await run(b, [later]) == expected[2:]
    s = b.stats()
    assert s.host_hits == 1 and s.tokens_from_host >= PREFIX // PER_TOKEN - 10
    b.tiers.host.check()


def peaked_llama_on_a_gpu():
    """The tiny Llama on the GPU, its LM head scaled up to a trained model's peaked distributions: cuBLAS picks its
    GEMM kernels by the number of rows, so a row's logits may differ in their last bits batched and alone, which
    on a random model's near-ties would move a greedy pick (`tests/engine/test_fused_engine.py` does the same)."""
    model = tiny_llama().cuda()
    model.lm_head.weight.data *= 10
    return model


OWN_SLOTS_WARM = [(s, f"what is {w}?") for s, w in [(0, "one"), (1, "two"), (2, "three")]]
OWN_SLOTS_CALLS = [(s, f"where is {w}?") for s, w in [(0, "four"), (1, "five"), (2, "six")]]


async def own_slots_run(model, tokenizer, prepare=None):
    """`OWN_SLOTS_WARM` one after another, then `OWN_SLOTS_CALLS` at once (after `prepare(backend)`, if given), on
    a trie that holds 1.5 prefixes: (the backend, its stats before the calls at once, their prompts, the prompts
    expected)."""
    expected = await run(backend(model, tokenizer, cache_budget=0), OWN_SLOTS_WARM + OWN_SLOTS_CALLS)
    b = backend(model, tokenizer, cache_budget=int(1.5 * PREFIX), host_cache="16MB")
    assert await run(b, OWN_SLOTS_WARM) == expected[:3]
    assert sum(seg.tokens >= PREFIX // PER_TOKEN - 10 for seg in b.tiers.host) == 2  # (the last in the trie)
    if prepare is not None:
        prepare(b)
    before = b.stats()
    q = lmq.Query(QUERY, model=b)
    out = await asyncio.gather(*(q.run({"shots": shots(s), "question": t}) for s, t in OWN_SLOTS_CALLS))
    return b, before, [r.prompt for r in out], expected[3:]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
async def test_a_host_hit_the_trie_has_no_room_for_is_loaded_into_the_calls_own_slots(model, tokenizer, device):
    """Three prefixes computed one after another, a trie that holds one (the last; the others went to the host
    tier): three calls at once on them. The first call's prefix is loaded into the trie (the last one goes down
    to make room) and pinned by its call; the others find no room there, so their prefixes are copied from the
    host tier into their own slots and only their questions are prefilled. The same tokens as without a cache;
    what the trie refused is not copied down again (the host tier holds it); no slot is leaked. (On a GPU the
    copies up from pinned memory and their scatter into the slots are queued layer by layer on a stream of their
    own, each layer of the prefill waiting for its own: `CacheTiers.queue_loads`.)"""
    b, before, out, expected = await own_slots_run(model if device == "cpu" else peaked_llama_on_a_gpu(), tokenizer)
    assert out == expected
    s = b.stats()
    prefix_tokens = PREFIX // PER_TOKEN - 10
    assert s.host_hits - before.host_hits == 3 and s.tokens_from_host - before.tokens_from_host >= 3 * prefix_tokens
    assert s.tokens_prefilled - before.tokens_prefilled < 3 * 20  # the questions alone
    assert s.bytes_to_host - before.bytes_to_host <= PREFIX  # the prefix evicted for the first, alone
    assert b.trie.pinned_nodes() == 0
    b.store.check(node_slots(b.trie), [])
    b.tiers.host.check()


def first_copy_only(b):
    """The tiers' copies up of backend `b` failing after the first."""
    up, copies = b.tiers._up, []

    def copy(*args):
        copies.append(args)
        if len(copies) > 1:
            raise OSError("the device is gone")
        return up(*args)
    b.tiers._up = copy


async def test_a_failing_copy_into_a_calls_own_slots_computes_its_prefix(model, tokenizer):
    """As above, the tiers' copies up failing after the first (the load into the trie): the two calls whose
    prefixes were to be copied into their own slots compute them instead, with a warning."""
    with pytest.warns(RuntimeWarning, match="a cache tier failed"):
        b, before, out, expected = await own_slots_run(model, tokenizer, first_copy_only)
    assert out == expected
    s = b.stats()
    prefix_tokens = PREFIX // PER_TOKEN - 10
    assert s.host_hits - before.host_hits == 1 and s.tokens_from_host - before.tokens_from_host >= prefix_tokens
    assert s.tokens_prefilled - before.tokens_prefilled >= 2 * prefix_tokens
    assert b.trie.pinned_nodes() == 0
    b.store.check(node_slots(b.trie), [])


@pytest.mark.gpu
async def test_loads_that_fail_after_their_copies_were_queued_compute_the_prefix_on_a_gpu(tokenizer):
    """On a GPU, the loads into the two calls' own slots fail after their copies were queued on the loading
    stream: the calls compute those tokens, their K/V written after the queued copies land (the compute stream
    waits for them), so the answers are those without a cache."""
    def queue_then_fail(b):
        queue = b.tiers._queue_layers

        def failing(*args):
            queue(*args)
            raise OSError("the device is gone")
        b.tiers._queue_layers = failing
    with pytest.warns(RuntimeWarning, match="a cache tier failed"):
        b, before, out, expected = await own_slots_run(peaked_llama_on_a_gpu(), tokenizer, queue_then_fail)
    assert out == expected
    s = b.stats()
    prefix_tokens = PREFIX // PER_TOKEN - 10
    assert s.host_hits - before.host_hits == 1  # (the load into the trie)
    assert s.tokens_prefilled - before.tokens_prefilled >= 2 * prefix_tokens
    assert b.trie.pinned_nodes() == 0
    b.store.check(node_slots(b.trie), [])


async def test_a_failing_copy_into_the_first_part_of_a_long_prompt_is_counted_as_computed(model, tokenizer):
    """As above, each call's new tokens prefilled in parts (of 4): the first part of the two calls whose copies fail
    computes their prefixes with its new tokens, and the stats count those tokens as prefilled, not reused."""
    def parts_and_first_copy_only(b):
        b.scheduler.max_prefill_tokens = 4
        first_copy_only(b)

    with pytest.warns(RuntimeWarning, match="a cache tier failed"):
        b, before, out, expected = await own_slots_run(model, tokenizer, parts_and_first_copy_only)
    assert out == expected
    prefix_tokens = PREFIX // PER_TOKEN - 10
    assert b.stats().tokens_prefilled - before.tokens_prefilled >= 2 * prefix_tokens
    assert b.trie.pinned_nodes() == 0
    b.store.check(node_slots(b.trie), [])


async def test_a_prefill_retried_copies_its_loads_again(model, tokenizer):
    """As above, the prefill of the calls at once failing after its rows took their slots (and their loads were
    copied), leaving those slots' K/V garbage: the halves, retried, copy the loads again into the slots they
    take then."""
    failed = []

    def failing_once(b):
        prefill = b.runner.prefill

        def once(pool, rows):
            logits, slots = prefill(pool, rows)
            if not failed and len(rows) > 1:  # (the calls at once: two of them with loads)
                failed.append(len(rows))
                for slot in slots:
                    taken = pool.row_slots(slot)
                    taken = taken[b.store.owner[taken] == ROW]
                    b.store.data[:, :, torch.from_numpy(taken.astype(np.int64))] = 0.5
                raise torch.OutOfMemoryError("simulated: out of memory in the forward")
            return logits, slots
        b.runner.prefill = once

    b, before, out, expected = await own_slots_run(model, tokenizer, failing_once)
    assert failed and out == expected
    s = b.stats()
    assert s.tokens_prefilled - before.tokens_prefilled < 3 * 20  # (loaded, not computed)
    assert s.host_hits - before.host_hits == 3  # (a lookup is one hit, its copies counted once)
    b.store.check(node_slots(b.trie), [])


async def test_without_a_host_tier_a_prefix_the_trie_has_no_room_for_is_written_to_disk(model, tokenizer, tmp_path):
    calls = [(0, "what is one?"), (1, "what is two?")]
    b = backend(model, tokenizer, cache_budget=int(1.5 * PREFIX), host_cache=0, disk_cache=tmp_path)
    q = lmq.Query(QUERY, model=b)
    await asyncio.gather(*(q.run({"shots": shots(s), "question": t}) for s, t in calls))
    b.close()  # (the files written)
    assert b.stats().evictions == 0 and len(files(tmp_path)) == 2  # the one the trie kept, the one it refused


async def test_a_failing_tier_is_a_miss_with_a_warning(model, tokenizer, reference, tmp_path, monkeypatch):
    first = backend(model, tokenizer, disk_cache=tmp_path, host_cache=0)
    await run(first, CALLS[:4])
    first.close()
    b = backend(model, tokenizer, cache_budget=int(1.5 * PREFIX), host_cache="16MB", disk_cache=tmp_path)

    def broken(*args, **kwargs):
        raise OSError("the device is gone")

    monkeypatch.setattr(b.tiers, "_up", broken)
    monkeypatch.setattr(b.tiers.disk, "read", broken)
    with pytest.warns(RuntimeWarning, match="a cache tier failed"):
        assert await run(b) == reference
    s = b.stats()
    assert s.bytes_to_host > 0 and s.tokens_from_host == s.tokens_from_disk == 0
    b.store.check(node_slots(b.trie), [])  # no slot leaked


async def test_host_tier_budget_holds_under_pressure(model, tokenizer, reference):
    b = backend(model, tokenizer, cache_budget=int(1.5 * PREFIX), host_cache=2 * PREFIX)
    assert await run(b) == reference
    assert b.tiers.host.bytes_in_use <= 2 * PREFIX and b.stats().bytes_to_host > 2 * PREFIX


async def test_exact_after_a_disk_round_trip_in_a_new_backend(model, tokenizer, reference, tmp_path):
    first = backend(model, tokenizer, disk_cache=tmp_path, host_cache=0)
    assert await run(first) == reference
    first.close()
    assert first.stats().bytes_to_disk > 0 and len(files(tmp_path)) >= 4
    second = backend(model, tokenizer, disk_cache=tmp_path, host_cache=0)
    assert await run(second) == reference
    s, before = second.stats(), first.stats()
    assert s.disk_hits >= 4 and s.tokens_from_disk > 0 and s.disk_rejected == 0
    assert s.tokens_prefilled < before.tokens_prefilled - s.tokens_from_disk // 2


async def test_exact_with_evictions_straight_to_disk(model, tokenizer, reference, tmp_path):
    b = backend(model, tokenizer, cache_budget=int(1.5 * PREFIX), disk_cache=tmp_path, host_cache=0)
    assert await run(b) == reference
    s = b.stats()
    assert s.evictions > 0 and s.disk_hits > 0 and s.bytes_to_host == 0


@pytest.mark.parametrize("how", ["payload byte", "truncated", "other model"])
async def test_damaged_or_foreign_files_give_the_right_answer_and_a_warning(model, tokenizer, reference, tmp_path,
                                                                           how):
    first = backend(model, tokenizer, disk_cache=tmp_path, host_cache=0)
    await run(first, CALLS[:4])
    first.close()
    written = files(tmp_path)
    assert len(written) == 4
    if how == "other model":
        other = backend(tiny_llama(seed=1), tokenizer, disk_cache=tmp_path / "other", host_cache=0)
        await run(other, CALLS[:4])
        other.close()
        for path, theirs in zip(written, files(tmp_path / "other")):  # their files under our names
            shutil.copy(theirs, path)
    else:
        for path in written:
            damage(path, how)
    second = backend(model, tokenizer, disk_cache=tmp_path, host_cache=0)
    with pytest.warns(CacheFileWarning):
        assert await run(second) == reference
    assert second.stats().disk_rejected >= 1 and second.stats().tokens_from_disk == 0


async def test_a_segment_serves_a_match_that_ends_inside_it(model, tokenizer, reference, tmp_path):
    """The device trie holds the first tokens of a prefix (another prompt shares them) that a lower tier holds
    whole: the rest comes from the tier, from the middle of its segment."""
    other = [(5, "what is one?")]  # shots(5) shares its first tokens ("Q:") with shots(0)'s
    first = backend(model, tokenizer, disk_cache=tmp_path, host_cache="16MB")
    assert await run(first, CALLS[:1]) == reference[:1]
    first.close()
    second = backend(model, tokenizer, disk_cache=tmp_path, host_cache="16MB")
    await run(second, other)
    assert await run(second, CALLS[:1]) == reference[:1]
    s = second.stats()
    assert s.tokens_from_disk > 150 and second.trie.match(second.vocab.encode(shots(0)))[1] > 150
    second.trie.evict(second.trie.budget_bytes)  # everything down to the host tier
    await run(second, other)
    before = second.stats()
    assert await run(second, CALLS[:1]) == reference[:1]
    assert second.stats().since(before).tokens_from_host > 150


async def test_a_slow_tier_is_not_loaded(model, tokenizer, reference, tmp_path):
    first = backend(model, tokenizer, disk_cache=tmp_path, host_cache=0)
    await run(first)
    first.close()
    second = backend(model, tokenizer, disk_cache=tmp_path, host_cache=0)
    second.tiers.prefill_seconds_per_token = 1e-9  # measured: prefills are very fast here
    second.tiers.bandwidth["disk"] = 1e3           # and files very slow
    assert await run(second) == reference
    assert second.stats().disk_hits == 0 and second.stats().bytes_from_disk == 0


def test_worth_compares_measured_bandwidth_with_prefill_speed():
    tiers = CacheTiers.__new__(CacheTiers)
    tiers.bandwidth, tiers.prefill_seconds_per_token = {}, None
    assert tiers.worth("disk", 10**9, 1)  # nothing measured yet: load
    tiers.observe_prefill(100, 1.0)       # 10 ms a token
    tiers.observe_prefill(10, 0.001)      # too few tokens to say anything
    tiers.observe_prefill(100, 2.0)       # slower (a batch, a wait): the fastest is kept
    assert tiers.prefill_seconds_per_token == pytest.approx(0.01)
    tiers.bandwidth["disk"] = 10**8       # 100 MB/s
    assert tiers.worth("disk", 10**6, 100)      # 10 ms vs 1 s
    assert not tiers.worth("disk", 10**9, 100)  # 10 s vs 1 s


async def test_stats_count_tiers_since_reset(model, tokenizer, tmp_path):
    b = backend(model, tokenizer, cache_budget=int(1.5 * PREFIX), host_cache="16MB")
    await run(b, CALLS[:6])
    assert b.stats().bytes_to_host > 0
    b.reset_stats()
    s = b.stats()
    assert s.bytes_to_host == s.host_hits == s.tokens_from_host == 0 and s.host_bytes_in_use > 0
    d = s.as_dict()
    assert {"host_hits", "disk_hits", "bytes_to_disk", "disk_rejected", "host_bytes_in_use"} <= set(d)
    before = b.stats()
    await run(b, CALLS[6:])
    since = b.stats().since(before)  # (what `lmq profile` reports)
    assert since.host_hits == b.stats().host_hits and since.host_bytes_in_use == b.stats().host_bytes_in_use
    assert "tiers: host" in format_table(since) and "tiers:" not in format_table(CacheStats())


def test_tiers_are_off_where_the_trie_is(model, tokenizer, tmp_path):
    assert backend(model, tokenizer, cache_budget=0, disk_cache=tmp_path, host_cache="1GB").tiers is None
    assert backend(model, tokenizer, host_cache="auto").tiers is None  # the CPU: no host tier; no disk by default
    b = backend(model, tokenizer, disk_cache=tmp_path)
    assert b.tiers.host is None and b.tiers.disk is not None


# ----- a new process ---------------------------------------------------------------------------------------

RESTART = textwrap.dedent('''
    import asyncio, json, sys
    sys.path[:0] = [{tests!r}, {tests!r} + "/cache"]
    from transformers import AutoTokenizer
    import lmq_backend as lmq
    from lmq_backend.backend.default_model import default_model_dir
    from support.tiny import tiny_llama
    from test_tiers import run

    b = lmq.HFBackend.from_model(tiny_llama(), AutoTokenizer.from_pretrained(default_model_dir()), name="tiny",
                                 disk_cache={folder!r}, host_cache=0)
    prompts = asyncio.run(run(b))
    print(json.dumps({{"prompts": prompts, "stats": b.stats().as_dict()}}))
''')


def test_exact_after_a_process_restart(reference, tmp_path):
    script = tmp_path / "restart.py"
    script.write_text(RESTART.format(tests=str(Path(__file__).resolve().parents[1]), folder=str(tmp_path / "kv")))

    def process() -> dict:
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                             env={**os.environ, "PYTHONWARNINGS": "error::UserWarning"})
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold, warm = process(), process()
    assert cold["prompts"] == warm["prompts"] == reference
    assert cold["stats"]["disk_hits"] == 0 and cold["stats"]["bytes_to_disk"] > 0
    assert warm["stats"]["disk_hits"] >= 4 and warm["stats"]["bytes_to_disk"] == 0
    assert warm["stats"]["tokens_prefilled"] < cold["stats"]["tokens_prefilled"] // 2


# ----- on a GPU ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
async def test_exact_through_pinned_host_memory_on_a_gpu(tokenizer, tmp_path):
    model = tiny_llama().cuda()
    ref = await run(lmq.HFBackend.from_model(model, tokenizer, cache_budget=0, name="tiny"))
    b = lmq.HFBackend.from_model(model, tokenizer, cache_budget=int(1.5 * PREFIX), host_cache="16MB", disk_cache=tmp_path,
                                 name="tiny")
    assert b.tiers.cuda and b.tiers.host.arena.pinned  # (the budget pinned once, as power-of-two blocks)
    assert await run(b) == ref
    s = b.stats()
    assert s.host_hits > 0 and s.bytes_to_host > 0
    b.close()
    again = lmq.HFBackend.from_model(model, tokenizer, cache_budget="64MB", host_cache=0, disk_cache=tmp_path,
                                     name="tiny")
    assert await run(again) == ref
    assert again.stats().disk_hits > 0


@pytest.mark.gpu
async def test_calls_at_once_through_a_small_pinned_arena_on_a_gpu(tokenizer):
    """Twelve calls at once over four prefixes, twice, a trie that holds 1.5 of them and a host tier that holds
    two: segments go down (copied on the side stream) into arena regions that copies up queued before them (on the
    compute stream, or the loading stream) were reading; the answers are those of the calls one after another without a cache."""
    model = peaked_llama_on_a_gpu()
    expected = await run(backend(model, tokenizer, cache_budget=0), CALLS)
    b = backend(model, tokenizer, cache_budget=int(1.5 * PREFIX), host_cache=3 * PREFIX)
    q = lmq.Query(QUERY, model=b)
    for _ in range(2):
        out = await asyncio.gather(*(q.run({"shots": shots(s), "question": t}) for s, t in CALLS))
        assert [r.prompt for r in out] == expected
    assert b.stats().host_hits > 0
    assert b.trie.pinned_nodes() == 0
    b.store.check(node_slots(b.trie), [])
    b.tiers.host.check()
