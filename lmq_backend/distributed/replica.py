"""A replica: one backend in its own process (a Ray actor), running whole query calls.

A call arrives as (query key, [ObjectRef of the query], inputs). The replica fetches a query the first time
it sees its key and keeps it, so the query travels once per replica, not once per call. Calls run
concurrently on the actor's event loop, so the backend batches them as it batches local calls. A call's
own failure comes back as a value (`Outcome`), never as a dead actor: only a lost process is an exception.
"""
from __future__ import annotations

import os
import pickle
from typing import Any, Callable

from ..backend.protocol import Backend
from ..backend.registry import get_backend
from ..errors import LMQRuntimeError

Spec = str | Callable[[], Backend]
Outcome = tuple[bool, Any]  # (True, result) or (False, the exception the call raised)


def make_backend(spec: Spec, options: dict[str, Any]) -> Backend:
    """A backend from a spec: "default", "hf:<dir>" or a folder path, with HFBackend's options (device,
    dtype, cache_budget, kv_budget, max_batch); or a zero-argument factory returning any Backend."""
    if callable(spec):
        return spec()
    if not options and (spec == "default" or spec.startswith("hf:")):
        return get_backend(spec)
    from ..backend.hf import HFBackend

    return HFBackend(spec[3:] if spec.startswith("hf:") else spec, name=spec, **options)


def portable_error(error: BaseException) -> BaseException:
    """`error` if it survives pickling (the client re-raises it as is), else an LMQRuntimeError saying what
    it was."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure
        return LMQRuntimeError(f"{type(error).__name__}: {error}")


class Replica:
    """The actor class (the cluster applies `ray.remote` with its resources)."""

    def __init__(self, spec: Spec, options: dict[str, Any]):
        self.backend = make_backend(spec, options)
        self.queries: dict[str, Any] = {}

    async def ready(self) -> dict:
        """Who serves here: the process, the backend, the Ray node, and the disk tier's folder (None: none)."""
        import ray

        disk = getattr(getattr(self.backend, "tiers", None), "disk", None)
        return {"pid": os.getpid(), "backend": getattr(self.backend, "name", type(self.backend).__name__),
                "node": ray.get_runtime_context().get_node_id(),
                "disk": None if disk is None else str(disk.folder.resolve())}

    async def _query(self, key: str, box: list):
        query = self.queries.get(key)
        if query is None:
            query = self.queries[key] = await box[0]
        return query

    async def call(self, key: str, box: list, inputs: dict[str, Any]) -> Outcome:
        """Run one call of the query `key` (its ObjectRef in `box`, a list so that Ray passes the reference,
        not the object) on this replica's backend."""
        query = await self._query(key, box)
        try:
            return True, await query.run(dict(inputs), self.backend)
        except Exception as e:  # noqa: BLE001 - the call's own failure goes back to its caller
            return False, portable_error(e)

    async def call_many(self, key: str, box: list, inputs: list[dict[str, Any]]) -> list[Outcome]:
        """Run several calls of one query at once (batched by the backend); an outcome per input, in order."""
        import asyncio

        await self._query(key, box)  # fetched once, before the calls start
        return list(await asyncio.gather(*(self.call(key, box, item) for item in inputs)))

    async def stats(self):
        return self.backend.stats()

    async def reset_stats(self) -> None:
        self.backend.reset_stats()
