"""A real model folder for tests of what loads from disk: a tiny random Llama and the default model's
tokenizer, written with `save_pretrained` (as a user's fine-tuned model would be)."""
from __future__ import annotations

from pathlib import Path

import pytest


def copy_without_weights(folder: Path) -> Path:
    """A new folder holding the default model's files except its weights (tokenizer and config)."""
    import shutil

    from lmq_backend.backend.default_model import default_model_dir

    folder.mkdir()
    for f in default_model_dir().iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, folder / f.name)
    return folder


def save_tiny_folder(path: Path, seed: int = 1) -> Path:
    from transformers import AutoTokenizer

    from lmq_backend.backend.default_model import default_model_dir

    from support.tiny import tiny_llama

    path.mkdir(parents=True, exist_ok=True)
    tiny_llama(seed=seed).save_pretrained(path)
    AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(path)
    return path


_SAVED: dict[str, Path] = {}   # the tiny folder, saved once in a test run


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A saved tiny Llama folder (one for the whole test run: tests must not change it). Seed 1: its greedy choice among
    " positive", " negative", " neutral" changes with the review (seed 0 answers " positive" to all)."""
    if "tiny" not in _SAVED:
        _SAVED["tiny"] = save_tiny_folder(tmp_path_factory.mktemp("tiny-model"))
    return _SAVED["tiny"]
