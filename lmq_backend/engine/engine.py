"""`Engine`: one model's engine, built here and nowhere else: the model runner, the paged K/V store, the prefix
cache over it and the scheduler that batches the queries' work.

    engine = Engine(model, max_batch=256, kv_budget=None, cache_budget=2 * 10**9)
    logits, row = await engine.prefill(PrefillRequest(pin, ids, stored=len(ids)))  # the cached prefix
    logits = await engine.decode(row, token)                       # looked up, the rest computed; then one
    engine.release(row)                                            # token a step, batched with other rows

A request's `pin` (`cache.prefix_cache.Pin`) holds the cached prefix it reads between calls; `engine.cache`
moves, forks and releases pins (`PrefixCache`).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ..cache.prefix_cache import Pin, PrefixCache
from ..cache.tiers import TierOptions
from .picks import Draw
from .rows import Continuation, ContinuationGroup, PrefillRequest, Row
from .runner import ModelRunner
from .scheduler import Scheduler


def default_kv_budget(device: torch.device) -> int:
    """Bytes for the K/V store when the user names none: half the GPU's free memory, once torch's allocator
    has handed back what it holds unused (a dropped backend's store, for one: cached blocks that one
    allocation of the store's size could not use); on a CPU a third of the machine's memory (untouched pages
    of the store cost nothing there)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 3
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not a POSIX system
        return 4 * 2**30


class Engine:
    def __init__(self, model, max_batch: int = 256, kv_budget: int | None = None, cache_budget: int = 0,
                 weights_folder: Path | None = None, tiers: TierOptions | None = None):
        """`kv_budget`: bytes of the K/V store (None: `default_kv_budget`); `cache_budget`: bytes the prefix
        cache keeps of it (0: none, every prefill computes its whole prompt); `weights_folder`: the folder the
        model was just loaded from, where the fused step keeps its weights' layout (`ModelRunner`); `tiers`:
        the cache tiers under the prefix cache (host memory, disk: `cache/tiers.py`; None: none)."""
        self.runner = ModelRunner(model, max_batch=max_batch, weights_folder=weights_folder)
        self.store = self.runner.new_store(default_kv_budget(self.runner.device) if kv_budget is None else kv_budget)
        self.cache = PrefixCache(self.store, cache_budget, tiers)
        self.scheduler = Scheduler(self.runner, self.store, self.cache)
        self._commit_warm_start_window()

    def _commit_warm_start_window(self) -> None:
        """A warm start copies the disk tier's K/V into the lowest free slots: on a CPU their pages are committed
        now (`KVStore.touch`), not by page faults inside the process's first call, and as many beyond the
        highest slot in use from then on (`KVStore.commit_ahead`: the next prefix loaded from disk). The window:
        the model's largest file, within what the prefix cache may keep; two of them at the load, so that the
        thread committing ahead wakes after the first call (on a machine of a few cores it competes with the
        call's prefill), not inside it."""
        tiers = self.cache.tiers
        if tiers is None or tiers.disk is None or self.store.device.type != "cpu":
            return
        tokens = min(tiers.disk.most_tokens(), self.cache.budget_bytes // self.store.bytes_per_token)
        if tokens > 0:
            self.store.touch(1 + 2 * tokens)
            self.store.commit_ahead(tokens * self.store.bytes_per_token)

    @property
    def device(self) -> torch.device:
        return self.runner.device

    async def prefill(self, request: PrefillRequest, first: bool = False) -> tuple[torch.Tensor, Row]:
        """The logits [V] after the request's ids, and its row in the running batch (release it). `first`: ahead
        of the other waiting requests (a preempted row resuming). The disk tier's files that may serve its
        prefix are read first, off the event loop (`PrefixCache.stage`)."""
        request.staged = await self.cache.stage(request.ids, len(request.ids) - 1)
        return await self.scheduler.prefill(request, first)

    async def decode(self, row: Row, token: int, ahead: int | Draw | None = None,
                     then: Continuation | None = None, group: ContinuationGroup | None = None
                     ) -> torch.Tensor | None:
        """The logits after feeding `token` to the row (see `Scheduler.decode`); raises `Preempted` where the
        row was taken out of the batch to free slots."""
        return await self.scheduler.decode(row, token, ahead, then, group)

    def release(self, row: Row) -> None:
        self.scheduler.release(row)

    def extend(self, pin: Pin, ids: list[int], row: Row, start: int) -> bool:
        """Put the row's K/V of positions [start, start + len(ids)) (tokens `ids`) in the prefix cache after the
        pin's prefix, and move the pin there; False where nothing was stored."""
        return self.cache.extend(pin, ids, self.scheduler.segment(row, start, start + len(ids)))

    def length(self, row: Row) -> int:
        """The tokens the row holds K/V for."""
        return self.scheduler.length(row)

    def score(self, row: Row, prompt: int, logits: torch.Tensor, continuations: list[list[int]]) -> list[list[float]]:
        """Per-token log-probabilities of each continuation after the row's first `prompt` tokens, whose
        next-token logits are `logits`."""
        kv = self.scheduler.pool.segment_kv(row.slot, 0, prompt)
        return self.runner.score(kv, logits, continuations)

    def close(self) -> None:
        """Give the memory back now: queries waiting fail, later ones are refused; the runner's device buffers
        and the store go."""
        if self.scheduler.closed:
            return
        self.scheduler.close()
        self.cache.close()  # the tiers' files being written are finished
        self.runner.close()
        self.store.close()

    @property
    def closed(self) -> bool:
        return self.scheduler.closed

