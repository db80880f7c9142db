"""What a backend's load makes, so that its first query's call does not: the panel-major weight copies that lmq's
C kernels read, and the tokenizer's prefix encoder."""
from __future__ import annotations

import pytest

import lmq_backend as lmq
from lmq_backend.engine.fused import cpu_step
from lmq_backend.text.prefix_encode import PrefixEncoder
from lmq_kernels.cpu import step
from support.models import build

pytestmark = pytest.mark.cpu_kernels


async def test_the_first_call_makes_no_weight_panels_and_no_prefix_encoder(monkeypatch):
    from transformers import AutoTokenizer

    from lmq_backend.backend.default_model import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())  # its own: a tokenizer keeps its vocab index
    made = []
    for module in (step, cpu_step):
        real = module.panel_major
        monkeypatch.setattr(module, "panel_major", lambda w, real=real: made.append("panels") or real(w))
    real_encoder = PrefixEncoder.for_tokenizer
    monkeypatch.setattr(PrefixEncoder, "for_tokenizer",
                        classmethod(lambda cls, *a: made.append("encoder") or real_encoder(*a)))
    backend = lmq.HFBackend.from_model(build("llama"), tokenizer, name="first-call")  # a model no test laid out
    assert "panels" in made and "encoder" in made
    at_load = len(made)
    q = lmq.compile('"Shared instructions for every call. {x}[A]" where len(TOKENS(A)) < 5', model=backend)
    await q(x="A first call.")
    assert len(made) == at_load
