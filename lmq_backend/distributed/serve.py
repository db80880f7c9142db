"""A served endpoint: a `Cluster` inside a named, detached Ray actor, so that many client processes share its
replicas, their warm caches and one router.

    serve("lmq", model="default", replicas=2)      # once, from any process attached to the Ray cluster
    cluster = connect("lmq")                        # in each client: the same API as Cluster
    await cluster.run(classify, review="...")

A client renders its calls' prompt text and ships its queries itself; the endpoint routes and dispatches.
The endpoint lives until `cluster.shutdown()` (or the Ray cluster stops), whatever its clients do.
"""
from __future__ import annotations

from typing import Any

from ..cache.stats import CacheStats
from .client import ClusterClient
from .cluster import Cluster, _ray
from .replica import Outcome

NAMESPACE = "lmq"


class Endpoint:
    """The endpoint actor's class: it holds the Cluster and forwards the transport calls to it."""

    def __init__(self, model, replicas: int, cluster_options: dict[str, Any]):
        self.cluster = Cluster(model, replicas, **cluster_options)

    async def call(self, key: str, box: list, text: str, inputs: dict) -> Outcome:
        return await self.cluster._call(key, box, text, inputs)

    async def call_many(self, key: str, box: list, text: str, inputs: list[dict]) -> list[Outcome]:
        return await self.cluster._call_many(key, box, text, inputs)

    async def replica_stats(self) -> dict[int, CacheStats]:
        return await self.cluster.areplica_stats()

    async def reset_stats(self) -> None:
        await self.cluster.areset_stats()

    async def info(self) -> dict:
        c = self.cluster
        return {"model": c.name, "replicas": sorted(c.handles), "lost": list(c.lost), "retries": c.retries,
                "routes": {"prefix": c.router.counts.prefix, "smallest_tree": c.router.counts.smallest_tree,
                           "least_loaded": c.router.counts.least_loaded}}

    async def wait_ready(self) -> dict:
        import asyncio

        return await asyncio.to_thread(self.cluster.wait_ready)

    async def shutdown(self) -> None:
        self.cluster.shutdown()


class RemoteCluster(ClusterClient):
    """A client of a served endpoint (what `connect` returns): `run`, `map`, `map_dataset`, `bind`,
    `stats`, as on a local Cluster."""

    def __init__(self, handle, name: str):
        super().__init__()
        self.handle, self.name = handle, name

    async def _call(self, key: str, box: list, text: str, inputs: dict) -> Outcome:
        return await self.handle.call.remote(key, box, text, inputs)

    async def _call_many(self, key: str, box: list, text: str, inputs: list[dict]) -> list[Outcome]:
        return await self.handle.call_many.remote(key, box, text, inputs)

    async def areplica_stats(self) -> dict[int, CacheStats]:
        return await self.handle.replica_stats.remote()

    async def areset_stats(self) -> None:
        await self.handle.reset_stats.remote()

    def info(self) -> dict:
        return _ray().get(self.handle.info.remote())

    def wait_ready(self) -> dict:
        return _ray().get(self.handle.wait_ready.remote())

    def shutdown(self) -> None:
        """Stop the endpoint and its replicas, for every client."""
        ray = _ray()
        ray.get(self.handle.shutdown.remote())
        ray.kill(self.handle)


def serve(name: str = "lmq", model="default", replicas: int = 2, **cluster_options: Any) -> RemoteCluster:
    """Start the endpoint `name` (or attach to it if it runs already) and return a client of it.
    `cluster_options` are Cluster's (num_cpus, num_gpus, router, max_respawns, backend options)."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init()
    actor = ray.remote(Endpoint).options(name=name, namespace=NAMESPACE, lifetime="detached",
                                         get_if_exists=True, num_cpus=0, max_concurrency=10_000)
    return RemoteCluster(actor.remote(model, replicas, cluster_options), name)


def connect(name: str = "lmq", address: str | None = "auto") -> RemoteCluster:
    """A client of the running endpoint `name`; attaches this process to the Ray cluster at `address`
    ("auto": the one `ray start --head` started on this machine, or RAY_ADDRESS) if it is not attached."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=address)
    return RemoteCluster(ray.get_actor(name, namespace=NAMESPACE), name)
