"""lmq over a Ray cluster (the `ray` extra): replicas that each hold a backend and run whole query calls, a
prefix-aware router, batch jobs over data sets, and a served endpoint for many client processes.

    from lmq_backend.distributed import Cluster
    cluster = Cluster("default", replicas=2)      # ray.init() if this process is not attached to Ray
    classify = cluster.bind(classify)             # the compiled query runs on the cluster

Files: `prefix_tree.py` (the router's approximate tree of prompt text), `router.py` (the policy),
`render.py` (a call's prompt text, a query as shipped), `replica.py` (the actor), `cluster.py` (replicas,
dispatch, retries), `client.py` (run/map/bind/stats), `batch.py` (chunked jobs, Ray Data inputs),
`serve.py` (the named endpoint), `stats.py` (summed statistics), `profile.py` (`lmq profile --cluster`).
"""
from .client import ClusterClient, ClusterQuery
from .cluster import Cluster
from .router import Router, RouterConfig
from .serve import RemoteCluster, connect, serve
from .stats import sum_stats

__all__ = ["Cluster", "ClusterClient", "ClusterQuery", "RemoteCluster", "Router", "RouterConfig", "connect",
           "serve", "sum_stats"]
