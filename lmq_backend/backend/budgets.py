"""The backend's memory settings: byte counts as users write them (`cache_budget=`, `kv_budget=`), and the K/V
store's size when the user names none."""
from __future__ import annotations

import os
import re

import torch

from ..errors import LMQBackendError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(budget: int | float | str, name: str = "cache_budget") -> int:
    """A byte count from 1_000_000, "512MB", "2GB" or "1.5 GiB" (`name`: the setting, for the error)."""
    if isinstance(budget, (int, float)):
        if budget < 0:
            raise LMQBackendError(f"{name} must be >= 0, got {budget}")
        return int(budget)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?I?B?)\s*", str(budget).upper())
    if not m or m.group(2) not in _UNITS:
        raise LMQBackendError(f"cannot read {name} {budget!r}: use bytes or a string like '2GB'")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


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
