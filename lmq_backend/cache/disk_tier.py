"""`DiskTier`: segments in files under a folder that processes share, within a byte budget (LRU across them).

Folder (default `paths.cache_dir()/kv`; `default_folder`):

    .lock                        flock'ed while a file is put in place, files are evicted or the folder cleared
    tmp/                         files being written (named by host, pid and thread), renamed into place when
                                 whole; one a dead process of this host left goes at the next write, any after
                                 an hour
    <model>/model.json           what <model> is (name, dtype, device, K/V shape): for `lmq cache ls`
    <model>/<start>/<end>.kv     a segment: <start> = prefix_key(ids[:start]), <end> = prefix_key(ids[:end])

The names are 32 hex digits. Only what has lmq's names (a model folder that holds its model.json, start folders
and `<end>.kv` files in it) is counted, evicted or cleared: another file or folder under the same folder is
never touched.

<model> (`model_key`) hashes everything that makes two processes' K/V interchangeable: the weights' fingerprint
(`cache/fingerprint.py`), dtype, device, the store's layout version, this file format's version and the K/V
shape. A process looks only in its own <model> folder, and checks each file's header against it again.

File (little-endian):

    b"LMQKVSEG"  u32 header bytes  header (JSON: model, dtype, layout, shape [L, H_kv, D], start, end)
    ids      int32 [end]              the whole prefix: a file serves a sequence only if these ids match exactly
    payload  [L, 2, T, H_kv, D]       K/V of tokens [start, end) in the model's dtype, zero-padded to 4 KiB blocks
    b"LMQKVEND"  u32 crc32(everything before the payload)  u32 0  u64 xxh3_64(the payload, padding included)  u64 0

(the ids and the payload start at multiples of 64 bytes). The payload's hash is XXH3 (the `xxhash` package): it
runs at memory speed (~30 GB/s here, a warm start reads the file while its query waits), where zlib's CRC-32
runs at ~4; any damage (flipped, zeroed, swapped or missing bytes) passes it with a chance of one in 2^64. (A
sum of the payload's 64-bit words, as fast, missed errors that cancel: a sign bit flipped in two words.)

Safety: a file is written under tmp/ and renamed into place (atomic), so a reader sees a whole file or none;
two processes writing the same segment write the same bytes, and the later rename wins. Renames, evictions
and clearing hold the folder's flock, so the budget holds across processes when each file is added. Readers
take no lock: a file removed while read is still read whole (POSIX keeps an open file's data). A file that
fails any check (torn, truncated, corrupted, from another model, dtype or layout) is removed with a
`CacheFileWarning`; its tokens are computed again, never read wrong.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import mmap
import os
import queue
import re
import socket
import struct
import sys
import threading
import time
import warnings
import weakref
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from ..paths import cache_dir

try:
    import fcntl
except ImportError:  # pragma: no cover - not a POSIX system: the lock holds within this process only
    fcntl = None
from .segment import Segment, continued, prefix_key

FORMAT_VERSION = 3
MAGIC, END_MAGIC = b"LMQKVSEG", b"LMQKVEND"
BLOCK = 4096
ALIGN = 64
TRAILER = struct.Struct("<8sIIQQ")
PENDING_BYTES = 1 << 29   # files queued beyond this are not written (a cache may drop what it cannot keep up with)
STALE_TEMP_SECONDS = 3600  # a temp file this old was left by a writer that died (of another host: its pid says nothing)
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform.startswith("linux") else None)
_HOST = socket.gethostname()
DISK_ENV = "LMQ_DISK_CACHE"
OFF = ("", "0", "off", "none", "false", "no")


class CacheFileWarning(UserWarning):
    """A file of the disk tier was ignored (and removed): torn, truncated, corrupted or foreign."""


def default_folder() -> Path | None:
    """The disk tier's folder when none is named: $LMQ_DISK_CACHE if it names a folder, none if it is "off"
    (or "0", "none"), else `paths.cache_dir()/kv`."""
    value = os.environ.get(DISK_ENV)
    if value is None:
        return cache_dir() / "kv"
    return None if _off(value) else Path(value).expanduser()


def _off(value: str) -> bool:
    """Does $LMQ_DISK_CACHE's (or a `disk_cache=` string's) value turn the disk tier off?"""
    return value.strip().lower() in OFF


def resolve_folder(disk_cache) -> Path | None:
    """`disk_cache=` of a backend: None/False or a string $LMQ_DISK_CACHE reads as off ("", "off", ...: off),
    True or "default" (`default_folder()`) or a folder."""
    if disk_cache is None or disk_cache is False or (isinstance(disk_cache, str) and _off(disk_cache)):
        return None
    if disk_cache is True or disk_cache == "default":
        return default_folder()
    return Path(disk_cache).expanduser()


def check_folder(folder: Path) -> None:
    """Raise NotADirectoryError where `folder` exists and is no folder (it could hold no cache)."""
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{folder} is not a folder")


def model_key(fingerprint: str, dtype: str, device: str, layout: int, shape: tuple[int, int, int]) -> str:
    """The name of a model's folder: K/V is shared only between processes that agree on all of these."""
    text = json.dumps([fingerprint, dtype, device, layout, FORMAT_VERSION, list(shape)])
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


def payload_checksum(payload: np.ndarray) -> int:
    """XXH3-64 of uint8 bytes zero-padded to whole 4 KiB blocks (see the module docstring)."""
    h = xxhash.xxh3_64()
    h.update(payload)
    pad = _pad(len(payload), BLOCK) - len(payload)
    if pad:
        h.update(bytes(pad))
    return h.intdigest()


@dataclass(slots=True)
class Layout:
    """Where a file's parts lie, from its header."""

    header: dict
    ids_at: int
    payload_at: int
    payload_bytes: int
    size: int

    @classmethod
    def of(cls, header: dict, header_bytes: int, element_size: int) -> "Layout":
        ids_at = _pad(len(MAGIC) + 4 + header_bytes, ALIGN)
        payload_at = _pad(ids_at + 4 * header["end"], ALIGN)
        layers, heads, dim = header["shape"]
        payload = 2 * layers * (header["end"] - header["start"]) * heads * dim * element_size
        return cls(header, ids_at, payload_at, payload, payload_at + _pad(payload, BLOCK) + TRAILER.size)


class Rejected(Exception):
    """A file that fails a check (the reason is the message)."""


@dataclass(slots=True)
class ModelUsage:
    """One model's files in a disk tier folder (`lmq cache ls`)."""

    key: str
    description: dict
    files: int
    bytes: int


_live: "weakref.WeakSet[DiskTier]" = weakref.WeakSet()


@atexit.register
def _flush_all() -> None:
    """At exit, the files being written are finished (the next process's warm start reads them)."""
    for tier in list(_live):
        tier.flush()


class DiskTier:
    """One model's segments in a shared folder. `write` queues a file for the tier's writer thread; `find` and
    `read` may run in any thread (the backend runs them off its event loop)."""

    def __init__(self, folder: Path, key: str, dtype: torch.dtype, shape: tuple[int, int, int], layout: int,
                 budget_bytes: int, description: dict | None = None):
        self.folder, self.key, self.dtype, self.shape, self.layout = Path(folder), key, dtype, tuple(shape), layout
        self.budget_bytes = int(budget_bytes)
        self.description = {**(description or {}), "dtype": str(dtype).removeprefix("torch."), "layout": layout,
                            "shape": list(shape)}
        self.element_size = torch.empty(0, dtype=dtype).element_size()
        self.model_folder = self.folder / key
        self._jobs: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pending: set[tuple[str, str]] = set()
        self._pending_bytes = 0
        # start folder -> (its mtime_ns, {file name: the prefix ids in it}): the heads read already
        self._heads: dict[str, tuple[int, dict[str, np.ndarray]]] = {}
        self.bytes_written = self.bytes_read = self.files_written = self.rejected = 0
        _live.add(self)

    # ----- names ----------------------------------------------------------------------------------------

    def path(self, start_key: str, end_key: str) -> Path:
        return self.model_folder / start_key / f"{end_key}.kv"

    def wants(self, start_key: str, end_key: str, nbytes: int) -> bool:
        """Would `write` take that segment (of `nbytes` of K/V): not on disk nor queued, within the budget and
        the writer's queue? One stat."""
        with self._lock:
            if (start_key, end_key) in self._pending or self._pending_bytes + nbytes > PENDING_BYTES:
                return False
        return nbytes < self.budget_bytes and not self.path(start_key, end_key).exists()

    def starts_at(self, start_key: str) -> bool:
        """Could a file continue the prefix named `start_key` (has it a folder)? One stat."""
        return (self.model_folder / start_key).is_dir()

    def most_tokens(self) -> int:
        """At most how many tokens this model's largest file holds (from the files' sizes: one scan of the
        model's folder, no file opened); 0 where it has none. What a warm start's first file may fill."""
        largest = max((size for _, size, _ in _files(self.model_folder)), default=0)
        return largest // (2 * int(np.prod(self.shape)) * self.element_size)

    # ----- reading --------------------------------------------------------------------------------------

    def find(self, ids32: np.ndarray, start: int, limit: int, past: int | None = None) -> tuple[Path | None, int]:
        """The file whose segment starts at `start` and continues `ids32` furthest (short of `limit`), and by
        how many tokens; with `past`, only one that continues them beyond position `past`. Reads the heads
        (header and ids) of files it has not seen, once per process."""
        past = start if past is None else past
        if not start <= past < limit:
            return None, 0
        start_key = prefix_key(ids32[:start])
        best, most = None, past - start
        for name, ids in self._heads_in(start_key, start).items():
            if len(ids) <= past or ids[past] != ids32[past]:
                continue
            k = continued(ids, start, ids32, limit)
            if k > most:
                best, most = self.model_folder / start_key / name, k
        return (best, most) if best is not None else (None, 0)

    def _heads_in(self, start_key: str, start: int) -> dict[str, np.ndarray]:
        folder = self.model_folder / start_key
        try:
            stamp = os.stat(folder).st_mtime_ns
        except OSError:
            return {}
        with self._lock:
            known = self._heads.get(start_key)
            if known is not None:
                known = (known[0], dict(known[1]))  # (a copy: other threads may forget files meanwhile)
        if known is not None and known[0] == stamp:
            return known[1]
        try:
            names = [n for n in os.listdir(folder) if n.endswith(".kv")]
        except OSError:
            return {}
        heads = {}
        for name in names:
            if known is not None and name in known[1]:
                heads[name] = known[1][name]
                continue
            path = folder / name
            try:
                layout, ids = self._head(path)
                if layout.header["start"] != start:
                    raise Rejected(f"it starts at {layout.header['start']}, its folder at {start}")
            except FileNotFoundError:
                continue
            except Rejected as e:
                self._reject(path, str(e))
                continue
            heads[name] = ids
        with self._lock:
            self._heads[start_key] = (stamp, dict(heads))
        return heads

    def read(self, path: Path) -> Segment | None:
        """The segment of a file, its K/V mapped from the file (not copied), after every check; None when the
        file is gone or fails one (then it is removed with a warning). Marks the file used (LRU)."""
        try:
            with open(path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except FileNotFoundError:
            self._forget(path)
            return None
        except ValueError:  # an empty file cannot be mapped
            self._reject(path, "it is empty")
            return None
        if MADV_POPULATE_READ is not None:
            try:  # the page tables in one call, not a fault per few pages as the checks read them
                mapped.madvise(MADV_POPULATE_READ)
            except OSError:
                pass
        try:
            layout = self._check(mapped)
        except Rejected as e:
            self._reject(path, str(e))
            return None
        h = layout.header
        ids = np.frombuffer(mapped, dtype=np.int32, count=h["end"], offset=layout.ids_at).copy()
        layers, heads, dim = self.shape
        kv = torch.frombuffer(mapped, dtype=self.dtype, count=layout.payload_bytes // self.element_size,
                              offset=layout.payload_at)
        try:
            os.utime(path)
        except OSError:
            pass
        with self._lock:
            self.bytes_read += layout.size
        return Segment.of(ids, h["start"], kv.view(layers, 2, h["end"] - h["start"], heads, dim))

    def _head(self, path: Path) -> tuple[Layout, np.ndarray]:
        with open(path, "rb") as f:
            def read(at: int, n: int) -> bytes:
                f.seek(at)
                return f.read(n)

            layout = self._layout(read, os.fstat(f.fileno()).st_size)
            raw = read(layout.ids_at, 4 * layout.header["end"])
        return layout, np.frombuffer(raw, dtype=np.int32)

    def _layout(self, read, size: int) -> Layout:
        """The file's layout from its header (`read(offset, n)` gives its bytes), checked against this
        model and against the file's size."""
        first = read(0, len(MAGIC) + 4)
        if len(first) < len(MAGIC) + 4 or first[:len(MAGIC)] != MAGIC:
            raise Rejected("it is not an lmq K/V file (or its start is damaged)")
        (n,) = struct.unpack("<I", first[len(MAGIC):])
        try:
            if n > 1 << 16:
                raise ValueError
            header = json.loads(read(len(first), n).decode())
            start, end = int(header["start"]), int(header["end"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise Rejected("its header is damaged") from None
        for field, value in (("model", self.key), ("dtype", self.description["dtype"]), ("layout", self.layout),
                             ("shape", list(self.shape))):
            if header.get(field) != value:
                raise Rejected(f"it is for another {field} ({header.get(field)!r}, not {value!r})")
        if not 0 <= start < end:
            raise Rejected("its header is damaged")
        layout = Layout.of(header, n, self.element_size)
        if size != layout.size:
            raise Rejected(f"it is truncated or torn ({size} bytes, its header says {layout.size})")
        return layout

    def _check(self, mapped: mmap.mmap) -> Layout:
        layout = self._layout(lambda at, n: mapped[at:at + n], len(mapped))
        magic, crc, _, payload_hash, _ = TRAILER.unpack_from(mapped, layout.size - TRAILER.size)
        if magic != END_MAGIC:
            raise Rejected("its end is damaged (torn or truncated)")
        if zlib.crc32(mapped[:layout.payload_at]) != crc:
            raise Rejected("its header or token ids fail their checksum")
        payload = np.frombuffer(mapped, dtype=np.uint8, count=_pad(layout.payload_bytes, BLOCK),
                                offset=layout.payload_at)
        if payload_checksum(payload) != payload_hash:
            raise Rejected("its K/V fail their checksum")
        return layout

    # ----- writing --------------------------------------------------------------------------------------

    def write(self, seg: Segment, start_key: str) -> bool:
        """Queue `seg` to be written (by the writer thread, once `seg.ready`); False where `wants` says no."""
        name = (start_key, seg.key)
        if not self.wants(start_key, seg.key, seg.nbytes):
            return False
        with self._lock:
            if name in self._pending:
                return False
            self._pending.add(name)
            self._pending_bytes += seg.nbytes
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._write_loop, name="lmq-disk-tier", daemon=True)
            self._writer.start()
        self._jobs.put((seg, start_key))
        return True

    def flush(self) -> None:
        """Wait until every queued file is written."""
        if self._writer is not None and self._writer.is_alive():
            self._jobs.join()

    def _write_loop(self) -> None:
        while True:
            seg, start_key = self._jobs.get()
            try:
                self._write(seg, start_key)
            except Exception as e:  # noqa: BLE001 - a cache file that cannot be written is no error
                warnings.warn(f"lmq: could not write a K/V cache file under {self.folder}: {e}", CacheFileWarning,
                              stacklevel=1)
            finally:
                with self._lock:
                    self._pending.discard((start_key, seg.key))
                    self._pending_bytes -= seg.nbytes
                self._jobs.task_done()

    def _header(self, seg: Segment) -> dict:
        return {"model": self.key, "dtype": self.description["dtype"], "layout": self.layout,
                "shape": list(self.shape), "start": seg.start, "end": seg.end}

    def _write(self, seg: Segment, start_key: str) -> None:
        final = self.path(start_key, seg.key)
        if final.exists():
            return
        seg.wait()
        raw = json.dumps(self._header(seg)).encode()
        layout = Layout.of(self._header(seg), len(raw), self.element_size)
        head = bytearray(layout.payload_at)
        head[:len(MAGIC) + 4 + len(raw)] = MAGIC + struct.pack("<I", len(raw)) + raw
        head[layout.ids_at:layout.ids_at + 4 * seg.end] = seg.ids.tobytes()
        payload = seg.kv.contiguous().reshape(-1).view(torch.uint8).numpy()
        assert len(payload) == layout.payload_bytes
        payload_hash = payload_checksum(payload)
        tmp = self.folder / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        part = tmp / f"{_HOST}-{os.getpid()}-{threading.get_ident()}-{seg.key}.part"
        try:
            with open(part, "wb") as f:
                f.write(head)
                f.write(memoryview(payload))
                f.write(bytes(_pad(len(payload), BLOCK) - len(payload)))
                f.write(TRAILER.pack(END_MAGIC, zlib.crc32(head), 0, payload_hash, 0))
            with folder_lock(self.folder):
                if final.exists() or layout.size > self.budget_bytes:
                    return
                # room first: making it removes a start folder its last file leaves, this file's maybe
                _make_room(self.folder, self.budget_bytes - layout.size)
                final.parent.mkdir(parents=True, exist_ok=True)
                described = self.model_folder / "model.json"
                if not described.exists():
                    described.write_text(json.dumps({"key": self.key, **self.description}, indent=1))
                os.replace(part, final)
        finally:
            part.unlink(missing_ok=True)
        with self._lock:
            self.bytes_written += layout.size
            self.files_written += 1

    def _forget(self, path: Path) -> None:
        """Drop a file from the heads read (it is gone)."""
        with self._lock:
            known = self._heads.get(path.parent.name)
            if known is not None:
                known[1].pop(path.name, None)

    def _reject(self, path: Path, reason: str) -> None:
        self._forget(path)
        with self._lock:
            self.rejected += 1
        warnings.warn(f"lmq: ignored the K/V cache file {path}: {reason}; its tokens are computed again",
                      CacheFileWarning, stacklevel=2)
        try:
            path.unlink()
        except OSError:
            pass


# ----- the folder as a whole (the writer's eviction; `lmq cache ls | clear`) ----------------------------------

_process_lock = threading.RLock()


@contextmanager
def folder_lock(folder: Path):
    """The folder's exclusive lock (flock on `.lock`): held while files are put in place or removed."""
    folder.mkdir(parents=True, exist_ok=True)
    with _process_lock, open(folder / ".lock", "a+b") as f:
        if fcntl is not None:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _entries(folder: Path) -> list[tuple[float, int, Path]]:
    """Every segment file under the folder: (last used, bytes, path)."""
    return [e for model in _models(folder) for e in _files(model)]


def _files(model: Path) -> list[tuple[float, int, Path]]:
    """One model's segment files: (last used, bytes, path)."""
    out = []
    for start in _subfolders(model):
        try:
            with os.scandir(start) as it:
                for e in it:
                    if e.name.endswith(".kv") and _KEY.fullmatch(e.name[:-3]):
                        try:
                            st = e.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        out.append((st.st_mtime, st.st_size, Path(e.path)))
        except (FileNotFoundError, NotADirectoryError):
            continue
    return out


_KEY = re.compile(r"[0-9a-f]{32}")  # a model's, a start's or an end's name (`model_key`, `prefix_key`)


def _models(folder: Path) -> list[Path]:
    """The model folders under the folder: lmq's names, each with its model.json."""
    return [m for m in _subfolders(folder) if (m / "model.json").is_file()]


def _subfolders(folder: Path) -> list[Path]:
    """The folders under `folder` with lmq's names (`_KEY`)."""
    try:
        with os.scandir(folder) as it:
            return [Path(e.path) for e in it if _KEY.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _make_room(folder: Path, budget: int) -> None:
    """(Under the folder's lock) remove the least recently used files until at most `budget` bytes remain;
    and temp files that dead writers left."""
    entries = _entries(folder)
    used = sum(size for _, size, _ in entries)
    if used > budget:
        for _, size, path in sorted(entries):
            if used <= budget:
                break
            try:
                path.unlink()
                used -= size
            except FileNotFoundError:
                used -= size
            try:
                path.parent.rmdir()  # (only if that was its last file)
            except OSError:
                pass
    now = time.time()
    try:
        with os.scandir(folder / "tmp") as it:
            for e in it:
                try:
                    if _left(e.name) or now - e.stat().st_mtime > STALE_TEMP_SECONDS:
                        os.unlink(e.path)
                except OSError:
                    pass
    except FileNotFoundError:
        pass


def _left(name: str) -> bool:
    """Is the temp file `name` one a process of this host left when it died (killed while it wrote)?"""
    host, pid, *_ = [*name.rsplit("-", 3), "", ""]
    if host != _HOST or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # (alive, another user's)
        return False
    return False


def usage(folder: Path) -> list[ModelUsage]:
    """The models with files in the folder, each with its description, file count and bytes."""
    out = []
    for model in _models(folder):
        try:
            description = json.loads((model / "model.json").read_text())
        except (OSError, ValueError):
            description = {}
        files = [size for _, size, _ in _files(model)]
        out.append(ModelUsage(model.name, description, len(files), sum(files)))
    return sorted(out, key=lambda u: -u.bytes)


def clear(folder: Path, model: str | None = None) -> tuple[int, int]:
    """Remove every model's files (or those of the model whose key or name starts with `model`): its segment
    files, then its start folders and its model folder where nothing else is in them; returns (files, bytes)
    removed."""
    files = nbytes = 0
    if not _models(folder):  # (none, or no folder: a folder lmq wrote nothing in gets no lock file either)
        return 0, 0
    with folder_lock(folder):
        for u in usage(folder):
            if model is not None and not (u.key.startswith(model) or str(u.description.get("name", "")) == model):
                continue
            where = folder / u.key
            for _, size, path in _files(where):
                try:
                    path.unlink()
                except FileNotFoundError:
                    continue
                files += 1
                nbytes += size
            for start in _subfolders(where):
                _remove_empty(start)
            (where / "model.json").unlink(missing_ok=True)
            _remove_empty(where)
    return files, nbytes


def _remove_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:  # (not empty: what is left is not lmq's)
        pass
