"""A model folder's CPU layout kept on disk: the fused step's K-major buffers, memory-mapped and taken as
they are at the next load (no copy, no transpose, no fresh memory to fault in).

The fused step's CPU layout (`weights.py`) keeps every projection K-major: q/k/v and gate/up stacked, o and
down alone, and a K-major copy of a tied LM head. Built from the row-major weights that `from_pretrained`
loads, that is ~420 copies and 540 MB of fresh memory for SmolLM2-135M in float32 (0.5 CPU s alone on a
quiet host, 2-2.5 s when another process holds the cores: every copy is a parallel region whose second
thread waits for a core). `laid_out(model, folder)` takes the buffers from `<cache_dir>/weights/<entry>`
(`prepared`, see `decoder_weights`) and writes the entry when it is missing or stale. An entry changes no
value: the layout's buffers hold copies of the folder's weights.

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

HOLDS = "layout"  # (entries of the first format held each Linear's transpose: removed by `_prune`)


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
    return cache_dir() / "weights" / f"{place}.safetensors", key


def _read(path: Path, key: str) -> dict[str, torch.Tensor] | None:
    """The entry's buffers ([N, K] K-major views of the memory-mapped file); None when it is missing, stale
    or unreadable."""
    from safetensors import safe_open

    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("key") != key:
                return None
            return {name: f.get_tensor(name).t() for name in f.keys()}
    except Exception:  # noqa: BLE001 - an unreadable entry is written again
        return None


def _write(path: Path, key: str, buffers: dict[str, torch.Tensor], folder: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f"{path.stem}.partial-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({name: t.t() for name, t in buffers.items()}, str(tmp),  # [K, N], contiguous
                  metadata={"key": key, "folder": str(folder.resolve()), "holds": HOLDS})
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001 - a cache that cannot be written is only slower
        tmp.unlink(missing_ok=True)
    _prune(path.parent)


def _prune(directory: Path) -> None:
    """Remove the entries of folders that no longer exist (test runs and deleted models leave them), and
    entries of an older format."""
    from safetensors import safe_open

    for entry in directory.glob("*.safetensors"):
        try:
            with safe_open(str(entry), framework="pt") as f:
                meta = f.metadata() or {}
            folder = meta.get("folder")
            if meta.get("holds") != HOLDS or not (folder and Path(folder).is_dir()):
                entry.unlink()
        except Exception:  # noqa: BLE001 - unreadable or removed meanwhile: left to its own folder's load
            pass
