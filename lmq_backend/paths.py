"""Where lmq keeps what it builds once per machine: converted models, compiled CPU kernels."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$LMQ_CACHE_DIR, else $XDG_CACHE_HOME/lmq, else ~/.cache/lmq."""
    if os.environ.get("LMQ_CACHE_DIR"):
        return Path(os.environ["LMQ_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lmq"
