"""lmq on a real local Ray cluster (in-process `ray.init`): 2 replicas of a tiny random-weight model saved to a
folder, against one in-process backend on the same folder (greedy, float32). Results are identical, calls of
one few-shot prefix land on one replica, batch jobs keep input order, a bad input fails alone, a served
endpoint answers another process, killing a replica mid-run loses no call, and a replacement takes over a lost
replica's prefixes from the disk tier they share."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

import ray

import lmq_backend as lmq  # noqa: E402
from lmq_backend.distributed import Cluster, serve  # noqa: E402

from support.models import build  # noqa: E402

OPTIONS = dict(device="cpu", dtype="float32", cache_budget="64MB", kv_budget="256MB")
SOURCE = '''argmax
    "{shots}Review: {review}\\nSentiment:[CLS]"
where CLS in [" positive", " negative", " neutral"]
'''
CLASSIFY = lmq.compile(SOURCE, name="classify")
SUMMARY = lmq.compile('''argmax
    "{shots}Review: {review}\\nSummary:[S]" where len(TOKENS(S)) < 48 and STOPS_AT(S, ".")
''', name="summary")
STRIP = lmq.compile('''argmax
    "{shots}Review: {review.strip()}\\nSentiment:[CLS]"
where CLS in [" positive", " negative"]
''', name="strip")
SUBJECTS = ["The pasta", "Our waiter", "The hotel room", "The concert", "This phone", "The delivery"]
PHRASES = ["was wonderful and I would come back", "was cold and late", "was fine, nothing special",
           "broke after two days", "made our evening special", "did the job"]


def shots(task: int) -> str:
    head = ["Classify each review.", "Label the sentiment of these reviews.", "Sentiment of customer notes."][task]
    lines = [head + "\n\n"]
    for i in range(8):
        label = ("positive", "negative", "neutral")[(i + task) % 3]
        lines.append(f"Review: {SUBJECTS[(i * 5 + task) % 6]} {PHRASES[(i + 2 * task) % 6]}.\nSentiment: {label}\n\n")
    return "".join(lines)


def calls(n: int, tasks: int = 3) -> list[dict]:
    return [{"shots": shots(i % tasks), "review": f"{SUBJECTS[i % 6]} {PHRASES[(i * 7) % 6]} (visit {i})."}
            for i in range(n)]


def answer(result) -> tuple:
    return result.prompt, result.variables


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from transformers import AutoTokenizer

    from lmq_backend.backend.default_model import default_model_dir

    path = tmp_path_factory.mktemp("ray-model")
    build("llama").save_pretrained(path)
    AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(path)
    return path


# Ray gives its raylet 30 s to see its agents start and register: a busy 2-core machine may need longer
PATIENT_RAY = {"RAY_agent_register_timeout_ms": "180000", "RAY_worker_register_timeout_seconds": "180"}


@pytest.fixture(scope="module")
def local_ray():
    saved = {k: os.environ.get(k) for k in PATIENT_RAY}
    os.environ.update(PATIENT_RAY)
    for attempt in range(2):
        try:
            ray.init(num_cpus=6, include_dashboard=False, object_store_memory=150 * 2**20, log_to_driver=False)
            break
        except Exception:
            ray.shutdown()
            if attempt:
                raise
    yield
    ray.shutdown()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def cluster(local_ray, folder):
    c = Cluster(f"hf:{folder}", replicas=2, max_respawns=1, **OPTIONS)
    c.wait_ready()
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def reference(folder):
    """One in-process backend on the same folder: `reference(query, inputs) -> [results]` in order."""
    backend = lmq.HFBackend(str(folder), **OPTIONS)

    async def run(query, inputs: list[dict]):
        backend.trie.evict(backend.trie.evictable_bytes())  # a cold cache, as the cluster's replicas start
        backend.reset_stats()
        return [await query.run(dict(x), backend) for x in inputs], backend.stats()

    return run


async def test_results_equal_one_backend_and_a_prefix_stays_on_one_replica(cluster, reference):
    inputs = calls(24)
    want, one = await reference(CLASSIFY, inputs)
    cluster.reset_stats()
    q = cluster.bind(CLASSIFY)
    got = await asyncio.gather(*(q(**x) for x in inputs))
    assert [answer(r) for r in got] == [answer(r) for r in want]
    assert len({r["CLS"] for r in want}) > 1  # the model's answer depends on the review
    per_replica = cluster.replica_stats()
    total = cluster.stats()
    assert all(s.calls > 0 for s in per_replica.values())  # both replicas took calls ...
    for task in range(3):  # ... and each few-shot prefix went to one of them
        text = shots(task) + "Review: "
        assert sum(tree.match(text) == len(text) for tree in cluster.router.trees.values()) == 1
    assert total.calls == 24 == sum(s.calls for s in per_replica.values())
    assert total.tokens_reused == sum(s.tokens_reused for s in per_replica.values())
    assert total.token_hit_rate >= one.token_hit_rate - 0.05, (total.token_hit_rate, one.token_hit_rate)


async def test_batch_jobs_keep_input_order_over_lists_files_and_datasets(cluster, reference, tmp_path):
    inputs = calls(30)
    want = [answer(r) for r in (await reference(CLASSIFY, inputs))[0]]
    got = await cluster.map(CLASSIFY, inputs, chunk_size=4, progress=True)
    assert [answer(r) for r in got] == want
    jsonl = tmp_path / "inputs.jsonl"
    jsonl.write_text("".join(json.dumps(x) + "\n" for x in inputs))
    assert [answer(r) for r in await cluster.map_dataset(CLASSIFY, jsonl)] == want
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(inputs), tmp_path / "inputs.parquet")
    assert [answer(r) for r in await cluster.map_dataset(CLASSIFY, tmp_path / "inputs.parquet")] == want
    dataset = ray.data.from_items(inputs)
    assert [answer(r) for r in await cluster.bind(CLASSIFY).map_dataset(dataset)] == want


async def test_a_call_that_fails_on_its_input_fails_alone(cluster, reference):
    inputs = calls(6)
    inputs[2] = {**inputs[2], "review": 5}      # `review.strip()` raises in the replica
    del inputs[4]["review"]                      # a missing input
    good = [x for i, x in enumerate(inputs) if i not in (2, 4)]
    want = [answer(r) for r in (await reference(STRIP, good))[0]]
    out = await cluster.map(STRIP, inputs, return_exceptions=True)
    assert isinstance(out[2], lmq.LMQRuntimeError) and "strip" in str(out[2])
    assert isinstance(out[4], lmq.LMQInputError) and "review" in str(out[4])
    assert [answer(r) for i, r in enumerate(out) if i not in (2, 4)] == want
    with pytest.raises(lmq.LMQRuntimeError):
        await cluster.run(STRIP, **inputs[2])
    with pytest.raises(lmq.LMQRuntimeError):
        await cluster.map(STRIP, inputs)
    assert len(cluster.handles) == 2 and not cluster.lost  # no replica suffered


CLIENT = textwrap.dedent('''
    import asyncio, json, sys
    import lmq_backend as lmq
    from lmq_backend.distributed import connect
    q = lmq.compile(sys.argv[3], name="classify")
    cluster = connect(sys.argv[1], address=sys.argv[2])
    inputs = json.loads(sys.stdin.read())
    async def main():
        return await asyncio.gather(*(cluster.run(q, **x) for x in inputs))
    print(json.dumps([r.variables for r in asyncio.run(main())]))
''')


def test_an_endpoint_serves_other_processes_and_lmq_profile(local_ray, folder, reference, tmp_path, capsys):
    from lmq_backend.cli import main

    inputs = calls(6, tasks=1)
    want = [r.variables for r in asyncio.run(reference(CLASSIFY, inputs))[0]]
    endpoint = serve("lmq-test", model=f"hf:{folder}", replicas=1, **OPTIONS)
    try:
        endpoint.wait_ready()
        first = endpoint.run_sync(CLASSIFY, **inputs[0])  # this process warms the prefix ...
        assert first.variables == want[0]
        address = ray.get_runtime_context().gcs_address
        out = subprocess.run([sys.executable, "-c", CLIENT, "lmq-test", address, SOURCE], input=json.dumps(inputs),
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert json.loads(out.stdout.strip().splitlines()[-1]) == want  # ... another process's calls reuse it
        stats = endpoint.stats()
        assert stats.calls == 7 and stats.hits >= 6
        query = tmp_path / "q.lmq"
        query.write_text(SOURCE)
        data = tmp_path / "in.jsonl"
        data.write_text("".join(json.dumps(x) + "\n" for x in inputs))
        assert main(["profile", str(query), "--inputs", str(data), "--cluster", "lmq-test", "--no-progress",
                     "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["calls_ok"] == 6 and report["stats"]["calls"] == 6
        assert report["stats"]["token_hit_rate"] > 0.8  # the endpoint's cache was warm
        assert list(report["replicas"]) == ["0"] and report["replicas"]["0"]["calls"] == 6
    finally:
        endpoint.shutdown()


async def test_killing_a_replica_mid_run_loses_nothing(cluster, reference):
    inputs = calls(16, tasks=2)
    want = [answer(r) for r in (await reference(SUMMARY, inputs))[0]]
    pids = {rid: info["pid"] for rid, info in cluster.wait_ready().items()}
    job = asyncio.create_task(cluster.map(SUMMARY, inputs, chunk_size=2, concurrency=8))
    while not any(cluster.router.loads.values()):
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)
    victim = max(cluster.router.loads, key=cluster.router.loads.get)
    ray.kill(cluster.handles[victim])
    got = await job
    assert [answer(r) for r in got] == want
    assert cluster.retries >= 1 and len(cluster.lost) == 1 and victim not in cluster.handles
    after = cluster.wait_ready()  # the replacement started and serves
    assert len(after) == 2 and pids[victim] not in {info["pid"] for info in after.values()}
    again = await cluster.map(SUMMARY, inputs[:4])
    assert [answer(r) for r in again] == want[:4]


async def test_a_replacement_warms_a_lost_replicas_prefixes_from_the_shared_disk(local_ray, folder, reference,
                                                                                  tmp_path):
    """Replicas sharing a disk tier folder: a lost replica's replacement takes over its routes and loads their
    prefixes from the files its predecessor wrote, instead of prefilling them; the results are unchanged."""
    disk = tmp_path / "kv"
    c = Cluster(f"hf:{folder}", replicas=2, max_respawns=1, disk_cache=str(disk), **OPTIONS)
    try:
        infos = c.wait_ready()
        assert c.disk_shared and {info["disk"] for info in infos.values()} == {str(disk.resolve())}
        inputs = calls(8, tasks=2)
        want = [answer(r) for r in (await reference(CLASSIFY, inputs))[0]]
        got = await c.map(CLASSIFY, inputs[:4])
        deadline = time.monotonic() + 60
        while len(list(disk.glob("*/*/*.kv"))) < 2 and time.monotonic() < deadline:  # (each task's prompt)
            await asyncio.sleep(0.1)
        text = shots(0) + "Review: "
        (owner,) = [r for r, tree in c.router.trees.items() if tree.match(text) == len(text)]
        routes = c.router.trees[owner]
        ray.kill(c.handles[owner])
        got += await c.map(CLASSIFY, inputs[4:])
        assert [answer(r) for r in got] == want
        assert c.retries >= 1 and owner not in c.handles
        (new,) = [r for r in c.handles if r not in infos]
        assert c.router.trees[new] is routes  # the lost replica's calls go to its replacement ...
        stats = await c.areplica_stats()
        assert stats[new].disk_hits >= 1 and stats[new].tokens_from_disk > 0  # ... which read their prefix from disk
    finally:
        c.shutdown()
