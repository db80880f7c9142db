"""STOPS_AT / STOPS_BEFORE on holes where the stop must fire, with the exact value checked.

`REGEX(X, forcing(text, value, ...))` forces the model to write `text` (every token keeps the value a prefix of
it, and the value may not end before it holds `value`, nor inside STOPS_BEFORE's string), so a stop string
inside it must fire, and its value `value` satisfies the constraint (a value cut where its constraint does not
let it end would be refused); sampled runs on a random model (temperature 1, near-uniform logits) reach that
text through many different tokenizations, so the stop string often falls inside a token (`lo w` inside
` world`, `\\n` inside `.\\n`, a 2-byte `é` split over tokens) and the engine has to cut the token and
re-tokenize the rest. Every result must have exactly the expected value, the prompt must continue right after
it, and the next hole must see the ids of exactly that text.
"""
from __future__ import annotations

import re

import pytest

import lmq_backend as lmq


def forcing(text: str, value: str, stop: str = "") -> str:
    """A regular expression that `value` (a prefix of `text`) matches, and the prefixes of `text` that go on
    past `value + stop` (STOPS_BEFORE's `stop`: the value may not end inside it)."""
    out = ""
    for ch in reversed(text[len(value + stop):]):
        out = f"(?:{re.escape(ch)}{out})?"
    return re.escape(value) + (f"(?:{re.escape(stop)}{out})?" if stop else out)


FORCED = [
    # forced text, rule, stop string, the value
    ("Hello world, again", "STOPS_AT", "lo w", "Hello w"),
    ("Hello world, again", "STOPS_BEFORE", "lo w", "Hel"),
    ("Answer: 42.\nNext one", "STOPS_AT", "\n", "Answer: 42.\n"),
    ("Answer: 42.\nNext one", "STOPS_BEFORE", "\n", "Answer: 42."),
    ("Answer: 42.\nNext one", "STOPS_BEFORE", ".\nNe", "Answer: 42"),
    ("a, b; c, d", "STOPS_AT", ",", "a,"),  # the first occurrence
    ("a, b; c, d", "STOPS_BEFORE", "; c", "a, b"),
    ("café au lait", "STOPS_AT", "é", "café"),
    ("café au lait", "STOPS_BEFORE", "é", "caf"),
    ("café au lait", "STOPS_BEFORE", "au", "café "),
    ("Hello world", "STOPS_BEFORE", "Hel", ""),  # fires within the first token(s): an empty value
    ("Hello world", "STOPS_AT", "world", "Hello world"),  # the forced text's last token
]


def record_generate(backend) -> list[tuple[str, list[int]]]:
    """Spy on backend.generate: (seq.text, seq.ids) as each hole starts."""
    seen: list[tuple[str, list[int]]] = []
    original = backend.generate

    async def spy(seq, state, sampler):
        seen.append((seq.text, list(seq.ids)))
        return await original(seq, state, sampler)

    backend.generate = spy
    return seen


def spelled(backend, ids: list[int]) -> str:
    start = len(backend.sequence("t").ids)
    return backend.vocab.decode_bytes(ids[start:]).decode("utf-8")


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("forced,rule,stop,value", FORCED)
async def test_a_forced_stop_gives_the_exact_value(make_backend, kind, forced, rule, stop, value):
    backend = make_backend(kind)
    seen = record_generate(backend)
    regex = forcing(forced, value, stop if rule == "STOPS_BEFORE" else "")
    source = (f'sample(n=6, temperature=1.0, seed=0)\n'
              f'    "Say:[X]" where REGEX(X, {regex!r}) and {rule}(X, {stop!r}) and len(TOKENS(X)) < 40\n'
              f'    " and then[Y]" where len(TOKENS(Y)) < 3')
    results = await lmq.compile(source, model=backend)()
    assert [r["X"] for r in results] == [value] * 6
    if rule == "STOPS_AT":
        assert value.endswith(stop) and stop not in value[:-1]
    else:
        assert stop not in value and forced.startswith(value + stop)
    for r in results:
        assert r.prompt == "Say:" + value + " and then" + r["Y"]
    # the later hole sees exactly the text so far, as ids that spell it
    later = [(text, ids) for text, ids in seen if text.endswith(" and then")]
    assert len(later) == 6
    for text, ids in later:
        assert text == "Say:" + value + " and then"
        assert spelled(backend, ids) == text
    assert backend.trie.pinned_nodes() == 0


async def test_the_forced_values_were_reached_through_split_tokens(make_backend):
    """The point of the sampled runs above: the stop string often lies inside a generated token."""
    backend = make_backend("llama")
    tokens_seen = []
    original = backend.generate

    async def spy(seq, state, sampler):
        value = await original(seq, state, sampler)
        tokens_seen.append(list(state.tokens))
        return value

    backend.generate = spy
    q = lmq.compile('sample(n=12, temperature=1.0, seed=0)\n'
                    f'    "Say:[X]" where REGEX(X, {forcing("Hello world, again", "Hello w")!r})'
                    ' and STOPS_AT(X, "lo w")'
                    ' and len(TOKENS(X)) < 40', model=backend)
    results = await q()
    assert {r["X"] for r in results} == {"Hello w"}
    vocab = backend.vocab
    ends_inside = 0
    for toks in tokens_seen:
        text = vocab.decode_bytes(toks).decode("utf-8")
        assert text.startswith("Hello w")
        ends_inside += text != "Hello w"  # the last token went past the stop string's end: it was cut
    assert ends_inside >= 3 and len({tuple(t) for t in tokens_seen}) >= 3


async def test_a_value_its_constraint_refuses_is_never_returned(make_backend):
    """The token limit ends a value only where its constraint lets it end: the last token it allows is one
    after which the value may end (`X in [...]`: a one-token option), and where none is, or a stop string cuts
    the value where the constraint does not let it end, the call fails naming the hole; a beam that ends so is
    dropped, the others go on."""
    backend = make_backend("llama")
    options = '[" strawberry milkshake deluxe", " fig"]'
    r = await lmq.compile(f'"Fruit:[X]" where X in {options} and len(TOKENS(X)) < 2', model=backend)()
    assert r["X"] == " fig"
    results = await lmq.compile('beam(n=8)\n    "Fruit:[X]" where X in [" apple pie", " fig"] and STOPS_AT(X, " app")',
                                model=backend)()
    assert results and {r["X"] for r in results} == {" fig"}  # (every way to " apple pie" stops at " app")
    with pytest.raises(lmq.LMQUnsatisfiedError, match=r"line 2: hole \[X\]: the constraint cannot be satisfied"):
        await lmq.compile('"A"\n"Code:[X]" where REGEX(X, r"[0-9]{5}") and len(TOKENS(X)) < 3', model=backend)()
    with pytest.raises(lmq.LMQUnsatisfiedError, match=r"line 1: hole \[X\]: .*STOPS_AT\(' app'\) ended the value "
                                                      r"at ' app'"):
        await lmq.compile('"Dessert:[X]" where X in [" apple pie"] and STOPS_AT(X, " app")', model=backend)()
    assert backend.trie.pinned_nodes() == 0


async def test_a_limit_that_leaves_room_for_an_option_gives_one_on_the_default_model(default_backend):
    """The default model spells `" apple pie"` a token a few bytes (`" "`, `"a"`, `"p"`, ...) under the options'
    mask: a token limit that leaves room for an option never leads it where no option fits in the rest (`" a"`
    with two tokens left, where `"pple pie"` takes three); the value is an option, never an error."""
    for limit in (4, 5, 8):
        q = lmq.compile(f'"Another:[Y]" where Y in [" apple pie", " pear"] and len(TOKENS(Y)) < {limit}',
                        model=default_backend)
        r = await q()
        assert r["Y"] in (" apple pie", " pear")
        assert len(default_backend.tokenizer.encode(r["Y"], add_special_tokens=False)) < limit
    q = lmq.compile('"Another:[Y]" where Y in [" apple", " pear"] and len(TOKENS(Y)) < 4', model=default_backend)
    r = await q()
    assert r["Y"] == " apple"  # (the option it takes without a limit)


@pytest.mark.slow
@pytest.mark.parametrize("rule,value", [("STOPS_AT", " 6, 7, 8"), ("STOPS_BEFORE", " 6, 7, ")])
async def test_stop_fires_on_the_default_model(default_backend, rule, value):
    """The default model counts on; the stop text is in its greedy continuation, so the stop must fire."""
    q = lmq.compile(f'"Count: 1, 2, 3, 4, 5,[REST]" where {rule}(REST, "8") and len(TOKENS(REST)) < 20\n'
                    f'" and after that comes[NEXT]" where len(TOKENS(NEXT)) < 4')
    seen = record_generate(default_backend)
    try:
        r = await q()
    finally:
        del default_backend.generate  # the spy was an instance attribute
    assert r["REST"] == value
    assert r.prompt == "Count: 1, 2, 3, 4, 5," + value + " and after that comes" + r["NEXT"]
    text, ids = seen[1]
    assert text == "Count: 1, 2, 3, 4, 5," + value + " and after that comes" == spelled(default_backend, ids)
