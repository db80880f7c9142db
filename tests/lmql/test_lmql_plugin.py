"""The LMQL plugin (issue #7): real LMQL 0.7.3 queries served by lmq on the default model (SmolLM2-135M).

Skipped only when lmql is not installed. In-process (`async_transport=True`) on a backend of its own
(registered as "lmql-test": the other tests' default backend lives on pytest's event loop, the plugin's on
its own), plus one query in LMQL's default `local:` (subprocess) mode.
"""
from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import lmql

import lmq_backend  # noqa: E402
import lmq_backend.lmql.plugin as lmq_lmql  # noqa: E402
from lmq_backend.runtime.decoders import Greedy, Sampling  # noqa: E402
from lmq_backend.backend.default_model import default_model_dir  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
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


BOS = "<|im_start|>"  # LMQL starts every prompt with the tokenizer's BOS token; lmq's queries do not


def lmq_query(body: str, **kwargs):
    """lmq's own engine (the default backend, not the plugin's) on the token ids LMQL gives the model: the
    same prompt, after the BOS token LMQL puts first."""
    return lmq_backend.compile(body.replace('"', '"' + BOS, 1), model="default", **kwargs)


CHOICE_INT_STOP = '''
"Review: {review}\\nSentiment:[CLS]" where CLS in [" positive", " negative", " neutral"]
"\\nStars (1-5):[N]" where INT(N) and len(TOKENS(N)) < 3
"\\nSummary:[WHY]" where STOPS_AT(WHY, ".") and len(TOKENS(WHY)) < 16
'''


@pytest.mark.parametrize("review", ["Great food and friendly staff.", "Terrible. Never again!"])
async def test_choice_int_stops_at(model, default_backend, review):
    q = lmql.query(CHOICE_INT_STOP + "return CLS, N, WHY", model=model)
    cls, n, why = await q(review=review)
    mine = await lmq_query(CHOICE_INT_STOP)(review=review)
    # the answers lmq's engine gives on the same ids (LMQL turns an INT value into an int)
    assert (cls, n) == (mine["CLS"], int(mine["N"]))
    assert cls == {"Great food and friendly staff.": " positive", "Terrible. Never again!": " negative"}[review]
    assert why.endswith(".") or "." not in why  # (the later prompt is tokenized differently by LMQL)


async def test_loop_of_holes(model, default_backend):
    body = '''
"A shopping list:\\n"
items = []
for i in range(3):
    "-[ITEM]" where STOPS_AT(ITEM, "\\n") and len(TOKENS(ITEM)) < 8
    items.append(ITEM)
return items
'''
    items = await lmql.query(body, model=model)()
    assert len(items) == 3
    assert all("\n" not in i[:-1] for i in items)
    assert items == await lmq_query(body)()


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


async def test_gather_and_prefix_reuse(model, backend, default_backend):
    shots = W.w1_shots(12)
    q = lmql.query('"{shots}Review: {review}\\nSentiment:[CLS]" where CLS in ' + repr(OPTIONS) + "\nreturn CLS",
                   model=model)
    reviews = W.w1_reviews(4)
    one_by_one = [await q(shots=shots, review=r) for r in reviews]
    mine = lmq_query('"{shots}Review: {review}\\nSentiment:[CLS]" where CLS in ' + repr(OPTIONS))
    assert one_by_one == [(await mine(shots=shots, review=r))["CLS"] for r in reviews]
    assert len(set(one_by_one)) >= 2  # (not one answer for every review)
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


# ----- the README's claims: automatic tokenizer, model folders, arguments, mask_chunk, the LMTP server ----

from support.folders import tiny_folder  # noqa: E402,F401 - a fixture

GENERATE = ('"Review: {review}\\nSentiment:[X]" where len(TOKENS(X)) < 6\n'
            '"\\nScore:[N]" where N in [" 1", " 2", " 3", " 4", " 5"]\nreturn X, N')


async def answers(model, reviews) -> list:
    q = lmql.query(GENERATE, model=model)
    return [await q(review=r) for r in reviews]


async def expected_answers(folder, reviews) -> list:
    """What LMQL's own transformers backend answers on the folder (in-process): the same LMQL, the same
    weights, no lmq; a random model's greedy text changes with the review, so a wrong context shows."""
    got = await answers(lmql.model(f"local:{folder}", tokenizer=str(folder), async_transport=True), reviews)
    assert len({x for x, _ in got}) == len(reviews)
    return got


REVIEWS = ["Great food and friendly staff.", "Terrible. Never again!", "It was fine.", "Cold soup.", "Lovely!"]


async def test_model_finds_the_tokenizer(backend, tiny_folder):  # noqa: F811
    """lmq_lmql.model(SPEC) passes LMQL the tokenizer folder of SPEC's backend, for a registered name, an
    `hf:` folder and a bare folder; the folder's model then answers as LMQL's own backend does."""
    assert lmq_lmql.model("lmql-test").configuration["tokenizer"] == str(default_model_dir())
    assert lmq_lmql.model("default").configuration["tokenizer"] == str(default_model_dir())
    for spec in (f"hf:{tiny_folder}", str(tiny_folder)):
        m = lmq_lmql.model(spec, async_transport=True)
        assert m.configuration["tokenizer"] == str(tiny_folder)
    assert await answers(m, REVIEWS[:3]) == await expected_answers(tiny_folder, REVIEWS[:3])


def test_model_arguments_reach_the_backend(tiny_folder, monkeypatch):  # noqa: F811
    m = lmq_lmql.LMQModel(f"lmq:hf:{tiny_folder}", device="cpu", dtype="float64", cache_budget=0, batch_size=4)
    assert m.max_batch_size == 4
    assert {p.dtype for p in m.backend.model.parameters()} == {torch.float64}
    tok = m.backend.vocab.tokenizer
    ids = np.array([tok("The capital of France is").input_ids])
    cached = lmq_lmql.LMQModel(f"lmq:hf:{tiny_folder}", device="cpu", dtype="float64")
    for model in (m, cached):
        for _ in range(2):
            model.generate(ids, np.ones_like(ids), 0.0, 2, None, None)
    assert m.backend.stats().tokens_reused == 0 < m.backend.stats().tokens_requested  # cache_budget=0
    assert cached.backend.stats().tokens_reused > 0  # (the same calls with the cache on reuse the prompt)
    # LMQL's own spellings: torch_dtype= (its rename of dtype=) and device_map="auto" (its cuda=True)
    seen = []

    class Recorder:
        def __init__(self, path, **kwargs):
            seen.append((path, kwargs))
            self.vocab = m.backend.vocab

    monkeypatch.setattr("lmq_backend.backend.hf.HFBackend", Recorder)
    monkeypatch.setattr(lmq_lmql, "_backends", {})
    with pytest.warns(UserWarning, match="ignoring LMQL model arguments.*'unknown'"):
        lmq_lmql.LMQModel("lmq:/some/dir", torch_dtype=torch.bfloat16, device_map="auto", unknown=1)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (without CUDA: a warning, see test_lmql_failures)
    assert seen == [("/some/dir", {"dtype": "bfloat16", "device": device})]


def test_mask_chunk(backend):
    """Under an allow-list (every row's bias allows a few tokens), lmq returns one token per call; with
    mask_chunk=16 up to 16, as LMQL's own backends do; the first token is the same."""
    tok = backend.vocab.tokenizer
    ids = np.array([tok("Count: 1, 2, 3, 4, 5,").input_ids])
    digits = {tok.convert_tokens_to_ids(d): 100.0 for d in "0123456789"} | {tok.convert_tokens_to_ids("Ġ"): 100.0}

    def new_tokens(m) -> list[int]:
        out = m.generate(ids, np.ones_like(ids), 0.0, 8, [digits], None)
        return out.sequences[0, ids.shape[1]:].tolist()

    one = new_tokens(lmq_lmql.LMQModel("lmq:lmql-test"))
    many = new_tokens(lmq_lmql.LMQModel("lmq:lmql-test", mask_chunk=16))
    assert len(one) == 1 and len(many) == 8 and many[0] == one[0]
    assert set(many) <= set(digits)


async def test_mask_chunk_gives_the_same_answers(backend):
    body = "\n".join(CHOICE_INT_STOP.strip().splitlines()[:2]) + "\nreturn CLS, N"  # the masked holes
    q1 = lmql.query(body, model=lmq_lmql.model("lmql-test", async_transport=True))
    q16 = lmql.query(body, model=lmq_lmql.model("lmql-test", async_transport=True, mask_chunk=16))
    assert await q1(review=REVIEWS[1]) == await q16(review=REVIEWS[1]) == (" negative", 1)


def test_an_allow_list_picks_and_scores_as_the_whole_vocabulary(backend):
    """A row whose bias allows a few tokens is picked from and scored on those alone: the same greedy token
    (the first of tied maxima), the same sampled token for the same draw, and the log-probabilities of the
    whole [V] row, with and without the engine narrowing the allowed tokens; a bias's mask is made once."""
    from dataclasses import replace

    from lmq_backend.lmql.calls import LMQLCalls, _BiasSampler

    calls = LMQLCalls(backend)
    V = backend.vocab.size
    g = torch.Generator().manual_seed(3)
    eos = calls.eos_token_id
    for bias in ({5: 100.0, 900: 100.0, 17000: 100.0, 40000: 100.0}, {12: 100.0, 13: 100.0, eos: 100.0},
                 {7: 100.0, 8: 99.0, 9: 30.0}):
        mask = calls.mask(bias)
        assert calls.mask(dict(reversed(bias.items()))) is mask and mask.ids is not None
        whole = replace(mask, ids=None, bias_at_ids=None, _on={})  # the same mask, picked over [V]
        for trial in range(6):
            logits = torch.randn(V, generator=g) * 4
            if trial % 2:  # tied maxima among the allowed tokens: the first one is the pick
                logits[mask.ids] = logits[mask.ids].max()
            narrowed = None if trial < 3 else torch.from_numpy(mask.allowed_np.copy())
            if narrowed is not None:
                narrowed[int(mask.ids[0])] = False
            picks = []
            for m in (mask, whole):
                for inner in (Greedy(), Sampling(1.0, seed=trial)):
                    got = []
                    sampler = _BiasSampler(inner, m, type("Batch", (), {"push": lambda _, *a: got.append(a)})(), 0)
                    token = sampler.select(logits.clone(), narrowed)
                    [(_, pushed, scores)] = got
                    assert pushed == token and mask.allowed_np[token]
                    picks.append((token, scores.dense()))
            for (a, sa), (b, sb) in zip(picks[:2], picks[2:]):
                assert a == b
                assert np.array_equal(np.isinf(sa), np.isinf(sb))
                assert np.allclose(sa[~np.isinf(sa)], sb[~np.isinf(sb)], atol=1e-5)
            expect = torch.where(mask.allowed & (narrowed if narrowed is not None else True),
                                 logits + mask.bias, torch.tensor(float("-inf")))
            assert picks[0][0] == int(torch.argmax(expect))
    assert calls.mask({5: 100.0}) is not calls.mask({6: 100.0})


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


async def test_lmtp_server(tiny_folder):  # noqa: F811
    """`python -m lmq_backend.lmql.plugin lmq:hf:<dir> --port P` serves LMQL clients over LMTP."""
    import socket
    import subprocess

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "lmq_backend.lmql.plugin", f"lmq:hf:{tiny_folder}",
                               "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(600):  # wait for it to listen (a hang guard: it takes seconds)
            assert server.poll() is None, server.stdout.read()
            try:
                socket.create_connection(("localhost", port), timeout=1).close()
                break
            except OSError:
                await asyncio.sleep(0.2)
        m = lmql.model(f"lmq:hf:{tiny_folder}", endpoint=f"localhost:{port}", tokenizer=str(tiny_folder))
        assert await answers(m, REVIEWS[3:]) == await expected_answers(tiny_folder, REVIEWS[3:])
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_the_model_string_alone_is_enough():
    """SPEC 7 / issue #16: with lmq installed, a fresh interpreter that imports only lmql switches to lmq by
    the model string (the wheel's lmq-lmql.pth hooks LMQL; no tokenizer= argument), in LMQL's default
    subprocess mode and in-process, and answers as lmq's own engine does."""
    import subprocess

    script = ("import asyncio, lmql\n"
              "q = '\"Review: Terrible. Never again!\\\\nSentiment:[X]\" where X in [\" positive\", \" negative\"]\\nreturn X'\n"
              "async def main():\n"
              "    for m in (lmql.model('local:lmq:default'), lmql.model('local:lmq:default', async_transport=True)):\n"
              "        print(repr(await lmql.query(q, model=m)()))\n"
              "asyncio.run(main())\n")
    env = {k: v for k, v in os.environ.items() if k != "LMQ_LMQL_HOOK"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["' negative'"] * 2
    # the hook is what switches it: without it, LMQL finds no tokenizer for "lmq:default"
    off = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                         env={**env, "LMQ_LMQL_HOOK": "0"})
    assert off.returncode != 0 and "TokenizerNotAvailableError" in off.stderr


# ----- the model process: LMTP calls served without LMQL's scheduler --------------------------------------

def test_the_model_process_streams_the_payloads_lmqls_scheduler_would(backend):
    """`stream_generate` / `stream_score` (what lmq's model process runs per LMTP call) send the token payloads
    LMQL's own scheduler sends for a batch of that one call (`TokenStreamer` / `ScoreStreamer` over
    `generate` / `score`): the same tokens, top tokens and finish reasons, and log-probabilities up to the
    rounding of a prefill that found the prompt in the trie (the second of the two runs)."""

    def same_but_rounding(mine: list[dict], theirs: list[dict]) -> None:
        assert [{**p, "logprob": 0, "top_logprobs": list(p["top_logprobs"])} for p in mine] == \
            [{**p, "logprob": 0, "top_logprobs": list(p["top_logprobs"])} for p in theirs], (bias, kwargs)
        for a, b in zip(mine, theirs):
            assert np.isclose(a["logprob"], b["logprob"], atol=1e-4)
            assert np.allclose(list(a["top_logprobs"].values()), list(b["top_logprobs"].values()), atol=1e-4)

    from queue import Queue

    from lmql.models.lmtp.lmtp_scheduler import GenerateBatch, GenerateCall, ScoreStreamer, TokenStreamer

    from lmq_backend.lmql.calls import LMQLCalls, run

    calls = LMQLCalls(backend)
    tok = backend.vocab.tokenizer
    prompt = tok("Review: Great food and friendly staff.\nSentiment:").input_ids
    choice = {t: 100.0 for o in OPTIONS for t in tok(o).input_ids[:1]}
    cases = [(choice, {"max_tokens": 1}), ({}, {"max_tokens": 5, "top_logprobs": 3}),
             (None, {"max_tokens": 3}), ({tok(" 4").input_ids[0]: 100.0, calls.eos_token_id: 100.0}, {})]
    for bias, kwargs in cases:
        out: Queue = Queue()
        batch = GenerateBatch.from_calls([GenerateCall(prompt, bias, kwargs, 7, out)])
        args = batch.generate_args()
        args["input_ids"] = np.array(args["input_ids"], dtype=np.int64)
        args["attention_mask"] = np.array(args["attention_mask"], dtype=np.int32)
        streamer = TokenStreamer(batch, calls.eos_token_id)
        result = calls.generate(**args, streamer=streamer)
        streamer.log_token(result.sequences, result.scores, last=True)
        theirs = [out.get()[1] for _ in range(out.qsize())]
        mine = []
        run(calls.stream_generate(prompt, bias, kwargs, lambda p: mine.append({**p, "stream_id": 7})))
        same_but_rounding(mine, theirs)
        assert mine[-1]["finish_reason"] is not None and all(p["finish_reason"] is None for p in mine[:-1])

    scored = tok(" positive and kind").input_ids
    for head in (prompt, []):
        out = Queue()
        call = GenerateCall(head + scored, {}, {"score": True, "scoring_offset": len(head)}, 9, out)
        batch = GenerateBatch.from_calls([call])
        ScoreStreamer().log_token(batch, calls.score(np.array(batch.input_ids), np.array(batch.attention_mask)))
        theirs = [out.get()[1] for _ in range(out.qsize())]
        mine = []
        run(calls.stream_score(head, scored, lambda p: mine.append({**p, "stream_id": 9})))
        assert [p["token"] for p in mine] == [p["token"] for p in theirs] == scored
        assert np.allclose([p["logprob"] for p in mine], [p["logprob"] for p in theirs], atol=1e-5)
        assert [p["finish_reason"] for p in mine] == [p["finish_reason"] for p in theirs]


async def test_the_model_process_answers_as_in_process(tiny_folder):  # noqa: F811
    """LMQL's default `local:` mode (lmq's model process, its calls as tasks of its own) answers what the
    in-process mode (LMQL's scheduler over `LMQModel`) answers: generated holes, a choice, a distribution
    (scored), one call at a time and calls at once."""
    sub = lmql.model(f"local:lmq:hf:{tiny_folder}")
    inproc = lmq_lmql.model(f"hf:{tiny_folder}", async_transport=True)
    assert await answers(sub, REVIEWS) == await answers(inproc, REVIEWS)
    q = lmql.query(GENERATE, model=sub)
    assert await asyncio.gather(*(q(review=r) for r in REVIEWS)) == await answers(inproc, REVIEWS)
    dist = '''argmax
    "Review: {review}\\nScore:[N]\\nSentiment:[CLS]"
where len(TOKENS(N)) < 3
distribution CLS in [" good", " bad", " fine"]'''
    for review in REVIEWS[:2]:
        a, b = [await lmql.run(dist, model=m, review=review) for m in (sub, inproc)]
        assert a.variables["CLS"] == b.variables["CLS"] and a.variables["N"] == b.variables["N"]
        assert np.allclose([p for _, p in a.variables["log P(CLS)"]], [p for _, p in b.variables["log P(CLS)"]],
                           atol=1e-4)
