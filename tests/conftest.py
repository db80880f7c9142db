"""Shared fixtures: the embedded default model, and tiny random-weight models on its tokenizer; the skip policy
(tests/support/skip_policy.py: a test skips only where the host cannot run it by design).

On a host without CUDA, TRITON_INTERPRET=1 is set here, before anything imports triton, so that the Triton
kernels' `interpreter` tests run in this process under Triton's interpreter (triton binds the mode at import);
the engine itself never runs Triton on the CPU."""
from __future__ import annotations

import functools
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from lmq_backend.backend.default_model import default_model_dir  # noqa: E402
from support.tiny import MODELS  # noqa: E402

pytest_plugins = ["support.skip_policy"]

# No disk tier unless a test names its folder: tests must not read K/V files that earlier tests (or runs) wrote.
# Set here, so `lmq` processes that tests start inherit it.
os.environ["LMQ_DISK_CACHE"] = "off"


# The fixtures below are built once in a test run (`functools.cache`) and handed to each module that asks.

@functools.cache
def _tokenizer():
    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="module")
def tokenizer():
    return _tokenizer()


@functools.cache
def _vocab():
    from lmq_backend.text.vocab import VocabIndex

    return VocabIndex.for_tokenizer(_tokenizer())


@pytest.fixture(scope="module")
def vocab():
    """The default tokenizer's vocabulary index (the constraint tests': constraint_sim.py)."""
    return _vocab()


@functools.cache
def _tiny_models():
    return {name: make() for name, make in MODELS.items()}


@pytest.fixture(scope="module")
def tiny_models():
    return _tiny_models()


@pytest.fixture
def make_backend(tokenizer, tiny_models):
    """make_backend("llama" | "gpt2", cache_budget) -> an HFBackend over a tiny random model."""
    from lmq_backend.backend.hf import HFBackend

    def make(kind: str = "llama", cache_budget="64MB"):
        return HFBackend.from_model(tiny_models[kind], tokenizer, cache_budget=cache_budget, name=f"tiny-{kind}")

    return make


@functools.cache
def _default_backend():
    from lmq_backend.backend.registry import get_backend

    return get_backend("default")


@pytest.fixture(scope="module")
def default_backend():
    return _default_backend()


# context-sensitive models (tests/support/models.py): `zoo.backend(family)`, `zoo.reference(family)`
from support.models import zoo  # noqa: E402,F401


def pytest_collection_modifyitems(items):
    """The Ray tests run first: `ray.init` forks its cluster's processes from this one, and a fork of the
    process the later tests grow to GBs can fail for memory on a small host (heuristic overcommit)."""
    items.sort(key=lambda item: item.path.name != "test_distributed.py")
