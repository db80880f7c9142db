"""`Cluster`: replicas of one backend as Ray actors, with the prefix-aware router in this process.

    cluster = Cluster("default", replicas=2)           # ray.init() first if Ray is not running
    result = await cluster.run(classify, review="...")   # or: classify = cluster.bind(classify)

Dispatch: the router picks a replica for the call's prompt text, the call runs there whole, and its outcome
comes back. When the replica's process is lost (`RayActorError`), the router forgets it, a replacement is
started (at most `max_respawns` in the cluster's life) and the call runs again on another replica: calls
are never lost, and a call that ran again gives the same result where it is deterministic (greedy, or
seeded sampling).

A disk tier the replicas share (one folder on one machine, or on a filesystem every node mounts: the backends'
`disk_cache`) outlives a replica: the long prefixes a lost replica computed are on disk, so its replacement
takes over its routes (the router's tree of it) and loads those prefixes from disk at their first call, where
the other replicas would each prefill them again.
"""
from __future__ import annotations

import asyncio
import itertools
from typing import Any

from ..cache.stats import CacheStats
from ..errors import LMQBackendError
from .client import ClusterClient
from .replica import Outcome, Replica, Spec
from .prefix_tree import ApproxPrefixTree
from .router import Router, RouterConfig


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError("lmq_backend.distributed needs Ray: pip install 'lmq-backend[ray]'") from None
    return ray


class Cluster(ClusterClient):
    """`replicas` Ray actors, each holding a backend made from `model` ("default", "hf:<dir>", a folder, or
    a zero-argument factory) with `backend_options` (device, dtype, cache_budget, kv_budget, max_batch,
    disk_cache, ...). Each replica takes `num_cpus` CPUs and `num_gpus` GPUs (default: 1 where the cluster has
    GPUs, else 0). `shared_disk`: whether the replicas' disk tier is one folder they all read (see the module's
    docstring); None: as `wait_ready` finds them, every replica on one Ray node with one disk folder."""

    def __init__(self, model: Spec = "default", replicas: int = 2, *, num_cpus: float = 1,
                 num_gpus: float | None = None, router: RouterConfig | None = None,
                 max_respawns: int | None = None, shared_disk: bool | None = None, **backend_options: Any):
        super().__init__()
        ray = _ray()
        if not ray.is_initialized():
            ray.init()
        if num_gpus is None:
            num_gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
        if replicas < 1:
            raise ValueError(f"a cluster needs at least one replica, got {replicas}")
        self.model, self.backend_options = model, backend_options
        self.name = model if isinstance(model, str) else getattr(model, "__name__", "factory")
        self._actor = ray.remote(Replica).options(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0)
        self.router = Router(router or RouterConfig())
        self.handles: dict[int, Any] = {}
        self._ids = itertools.count()
        self.respawns_left = replicas if max_respawns is None else max_respawns
        self.lost: list[str] = []  # why each lost replica was lost
        self.shared_disk = shared_disk
        self.infos: dict[int, dict] = {}  # replica id -> what its `ready` said (`wait_ready`)
        self.retries = 0           # calls (or chunks) run again after their replica was lost
        for _ in range(replicas):
            self._start_replica()

    def _start_replica(self, tree: ApproxPrefixTree | None = None) -> int:
        rid = next(self._ids)
        self.handles[rid] = self._actor.remote(self.model, self.backend_options)
        self.router.add(rid, tree)
        return rid

    @property
    def disk_shared(self) -> bool:
        """Do the replicas share a disk tier (`shared_disk`, else what `wait_ready` found)?"""
        if self.shared_disk is not None:
            return self.shared_disk
        places = {(info.get("node"), info.get("disk")) for info in self.infos.values()}
        return len(places) == 1 and None not in next(iter(places))

    def _lose(self, rid: int, error: Exception) -> None:
        if rid not in self.handles:
            return  # another call saw the loss first
        handle = self.handles.pop(rid)
        try:  # an unreachable (not dead) actor must not come back as a replica nobody routes to
            _ray().kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        shared = self.disk_shared
        tree = self.router.remove(rid)
        self.infos.pop(rid, None)
        self.lost.append(f"replica {rid}: {type(error).__name__}: {error}")
        if self.respawns_left > 0:
            self.respawns_left -= 1
            self._start_replica(tree if shared else None)  # (its prefixes are on the disk it will read)

    def wait_ready(self, timeout: float | None = None) -> dict[int, dict]:
        """Block until every replica has built its backend; {replica id: {"pid", "backend", "node", "disk"}}
        (`Replica.ready`; kept as `infos`). A replica that cannot start raises LMQBackendError with its error."""
        ray = _ray()
        try:
            infos = ray.get([h.ready.remote() for h in self.handles.values()], timeout=timeout)
        except ray.exceptions.RayActorError as e:
            raise LMQBackendError(f"a replica of {self.name!r} could not start: {e}") from e
        self.infos = dict(zip(self.handles, infos))
        return dict(self.infos)

    # ----- dispatch -----------------------------------------------------------------------------------

    async def _dispatch(self, text: str, weight: int, send):
        """Route, send, await; on a lost replica, route again. `send(handle)` makes the ObjectRef."""
        ray = _ray()
        while True:
            try:
                rid = self.router.choose(text, weight)
            except LookupError:
                raise LMQBackendError(f"every replica of {self.name!r} was lost: {'; '.join(self.lost)}") from None
            ref = send(self.handles[rid])
            try:
                return await ref
            except ray.exceptions.RayActorError as e:
                self._lose(rid, e)
                self.retries += 1
            except asyncio.CancelledError:
                ray.cancel(ref)
                raise
            finally:
                self.router.finished(rid, weight)

    async def _call(self, key: str, box: list, text: str, inputs: dict) -> Outcome:
        return await self._dispatch(text, 1, lambda h: h.call.remote(key, box, inputs))

    async def _call_many(self, key: str, box: list, text: str, inputs: list[dict]) -> list[Outcome]:
        return await self._dispatch(text, len(inputs), lambda h: h.call_many.remote(key, box, inputs))

    # ----- statistics and life ------------------------------------------------------------------------

    async def areplica_stats(self) -> dict[int, CacheStats]:
        ray = _ray()
        out = {}
        for rid, handle in list(self.handles.items()):
            try:
                out[rid] = await handle.stats.remote()
            except ray.exceptions.RayActorError as e:
                self._lose(rid, e)
        return out

    async def areset_stats(self) -> None:
        ray = _ray()
        for rid, handle in list(self.handles.items()):
            try:
                await handle.reset_stats.remote()
            except ray.exceptions.RayActorError as e:
                self._lose(rid, e)

    def shutdown(self) -> None:
        """Stop every replica (their caches go with them)."""
        ray = _ray()
        for handle in self.handles.values():
            ray.kill(handle)
        self.handles.clear()
        for rid in self.router.replicas:
            self.router.remove(rid)
        self.respawns_left = 0
