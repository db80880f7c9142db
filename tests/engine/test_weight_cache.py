"""A model folder's CPU layout kept on disk (engine/fused/weight_cache.py, issue #16's start-up): a backend
loaded through an entry takes every K-major buffer from it, has exactly the folder's weights and gives the
same tokens; an entry is written once, never trusted once the folder, the layout's code, torch or the dtype
changed, never written through by the model, and removed with its folder."""
from __future__ import annotations

import hashlib
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import lmq_backend as lmq
from lmq_backend.engine.fused import weight_cache
from lmq_backend.engine.fused.weights import decoder_weights

from support.folders import save_tiny_folder, tiny_folder  # noqa: F401 - a fixture

QUERY = '"Once upon a time, in a land far away,[X]" where len(TOKENS(X)) < 9'
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture
def entries(tmp_path, monkeypatch):
    """The cache's folder of entries, in a temporary cache directory."""
    monkeypatch.setattr(weight_cache, "cache_dir", lambda: tmp_path / "cache")
    return tmp_path / "cache" / "weights"


@pytest.fixture(scope="module")
def tied_folder(tmp_path_factory):
    """A tiny Llama whose LM head is its embedding (as the default model's): the layout's own K-major copy."""
    folder = save_tiny_folder(tmp_path_factory.mktemp("tied") / "model")
    config = (folder / "config.json").read_text().replace('"tie_word_embeddings": false', '"tie_word_embeddings": true')
    (folder / "config.json").write_text(config)
    state = load_file(str(folder / "model.safetensors"))
    del state["lm_head.weight"]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def load(folder, dtype="float32"):
    return lmq.HFBackend(str(folder), device="cpu", dtype=dtype)


def same_weights(backend, folder) -> bool:
    state = backend.model.state_dict()
    return all(torch.equal(state[k], v.to(state[k].dtype)) for k, v in load_file(str(folder / "model.safetensors")).items())


def adopted_all(backend) -> bool:
    w = decoder_weights(backend.model)
    return bool(w.k_major) and w.adopted == set(w.k_major)


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("tied", [False, True])
async def test_a_backend_through_the_entry_is_the_backend_from_the_folder(tiny_folder, tied_folder, tied,  # noqa: F811
                                                                          entries, monkeypatch):
    folder = tied_folder if tied else tiny_folder
    first = load(folder)  # writes the entry
    [entry] = entries.iterdir()
    written = entry.stat().st_mtime_ns
    assert not adopted_all(first)
    monkeypatch.setattr(weight_cache, "_write", lambda *a: pytest.fail("the entry was written again"))
    second = load(folder)
    assert adopted_all(second) and entry.stat().st_mtime_ns == written
    assert ("lm_head.tied" in decoder_weights(second.model).k_major) == tied
    # as aligned as fresh memory (the kernels read misaligned weights slower)
    assert all(t.data_ptr() % 64 == 0 for t in decoder_weights(second.model).k_major.values())
    assert same_weights(first, folder) and same_weights(second, folder)
    for backend in (first, second):
        w = backend.model.model.layers[0].mlp.down_proj.weight
        assert w.stride() == (1, w.shape[0])  # K-major: the CPU layout's
        head = decoder_weights(backend.model).lm_head   # [49152, 64]: rows 192 KB apart, padded off 4 KB multiples
        assert head.stride() == (1, head.shape[0] + 16) and head.shape == (49152, 64)
    a = await lmq.compile(QUERY, model=first)()
    b = await lmq.compile(QUERY, model=second)()
    assert a["X"] == b["X"] and a.prompt == b.prompt


def test_writes_to_the_model_never_reach_the_entry(tied_folder, entries):
    load(tied_folder)
    [entry] = entries.iterdir()
    before = digest(entry)
    backend = load(tied_folder)
    assert adopted_all(backend)
    state = {k: v + 1 for k, v in backend.model.state_dict().items()}
    backend.model.load_state_dict(state)  # into the adopted buffers (a private mapping of the entry)
    with torch.no_grad():
        backend.model.model.layers[0].self_attn.o_proj.weight.mul_(2)
    assert digest(entry) == before
    again = load(tied_folder)
    assert adopted_all(again) and same_weights(again, tied_folder)


def test_a_weight_file_rewritten_with_its_old_times_is_not_trusted(tiny_folder, entries, tmp_path):  # noqa: F811
    folder = tmp_path / "model"
    shutil.copytree(tiny_folder, folder)
    load(folder)
    weights = folder / "model.safetensors"
    st = weights.stat()
    state = load_file(str(weights))
    state[Q_PROJ] = state[Q_PROJ] + 1  # same size, other values
    save_file(state, str(weights), metadata={"format": "pt"})
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # the old times: only size and mtime would match
    assert weights.stat().st_size == st.st_size
    changed = load(folder)
    assert not adopted_all(changed) and same_weights(changed, folder)  # the new weights, not the entry's
    assert torch.equal(changed.model.state_dict()[Q_PROJ], state[Q_PROJ])


def test_changed_or_unreadable_entries_are_written_again(tiny_folder, entries, tmp_path):  # noqa: F811
    folder = tmp_path / "model"
    shutil.copytree(tiny_folder, folder)
    load(folder)
    [entry] = entries.iterdir()
    entry.write_bytes(b"not an entry")
    assert same_weights(load(folder), folder)
    assert entry.stat().st_size > 1000  # written again
    assert adopted_all(load(folder))


def test_the_key_follows_the_folder_the_layout_code_torch_and_the_dtype(tiny_folder, entries, tmp_path,  # noqa: F811
                                                                       monkeypatch):
    folder = tmp_path / "model"
    shutil.copytree(tiny_folder, folder)
    model = load(folder).model
    path, key = weight_cache._entry(model, folder)
    (folder / "config.json").write_text((folder / "config.json").read_text() + "\n")  # any file of the folder
    assert weight_cache._entry(model, folder) != (path, key)
    path, key = weight_cache._entry(model, folder)
    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", "0.0.0")
        assert weight_cache._entry(model, folder)[1] != key
    edited = tmp_path / "weights.py"
    edited.write_text(open(weight_cache.layout.__file__).read() + "\n# a change to the layout\n")
    with monkeypatch.context() as m:
        m.setattr(weight_cache.layout, "__file__", str(edited))
        assert weight_cache._entry(model, folder)[1] != key
    bf16 = load(folder, dtype="bfloat16")
    other_path, other_key = weight_cache._entry(bf16.model, folder)
    assert other_path != path and other_key != key
    assert same_weights(bf16, folder)


def test_an_entry_goes_with_its_folder(tiny_folder, entries, tmp_path):  # noqa: F811
    gone = tmp_path / "gone"
    shutil.copytree(tiny_folder, gone)
    load(gone)
    shutil.rmtree(gone)
    load(tiny_folder)
    [entry] = entries.iterdir()
    with open(entry, "rb") as f:
        assert str(tiny_folder.resolve()).encode() in f.read(4096)
