"""A model folder's Linear weights stored K-major on disk, so that the CPU layout (`weights.py`) starts from
copies instead of transposes.

The fused step's CPU layout keeps every projection K-major; made from the row-major weights that
`from_pretrained` loads, that is a transposing copy of each matrix (1.4 of 2.3 CPU s of a warm
`HFBackend("default")`, SmolLM2-135M in float32). `use_k_major(model, folder)` re-points the model's
Linear weights to K-major views of `<cache_dir>/weights/<entry>.safetensors` (memory-mapped); the layout
then copies them with matching strides. An entry changes no value, only strides: the layout reads the
numbers it would read from the folder's weights, whatever it does with them.

One entry per folder, dtype and set of Linear modules (their names and shapes), replaced when its key
changes (also the folder's weight files' names, sizes and mtimes, and `FORMAT`) and removed with its
folder. Only for a model just loaded from `folder` whose Linear weights nothing changed since (the caller's
promise: `HFBackend(path)`; modules replaced by quantized ones are no longer Linear), on the CPU. A
missing, stale or unreadable entry is written again from the weights as loaded; a failure to write is
ignored.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from ...paths import cache_dir

FORMAT = 1  # what an entry holds: each Linear weight [N, K] saved as its transpose [K, N], contiguous


def _linears(model) -> dict[str, torch.nn.Linear]:
    """The model's Linear modules with a weight of their own (a head tied to the embedding is left out)."""
    embed = model.get_input_embeddings().weight
    return {name: m for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and m.weight.data_ptr() != embed.data_ptr()}


def _entry(model, folder: Path) -> tuple[Path, str] | None:
    """The entry's path and key, or None when the folder has no safetensors weights."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    dtype = str(next(model.parameters()).dtype)
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    shapes = [(n, tuple(m.weight.shape)) for n, m in _linears(model).items()]
    key = hashlib.sha256(json.dumps([FORMAT, dtype, stats, shapes]).encode()).hexdigest()[:32]
    place = hashlib.sha256(json.dumps([str(folder.resolve()), dtype, shapes]).encode()).hexdigest()[:32]
    return cache_dir() / "weights" / f"{place}.safetensors", key


def use_k_major(model, folder: Path) -> None:
    """Re-point the Linear weights of `model` (just loaded from `folder` and not changed since) to K-major
    views of the folder's cache entry, written first when it is missing or stale. Only on the CPU, whose
    layout stores them K-major (`weights.py`); elsewhere nothing changes."""
    if next(model.parameters()).device.type != "cpu":
        return
    linears = _linears(model)
    entry = _entry(model, folder) if linears else None  # (quantized models have other modules)
    if entry is None:
        return
    transposed = _read(entry, linears)
    if transposed is None:  # from the weights as loaded, never from a layout (which may change them)
        transposed = {name: m.weight.detach().t().contiguous() for name, m in linears.items()}
        _write(entry, transposed, folder)
    with torch.no_grad():
        for name, module in linears.items():
            module.weight.data = transposed[name].t()  # [N, K], K-major


def _read(entry: tuple[Path, str], linears: dict) -> dict[str, torch.Tensor] | None:
    """The entry's tensors, memory-mapped; None when it is missing, stale or unreadable."""
    from safetensors import safe_open

    path, key = entry
    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("key") != key:
                return None
            return {name: f.get_tensor(name) for name in linears}
    except Exception:  # noqa: BLE001 - an unreadable entry is written again
        return None


def _write(entry: tuple[Path, str], tensors: dict[str, torch.Tensor], folder: Path) -> None:
    from safetensors.torch import save_file

    path, key = entry
    tmp = path.with_name(f"{path.stem}.partial-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata={"key": key, "folder": str(folder.resolve())})
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001 - a cache that cannot be written is only slower
        tmp.unlink(missing_ok=True)
    _prune(path.parent)


def _prune(directory: Path) -> None:
    """Remove the entries of folders that no longer exist (test runs and deleted models leave them)."""
    from safetensors import safe_open

    for entry in directory.glob("*.safetensors"):
        try:
            with safe_open(str(entry), framework="pt") as f:
                folder = (f.metadata() or {}).get("folder")
            if folder and not Path(folder).is_dir():
                entry.unlink()
        except Exception:  # noqa: BLE001 - unreadable or removed meanwhile: left to its own folder's load
            pass
