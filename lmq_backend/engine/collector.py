"""The cyclic garbage collector's pace while the engine has work.

Python collects its young generation after every 700 new container objects (lists, dicts, objects) by default.
A round of many concurrent queries allocates such objects at every step (requests, rows, id lists of ~1,000
ints that each collection walks while they live): at N = 1,024 calls `bench_host.py` counted ~70 collections a
round, ~25 us of host work a query. While any scheduler's step task lives (from the first query's request:
the queries' first turns run before its first step), the young generation's threshold is
`BUSY_THRESHOLD` (most of those objects are gone before a collection meets them); the one before comes back
when the last loop ends. A threshold of 0 (the collector off) or one already higher is left alone, and one set
by the program in the meantime is kept.
"""
from __future__ import annotations

import gc
import threading

BUSY_THRESHOLD = 50_000

_lock = threading.Lock()
_busy = 0
_saved: tuple[int, ...] | None = None  # the thresholds before the first loop began; None: left alone


def busy() -> None:
    """An engine's step loop begins: the young generation's threshold at `BUSY_THRESHOLD` until every loop that
    began has ended (`idle`)."""
    global _busy, _saved
    with _lock:
        if _busy == 0:
            before = gc.get_threshold()
            _saved = before if 0 < before[0] < BUSY_THRESHOLD else None
            if _saved is not None:
                gc.set_threshold(BUSY_THRESHOLD, *before[1:])
        _busy += 1


def idle() -> None:
    """An engine's step loop ended (once for each `busy`)."""
    global _busy, _saved
    with _lock:
        _busy -= 1
        if _busy == 0 and _saved is not None:
            if gc.get_threshold()[0] == BUSY_THRESHOLD:  # (not one the program set since)
                gc.set_threshold(*_saved)
            _saved = None
