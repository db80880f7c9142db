"""A model folder's CPU layout kept on disk: the fused step's K-major buffers, memory-mapped and taken as
they are at the next load (no copy, no transpose, no fresh memory to fault in).

The fused step's CPU layout (`weights.py`) keeps every projection K-major: q/k/v and gate/up stacked, o and
down alone, and a K-major copy of a tied LM head. Built from the row-major weights that `from_pretrained`
loads, that is hundreds of copies and a fresh copy of every weight (slower still when another process holds
the cores: every copy is a parallel region whose second thread waits for a core). `laid_out(model, folder)` takes the buffers from `<cache_dir>/weights/<entry>`
(`prepared`, see `decoder_weights`) and writes the entry when it is missing or stale. An entry changes no
value: the layout's buffers hold copies of the folder's weights. Its file: a JSON header (key, folder, each
buffer's dtype, shape, offset and row stride), then each buffer at a page-aligned offset, mapped as it is.

One entry per folder and dtype. Its key: every file of the folder (name, size, mtime, ctime, inode: a
rewritten or replaced file changes it, an `os.utime` back to the old mtime too), the dtype, the source of
`weights.py` and of this file (a new layout or format), and torch's version. A missing, stale or unreadable
entry is written again from the layout just built; a failure to write is ignored. Only for a model just
loaded from `folder` whose weights nothing changed since (the caller's promise: `HFBackend(path)`), on the
CPU, not quantized (`QuantizedLinear` layouts are stacked copies of their own).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from ...paths import cache_dir
from ..quantize import QuantizedLinear
from . import weights as layout

HOLDS = "layout"
MAGIC, SUFFIX, ALIGN = b"LMQ-LAY1", ".lmqw", 4096  # (an entry: magic, header length, JSON header, buffers)


def laid_out(model, folder: Path):
    """`decoder_weights(model)`, from the folder's entry where it has a valid one (else it is written)."""
    if next(model.parameters()).device.type != "cpu" or any(isinstance(m, QuantizedLinear) for m in model.modules()):
        return layout.decoder_weights(model)
    path, key = _entry(model, folder)
    w = layout.decoder_weights(model, _read(path, key))
    if w.k_major and w.adopted != set(w.k_major):
        _write(path, key, w.k_major, folder)
    return w


def _entry(model, folder: Path) -> tuple[Path, str]:
    """The entry's path and key."""
    dtype = str(next(model.parameters()).dtype)
    files = []
    for f in sorted(folder.iterdir()):
        if f.is_file():
            st = f.stat()
            files.append((f.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    code = hashlib.sha256(Path(layout.__file__).read_bytes() + Path(__file__).read_bytes()).hexdigest()
    key = hashlib.sha256(json.dumps([dtype, files, code, torch.__version__]).encode()).hexdigest()[:32]
    place = hashlib.sha256(json.dumps([str(folder.resolve()), dtype]).encode()).hexdigest()[:32]
    return cache_dir() / "weights" / f"{place}{SUFFIX}", key


def _read(path: Path, key: str) -> dict[str, torch.Tensor] | None:
    """The entry's buffers ([N, K] K-major views of the file, mapped privately: a write copies the page and
    never reaches the file); None when it is missing, stale or unreadable."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
            if len(head) < 16 or head[:8] != MAGIC:
                return None
            header = json.loads(f.read(int.from_bytes(head[8:], "little")))
        if header.get("key") != key or header.get("holds") != HOLDS:
            return None
        size = path.stat().st_size
        storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
        start = _aligned(16 + int.from_bytes(head[8:], "little"))
        out = {}
        for name, (dtype_name, shape, offset, ld) in header["tensors"].items():
            dtype = getattr(torch, dtype_name)
            item = torch.empty(0, dtype=dtype).element_size()
            k, n = shape
            if start + offset + k * ld * item > size or offset % ALIGN or ld < n:
                return None
            t = torch.empty(0, dtype=dtype).set_(storage, (start + offset) // item, (k, n), (ld, 1))
            out[name] = t.t()
        return out
    except Exception:  # noqa: BLE001 - an unreadable entry is written again
        return None


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _write(path: Path, key: str, buffers: dict[str, torch.Tensor], folder: Path) -> None:
    """[K, N] row-major (each K-major buffer's transpose), each at a page-aligned offset: the kernels read
    the mapped weights as aligned as freshly allocated ones (safetensors' 8-byte alignment made lmq's
    small-M GEMM ~14% slower)."""
    tensors = {}
    offsets, offset = {}, 0
    for name, b in buffers.items():
        k, n, ld = b.shape[1], b.shape[0], b.stride(1)   # its rows as laid out, padding included
        tensors[name] = b.t().as_strided((k, ld), (ld, 1))
        offsets[name] = [str(b.dtype).removeprefix("torch."), [k, n], offset, ld]
        offset = _aligned(offset + tensors[name].numel() * b.element_size())
    header = json.dumps({"key": key, "folder": str(folder.resolve()), "holds": HOLDS, "tensors": offsets}).encode()
    start = _aligned(16 + len(header))
    tmp = path.with_name(f"{path.stem}.partial-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(MAGIC + len(header).to_bytes(8, "little") + header)
            for name, t in tensors.items():
                f.seek(start + offsets[name][2])
                f.write(t.contiguous().view(torch.uint8).numpy().data)
            f.truncate(start + offset)
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001 - a cache that cannot be written is only slower
        tmp.unlink(missing_ok=True)
    _prune(path.parent)


def _prune(directory: Path) -> None:
    """Remove the entries of folders that no longer exist (test runs and deleted models leave them), and
    entries of older formats (`*.safetensors`: each Linear's transpose, then the layout unaligned)."""
    for entry in directory.glob("*.safetensors"):
        entry.unlink(missing_ok=True)
    for entry in directory.glob(f"*{SUFFIX}"):
        try:
            with open(entry, "rb") as f:
                head = f.read(16)
                meta = json.loads(f.read(int.from_bytes(head[8:], "little"))) if head[:8] == MAGIC else {}
            folder = meta.get("folder")
            if meta.get("holds") != HOLDS or not (folder and Path(folder).is_dir()):
                entry.unlink()
        except Exception:  # noqa: BLE001 - unreadable or removed meanwhile: left to its own folder's load
            pass
