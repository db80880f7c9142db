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


# A new process: a backend loaded through `lmq.get_backend`, then one query compiled and called (as `lmq run`'s
# code does once the model is loaded); prints what that first call imported and built of the front end.
FIRST_CALL = r'''
import asyncio, json, sys
import lark
from transformers import AutoTokenizer
import lmq_backend as lmq
from lmq_backend.backend.default_model import default_model_dir
from support.tiny import tiny_llama

tokenizer, model = AutoTokenizer.from_pretrained(default_model_dir()), tiny_llama()
lmq.register_backend("first-call", lambda: lmq.HFBackend.from_model(model, tokenizer, name="first-call"))
backend = lmq.get_backend("first-call")
built = []
for cls, name in ((lark.Lark, "__init__"), (lark.lexer.BasicLexer, "_build_scanner")):
    real = getattr(cls, name)
    setattr(cls, name, lambda self, *a, real=real, what=cls.__name__, **k: built.append(what) or real(self, *a, **k))
before = set(sys.modules)
query = lmq.Query(sys.argv[1], model=backend)
result = asyncio.run(query(review="A quiet film, well made."))
new = sorted(m for m in set(sys.modules) - before if m.split(".")[0] in ("lmq_backend", "lmq_kernels", "lark"))
print(json.dumps({"built": built, "imported": new, "answer": str(result.variables)}))
'''

SENTIMENT = '''argmax
    "Review: a fine film.\\nSentiment: positive\\n\\nReview: {review}\\nSentiment:[CLS]"
from "first-call"
where CLS in [" positive", " negative", " neutral"]
'''
SUMMARY = '''argmax
    "Review: {review}\\nIn a few words:[WHY]" where len(TOKENS(WHY)) < 6 and STOPS_AT(WHY, ".")
    if WHY:
        "Done."
from "first-call"
'''


@pytest.mark.parametrize("source", [SENTIMENT, SUMMARY], ids=["choice", "stops"])
def test_a_process_that_loads_a_backend_leaves_its_first_call_no_front_end_set_up(source):
    """`lmq.get_backend` readies the query front end (runtime/ready.py): the first query's compile and call in
    that process import no module of lmq or lark and build no parser or lexer."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", FIRST_CALL, source], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["built"] == [] and seen["imported"] == [], seen
