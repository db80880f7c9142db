"""The LMQL plugin never hangs its client (issue #16): a failure in the model process (a bad model folder,
an exception while loading or serving, the process dying) reaches the LMQL caller as an error; cuda=True
without CUDA runs on the CPU with a warning; one model process per SPEC serves every handle of it.

Every LMQL call here is bounded by `asyncio.wait_for(..., GUARD_S)`: a regression fails the test instead
of hanging the suite. The guard is generous (a loaded 2-CPU machine starts a model process slowly); the
calls that must fail fail within seconds, and a hang would never end.
"""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

import lmql

import lmq_backend  # noqa: E402
import lmq_backend.lmql.plugin as lmq_lmql  # noqa: E402
from lmq_backend.lmql import process as lmql_process  # noqa: E402

from support.folders import copy_without_weights, tiny_folder  # noqa: E402,F401 - a fixture

GUARD_S = 300
QUERY = '"Review: {review}\\nSentiment:[X]" where X in [" positive", " negative", " neutral"]\nreturn X'


async def ask(model, review: str = "Great food.") -> str:
    return await asyncio.wait_for(lmql.query(QUERY, model=model)(review=review), GUARD_S)


@pytest.fixture
def no_weights(tmp_path) -> Path:
    """A folder with the default model's tokenizer and config but no weights: LMQL's tokenizer loads, the
    model does not."""
    return copy_without_weights(tmp_path / "no-weights")


def model_processes() -> set[int]:
    """Our child processes running lmq's model process."""
    pids = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        pids |= {int(p) for p in (task / "children").read_text().split()}
    return {p for p in pids if b"lmq_backend.lmql.process" in Path(f"/proc/{p}/cmdline").read_bytes()}


@pytest.mark.parametrize("async_transport", [False, True], ids=["model-process", "in-process"])
async def test_a_bad_model_folder_is_an_error(no_weights, async_transport):
    m = lmql.model(f"local:lmq:{no_weights}", async_transport=async_transport)
    with pytest.raises(Exception, match="lmq could not load the model.*no-weights"):
        await ask(m)


async def test_an_exception_while_serving_is_an_error(tiny_folder, monkeypatch):  # noqa: F811
    backend = lmq_backend.HFBackend(tiny_folder, device="cpu")
    lmq_backend.register_backend("lmql-failing", backend)
    m = lmql.model("local:lmq:lmql-failing", tokenizer=str(tiny_folder), async_transport=True)
    assert await ask(m) in (" positive", " negative", " neutral")

    async def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(backend, "generate", out_of_memory)
    with pytest.raises(Exception, match="out of memory"):
        await ask(m, "Another review.")
    monkeypatch.undo()  # the model serves again: the failure ended that call only
    assert await ask(m, "A third review.") in (" positive", " negative", " neutral")


async def test_a_dead_model_process_is_an_error_and_the_next_call_restarts_it(tiny_folder):  # noqa: F811
    from lmql.models.lmtp.errors import LMTPStreamError

    spec = f"hf:{tiny_folder}"
    m = lmql.model(f"local:lmq:{spec}")
    first = await ask(m)
    handle = lmql_process.handle_or_none(f"lmq:{spec}", {})
    pending = asyncio.ensure_future(handle.generate([1, 2, 3], max_tokens=4, temperature=0.0).__anext__())
    await asyncio.sleep(0)  # the request is sent
    handle.process.proc.kill()
    with pytest.raises(LMTPStreamError, match="killed by signal 9"):
        await asyncio.wait_for(pending, GUARD_S)
    with pytest.raises(LMTPStreamError, match="killed by signal 9"):  # later calls on it fail at once
        await asyncio.wait_for(handle.generate([1, 2], max_tokens=1).__anext__(), 10)
    assert await ask(m) == first  # LMQL's next call gets a new process


async def test_a_model_process_dying_while_tokens_stream_is_an_error(tiny_folder, monkeypatch):  # noqa: F811
    """The process dies after a call's first tokens came: LMQL's cache only warns of an error inside a stream,
    so the stream ends there; LMQL asks for the next token again and gets the error (not a hang)."""
    from lmql.models.lmtp.errors import LMTPStreamError

    spec = f"hf:{tiny_folder}"
    m = lmql.model(f"local:lmq:{spec}")
    await ask(m)  # (its process runs)
    streaming = lmql_process.ProcessHandle.generate

    async def dying(self, prompt, **kwargs):
        async for n, token in _numbered(streaming(self, prompt, **kwargs)):
            yield token
            if n == 20:
                self.process.proc.kill()

    monkeypatch.setattr(lmql_process.ProcessHandle, "generate", dying)
    with pytest.raises(LMTPStreamError, match="killed by signal 9"):
        await asyncio.wait_for(lmql.run('"A long story:[X]" where len(TOKENS(X)) < 200', model=m), GUARD_S)


async def _numbered(stream):
    n = 0
    async for item in stream:
        n += 1
        yield n, item


async def test_cuda_true_without_cuda_runs_on_the_cpu(tiny_folder):  # noqa: F811
    import torch

    if torch.cuda.is_available():
        m = lmq_lmql.LMQModel(f"lmq:hf:{tiny_folder}", device_map="auto")
        assert m.backend.runner.device.type == "cuda"
        return
    with pytest.warns(UserWarning, match="CUDA is not available.*CPU"):
        m = lmq_lmql.LMQModel(f"lmq:hf:{tiny_folder}", device_map="auto")
    assert m.failure is None and m.backend.runner.device.type == "cpu"
    # the case: LMQL's cuda=True in LMQL's default (model process) mode answers
    assert await ask(lmql.model(f"local:lmq:hf:{tiny_folder}", cuda=True)) in (" positive", " negative", " neutral")


async def test_one_model_process_per_spec(tiny_folder):  # noqa: F811
    spec = f"hf:{tiny_folder}"
    before = model_processes()
    handles = [lmql.model(f"local:lmq:{spec}", **kw) for kw in ({}, {"mask_chunk": 16}, {"batch_size": 4})]
    answers = [await ask(h, "Terrible. Never again!") for h in handles]
    assert answers[0] == answers[1] == answers[2]
    started = model_processes() - before
    assert len(started) <= 1 and len(model_processes()) >= 1  # (one may run from an earlier test)
    process = lmql_process._processes[spec]
    assert process.proc.pid in model_processes() and len(process._argument_sets) >= 3  # three argument sets
