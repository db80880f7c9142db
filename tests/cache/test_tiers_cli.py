"""The disk tier as a command-line user meets it: a second `lmq run` in a new process reads what the first one
wrote (and answers the same), `lmq cache ls` shows it, `lmq cache clear` removes it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sentiment.lmq"


def lmq(*args: str, folder: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "lmq_backend.cli", *args], capture_output=True, text=True,
                         timeout=900, env={**os.environ, "LMQ_DISK_CACHE": str(folder)})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_a_second_lmq_run_starts_warm_from_the_disk_tier(tmp_path):
    folder = tmp_path / "kv"
    run = ("run", str(EXAMPLE), "--var", "review=The soup was cold and the bread was stale.")
    first = lmq(*run, folder=folder)
    listed = json.loads(lmq("cache", "ls", "--json", folder=folder))
    assert listed["folder"] == str(folder) and len(listed["models"]) == 1
    model = listed["models"][0]
    assert model["files"] >= 1 and model["bytes"] > 0 and model["dtype"] == "float32"
    files = sorted(folder.glob("*/*/*.kv"))
    assert len(files) == model["files"]
    for f in files:
        os.utime(f, (1, 1))  # long ago: a read marks a file used (LRU), which shows here
    assert lmq(*run, folder=folder) == first
    assert any(f.stat().st_mtime > time.time() - 3600 for f in files)
    assert "1 model" in lmq("cache", "ls", folder=folder)
    for name in ("nosuchmodel", ""):  # a name that is not cached: an error listing what is, nothing removed
        out = subprocess.run([sys.executable, "-m", "lmq_backend.cli", "cache", "clear", "--model", name],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "LMQ_DISK_CACHE": str(folder)})
        assert out.returncode != 0 and "no cached model" in out.stderr and model["key"][:12] in out.stderr
    assert f"removed {model['files']} files" in lmq("cache", "clear", "--model", "default", folder=folder)
    assert "no cached K/V" in lmq("cache", "ls", folder=folder)
