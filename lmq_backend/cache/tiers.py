"""`CacheTiers`: host memory and disk under the device's prefix trie.

Where K/V moves
---------------
    trie --evicted--> host tier --dropped (LRU)--> disk tier     down, instead of being thrown away
    trie --refused--> (as if evicted)                            a prefix the trie has no room for
    trie --inserted--> disk tier                                 written through: the next process's warm start
    (nodes of MIN_TOKENS or more only)
    host tier, disk tier --load--> fresh store slots            up, as trie nodes, when cheaper than a prefill
                         --load--> a request's own slots       up, where the trie has no room (`Loads`)

Without a host tier, an evicted node goes to disk directly. The host tier keeps what it gives back (evicting
that node again costs nothing); the disk tier keeps what it has until its budget evicts it.

The prefix cache's side (`prefix_cache.py`, which owns the tiers; each line marked "cache tiers" where it is):
    PrefixTrie.evict          `on_evict(trie, leaf)` before the leaf's slots are freed       -> `evicted`
    PrefixCache.extend        each node a prefill or a hole stored                          -> `inserted`
                              what the trie had no room for                                 -> `refused`
    PrefixCache.stage         (before a prefill is queued: `Engine.prefill`) `stage_from` on the loop; `stage`
                              in a worker thread reads the files that continue the device and host matches
                              (mapped, checked)
    PrefixCache.lookup        after the trie's match                                         -> `load`
    (a prefill, ModelRunner)  the request's own part of its prefix into its slots             -> `queue_loads`
    PrefixCache.observe_prefill  the prefill's new tokens and time (`Scheduler`)            -> `observe_prefill`

On a GPU a node going down is gathered on the compute stream and copied into a region of the host tier's pinned
arena on a side stream (the compute stream never waits for it; whoever reads the copy waits for its event). A
load into fresh trie slots goes up on the compute stream (the host does not wait; the prefill reading it is
queued after it); a prefill's loads into its rows' own slots go up on a loading stream, layer by layer, each
layer of the prefill waiting for its own (`queue_loads`: the later layers' copies run while the first layers
compute). A copy down waits for the work queued so far on both, so it never overwrites an arena region a copy
up still reads. A file's K/V is copied into pinned memory by the worker thread that read it. On the CPU every
copy is plain.

When to load (`worth`): a segment is loaded when moving its bytes at the tier's measured bandwidth takes less
time than prefilling its tokens at the fastest prefill speed seen so far (new tokens / time from a prefill's
look-up to its logits, over prefills of at least 32 new tokens). Until both are measured it is loaded: K/V
comes back exact, and a prefill costs far more per token than a copy on the machines lmq targets.
"""
from __future__ import annotations

import itertools
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from ..errors import LMQBackendError
from .disk_tier import DiskTier, check_folder, model_key
from .fingerprint import describe_device
from .host_arena import HostArena
from .host_tier import HostTier
from .kv_store import LAYOUT_VERSION, OutOfSlots, KVStore
from .segment import Segment, prefix_key
from .stats import TIER_COUNTERS
from .trie import PrefixTrie, TrieNode

# Shorter nodes go to no tier: a file read, or a copy's fixed costs, take about what their prefill does, and
# most of them are a call's own tail (its inputs), which no later call asks for: kept, they would push out the
# long shared prefixes a tier is for.
MIN_TOKENS = 64
MEASURED_PREFILL_MIN = 32  # prefills with fewer new tokens say little about the per-token cost


class CacheTiers:
    def __init__(self, store: KVStore, host: HostTier | None, disk: DiskTier | None,
                 min_tokens: int = MIN_TOKENS):
        self.store, self.host, self.disk = store, host, disk
        self.min_tokens = min_tokens
        self.cuda = store.device.type == "cuda"
        self._side: torch.cuda.Stream | None = None    # copies down
        self._loading: torch.cuda.Stream | None = None  # a prefill's loads into its rows' own slots (`queue_loads`)
        self._lock = threading.Lock()
        self._reading: dict[Path, threading.Event] = {}
        self._read: "weakref.WeakValueDictionary[Path, Segment]" = weakref.WeakValueDictionary()
        self.prefill_seconds_per_token: float | None = None
        self.bandwidth: dict[str, float] = {}     # tier -> bytes/s of moving a segment up from it
        self.host_hits = self.disk_hits = self.tokens_from_host = self.tokens_from_disk = 0
        self.bytes_to_host = self.bytes_from_host = 0
        self._warned = False

    # ----- counters ---------------------------------------------------------------------------------

    def counts(self, since: dict[str, int] | None = None) -> dict[str, int]:
        """The counters of `TIER_COUNTERS` (since `since`, an earlier answer; else since this object was made)
        and the host tier's bytes in use."""
        disk = self.disk
        now = {"host_hits": self.host_hits, "disk_hits": self.disk_hits, "tokens_from_host": self.tokens_from_host,
                "tokens_from_disk": self.tokens_from_disk, "bytes_to_host": self.bytes_to_host,
                "bytes_from_host": self.bytes_from_host,
                "bytes_to_disk": disk.bytes_written if disk else 0, "bytes_from_disk": disk.bytes_read if disk else 0,
                "disk_rejected": disk.rejected if disk else 0,
                "host_bytes_in_use": self.host.bytes_in_use if self.host else 0}
        if since:
            for name in TIER_COUNTERS:
                now[name] -= since.get(name, 0)
        return now

    # ----- down ---------------------------------------------------------------------------------------

    def evicted(self, trie: PrefixTrie, node: TrieNode) -> None:
        """`trie` evicts `node` (still in place): keep its K/V in the host tier, else on disk (nodes of
        `min_tokens` or more; their token ids from the root are read only then). Never raises: a tier that
        fails is a miss later, with one warning."""
        if len(node.ids) >= self.min_tokens:
            self._keep(lambda: trie.path_ids(node), len(node.ids), node.slots)

    def refused(self, trie: PrefixTrie, parent: TrieNode, ids: Sequence[int], slots: np.ndarray) -> None:
        """`trie` had no room for `ids` after `parent` (the running requests' prefixes fill its budget): their K/V,
        in store `slots` that the request computing them frees when it ends, is kept as an evicted node's would
        be, so that a later request loads it instead of computing it again. Its head that the host tier holds
        already (the part of a prefix the request loaded from there into slots of its own) stays where it is."""
        if len(ids) < self.min_tokens:
            return
        path = trie.path(parent)
        whole = [*itertools.chain.from_iterable(n.ids for n in path), *ids]
        whole32 = np.asarray(whole, dtype=np.int32)
        start, held = len(whole) - len(ids), 0
        if self.host is not None:
            held = self._in_host(whole, whole32, [0, *(n.depth for n in path)], start, len(whole))[2]
        if len(ids) - held >= self.min_tokens:
            self._keep(lambda: whole32, len(ids) - held, slots[held:])

    def inserted(self, trie: PrefixTrie, node: TrieNode) -> None:
        """The trie stored `node`: a long one is written to disk."""
        if self.disk is None or len(node.ids) < self.min_tokens:
            return
        try:
            ids = np.asarray(trie.path_ids(node), dtype=np.int32)
            self._write_through(ids, len(ids) - len(node.ids), node.slots)
        except Exception as e:  # noqa: BLE001 - a cache file not written is no error
            self._warn(e)

    def _keep(self, path_ids: Callable[[], Sequence[int]], tokens: int, slots: np.ndarray) -> None:
        """The K/V of the last `tokens` of the sequence `path_ids()` (from the root), in store `slots`, to the host
        tier (what it lets go to disk), else to disk. Never raises (a warning, once)."""
        try:
            ids = np.asarray(path_ids(), dtype=np.int32)
            start = len(ids) - tokens
            if self.host is None:
                self._write_through(ids, start, slots)
                return
            if self.host.covering(ids, start) is not None:
                return
            into = None
            if self.host.arena is not None:
                into = self.host.reserve(self._shape(tokens), self.store.dtype, self._to_disk)
                if into is None:  # (larger than the host tier: the K/V goes to disk, as without one)
                    self._write_through(ids, start, slots)
                    return
            seg = self._down(ids, start, slots, into)
            self.bytes_to_host += seg.nbytes
            for dropped in self.host.put(seg):
                self._to_disk(dropped)
        except Exception as e:  # noqa: BLE001 - the trie goes on; the tokens are computed later
            self._warn(e)

    def _write_through(self, ids: np.ndarray, start: int, slots: np.ndarray) -> None:
        """Tokens [start, len(ids)) of `ids`, their K/V in store `slots`, to disk, unless the disk tier has them
        or will not take them."""
        start_key, nbytes = prefix_key(ids[:start]), len(slots) * self.store.bytes_per_token
        if self.disk is not None and self.disk.wants(start_key, prefix_key(ids), nbytes):
            self.disk.write(self._down(ids, start, slots), start_key)

    def _to_disk(self, seg: Segment) -> None:
        """A segment the host tier let go (one of `min_tokens` or more, as every segment it holds) to disk."""
        if self.disk is not None:
            self.disk.write(seg, prefix_key(seg.ids[:seg.start]))

    def _shape(self, tokens: int) -> tuple[int, ...]:
        """The shape of `tokens` tokens' K/V (a segment's `kv`)."""
        layers, heads, head_dim = self.store.shape
        return (layers, 2, tokens, heads, head_dim)

    def _down(self, ids: np.ndarray, start: int, slots: np.ndarray, into: torch.Tensor | None = None) -> Segment:
        """A copy of the K/V of store `slots` in host memory (pinned on a GPU, copied on a side stream), in `into`
        (a region of the host tier's arena) if given."""
        index = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
        if not self.cuda:
            return Segment.of(ids, start, self.store.data[:, :, index])
        on_device = self.store.data[:, :, index.pin_memory().to(self.store.device, non_blocking=True)]
        host = into if into is not None else torch.empty(on_device.shape, dtype=on_device.dtype, pin_memory=True)
        side = self._side_stream()
        # after the compute stream's work queued so far: the gather, and every copy up (a region of the arena
        # given back may be one they still read), on either stream
        side.wait_stream(torch.cuda.current_stream(self.store.device))
        if self._loading is not None:
            side.wait_stream(self._loading)
        with torch.cuda.stream(side):
            host.copy_(on_device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        on_device.record_stream(side)
        return Segment.of(ids, start, host, ready=done)

    def _side_stream(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(self.store.device)
        return self._side

    def _loading_stream(self) -> torch.cuda.Stream:
        if self._loading is None:
            self._loading = torch.cuda.Stream(self.store.device)
        return self._loading

    # ----- up -------------------------------------------------------------------------------------------

    def stage_from(self, trie: PrefixTrie, ids: list[int], limit: int) -> tuple[int, list[int]] | None:
        """Where the disk tier may continue `ids` (short of `limit`) after the device trie and the host tier:
        that position and the starts of the segments before it (a file that begins at any of them may hold
        what follows), for `stage`; None when no file is worth a look (a few stats)."""
        if self.disk is None or not trie.enabled:
            return None
        node, p = trie.match(ids, limit)
        if limit - p < self.min_tokens:  # (a warm call's new tail: no file is worth a look)
            return None
        starts = [0, *(n.depth for n in trie.path(node))]
        ids32 = np.asarray(ids, dtype=np.int32)
        while (found := self._in_host(ids, ids32, starts, p, limit))[0] is not None:
            p += found[2]
            starts.append(p)
        if limit - p < self.min_tokens or not any(self.disk.starts_at(prefix_key(ids32[:s])) for s in starts):
            return None
        return p, starts

    def stage(self, ids: list[int], at: tuple[int, list[int]], limit: int) -> list[Segment]:
        """(Any thread) the disk tier's segments that continue `ids` from `at` (`stage_from`'s answer), one
        after the other, mapped and checked (on a GPU machine, copied into pinned memory). Files read for
        another sequence at the same time are read once. Never raises: a failure is a miss, with a warning."""
        try:
            return self._stage(ids, at, limit)
        except Exception as e:  # noqa: BLE001 - the tokens are computed instead
            self._warn(e)
            return []

    def _stage(self, ids: list[int], at: tuple[int, list[int]], limit: int) -> list[Segment]:
        ids32 = np.asarray(ids, dtype=np.int32)
        p, starts = at[0], list(at[1])
        out: list[Segment] = []
        tries = 0
        while p < limit and tries < 8:
            path, most = None, 0
            for s in starts:
                found, k = self.disk.find(ids32, s, limit, past=p)
                if found is not None and s + k - p > most:
                    path, most = found, s + k - p
            if path is None:
                break
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                tries += 1
                continue
            if not self.worth("disk", size, most):
                break
            seg = self._read_once(path, size)
            if seg is None:  # gone or rejected (removed): look again
                tries += 1
                continue
            k = seg.start + seg.continues(ids32, limit) - p
            if k <= 0:  # (replaced since its head was read)
                break
            out.append(seg)
            p += k
            starts.append(p)
        return out

    def _in_host(self, ids: list[int], ids32: np.ndarray, starts: list[int], p: int,
                 limit: int) -> tuple[Segment | None, int, int]:
        """The host segment, starting at one of `starts`, that continues `ids` furthest beyond `p`: (it, the
        offset of position p in it, the tokens it holds from p on), or (None, 0, 0)."""
        best, offset, most = None, 0, 0
        if self.host is not None:
            for s in starts:
                seg, k = self.host.find(ids, ids32, s, limit, past=p)
                if seg is not None and s + k - p > most:
                    best, offset, most = seg, p - s, s + k - p
        return best, offset, most

    def _read_once(self, path: Path, size: int) -> Segment | None:
        with self._lock:
            seg = self._read.get(path)
            if seg is not None:
                return seg
            reading = self._reading.get(path)
            mine = reading is None
            if mine:
                reading = self._reading[path] = threading.Event()
        if not mine:
            reading.wait()
            with self._lock:
                return self._read.get(path)
        try:
            started = time.perf_counter()
            seg = self.disk.read(path)
            if seg is not None and self.cuda:
                seg.kv = seg.kv.pin_memory()
            self._measure("disk", size, time.perf_counter() - started)
            if seg is not None:
                with self._lock:
                    self._read[path] = seg
            return seg
        finally:
            with self._lock:
                del self._reading[path]
            reading.set()

    def load(self, trie: PrefixTrie, node: TrieNode, ids: list[int], cached: int, limit: int,
             staged: list[Segment] = ()) -> tuple[TrieNode, int, "Loads | None"]:
        """Extend the device match (`node`, `cached` tokens of `ids`) from the host tier and the `staged`
        segments, short of `limit`: each loaded run of tokens gets fresh store slots and becomes a trie node.
        A segment serves from any of its positions, so one that begins where a segment of the match begins
        continues a match that ends inside it. Where the trie has no room for a run (the running requests'
        prefixes fill its budget), that run and those after it are the request's own: `Loads`, copied into
        its own slots when its prefill runs, instead of computed. Returns the deepest node, its depth, and
        the loads (None: none); stops where the store has no room."""
        if cached >= limit:
            return node, cached, None
        starts = [0, *(n.depth for n in trie.path(node))]
        if not staged and (self.host is None or not any(self.host.starts(s, ids[s]) for s in starts)):
            return node, cached, None
        ids32 = np.asarray(ids, dtype=np.int32)
        hit = {"host": False, "disk": False}
        own: list[tuple[Segment, int, int, str]] = []  # (segment, offset, tokens, tier): the request's own
        at = cached
        trie.pin(node)
        try:
            while at < limit:
                seg, offset, k = self._in_host(ids, ids32, starts, at, limit)
                tier = "host"
                for s in staged:
                    if s.start <= at and (n := s.start + s.continues(ids32, limit) - at) > k:
                        seg, offset, k, tier = s, at - s.start, n, "disk"
                if seg is None or (tier == "host" and not self.worth("host", k * self.store.bytes_per_token, k)):
                    break
                if own or not trie.has_room(k):
                    own.append((seg, offset, k, tier))
                    at += k
                    starts.append(at)
                    continue
                try:
                    slots = self.store.alloc(k)
                except OutOfSlots:
                    break
                try:
                    self._up(seg, offset, k, slots, tier)
                except Exception as e:  # noqa: BLE001 - a tier that fails is a miss: the tokens are computed
                    self.store.free(slots)
                    self._warn(e)
                    break
                child = trie.insert(node, ids[cached:cached + k], slots)
                self.store.free_rows(slots)  # those the trie did not take (it had them, or had no room)
                if child is None:
                    break
                trie.pin(child)
                trie.unpin(node)
                node, cached = child, child.depth
                at = cached
                starts.append(cached)
                hit[tier] = True
                self._count(tier, k)
        finally:
            trie.unpin(node)
        self.host_hits += hit["host"]
        self.disk_hits += hit["disk"]
        loaded = {t for t, hit_tier in hit.items() if hit_tier}
        return node, cached, Loads(self, own, ids[cached:at], loaded) if own else None

    def _count(self, tier: str, tokens: int) -> None:
        """`tokens` tokens moved up from `tier`."""
        if tier == "host":
            self.tokens_from_host += tokens
            self.bytes_from_host += tokens * self.store.bytes_per_token
        else:
            self.tokens_from_disk += tokens

    def _up(self, seg: Segment, offset: int, k: int, slots: np.ndarray, tier: str) -> None:
        """The K/V of `seg`'s tokens [offset, offset + k) into store `slots`."""
        data = self.store.data
        index = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
        if not self.cuda:
            started = time.perf_counter()
            data.index_copy_(2, index, seg.kv[:, :, offset:offset + k])
            self._measure(tier, k * self.store.bytes_per_token, time.perf_counter() - started)
            return
        stream = torch.cuda.current_stream(self.store.device)
        if seg.ready is not None:
            stream.wait_event(seg.ready)
        timed = tier not in self.bandwidth
        if timed:
            torch.cuda.synchronize(self.store.device)
            started = time.perf_counter()
        # the whole segment goes up (a slice of pinned memory on dim 2 is not contiguous: it would not copy
        # asynchronously), then the part wanted goes into the store
        up = seg.kv.to(self.store.device, non_blocking=True)
        data.index_copy_(2, index.pin_memory().to(self.store.device, non_blocking=True), up[:, :, offset:offset + k])
        if timed:
            torch.cuda.synchronize(self.store.device)
            self._measure(tier, seg.nbytes, time.perf_counter() - started)

    # ----- a prefill's loads ----------------------------------------------------------------------------

    def queue_loads(self, jobs: list[tuple["Loads", np.ndarray]], before=None) -> tuple[list[int], list | None]:
        """The K/V of a prefill's rows' `Loads` into their own store slots (`jobs`: each row's loads and its slots
        for them), before the prefill reads them. On the CPU, copied now. On a GPU, queued layer by layer on a
        stream of their own: each segment's layer copied up once (rows that share a segment share the copy),
        then one scatter into the store a layer, and an event after each layer: the prefill's layer l waits
        for event l alone, so the later layers' copies run while the first layers compute (as SGLang's
        hierarchical cache loads, layer by layer), after the event `before` (the work that may have written the
        slots before they were the rows'; None: all the compute stream's work queued so far). Returns (the jobs
        whose tier failed: their rows compute those tokens; the layers' events, None where the copies are
        done)."""
        if not self.cuda:
            return [i for i, (loads, slots) in enumerate(jobs) if not loads.into(slots)], None
        compute = torch.cuda.current_stream(self.store.device)
        loading = self._loading_stream()
        timed = "host" not in self.bandwidth
        try:
            if timed:
                torch.cuda.synchronize(self.store.device)
                started = time.perf_counter()
            events, nbytes = self._queue_layers(jobs, before, compute, loading)
            if timed:
                torch.cuda.synchronize(self.store.device)
                self._measure("host", nbytes, time.perf_counter() - started)
        except Exception as e:  # noqa: BLE001 - a tier that fails is a miss: the tokens are computed
            compute.wait_stream(loading)  # (what was queued lands before the prefill writes those slots)
            self._warn(e)
            return list(range(len(jobs))), None
        for loads, _ in jobs:
            loads.count()
        return [], events

    def _queue_layers(self, jobs: list[tuple["Loads", np.ndarray]], before, compute: torch.cuda.Stream,
                      loading: torch.cuda.Stream) -> tuple[list[torch.cuda.Event], int]:
        """`queue_loads` on a GPU: the layers' events and the bytes copied up."""
        data = self.store.data                                   # [L, 2, slots, H_kv, D]
        layers, _, capacity, heads, head_dim = data.shape
        placed: dict[int, tuple[Segment, int]] = {}              # id(segment) -> (it, its first row in `staging`)
        rows = 0
        k_rows, v_rows, into = [], [], []
        for loads, slots in jobs:
            at = 0
            for seg, offset, k, _ in loads.pieces:
                if id(seg) not in placed:
                    placed[id(seg)] = (seg, rows)
                    rows += 2 * seg.tokens
                first = placed[id(seg)][1] + offset
                k_rows.append(np.arange(first, first + k))
                v_rows.append(np.arange(first + seg.tokens, first + seg.tokens + k))
                into.append(slots[at:at + k])
                at += k
        into_rows = np.concatenate(into).astype(np.int64)
        index = np.stack([np.concatenate(k_rows + v_rows), np.concatenate([into_rows, into_rows + capacity])])
        if before is not None:
            loading.wait_event(before)
        else:
            loading.wait_stream(compute)
        for seg, _ in placed.values():
            if seg.ready is not None:  # (a copy down still running)
                loading.wait_event(seg.ready)
        events = []
        with torch.cuda.stream(loading):
            index = torch.from_numpy(index).pin_memory().to(self.store.device, non_blocking=True)
            for layer in range(layers):
                staging = torch.empty(rows, heads, head_dim, dtype=data.dtype, device=self.store.device)
                for seg, first in placed.values():
                    staging[first:first + 2 * seg.tokens].view(2, seg.tokens, heads, head_dim).copy_(
                        seg.kv[layer], non_blocking=True)
                data[layer].view(2 * capacity, heads, head_dim).index_copy_(0, index[1], staging[index[0]])
                event = torch.cuda.Event()
                event.record(loading)
                events.append(event)
        return events, sum(seg.nbytes for seg, _ in placed.values())

    # ----- the cost model -----------------------------------------------------------------------------

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill computed `tokens` new tokens in `seconds` (from its look-up to its logits)."""
        if tokens >= MEASURED_PREFILL_MIN and seconds > 0:
            rate = seconds / tokens
            if self.prefill_seconds_per_token is None or rate < self.prefill_seconds_per_token:
                self.prefill_seconds_per_token = rate

    def worth(self, tier: str, nbytes: int, tokens: int) -> bool:
        """Is moving `nbytes` up from `tier` quicker than prefilling `tokens` (True until both are measured)?"""
        bandwidth, per_token = self.bandwidth.get(tier), self.prefill_seconds_per_token
        if bandwidth is None or per_token is None:
            return True
        return nbytes / bandwidth < tokens * per_token

    def _measure(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes < 1 << 20 or seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            old = self.bandwidth.get(tier)
            self.bandwidth[tier] = rate if old is None else (old + rate) / 2

    # ----- life ----------------------------------------------------------------------------------------

    def flush(self) -> None:
        """Wait for the files being written."""
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        """Finish the files being written and let the host tier's memory go (an arena's pinned blocks go back
        to torch's pinned allocator, which keeps them for the process's next use); the tiers hold nothing
        after."""
        self.flush()
        if self.host is not None:
            self.host.clear()
            self.host = None

    def _warn(self, error: Exception) -> None:
        """One warning per backend: a tier that fails keeps failing the same way."""
        if not self._warned:
            self._warned = True
            warnings.warn(f"lmq: a cache tier failed ({type(error).__name__}: {error}); its prefixes are computed "
                          "again", RuntimeWarning, stacklevel=3)


class Loads:
    """A request's K/V beyond the trie's match that the trie had no room for (`CacheTiers.load`): the tiers'
    segments that hold it, held until its prefill copies them into the request's own store slots (`into`) in
    place of computing them. `ids`: those tokens; `counted`: the tiers its lookup counted a hit of already (a
    lookup is one hit of a tier however many of its segments it loads; None once `into` counted its own, which
    a prefill retried copies again without counting)."""

    __slots__ = ("tiers", "pieces", "ids", "counted")

    def __init__(self, tiers: CacheTiers, pieces: list[tuple[Segment, int, int, str]], ids: list[int],
                 counted: set[str] | None = None):
        self.tiers, self.pieces, self.ids, self.counted = tiers, pieces, ids, set(counted or ())

    @property
    def tokens(self) -> int:
        return len(self.ids)

    def into(self, slots: np.ndarray) -> bool:
        """Copy the K/V into store `slots` (`tokens` of them, the request's own), queued on the device's compute
        stream before the prefill that reads them. False where a tier fails (one warning): the caller computes
        the tokens. (A prefill's rows load through `CacheTiers.queue_loads`.)"""
        tiers, at = self.tiers, 0
        try:
            for seg, offset, k, tier in self.pieces:
                tiers._up(seg, offset, k, slots[at:at + k], tier)
                at += k
        except Exception as e:  # noqa: BLE001 - a tier that fails is a miss: the tokens are computed
            tiers._warn(e)
            return False
        self.count()
        return True

    def count(self) -> None:
        """The tiers' counters of a load done (once: a prefill retried copies the K/V again without counting; a
        tier its lookup counted a hit of already is not counted again)."""
        if self.counted is None:
            return
        tiers, hit = self.tiers, set()
        for _, _, k, tier in self.pieces:
            tiers._count(tier, k)
            hit.add(tier)
        hit -= self.counted
        tiers.host_hits += "host" in hit
        tiers.disk_hits += "disk" in hit
        self.counted = None


@dataclass(slots=True)
class TierOptions:
    """What a backend asks of the tiers under its prefix cache: `host_bytes` of host memory (None: "auto",
    none: on the CPU the store is host memory already, and on a GPU pinned host memory is taken only when
    given, as its size is the user's to choose; 0: none), a disk
    `folder` (None: none) of at most `disk_bytes`, keyed by the weights' `fingerprint()` (called only then) and
    `weights_dtype` (a quantized dtype; None: the store's); `name` describes the model in `lmq cache ls`."""

    host_bytes: int | None
    folder: Path | None
    disk_bytes: int
    fingerprint: Callable[[], str]
    weights_dtype: str | None = None
    name: str = "model"


def build_tiers(store: KVStore, options: TierOptions) -> CacheTiers | None:
    """The tiers of a store as `options` ask (None: neither a host nor a disk tier)."""
    cuda = store.device.type == "cuda"
    host_bytes = options.host_bytes or 0
    host = None
    if host_bytes > 0:
        host = HostTier(host_bytes, HostArena(host_bytes) if cuda else None)
    disk = None
    if options.folder is not None and options.disk_bytes > 0:
        try:
            check_folder(options.folder)
        except NotADirectoryError as e:
            raise LMQBackendError(f"disk_cache: {e}: the disk tier needs a folder (None turns it off)") from None
        weights_dtype = options.weights_dtype or str(store.dtype).removeprefix("torch.")
        device = describe_device(store.device)
        key = model_key(options.fingerprint(), weights_dtype, device, LAYOUT_VERSION, store.shape)
        disk = DiskTier(options.folder, key, store.dtype, store.shape, LAYOUT_VERSION, options.disk_bytes,
                        description={"name": options.name, "weights_dtype": weights_dtype, "device": device})
    if host is None and disk is None:
        return None
    return CacheTiers(store, host, disk)
