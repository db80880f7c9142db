"""Shared fixtures: the embedded default model, and tiny random-weight models on its tokenizer."""
from __future__ import annotations

import os

import pytest
from transformers import AutoTokenizer

from lmq_backend.backend.default_model import default_model_dir
from support.tiny import MODELS

# No disk tier unless a test names its folder: tests must not read K/V files that earlier tests (or runs) wrote.
# Set here, so `lmq` processes that tests start inherit it.
os.environ["LMQ_DISK_CACHE"] = "off"


@pytest.fixture(scope="session")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="session")
def vocab(tokenizer):
    """The default tokenizer's vocabulary index (the constraint tests': constraint_sim.py)."""
    from lmq_backend.text.vocab import VocabIndex

    return VocabIndex.for_tokenizer(tokenizer)


@pytest.fixture(scope="session")
def tiny_models():
    return {name: make() for name, make in MODELS.items()}


@pytest.fixture
def make_backend(tokenizer, tiny_models):
    """make_backend("llama" | "gpt2", cache_budget) -> an HFBackend over a tiny random model."""
    from lmq_backend.backend.hf import HFBackend

    def make(kind: str = "llama", cache_budget="64MB"):
        return HFBackend.from_model(tiny_models[kind], tokenizer, cache_budget=cache_budget, name=f"tiny-{kind}")

    return make


@pytest.fixture(scope="session")
def default_backend():
    from lmq_backend.backend.registry import get_backend

    return get_backend("default")


# context-sensitive models (tests/support/models.py): `zoo.backend(family)`, `zoo.reference(family)`
from support.models import zoo  # noqa: E402,F401


def pytest_collection_modifyitems(items):
    """The Ray tests run first: `ray.init` forks its cluster's processes from this one, and a fork of the
    process the later tests grow to GBs can fail for memory on a small host (heuristic overcommit)."""
    items.sort(key=lambda item: item.path.name != "test_distributed.py")
