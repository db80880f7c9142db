"""What a caller of a cluster sees, whether the router lives in this process (`Cluster`) or in a served
endpoint (`RemoteCluster`): `run`, `map`, `map_dataset`, `bind`, `stats`. Subclasses provide the transport:
`_ship` (the query into Ray's object store, once), `_call` (one call) and `_call_many` (one chunk of calls
that share a prefix), and the statistics."""
from __future__ import annotations

import abc
import asyncio
import uuid
import weakref
from typing import Any, Iterable

from ..cache.stats import CacheStats
from .render import prompt_prefix, shippable
from .replica import Outcome
from .stats import sum_stats


class ClusterClient(abc.ABC):
    default_concurrency = 64

    def __init__(self):
        self._shipped: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # ----- transport (subclasses) ---------------------------------------------------------------------

    @abc.abstractmethod
    async def _call(self, key: str, box: list, text: str, inputs: dict) -> Outcome: ...

    @abc.abstractmethod
    async def _call_many(self, key: str, box: list, text: str, inputs: list[dict]) -> list[Outcome]: ...

    @abc.abstractmethod
    async def areplica_stats(self) -> dict[int, CacheStats]:
        """Each live replica's `CacheStats`, by replica id."""

    @abc.abstractmethod
    async def areset_stats(self) -> None: ...

    def _ship(self, query, calls: list[dict[str, Any]]) -> tuple[str, list]:
        """(key, [ObjectRef]) of `query` for `calls`, put into the object store on first use. A name every
        call gives is not shipped from the query's scope (a module's function that an input shadows)."""
        import ray

        given = frozenset.intersection(*(frozenset(c) for c in calls)) if calls else frozenset()
        shipped = self._shipped.setdefault(query, {})
        if given not in shipped:
            shipped[given] = (uuid.uuid4().hex, [ray.put(shippable(query, given))])
        return shipped[given]

    # ----- calls --------------------------------------------------------------------------------------

    async def run(self, query, /, **inputs):
        """One call of a compiled query on the replica that most likely holds its prefix; returns what
        `await query(**inputs)` returns, or raises what it raises."""
        inputs = query._bind((), inputs)
        key, box = self._ship(query, [inputs])
        ok, value = await self._call(key, box, prompt_prefix(query, inputs), inputs)
        if not ok:
            raise value
        return value

    def run_sync(self, query, /, **inputs):
        return asyncio.run(self.run(query, **inputs))

    async def map(self, query, inputs: Iterable[dict[str, Any]], *, chunk_size: int = 8,
                  concurrency: int | None = None, progress: bool = False, return_exceptions: bool = False) -> list:
        """Run `query` over many inputs; results in input order. Inputs are grouped by the text their
        prompts start with, then cut into chunks of `chunk_size` that each run as one remote call (batched
        on its replica); at most `concurrency` calls are in flight. A failing input fails alone: with
        `return_exceptions` its exception takes its place in the list, else the first failure (in input
        order) is raised once every call has finished."""
        from .batch import run_batch

        items = [query._bind((), dict(x)) for x in inputs]
        key, box = self._ship(query, items)
        outcomes = await run_batch(self, key, box, [prompt_prefix(query, x) for x in items], items,
                                   chunk_size=chunk_size, concurrency=concurrency or self.default_concurrency,
                                   progress=query.name[:30] if progress else None)
        if not return_exceptions:
            for ok, value in outcomes:
                if not ok:
                    raise value
        return [value for _, value in outcomes]

    async def map_dataset(self, query, source, **kwargs) -> list:
        """`map` over the rows of a Ray Dataset, a JSONL file (one object of inputs a line) or a Parquet
        file (one column per input), in row order."""
        from .batch import read_rows

        return await self.map(query, read_rows(source), **kwargs)

    def bind(self, query) -> "ClusterQuery":
        """`query` as a cluster query: `await q(**inputs)`, `await q.map(...)`, `q.run_sync(...)` run on
        the cluster."""
        return ClusterQuery(query, self)

    # ----- statistics ---------------------------------------------------------------------------------

    async def astats(self) -> CacheStats:
        return sum_stats(list((await self.areplica_stats()).values()))

    def replica_stats(self) -> dict[int, CacheStats]:
        return _blocking(self.areplica_stats())

    def stats(self) -> CacheStats:
        """The replicas' `CacheStats` summed (counters, gauges and per-template breakdowns)."""
        return _blocking(self.astats())

    def reset_stats(self) -> None:
        _blocking(self.areset_stats())


def _blocking(coro):
    """Run `coro` to completion from synchronous code, also while an event loop runs in this thread (then
    in a helper thread: the calls it makes are Ray calls, which need no loop of ours)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


class ClusterQuery:
    """A compiled query bound to a cluster: called like the query, it runs there."""

    def __init__(self, query, cluster: ClusterClient):
        self.query, self.cluster = query, cluster
        self.name = query.name

    async def __call__(self, *args, **kwargs):
        return await self.cluster.run(self.query, **self.query._bind(args, kwargs))

    async def run(self, inputs: dict[str, Any], backend=None):
        """As `Query.run` (the signature `lmq profile` calls); `backend` is ignored: the cluster's replicas
        hold the backends."""
        return await self.cluster.run(self.query, **inputs)

    def run_sync(self, *args, **kwargs):
        return asyncio.run(self(*args, **kwargs))

    async def map(self, inputs: Iterable[dict[str, Any]], concurrency: int | None = None, progress: bool = False,
                  **kwargs) -> list:
        return await self.cluster.map(self.query, inputs, concurrency=concurrency, progress=progress, **kwargs)

    async def map_dataset(self, source, **kwargs) -> list:
        return await self.cluster.map_dataset(self.query, source, **kwargs)
