"""What LMQL's own process loads for a `local:lmq:` model (issue #16's start-up): no torch (the model runs in
lmq's model process; LMQL's transformers backend, which imports torch, loads on first use), and that backend
still loads and registers itself when asked for."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import lmql  # noqa: F401

pytestmark = pytest.mark.slow

SCRIPT = """
import asyncio, sys, lmql
q = '"Review: Terrible. Never again!\\\\nSentiment:[X]" where X in [" positive", " negative"]\\nreturn X'
print(repr(asyncio.run(lmql.query(q, model=lmql.model("local:lmq:default"))())))
print("torch" in sys.modules)
from lmql.models.lmtp.backends.lmtp_model import LMTPModel
deferred = LMTPModel.registry["transformers"]
from lmql.models.lmtp.backends.transformers_model import TransformersLLM
print("torch" in sys.modules, LMTPModel.registry["transformers"] is TransformersLLM, deferred is not TransformersLLM)
"""


def test_lmqls_process_loads_no_torch_for_lmq_models():
    env = {k: v for k, v in os.environ.items() if k != "LMQ_LMQL_HOOK"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["' negative'", "False", "True True True"]


def test_lmqls_transformers_backend_loads_on_first_use(tiny_folder):  # noqa: F811
    script = ("import sys, lmql\n"
              "from lmql.models.lmtp.backends.lmtp_model import LMTPModel\n"
              f"m = LMTPModel.load({str(tiny_folder)!r})\n"
              "print(type(m).__name__, 'torch' in sys.modules)\n")
    env = {k: v for k, v in os.environ.items() if k != "LMQ_LMQL_HOOK"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["TransformersLLM", "True"]


from support.folders import tiny_folder  # noqa: E402, F401 - a fixture
