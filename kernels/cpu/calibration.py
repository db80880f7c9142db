"""Which kernel runs an op on this machine, lmq's C kernel or torch's, decided by measuring both.

    cal = Calibration(path, key)
    cal.choose(op, shape_class, bench, measure=False) -> bool     True: lmq's kernel is the faster here

`shape_class` is a tuple naming a class of operands (e.g. the thread count, a row bucket, size classes);
`bench()` returns two zero-argument callables, one running lmq's kernel and one running torch's counterpart
once each on representative operands (see benches.py). They are timed alternately (a few rounds, at most
CAP_S seconds a class); lmq's kernel is kept only if its best time beats torch's by MARGIN, so that no lmq
kernel runs where it is slower than torch's.

When a class is measured: with `measure` (a warm-up, before any query: library.warming), a class not yet
measured on this machine, or one measured on a busy machine while this one is quiet now. Without it (a
query's own calls), a class not yet measured takes the choice of its nearest measured neighbour (the same op
and thread count, the closest sizes: `neighbour`), unmeasured, so that no measurement runs inside a query's
calls; only an op with no measured class at all is measured there. Whatever is chosen, the results are the
same: the choice is one of speed.

Choices are cached in memory and in a JSON file next to the built library (`path`), keyed by the library's
own key (sources, flags, compiler, CPU flags: see toolchain.py) and torch's version. A choice whose timings
never settled, or made while the load average exceeded the CPU count (a busy machine: `stable` false), is
used by later processes and measured again by a warm-up on a quiet machine. A file that does not parse, has
another key or torch version, or holds an entry that is malformed or contradicts its own timings is not
trusted: it is logged once, ignored, and rewritten by the next measurement. Writes merge with what other
processes wrote meanwhile and replace the file atomically.
"""
from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger("lmq_kernels.cpu")

VERSION = 1
MARGIN = 0.97            # lmq's best time must be below MARGIN x torch's
MIN_ROUNDS, MAX_ROUNDS, STABLE = 5, 60, 3
TARGET_S, CAP_S = 0.05, 0.6   # stop after MIN_ROUNDS once TARGET_S is spent (and STABLE); never past CAP_S
# Calls of at least DECISIVE_S whose best times differ DECISIVE-fold after two rounds settle the choice there:
# no neighbour's stall makes one side's best twice as fast. Shorter calls run the usual rounds: a neighbour
# that takes a core stalls a two-thread call for a scheduler tick (several ms), and can do so in both of one
# side's first rounds, which would keep the slower side
DECISIVE, DECISIVE_S = 2.0, 0.02

Runner = Callable[[], object]
Bench = Callable[[], "tuple[Runner, Runner]"]


def measure_pair(run_lmq: Runner, run_torch: Runner) -> tuple[float, float, int, bool]:
    """(lmq's best seconds, torch's best seconds, rounds, stable): one warm-up call each, then rounds of one
    call each, alternating which goes first (the machine's drift and neighbours hit both alike). The best
    of several rounds is what each takes on a quiet machine; on a busy one (a neighbour's process taking a
    core stalls a two-thread call for a scheduler tick) it runs on until each side has STABLE calls within
    25% of its best (stable), or CAP_S is spent (not stable). Long calls DECISIVE-fold apart stop after two
    rounds (stable)."""
    run_lmq()
    run_torch()
    times: tuple[list[float], list[float]] = ([], [])
    runs = (run_lmq, run_torch)
    start = time.perf_counter()
    rounds = 0
    while rounds < MAX_ROUNDS:
        for side in ((0, 1) if rounds % 2 == 0 else (1, 0)):
            t0 = time.perf_counter()
            runs[side]()
            times[side].append(time.perf_counter() - t0)
        rounds += 1
        spent = time.perf_counter() - start
        best = (min(times[0]), min(times[1]))
        decisive = rounds >= 2 and min(best) >= DECISIVE_S and max(best) >= DECISIVE * min(best)
        stable = decisive or all(sum(t <= 1.25 * min(ts) for t in ts) >= STABLE for ts in times)
        if spent >= CAP_S or decisive or (rounds >= MIN_ROUNDS and spent >= TARGET_S and stable):
            break
    return min(times[0]), min(times[1]), rounds, stable


def _load_average() -> float:
    """The last minute's load average: above the CPU count, other processes kept every CPU busy while the
    calibration ran (a two-thread kernel then waits for its second thread), so its choice is not kept."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def quiet() -> bool:
    """Whether the machine is quiet enough to measure on: the last minute's load average at most the CPU count."""
    return _load_average() <= (os.cpu_count() or 1)


def _sizes(name: str) -> tuple[str, list]:
    """("op/threads" and the non-numeric parts, the numeric parts) of a choice's name."""
    parts = name.split("/")
    fixed = [p for p in parts[2:] if not p.isdigit()]
    return "/".join(parts[:2] + fixed), [int(p) for p in parts[2:] if p.isdigit()]


def neighbour(name: str, names) -> str | None:
    """Among `names`, the nearest class to `name`: the same op, thread count and non-numeric parts, as many
    sizes, the least sum of |log2| distances between them (ties: the first in sorted order); None if none."""
    fixed, sizes = _sizes(name)
    best, best_d = None, math.inf
    for other in sorted(names):
        f, s = _sizes(other)
        if other == name or f != fixed or len(s) != len(sizes):
            continue
        d = sum(abs(math.log2(a + 1) - math.log2(b + 1)) for a, b in zip(sizes, s))
        if d < best_d:
            best, best_d = other, d
    return best


def _entry_ok(entry: object) -> bool:
    if not isinstance(entry, dict) or entry.get("use") not in ("lmq", "torch"):
        return False
    lmq, tch = entry.get("lmq_us"), entry.get("torch_us")
    if not all(isinstance(t, (int, float)) and math.isfinite(t) and t > 0 for t in (lmq, tch)):
        return False
    if not isinstance(entry.get("stable", True), bool):
        return False
    return (entry["use"] == "lmq") == (lmq <= MARGIN * tch)   # a choice its own timings contradict: forged


class Calibration:
    """The choices of one library on this machine (see the module docstring). `path` None: memory only."""

    def __init__(self, path: Path | None, key: str):
        self.path, self.key = (Path(path) if path is not None else None), key
        self._lock = threading.RLock()   # a bench may choose other ops (decode_layers: the per-op step)
        self._use: dict[tuple, bool] = {}          # (op, shape_class) -> lmq chosen
        self._entries: dict[str, dict] = {}        # the file's form: "op/a/b/c" -> entry
        self._used: set[str] = set()               # the names this process asked for
        self._guessed: dict[str, str] = {}         # name -> the measured neighbour whose choice it took
        self._measured: set[str] = set()           # the names this process measured
        self._recheck: set[tuple] = set()          # (op, shape_class) guessed, or whose entry is not stable
        for name, entry in self._read(complain=True).items():
            self._entries[name] = entry

    # -------------------------------------------------------------------------------------------- the file
    def _read(self, complain: bool) -> dict[str, dict]:
        """The file's valid entries; {} (logged once when `complain`) for a missing, corrupt or stale file."""
        if self.path is None or not self.path.exists():
            return {}
        why = None
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as e:
            data, why = None, f"unreadable ({e.__class__.__name__})"
        if why is None:
            if not isinstance(data, dict) or data.get("version") != VERSION:
                why = "another format"
            elif data.get("key") != self.key:
                why = "made for another library build or benchmark"
            elif data.get("torch") != torch.__version__:
                why = f"made with torch {data.get('torch')}"
            elif not isinstance(data.get("choices"), dict) or not all(
                    isinstance(k, str) and _entry_ok(v) for k, v in data["choices"].items()):
                why = "malformed or inconsistent entries"
        if why is not None:
            if complain:
                log.warning("lmq: CPU kernel calibration %s not trusted (%s); measuring again", self.path, why)
            return {}
        return dict(data["choices"])

    def _write(self) -> None:
        if self.path is None:
            return
        merged = {**self._read(complain=False), **self._entries}
        data = {"version": VERSION, "key": self.key, "torch": torch.__version__, "choices": merged}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only cache: the choices hold for this process
            log.debug("lmq: cannot write %s: %s", self.path, e)

    # ------------------------------------------------------------------------------------------ choices
    def choose(self, op: str, shape_class: tuple, bench: Bench, measure: bool = False) -> bool:
        """Whether lmq's kernel runs `op` on operands of `shape_class` (see the module docstring for when a
        class is measured; `measure`: a warm-up's call, which may measure)."""
        hit = self._use.get((op, shape_class))
        if hit is not None and not (measure and (op, shape_class) in self._recheck):
            return hit
        with self._lock:
            hit = self._use.get((op, shape_class))
            if hit is not None and not (measure and (op, shape_class) in self._recheck):
                return hit
            name = "/".join([op, *map(str, shape_class)])
            self._used.add(name)
            entry = self._entries.get(name)
            if entry is None and not measure:
                near = neighbour(name, self._entries)
                if near is not None:
                    self._guessed[name] = near
                    self._recheck.add((op, shape_class))
                    self._use[(op, shape_class)] = self._entries[near]["use"] == "lmq"
                    return self._use[(op, shape_class)]
            if entry is None or (measure and not entry.get("stable", True) and name not in self._measured
                                 and quiet()):
                try:
                    lmq_s, torch_s, rounds, stable = measure_pair(*bench())
                except Exception as e:  # noqa: BLE001 (a calibration that cannot run: torch, not persisted)
                    log.warning("lmq: calibrating %s failed (%s); torch runs it", name, e)
                    self._use[(op, shape_class)] = False
                    return False
                lmq_us, torch_us = max(round(lmq_s * 1e6, 2), 0.01), max(round(torch_s * 1e6, 2), 0.01)
                load = _load_average()
                entry = {"use": "lmq" if lmq_us <= MARGIN * torch_us else "torch", "lmq_us": lmq_us,
                         "torch_us": torch_us, "rounds": rounds, "load": round(load, 2),
                         "stable": stable and load <= (os.cpu_count() or 1)}
                self._entries[name] = entry
                self._measured.add(name)
                self._guessed.pop(name, None)
                self._write()
                log.info("lmq: calibrated %s: lmq %.1f us, torch %.1f us -> %s", name, entry["lmq_us"],
                         entry["torch_us"], entry["use"])
            if not entry.get("stable", True):
                self._recheck.add((op, shape_class))
            else:
                self._recheck.discard((op, shape_class))
            self._use[(op, shape_class)] = entry["use"] == "lmq"
            return entry["use"] == "lmq"

    def guesses(self) -> dict[str, str]:
        """The classes this process met unmeasured (its queries' calls), each with the measured neighbour
        whose choice it took."""
        with self._lock:
            return dict(self._guessed)

    def choices(self, used: bool = False) -> dict[str, dict]:
        """Every choice made or loaded so far (`used`: those this process asked for): "op/class..." ->
        {"use", "lmq_us", "torch_us", ...}."""
        with self._lock:
            return {name: dict(entry) for name, entry in sorted(self._entries.items())
                    if not used or name in self._used}
