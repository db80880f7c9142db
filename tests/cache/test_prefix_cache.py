"""The prefix trie in use: reuse across calls, exactness with the cache on and off, budgets, pins."""
from __future__ import annotations

import asyncio
import random

import pytest

import lmq_backend as lmq

WORDS = ["alpha", "beta", "gamma", "delta", "\n\n", " ", "Review:", "é", "ß", "!!", "12", "\n", "the", "cat"]


def random_query(rng: random.Random) -> tuple[str, dict]:
    """A query with a shared-looking prefix, interpolated values and 1-3 holes under random constraints."""
    parts = []
    for h in range(rng.randint(1, 3)):
        text = "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))).replace('"', "")
        constraint = rng.choice([
            f'len(TOKENS(H{h})) < {rng.randint(2, 6)}',
            f'H{h} in [" yes", " no", " maybe so", "!"]',
            f'STOPS_AT(H{h}, "a") and len(TOKENS(H{h})) < 5',
            f'INT(H{h}) and len(TOKENS(H{h})) < 4',
        ])
        parts.append(f'"{text.encode("unicode_escape").decode()}{{v{h}}}[H{h}]" where {constraint}')
    inputs = {f"v{h}": rng.choice(["", " x", "\n\n", "Review: good", "[Z] {y}"]) for h in range(3)}
    return "{prefix}" + "\n".join(parts), inputs


def make_calls(seed: int, n: int = 10) -> list[tuple[str, dict]]:
    rng = random.Random(seed)
    prefixes = ["Few-shot examples:\n\n" * rng.randint(1, 4), "Q: hi\n\nA:", ""]
    queries = [random_query(rng) for _ in range(3)]
    calls = []
    for _ in range(n):
        src, inputs = rng.choice(queries)
        calls.append((src, {**inputs, "prefix": rng.choice(prefixes)}))
    return calls


async def run_calls(backend, calls) -> list:
    out = []
    for src, inputs in calls:
        q = lmq.Query(src.replace("{prefix}", '"{prefix}"\n', 1), model=backend)
        r = await q.run(inputs)
        out.append((r.prompt, r.variables))
        backend.trie.check()
        assert backend.trie.bytes_in_use <= backend.trie.budget_bytes
        assert backend.trie.pinned_nodes() == 0
    return out


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("seed", range(4))
async def test_greedy_output_identical_with_cache_on_and_off(make_backend, kind, seed):
    calls = make_calls(seed)
    reference = await run_calls(make_backend(kind, cache_budget=0), calls)
    budget = random.Random(seed).choice(["64MB", 40_000, 150_000])
    cached_backend = make_backend(kind, cache_budget=budget)
    assert await run_calls(cached_backend, calls) == reference
    shuffled = list(zip(calls, reference))
    random.Random(seed + 100).shuffle(shuffled)
    assert await run_calls(cached_backend, [c for c, _ in shuffled]) == [r for _, r in shuffled]
    assert cached_backend.stats().tokens_reused > 0 or budget == 40_000


async def test_second_identical_call_reuses_all_but_the_last_token(make_backend):
    backend = make_backend("llama")
    q = lmq.compile('"{shots}Review: {review}\\nSentiment:[CLS]" where CLS in [" positive", " negative"]',
                    model=backend)
    shots = "Review: fine.\nSentiment: positive\n\n" * 20
    await q(shots=shots, review="great")
    s1 = backend.stats()
    await q(shots=shots, review="great")
    s2 = backend.stats()
    assert s2.lookups - s1.lookups == 1
    requested = s2.tokens_requested - s1.tokens_requested
    assert s2.tokens_reused - s1.tokens_reused == requested - 1
    await q(shots=shots, review="a different review")
    s3 = backend.stats()
    new_tokens = len(backend.vocab.encode("a different review")) + len(backend.vocab.encode("\nSentiment:"))
    assert s3.tokens_prefilled - s2.tokens_prefilled == new_tokens


async def test_token_boundary_at_double_newline_is_the_same_cold_and_cached(tokenizer, make_backend):
    # The trap: tokenized alone, a prefix ending in "\n\n" is not a prefix of the ids of the full text. lmq
    # tokenizes the text up to a hole as one segment and matches the trie on token ids, so a cached run reuses
    # only the common token prefix and feeds the model exactly the ids of a cold run.
    prefix = "Review: good.\n\n"
    alone = tokenizer.encode(prefix, add_special_tokens=False)
    assert tokenizer.encode(prefix + "Sentiment:", add_special_tokens=False)[: len(alone)] != alone
    src = '"{prefix}"\n"{rest}[X]" where len(TOKENS(X)) < 4'
    calls = [{"prefix": prefix, "rest": ""}, {"prefix": prefix, "rest": "Sentiment:"},
             {"prefix": prefix, "rest": "\nSentiment:"}]
    runs = {}
    for name, backend in (("cold", make_backend("llama", cache_budget=0)), ("warm", make_backend("llama"))):
        seen = []
        original = backend.generate

        async def spy(seq, state, sampler, original=original, seen=seen):
            seen.append(list(seq.ids))
            return await original(seq, state, sampler)

        backend.generate = spy
        q = lmq.Query(src, model=backend)
        runs[name] = ([(await q.run(c)).variables for c in calls], seen, backend.stats())
    assert runs["cold"][:2] == runs["warm"][:2]  # same values, and the model saw the same ids
    ids = runs["warm"][1]
    assert ids[0] == alone and ids[1] == tokenizer.encode(prefix + "Sentiment:", add_special_tokens=False)
    assert runs["warm"][2].tokens_reused > 0 and runs["cold"][2].tokens_reused == 0


async def test_multi_turn_chat_reuses_the_whole_history(make_backend):
    backend = make_backend("llama")
    q = lmq.compile('''
"<|im_start|>system\\nBe brief.<|im_end|>\\n"
for question in questions:
    "<|im_start|>user\\n{question}<|im_end|>\\n<|im_start|>assistant\\n[ANSWER]" where len(TOKENS(ANSWER)) < 6
    "<|im_end|>\\n"
''', model=backend)
    lookups = []  # (prompt tokens, tokens from the trie) of each prefill
    backend.on_step(lambda step: lookups.append((step.new_tokens + step.cached_tokens, step.cached_tokens))
                    if step.kind == "prefill" else None)
    cold = make_backend("llama", cache_budget=0)
    questions = ["Hi!", "What is 2+2?", "Thanks, bye."]
    r = await q.run({"questions": questions})
    assert r.prompt == (await lmq.Query(q.source, model=cold).run({"questions": questions})).prompt
    # Every turn after the first reuses the previous prompt and the answer's tokens; it prefills only the
    # new turn's text (and the answer's last token, which the decode loop never fed to the model).
    new_turn = len(backend.vocab.encode("<|im_end|>\n")) + len(backend.vocab.encode("<|im_start|>user\n"))
    assert len(lookups) == len(questions)
    for (req_prev, _), (req, reused), question in zip(lookups, lookups[1:], questions[1:]):
        assert reused >= req_prev
        turn_text = new_turn + len(backend.vocab.encode(question)) + len(
            backend.vocab.encode("<|im_end|>\n<|im_start|>assistant\n"))
        assert req - reused <= turn_text + 1


async def test_failure_and_cancellation_leave_no_pins(make_backend):
    backend = make_backend("llama")
    failing = lmq.compile('"Some prompt text[X]" where len(TOKENS(X)) < 3\n"{1/0}[Y]"', model=backend)
    with pytest.raises(lmq.LMQRuntimeError):
        await failing()
    assert backend.trie.pinned_nodes() == 0
    backend.trie.check()

    slow = lmq.compile('"Write a long text:[X]" where len(TOKENS(X)) < 400', model=backend)
    task = asyncio.ensure_future(slow())
    for _ in range(5):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert backend.trie.pinned_nodes() == 0
    backend.trie.check()
    # The trie still serves correct results afterwards.
    q = lmq.compile('"Some prompt text[X]" where len(TOKENS(X)) < 3', model=backend)
    cold = lmq.Query(q.source, model=make_backend("llama", cache_budget=0))
    assert (await q()).variables == (await cold.run({})).variables


def test_cache_budget_strings(tokenizer, tiny_models):
    from lmq_backend.backend.budgets import parse_bytes

    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("1.5 GiB") == int(1.5 * 2**30)
    assert parse_bytes(0) == 0
    with pytest.raises(lmq.LMQBackendError):
        parse_bytes("lots")
    for setting in ("cache_budget", "kv_budget"):  # the error names the setting the user wrote
        with pytest.raises(lmq.LMQBackendError, match=f"cannot read {setting} 'lots'"):
            lmq.HFBackend.from_model(tiny_models["llama"], tokenizer, **{setting: "lots"})


@pytest.mark.parametrize("budget", [0, "64MB"])
async def test_sentencepiece_segments_add_no_space(budget):
    """Llama-2-style tokenizers put "▁" before every encoded text; after a hole lmq must not: the ids the
    model sees decode to exactly the prompt text, with the cache on and off."""
    from support.tiny import llama_style_tokenizer, tiny_llama
    from lmq_backend.backend.hf import HFBackend

    tokenizer = llama_style_tokenizer()
    backend = HFBackend.from_model(tiny_llama(vocab_size=len(tokenizer)), tokenizer, cache_budget=budget)
    seen = []
    original = backend.generate

    async def spy(seq, state, sampler):
        value = await original(seq, state, sampler)
        seen.append((list(seq.ids), seq.text))
        return value

    backend.generate = spy
    q = lmq.Query('"hello world,[A] the world[B]" where A in [" big", " small"] and B in [" is", "!"]\n"! hello"',
                  model=backend)
    r = await q.run({})
    assert r.prompt.endswith("! hello") and len(seen) == 2
    start = backend._start_ids
    for ids, text in seen:
        assert ids[: len(start)] == start
        assert backend.vocab.decode_bytes(ids[len(start):]) == b" " + text.encode()  # one leading "▁" only
