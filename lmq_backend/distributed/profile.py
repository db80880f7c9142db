"""`lmq profile --cluster N|NAME`: the profile of a query run on a cluster instead of one backend.

`N` (a number) starts N replicas of the query's model (or `--model`) on this machine's Ray (started here
if this process is not attached to one); `NAME` uses the served endpoint of that name (`serve`), attaching
to the running Ray cluster. The table is the replicas' statistics summed, then one line per replica.
"""
from __future__ import annotations

import asyncio
import json

from ..cache.stats import format_table
from ..errors import LMQInputError
from ..profile import plot_report, profile_query, query_inputs, read_inputs


class _ClusterAsBackend:
    """What `profile_query` asks of a backend (`stats`, `reset_stats`, `name`), served by a cluster."""

    def __init__(self, cluster, name: str):
        self.cluster, self.name = cluster, name

    def stats(self):
        return self.cluster.stats()

    def reset_stats(self) -> None:
        self.cluster.reset_stats()


def open_cluster(spec: str, model: str):
    """(cluster, owned): a new local Cluster of `spec` replicas of `model`, or a client of endpoint `spec`."""
    from .cluster import Cluster
    from .serve import connect

    if spec.isdigit():
        cluster = Cluster(model, replicas=int(spec))
        cluster.wait_ready()
        return cluster, True
    return connect(spec), False


def run_cli(args, read_source) -> int:
    import lmq_backend as lmq

    if args.concurrency < 1:
        raise LMQInputError(f"--concurrency must be at least 1, got {args.concurrency}")
    if args.log_steps:
        raise LMQInputError("--log-steps shows one process's forwards; it does not combine with --cluster")
    query = lmq.Query(read_source(args.file), name=args.file if args.file != "-" else "stdin", model=args.model)
    if not isinstance(query.model, str):
        raise LMQInputError("--cluster needs the model as a name: 'default', 'hf:<dir>' or a folder")
    required, accepted = query_inputs(query)
    inputs = read_inputs(args.inputs, required, accepted)
    cluster, owned = open_cluster(args.cluster, query.model)
    try:
        backend = _ClusterAsBackend(cluster, f"cluster {args.cluster} ({query.model})")
        report = asyncio.run(profile_query(cluster.bind(query), inputs, backend=backend,
                                           concurrency=args.concurrency, on_error=args.on_error,
                                           progress=not args.no_progress))
        per_replica = cluster.replica_stats()
    finally:
        if owned:
            cluster.shutdown()
    if args.plot:
        plot_report(report, args.plot)
    if args.json:
        doc = report.as_dict()
        doc["replicas"] = {str(r): s.as_dict() for r, s in per_replica.items()}
        print(json.dumps(doc, indent=2))
    else:
        print(format_table(report.stats))
        for rid, s in sorted(per_replica.items()):
            print(f"replica {rid}: {s.calls} calls, token hit rate {100 * s.token_hit_rate:.1f}%, "
                  f"{s.tokens_prefilled} prefilled, {s.nodes} nodes")
        print(report.summary())
        if args.plot:
            print(f"plot: {args.plot}")
    return 2 if report.stopped else 0
