"""A backend that is dropped gives its memory back at once, without a garbage collection (a GPU backend's store is
half the device's free memory by default; the process's first backend is frozen out of the collector's sight, so
a cycle through it would hold that memory for good): the backend itself is in no reference cycle, and dropping it
closes it (`HFBackend.close`), whatever cycles asyncio's cancelled tasks leave through the scheduler (Python 3.12
leaves one). A closed backend refuses queries with a clear error. On the GPU (`gpu`, skipped without CUDA) the device
memory comes back."""
from __future__ import annotations

import asyncio
import gc
import weakref

import pytest
import torch

import lmq_backend as lmq
from support.tiny import tiny_llama

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


SOURCE = '"Say:[X]" where len(TOKENS(X)) < 5\n"and[Y]" where Y in [" yes", " no"]'


@pytest.mark.parametrize("device", DEVICES)
def test_a_dropped_backend_frees_its_store_without_a_collection(tokenizer, device):
    model = tiny_llama().to(device)
    gc.collect()
    before = torch.cuda.memory_allocated() if device == "cuda" else 0
    gc.disable()
    try:
        backend = lmq.HFBackend.from_model(model, tokenizer, name=f"lifetime-{device}", kv_budget="1GB")
        query = lmq.compile(SOURCE, model=backend)
        for _ in range(2):  # two event loops: the first loop's step task ends cancelled with it
            assert asyncio.run(query()).variables["Y"] in (" yes", " no")
        store, held = weakref.ref(backend.store), backend.store.data.nbytes
        alive = weakref.ref(backend)
        assert held >= 0.99e9
        if device == "cuda":
            assert torch.cuda.memory_allocated() >= before + held
        del backend, query
        assert alive() is None
        assert store() is None or store().data.nbytes == 0
        if device == "cuda":
            assert torch.cuda.memory_allocated() < before + held // 4
    finally:
        gc.enable()


def test_a_closed_backend_refuses_queries_and_its_memory_is_back(make_backend):
    backend = make_backend()
    query = lmq.compile(SOURCE, model=backend)
    assert asyncio.run(query()).variables["Y"] in (" yes", " no")
    backend.close()
    assert backend.store.data.nbytes == 0 and backend.store.free_slots == 0
    with pytest.raises(lmq.LMQBackendError, match="closed"):
        asyncio.run(query())
    backend.close()  # (again: nothing more to give back)


def test_closing_a_backend_under_running_queries_fails_them_all_and_hangs_none(make_backend):
    backend = make_backend()
    query = lmq.compile('"Count:[X]" where len(TOKENS(X)) < 40', model=backend)

    async def main():
        steps = []
        backend.on_step(steps.append)
        calls = [asyncio.ensure_future(query.run({})) for _ in range(8)]
        while len([s for s in steps if s.kind == "decode"]) < 3:
            await asyncio.sleep(0.001)
        backend.close()
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=30)

    results = asyncio.run(main())
    assert len(results) == 8
    assert all(isinstance(r, lmq.LMQBackendError) and "closed" in str(r) for r in results), results
