"""The LMQL plugin (issue #7): real LMQL 0.7.3 queries served by lmq on the default model (SmolLM2-135M).

Skipped only when lmql is not installed. In-process (`async_transport=True`) on a backend of its own
(registered as "lmql-test": the other tests' default backend lives on pytest's event loop, the plugin's on
its own), plus one query in LMQL's default `local:` (subprocess) mode.
"""
from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

lmql = pytest.importorskip("lmql")

import lmq_backend  # noqa: E402
import lmq_backend.lmql_plugin as lmq_lmql  # noqa: E402
from lmq_backend.backend.default_model import default_model_dir  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import workloads as W  # noqa: E402

pytestmark = pytest.mark.slow
OPTIONS = [" positive", " negative", " neutral"]


@pytest.fixture(scope="module")
def backend():
    b = lmq_backend.HFBackend("default", name="lmql-test")
    lmq_backend.register_backend("lmql-test", b)
    return b


@pytest.fixture(scope="module")
def model(backend):
    return lmq_lmql.model("lmql-test", tokenizer=str(default_model_dir()), async_transport=True)


async def test_choice_int_stops_at(model):
    q = lmql.query('''
"Review: {review}\\nSentiment:[CLS]" where CLS in [" positive", " negative", " neutral"]
"\\nStars (1-5):[N]" where INT(N) and len(TOKENS(N)) < 3
"\\nSummary:[WHY]" where STOPS_AT(WHY, ".") and len(TOKENS(WHY)) < 16
return CLS, N, WHY
''', model=model)
    cls, n, why = await q(review="Great food and friendly staff.")
    assert cls in OPTIONS
    assert re.fullmatch(r" ?-?\d+", str(n))
    assert why.endswith(".") or "." not in why


async def test_loop_of_holes(model):
    q = lmql.query('''
"A shopping list:\\n"
items = []
for i in range(3):
    "-[ITEM]" where STOPS_AT(ITEM, "\\n") and len(TOKENS(ITEM)) < 8
    items.append(ITEM)
return items
''', model=model)
    items = await q()
    assert len(items) == 3
    assert all("\n" not in i[:-1] for i in items)


async def test_distribution_matches_reference(model, backend):
    # (LMQL 0.7.3 skips the distribution clause of a query without any other hole, so there is one)
    options = [" positive", " negative", " very negative"]
    result = await lmql.run('''argmax
    "Review: The soup was cold and the waiter was rude.\\nRating (1-5):[N]\\nSentiment:[CLS]"
where INT(N) and len(TOKENS(N)) < 3
distribution CLS in ''' + repr(options), model=model)
    got = dict(result.variables["log P(CLS)"])
    prompt = result.prompt[: -len(result.variables["CLS"])]
    # reference: LMQL's rule (mean token log-probability per option, then log-softmax) on a plain forward
    tok, hf = backend.vocab.tokenizer, backend.model
    ids = [tok.bos_token_id] + tok(prompt).input_ids
    means = []
    for o in options:
        cont = tok(o).input_ids
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([ids + cont])).logits[0].float(), -1)
        means.append(np.mean([logp[len(ids) - 1 + j, t].item() for j, t in enumerate(cont)]))
    ref = np.array(means) - np.logaddexp.reduce(means)
    assert np.allclose([got[o] for o in options], ref, atol=2e-3)
    assert result.variables["CLS"] == options[int(np.argmax(ref))]


async def test_gather_and_prefix_reuse(model, backend):
    shots = W.w1_shots(12)
    q = lmql.query('"{shots}Review: {review}\\nSentiment:[CLS]" where CLS in ' + repr(OPTIONS) + "\nreturn CLS",
                   model=model)
    reviews = W.w1_reviews(4)
    one_by_one = [await q(shots=shots, review=r) for r in reviews]
    assert all(a in OPTIONS for a in one_by_one)
    assert await asyncio.gather(*(q(shots=shots, review=r) for r in reviews)) == one_by_one

    # a second call of the compiled query prefills only its new review: the shots come from the trie
    before = backend.stats()
    assert await q(shots=shots, review="The coffee was cold and bitter.") in OPTIONS
    after = backend.stats()
    reused = after.tokens_reused - before.tokens_reused
    requested = after.tokens_requested - before.tokens_requested
    assert reused >= 0.85 * requested and reused >= len(backend.vocab.encode(shots)) - 2
    assert after.token_hit_rate > 0.5


def test_generate_contract(backend):
    """LMQL's batch contract: left padding, per-row bias dicts, streamed whole-batch steps, EOS padding."""
    m = lmq_lmql.LMQModel("lmq:lmql-test")
    tok = backend.vocab.tokenizer
    a, b = tok("The capital of France is").input_ids, tok("1, 2, 3,").input_ids
    width = max(len(a), len(b))
    ids = np.array([[0] * (width - len(r)) + r for r in (a, b)])
    mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in (a, b)])
    digits = {t: 100.0 for t in tok(" 4").input_ids}
    steps = []
    out = m.generate(ids, mask, 0.0, 4, [{}, {**digits, m.eos_token_id: 100.0}],
                     lambda seqs, scores: steps.append((seqs.copy(), scores[-1].copy())))
    assert out.sequences.shape[0] == 2 and out.scores[-1].shape[0] == 2
    n = out.sequences.shape[1] - width
    assert 1 <= n <= 4 and len(steps) == n - 1
    for k, (seqs, scores) in enumerate(steps):
        assert seqs.shape == (2, width + k + 1) and np.array_equal(seqs, out.sequences[:, : width + k + 1])
        assert np.isclose(np.logaddexp.reduce(scores[0]), 0.0, atol=1e-4)
    row = out.sequences[1, width:].tolist()
    assert set(row) <= set(digits) | {m.eos_token_id}
    scored = m.score(ids, mask)
    assert scored.shape == ids.shape and (scored[:, -1] < 0).all()


async def test_subprocess_mode():
    """LMQL's default `local:` mode runs the model in a subprocess, which inherits the registration."""
    folder = str(default_model_dir())
    q = lmql.query('"Review: Great food and friendly staff.\\nSentiment:[CLS]" where CLS in '
                   + repr(OPTIONS) + "\nreturn CLS", model=lmql.model(f"local:lmq:{folder}", tokenizer=folder))
    assert await q() in OPTIONS
