"""Long contexts on the CPU against the independent transformers reference (tests/support/models.py), with lmq's
C kernels forced on (LMQ_CPU_KERNELS=1): prompts of 1,000-2,000 tokens, so that the C decode attention reads
well past its 1,024th column, and trie hits at varied depths within one batch.

A store page is one token (cache/kv_store.py), so the boundaries a hit can end on are the trie's nodes and the
kernels' tiles. The calls: one alone (it fills the trie), then the others at once with random arrival: the
same call again (its prompt cached but for its last token, at every hole), the same few-shot prefix with
another input (a hit in the middle of a trie node, which splits), the prefix cut at exactly 1,024 tokens
then other text (a hit ending on a boundary of the C attention's 128-column chunks), the prefix cut at 600
tokens, and a ~2,000-token prompt (the prefix and more examples). The batch's rows have different cached
lengths. Each call's tokens equal the reference's (the distribution within 1e-4), on the context-sensitive
models of each family lmq runs differently (~1,500-2,000 tokens) and on the default model (its first four calls, ~1,250 tokens);
a fault test builds the C kernels with the decode attention's scores tripled past column 1,024 and the same
comparison fails, on a test model and on the default model."""
from __future__ import annotations

import random

import pytest
import torch

from support.kernel_faults import TRIPLE_SCORES_PAST_1024, faulty_kernels
from support.models import FAMILIES, SCRIPT, Script, differences, generate, run_engine

pytestmark = pytest.mark.cpu_kernels

CUT = 1024  # the hit that ends on a chunk boundary of the C decode attention (8 x 128 columns)
SHORT_CUT = 600
WORDS = ["alpha", "river", "stone", "cloud", "seven", "green", "table", "quiet", "north", "apple", "lamp", "Review",
         "é", "42", "!", "of the", "matrix", "orbit"]


def encoder(tokenizer):
    return lambda s: tokenizer.encode(s, add_special_tokens=False)


def prefix_text(tokenizer, text: str, n: int) -> str:
    """The text of `text`'s first n tokens: a prefix of `text` that encodes to exactly those tokens."""
    encode = encoder(tokenizer)
    ids = encode(text)
    head = tokenizer.decode(ids[:n])
    assert text.startswith(head) and encode(head) == ids[:n], "choose a text whose first n tokens cut cleanly"
    return head


def long_calls(tokenizer, shots: str, more: str, inputs: list[dict]) -> list[dict]:
    """The calls (see the module docstring) of a query whose input `shots` is its few-shot prefix; `inputs`:
    five dicts of the other inputs."""
    a, b, c, d, e = inputs
    note = "Note: the examples change here.\n\n"
    return [dict(shots=shots, **a), dict(shots=shots, **a), dict(shots=shots, **b),
            dict(shots=prefix_text(tokenizer, shots, CUT) + note, **c),
            dict(shots=prefix_text(tokenizer, shots, SHORT_CUT) + note, **d), dict(shots=more, **e)]


def common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def expected_hits(tokenizer, script: Script, calls: list[dict]) -> dict[str, int]:
    """The cached lengths the batch's first prefills must have (whatever the order the calls arrive in), of
    `long_calls` or its first four."""
    first = script.steps[0][1]
    ids = [encoder(tokenizer)(first.format(**c)) for c in calls]
    hit = lambda j: max(common(ids[j], i) for k, i in enumerate(ids) if k != j)  # noqa: E731
    hits = {"again: all but the last token": len(ids[1]) - 1, "mid-node": common(ids[2], ids[0]),
            "chunk boundary": hit(3)}
    assert hits["chunk boundary"] == CUT and CUT < hits["mid-node"] < len(ids[0]) - 1
    if len(calls) > 4:
        hits["short"] = hit(4)
        assert hits["short"] == SHORT_CUT and len(ids[5]) > len(ids[0]) + 300
    return hits


async def run_long(backend, script: Script, calls: list[dict], monkeypatch) -> tuple[list[tuple], list[int]]:
    """The first call alone, then the others at once; (each call's ids and distribution, every prefilled row's
    cached length)."""
    cached: list[int] = []
    prefill = backend.runner.prefill

    def spy(pool, rows, *args, **kwargs):
        cached.extend(r.cached for r in rows)
        return prefill(pool, rows, *args, **kwargs)

    monkeypatch.setattr(backend.runner, "prefill", spy)
    got = await run_engine(backend, script, calls[:1], batched=False)
    got += await run_engine(backend, script, calls[1:], batched=True, seed=5)
    return got, cached


# --------------------------------------------------------------------------- the context-sensitive models

def model_calls(tokenizer) -> list[dict]:
    rng = random.Random(11)
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    shots = "".join(f"Input: {words(3)}\nOutput: {words(2)}\n\n" for _ in range(120))       # ~1,540 tokens
    more = shots + "".join(f"Input: {words(3)}\nOutput: {words(2)}\n\n" for _ in range(34))  # ~1,980
    inputs = [dict(x=words(rng.randint(1, 3)), y=" " + words(rng.randint(0, 2))) for _ in range(5)]
    return long_calls(tokenizer, shots, more, inputs)


def model_expected(zoo, family: str, calls: list[dict]) -> list[tuple]:
    """The reference's answers: its holes by transformers' `generate(do_sample=False)` (its own KV cache: a
    forward over the whole context at every token costs seconds at these lengths)."""
    key = ("long", family)
    if key not in zoo.memo:
        model = zoo.reference(family)
        zoo.memo[key] = [SCRIPT.reference(model, zoo.tokenizer, c, fill=generate) for c in calls]
    return zoo.memo[key]


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "mistral"])  # (Mistral runs Llama's path)
async def test_long_prompts_with_hits_at_varied_depths_equal_the_reference(zoo, monkeypatch, family):
    monkeypatch.setenv("LMQ_CPU_KERNELS", "1")
    calls = model_calls(zoo.tokenizer)
    hits = expected_hits(zoo.tokenizer, SCRIPT, calls)
    backend = zoo.backend(family, "64MB")
    steps = []
    backend.on_step(steps.append)
    got, cached = await run_long(backend, SCRIPT, calls, monkeypatch)
    assert differences(got, model_expected(zoo, family, calls)) == []
    # the configuration ran as named: every hit depth, rows of different cached lengths in one prefill
    assert set(hits.values()) <= set(cached), (hits, cached)
    assert max(s.batch_size for s in steps if s.kind == "decode") > 1
    assert any(s.kind == "prefill" and s.batch_size > 1 for s in steps)
    assert backend.trie.pinned_nodes() == 0 and backend.scheduler.pool.rows == 0


async def test_the_long_context_comparison_catches_a_fault_past_column_1024(zoo, monkeypatch, tmp_path):
    """The same calls on the C kernels built with the decode attention's scores tripled from column 1,024 on:
    the tokens differ from the reference's (the C attention ran over those columns, and the comparison sees
    it)."""
    from lmq_kernels import cpu

    calls = model_calls(zoo.tokenizer)
    backend = zoo.backend("llama", "64MB")
    with cpu.use(faulty_kernels(tmp_path, TRIPLE_SCORES_PAST_1024)):
        got, _ = await run_long(backend, SCRIPT, calls, monkeypatch)
    assert differences(got, model_expected(zoo, "llama", calls)) != []


# ------------------------------------------------------------------------------------ the default model

QA_SCRIPT = Script((("text", "{shots}Q: {q}\nA:"), ("hole", "A", 16),))


def qa_calls(tokenizer) -> list[dict]:
    """The first four of `long_calls` (a prefill of the default model over 1,000-1,300 tokens takes seconds on a
    small CPU, the reference's too): ~1,250 tokens of few-shot sums."""
    rng = random.Random(3)
    pair = lambda: (rng.randint(2, 60), rng.randint(2, 40))  # noqa: E731
    shots = "".join(f"Q: What is {a} plus {b}?\nA: {a + b}.\n\n" for a, b in (pair() for _ in range(60)))
    inputs = [dict(q=f"What is {a} plus {b}?") for a, b in (pair() for _ in range(5))]
    return long_calls(tokenizer, shots, shots, inputs)[:4]


@pytest.fixture(scope="module")
def qa_reference(default_backend):
    """The default model's calls and the reference's answers: `generate(do_sample=False)` of a second instance
    loaded from the same folder, which lmq never sees."""
    from transformers import AutoModelForCausalLM

    from lmq_backend.backend.default_model import default_model_dir

    tok = default_backend.tokenizer
    calls = qa_calls(tok)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32, use_kernels=False).eval()
    answers: dict[tuple, tuple] = {}  # (the second call is the first one again)
    for c in calls:
        key = tuple(sorted(c.items()))
        if key not in answers:
            answers[key] = QA_SCRIPT.reference(model, tok, c, fill=generate)
    return calls, [answers[tuple(sorted(c.items()))] for c in calls]


@pytest.mark.slow
async def test_the_default_model_on_long_prompts_equals_the_reference(default_backend, qa_reference, monkeypatch):
    from lmq_backend.backend.hf import HFBackend

    monkeypatch.setenv("LMQ_CPU_KERNELS", "1")
    calls, want = qa_reference
    hits = expected_hits(default_backend.tokenizer, QA_SCRIPT, calls)
    backend = HFBackend.from_model(default_backend.model, default_backend.tokenizer, cache_budget="512MB",
                                   name="default-long")
    got, cached = await run_long(backend, QA_SCRIPT, calls, monkeypatch)
    assert differences(got, want) == []
    assert set(hits.values()) <= set(cached), (hits, cached)


@pytest.mark.slow
async def test_the_default_model_comparison_catches_a_fault_past_column_1024(default_backend, qa_reference,
                                                                             monkeypatch, tmp_path):
    from lmq_backend.backend.hf import HFBackend
    from lmq_kernels import cpu

    calls, want = qa_reference
    backend = HFBackend.from_model(default_backend.model, default_backend.tokenizer, cache_budget="512MB",
                                   name="default-long-fault")
    with cpu.use(faulty_kernels(tmp_path, TRIPLE_SCORES_PAST_1024)):
        got, _ = await run_long(backend, QA_SCRIPT, calls, monkeypatch)
    assert differences(got, want) != []
