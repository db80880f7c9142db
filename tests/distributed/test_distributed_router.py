"""The cluster's router without Ray: the approximate prefix tree, the routing policy, the prompt text a call is
routed by, chunking by prefix, and the statistics summed over replicas."""
from __future__ import annotations

import random

import lmq_backend as lmq
from lmq_backend.cache.stats import CacheStats, TemplateStats
from lmq_backend.distributed.batch import chunk_order
from lmq_backend.distributed.prefix_tree import ApproxPrefixTree, common_prefix_length
from lmq_backend.distributed.render import prompt_prefix, shippable
from lmq_backend.distributed.router import Router, RouterConfig
from lmq_backend.distributed.stats import sum_stats


def test_common_prefix_length_matches_a_loop():
    rng = random.Random(0)
    for _ in range(500):
        a = "".join(rng.choice("ab") for _ in range(rng.randrange(12)))
        b = "".join(rng.choice("ab") for _ in range(rng.randrange(12)))
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix_length(a, b) == want


def test_tree_matches_the_longest_inserted_prefix():
    rng = random.Random(1)
    texts = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 15))) for _ in range(60)]
    tree = ApproxPrefixTree()
    for t in texts:
        tree.insert(t)
    assert tree.size == sum(len(n.edge) for n in tree._nodes())
    for _ in range(300):
        q = "".join(rng.choice("abc") for _ in range(rng.randrange(15)))
        assert tree.match(q) == max(common_prefix_length(q, t) for t in texts)


def test_tree_evicts_least_recently_used_leaves_to_its_budget():
    tree = ApproxPrefixTree(max_chars=30)
    tree.insert("shared-" + "a" * 10)
    tree.insert("shared-" + "b" * 10)   # 7 shared + 10 + 10 = 27 chars
    tree.insert("shared-" + "a" * 10)   # a-branch used again
    tree.insert("shared-" + "c" * 10)   # 37 > 30: the least recently used leaf (b) goes
    assert tree.size <= 30
    assert tree.match("shared-" + "a" * 10) == 17
    assert tree.match("shared-" + "c" * 10) == 17
    assert tree.match("shared-" + "b" * 10) == 7


def test_router_keeps_a_prefix_on_one_replica_and_spreads_new_prefixes():
    router = Router(RouterConfig(balance_abs=1000))
    for r in range(2):
        router.add(r)
    shots = ["Task A. " * 20, "Task B. " * 20, "Task C. " * 20, "Task D. " * 20]
    where = {}
    for i in range(80):
        s = shots[i % 4]
        r = router.choose(s + f"item {i}")
        where.setdefault(s, set()).add(r)
        router.finished(r)
    assert all(len(rs) == 1 for rs in where.values())              # each prefix on one replica
    assert {next(iter(rs)) for rs in where.values()} == {0, 1}     # new prefixes went to the smaller tree
    assert router.counts.prefix == 76 and router.counts.smallest_tree == 4


def test_router_sends_to_the_least_loaded_when_loads_are_uneven():
    router = Router(RouterConfig(balance_abs=4, balance_rel=1.5))
    router.add(0)
    router.add(1)
    picks = [router.choose("same prompt text") for _ in range(12)]  # none finish: loads grow
    first = picks[0]
    assert picks[:5] == [first] * 5              # prefix affinity until max - min exceeds 4 ...
    assert picks[5] == 1 - first                 # ... then the least loaded takes the call
    assert router.counts.least_loaded > 0
    assert max(router.loads.values()) - min(router.loads.values()) <= 5
    router.remove(0)
    assert router.choose("same prompt text") == 1


def test_a_replacement_can_take_over_a_lost_replicas_routes():
    """Where replicas share a disk tier the cluster hands a lost replica's tree to its replacement: the calls
    that went to the lost one go to the new one."""
    router = Router()
    for r in (0, 1):
        router.add(r)
    texts = [f"few-shot prompt {i} " * 20 for i in range(6)]
    where = {t: router.choose(t) for t in texts}
    lost = where[texts[0]]
    tree = router.remove(lost)
    assert tree is not None and lost not in router.trees
    router.add(2, tree)
    assert all(router.choose(t) == (2 if r == lost else r) for t, r in where.items())
    router.add(3)  # (a new replica without one starts empty)
    assert router.trees[3].size == 0


CLASSIFY = lmq.compile('''argmax
    "{shots}Review: {review}\\nSentiment:[CLS]"
    "{tail}"
where CLS in [" positive", " negative"]
''', name="classify")


def test_prompt_prefix_is_the_text_up_to_the_first_hole():
    text = prompt_prefix(CLASSIFY, {"shots": "S1\n", "review": "Nice [X] {y}", "tail": "T"})
    assert text == "S1\nReview: Nice [X] {y}\nSentiment:"
    assert prompt_prefix(CLASSIFY, {"shots": "S1\n"}) == "S1\nReview: "  # a failing expression ends the text


def test_prompt_prefix_formats_fields_as_python_does():
    q = lmq.compile('"{x:>{w}.2f}|{s!r}|{n:,}|{x=}|{s}[Y]"')
    inputs = {"x": 3.14159, "w": 8, "s": "a [X]", "n": 12345}
    assert prompt_prefix(q, inputs) == f"{3.14159:>8.2f}|{'a [X]'!r}|{12345:,}|x={3.14159!r}|a [X]"


def test_prompt_prefix_never_runs_an_expression_that_could_change_its_inputs():
    """The routing prefix is rendered on the client from the inputs the replica then gets: `{todo.pop(0)}` run
    there would leave the replica one item short (a wrong answer, no error). Such a field ends the text; names,
    operators and str methods do not."""
    q = lmq.compile('"{head.strip()} and {' + "' '.join(tags)" + '}: {todo.pop(0)}, then [X]"\nreturn todo')
    inputs = {"head": " Tasks ", "tags": ["a", "b"], "todo": ["wash", "cook", "eat"]}
    assert prompt_prefix(q, inputs) == "Tasks and a b: "
    assert inputs["todo"] == ["wash", "cook", "eat"]


def test_a_shipped_query_keeps_only_what_it_reads():
    q = shippable(CLASSIFY)
    assert q.source == CLASSIFY.source and q.name == "classify"
    assert set(q.scope) <= CLASSIFY._needs and "random" not in q.scope


def test_chunks_group_inputs_by_prefix_and_end_where_a_prefix_ends():
    shots = ["A long shared few-shot prefix number %d. " % k * 3 for k in range(3)]
    texts = [f"{shots[i % 3]}review {i}" for i in range(31)]  # 11, 10 and 10 calls per prefix
    chunks = chunk_order(texts, 4)
    assert sorted(i for c in chunks for i in c) == list(range(31))
    assert all(len(c) <= 4 and len({i % 3 for i in c}) == 1 for c in chunks)  # one prefix per chunk
    assert len(chunks) == 3 + 3 + 3  # 11 -> 4+4+3, 10 -> 4+4+2, 10 -> 4+4+2


def test_sum_stats_adds_counters_gauges_and_templates():
    a = CacheStats(lookups=3, hits=2, tokens_requested=100, tokens_reused=80, tokens_prefilled=20, nodes=4,
                   bytes_in_use=10, per_template={"q": TemplateStats(calls=2, lookups=3, tokens_requested=100,
                                                                     tokens_reused=80, latencies=[0.1, 0.2])})
    b = CacheStats(lookups=1, tokens_requested=50, tokens_prefilled=50, nodes=1, bytes_in_use=5,
                   per_template={"q": TemplateStats(calls=1, lookups=1, tokens_requested=50, latencies=[0.3]),
                                 "r": TemplateStats(calls=1)})
    s = sum_stats([a, b])
    assert (s.lookups, s.hits, s.tokens_requested, s.tokens_reused, s.nodes, s.bytes_in_use) == (4, 2, 150, 80, 5, 15)
    assert s.token_hit_rate == 80 / 150 and s.calls == 4
    assert s.per_template["q"].calls == 3 and sorted(s.per_template["q"].latencies) == [0.1, 0.2, 0.3]
    assert sum_stats([]).lookups == 0
