"""The vocabulary index of a tokenizer folder, kept on disk: building it takes seconds, loading it ~0.1 s.

`vocab_index(tokenizer, size)` is `VocabIndex.for_tokenizer(tokenizer, size)`, loaded from
`<cache_dir>/vocab/<key>.pkl` when the tokenizer was loaded from a folder. The key is a hash of
everything the index is computed from: the folder's tokenizer files, `size`, the source of
`text/vocab.py` and of this file (a change to how the index is built or stored invalidates every entry),
the transformers and tokenizers versions (which decode the tokens), plus the Python and numpy versions
(pickle). A missing, stale or unreadable entry is rebuilt; a failure to write is ignored.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import sys
import threading
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..paths import cache_dir
from . import vocab as vocab_module
from .vocab import VocabIndex

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")
RUNTIME_ATTRS = ("tokenizer", "_lock", "_encode_cached")  # made again on load, never pickled


def vocab_index(tokenizer, size: int) -> VocabIndex:
    folder = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    if not folder.is_dir() or not (folder / "tokenizer.json").exists():
        return VocabIndex.for_tokenizer(tokenizer, size=size)
    path = cache_dir() / "vocab" / f"{cache_key(folder, size)}.pkl"
    index = _load(path, tokenizer)
    if index is None:
        index = VocabIndex.for_tokenizer(tokenizer, size=size)
        _save(index, path)
    return _memoize(tokenizer, size, index)


def cache_key(folder: Path, size: int) -> str:
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        f = folder / name
        if f.exists():
            h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(Path(vocab_module.__file__).read_bytes() + Path(__file__).read_bytes())
    h.update(f"{size}|{sys.version_info[:2]}|{np.__version__}|{_library_versions()}".encode())
    return h.hexdigest()[:32]


def _library_versions() -> str:
    """transformers' and tokenizers' versions: the tokens' bytes are what their decoding gives."""
    return "|".join(getattr(sys.modules.get(name), "__version__", "-") for name in ("transformers", "tokenizers"))


def _state(index: VocabIndex) -> dict:
    """The index's attributes, with `bytes_to_ids` as one flat array (pickling ~50k small arrays is slow)."""
    state = {k: v for k, v in vars(index).items() if k not in RUNTIME_ATTRS}
    keys = list(index.bytes_to_ids)
    arrays = [index.bytes_to_ids[k] for k in keys]
    state["bytes_to_ids"] = (keys, np.concatenate(arrays) if arrays else np.zeros(0, np.int64),
                             np.asarray([len(a) for a in arrays], dtype=np.int64))
    return state


def _save(index: VocabIndex, path: Path) -> None:
    try:
        data = pickle.dumps(_state(index), protocol=pickle.HIGHEST_PROTOCOL)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
        partial.write_bytes(data)
        partial.replace(path)
    except Exception:  # noqa: BLE001 - a cache that cannot be written is no error (the next load rebuilds)
        pass


def _load(path: Path, tokenizer) -> VocabIndex | None:
    try:
        state = pickle.loads(path.read_bytes())
        keys, flat, lengths = state["bytes_to_ids"]
    except Exception:  # noqa: BLE001 - missing or unreadable: rebuild
        return None
    flat.flags.writeable = False  # the arrays below are views of it (as the built ones, never modified)
    if (lengths == 1).all():
        arrays = list(flat.reshape(-1, 1))
    else:
        arrays = np.split(flat, np.cumsum(lengths)[:-1])
    state["bytes_to_ids"] = dict(zip(keys, arrays))
    index = VocabIndex.__new__(VocabIndex)
    index.__dict__.update(state)
    index.tokenizer = tokenizer
    index._lock = threading.Lock()
    index._encode_cached = lru_cache(maxsize=8192)(index._encode_tuple)
    return index


def _memoize(tokenizer, size: int, index: VocabIndex) -> VocabIndex:
    """Make `VocabIndex.for_tokenizer(tokenizer, size)` return `index` from now on."""
    memo = vocab_module._registry_lock
    with memo:
        try:
            per_size = tokenizer.__dict__.setdefault(vocab_module._ATTR, {})
        except AttributeError:
            return index
        return per_size.setdefault(size, index)
