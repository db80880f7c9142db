"""A model folder's K-major weights kept on disk (engine/fused/weight_cache.py, issue #16's start-up): a
backend loaded through an entry has exactly the folder's weights and gives the same tokens; an entry is
written once, not used when the folder's weights change or it cannot be read, and removed with its folder."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import lmq_backend as lmq
from lmq_backend.engine.fused import weight_cache

from folders import tiny_folder  # noqa: F401 - a fixture

QUERY = '"Once upon a time, in a land far away,[X]" where len(TOKENS(X)) < 9'


@pytest.fixture
def entries(tmp_path, monkeypatch):
    """The cache's folder of entries, in a temporary cache directory."""
    monkeypatch.setattr(weight_cache, "cache_dir", lambda: tmp_path / "cache")
    return tmp_path / "cache" / "weights"


def load(folder):
    return lmq.HFBackend(str(folder), device="cpu", dtype="float32")


def same_weights(backend, folder) -> bool:
    state = backend.model.state_dict()
    return all(torch.equal(state[k], v) for k, v in load_file(str(folder / "model.safetensors")).items())


async def test_a_backend_through_the_entry_is_the_backend_from_the_folder(tiny_folder, entries, monkeypatch):  # noqa: F811
    first = load(tiny_folder)  # writes the entry
    [entry] = entries.iterdir()
    written = entry.stat().st_mtime_ns
    monkeypatch.setattr(weight_cache, "_write", lambda *a: pytest.fail("the entry was written again"))
    read = []
    monkeypatch.setattr(weight_cache, "_read", lambda *a, f=weight_cache._read: read.append(f(*a)) or read[-1])
    second = load(tiny_folder)
    assert read[0] is not None and entry.stat().st_mtime_ns == written
    assert same_weights(first, tiny_folder) and same_weights(second, tiny_folder)
    for backend in (first, second):
        w = backend.model.model.layers[0].mlp.down_proj.weight
        assert w.stride() == (1, w.shape[0])  # K-major: the CPU layout's
    a = await lmq.compile(QUERY, model=first)()
    b = await lmq.compile(QUERY, model=second)()
    assert a["X"] == b["X"] and a.prompt == b.prompt


def test_changed_or_unreadable_entries_are_written_again(tiny_folder, entries, tmp_path):  # noqa: F811
    folder = tmp_path / "model"
    shutil.copytree(tiny_folder, folder)
    load(folder)
    [entry] = entries.iterdir()
    entry.write_bytes(b"not safetensors")
    assert same_weights(load(folder), folder)
    assert entry.stat().st_size > 1000  # written again
    weights = folder / "model.safetensors"
    state = load_file(str(weights))
    name = "model.layers.0.self_attn.q_proj.weight"
    state[name] = state[name] + 1
    from safetensors.torch import save_file

    save_file(state, str(weights), metadata={"format": "pt"})
    os.utime(weights, ns=(1, 1))  # a new key even where the file system's clock is coarse
    changed = load(folder)
    assert same_weights(changed, folder)  # the new weights, not the entry's


def test_an_entry_goes_with_its_folder(tiny_folder, entries, tmp_path):  # noqa: F811
    gone = tmp_path / "gone"
    shutil.copytree(tiny_folder, gone)
    load(gone)
    shutil.rmtree(gone)
    load(tiny_folder)
    [entry] = entries.iterdir()
    with open(entry, "rb") as f:
        assert str(tiny_folder.resolve()).encode() in f.read(4096)
