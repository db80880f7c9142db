"""Fingerprints of a model's weights: what the disk tier's files are keyed by (with dtype, device and layout).

`folder_fingerprint(folder)`: the weight and config files of a model folder, each by name, size, mtime and
a sample of its bytes (its first and last 64 KiB and 16 blocks of 4 KiB between): a changed file changes its
mtime, and a file replaced by another differs in size or in sampled bytes. Reading ~200 KiB a file keeps it
fast for any model size.

`state_fingerprint(model)`: a model object's parameters and buffers, each by name, shape, dtype and a
strided sample of at most 4,096 of its values. A model in memory can be changed in place with no trace, so
`HFBackend.from_model` keeps its disk tier off unless asked (`disk_cache=`).
"""
from __future__ import annotations

import hashlib
import platform
from pathlib import Path

import torch

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json")
EDGE, BLOCK, BLOCKS, SAMPLES = 1 << 16, 1 << 12, 16, 4096


def folder_fingerprint(*paths: Path) -> str:
    """The files of model folders (or single weight files, e.g. a GGUF file the weights came from)."""
    h = hashlib.blake2b(digest_size=16)
    for path in paths:
        path = Path(path)
        files = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES) if path.is_dir() else [path]
        for f in files:
            st = f.stat()
            h.update(f"{f.name}|{st.st_size}|{st.st_mtime_ns}|".encode())
            with open(f, "rb") as fh:
                for at, n in _samples(st.st_size):
                    fh.seek(at)
                    h.update(fh.read(n))
    return h.hexdigest()


def _samples(size: int) -> list[tuple[int, int]]:
    """(offset, bytes) read of a file: all of a small one; else both ends and blocks spread between."""
    if size <= 2 * EDGE + BLOCKS * BLOCK:
        return [(0, size)]
    step = (size - 2 * EDGE - BLOCK) // (BLOCKS - 1)
    return [(0, EDGE), *((EDGE + i * step, BLOCK) for i in range(BLOCKS)), (size - EDGE, EDGE)]


def state_fingerprint(model: torch.nn.Module) -> str:
    """A model object's parameters and buffers (see the module docstring), and its config."""
    h = hashlib.blake2b(digest_size=16)
    config = getattr(model, "config", None)
    h.update(type(model).__qualname__.encode())
    if config is not None and hasattr(config, "to_json_string"):
        h.update(config.to_json_string(use_diff=False).encode())
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
            flat = t.detach().reshape(-1)
            if flat.numel():
                step = max(flat.numel() // SAMPLES, 1)
                sample = flat[::step][:SAMPLES].contiguous().cpu()
                h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def describe_device(device: torch.device) -> str:
    """The device as part of a key: K/V computed on another kind of device may differ in rounding, and so may K/V
    a CPU computed with other kernels (lmq's or torch's: `LMQ_CPU_KERNELS`; built for another instruction set:
    the host's, or `LMQ_CPU_MARCH`)."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        from lmq_kernels.cpu import library, toolchain

        return f"cpu:{platform.machine()}:{toolchain.isa()}:kernels {library.mode()}, {library.target()}"
    return f"{device.type}:{platform.machine()}"
