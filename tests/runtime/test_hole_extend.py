"""`HoleState.extend`: the tokens of a hole at once are the same as advance() of each in turn (value, tokens,
stop), for free holes (taken at once where no stop rule watches the text) and any other."""
from __future__ import annotations

import random

import pytest

from lmq_backend.errors import LMQRuntimeError
from support.constraint_sim import AND, call, compiled, length

CONSTRAINTS = {
    "free": None,
    "limit": length("<", 6, unit="tokens"),
    "stop": call("STOPS_AT", "X", "e"),
    "stop and limit": AND(call("STOPS_BEFORE", "X", " t"), length("<", 9, unit="tokens")),
    "regex": AND(call("REGEX", "X", r"[a-z ]+"), length("<", 7, unit="tokens")),
}


def plain_tokens(vocab, rng: random.Random, n: int) -> list[int]:
    """n random tokens that may extend a value (no special one)."""
    pool = [t for t in range(vocab.size) if not vocab.special[t]]
    return [rng.choice(pool) for _ in range(n)]


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_extend_is_advance_of_each_token(vocab, name):
    hc = compiled(CONSTRAINTS[name], vocab)
    rng = random.Random(5)
    for _ in range(40):
        tokens = plain_tokens(vocab, rng, rng.randint(0, 12))
        if name == "stop":  # (a value the stop fires in, sometimes)
            tokens = [t for t in tokens if not vocab.token_bytes[t].count(b"e")][:8]
        one, many = hc.start(), hc.start()
        stop = None
        taken = 0
        for t in tokens:
            if one.stopped is not None or (name == "regex" and not one.allows(t)):
                break
            stop = one.advance(t)
            taken += 1
        assert many.extend(tokens[:taken]) == stop
        assert (many.value_bytes, many.tokens, many.stopped) == (one.value_bytes, one.tokens, one.stopped)
        assert many.allowed() is None or (many.allowed() == one.allowed()).all()


def test_extend_of_a_free_hole_with_a_limit_gives_its_stop(vocab):
    hc = compiled(length("<", 4, unit="tokens"), vocab)
    assert hc.start().free and not hc.start().watches_text and hc.start().max_tokens == 3
    tokens = plain_tokens(vocab, random.Random(1), 3)
    state = hc.start()
    assert state.extend(tokens[:2]) is None
    stop = state.extend(tokens[2:])
    assert stop is not None and stop.keep == 3 and state.stopped is stop
    with pytest.raises(LMQRuntimeError):
        state.extend(tokens[:1])  # after the stop, as advance()
    with pytest.raises(LMQRuntimeError):  # past the limit at once: the first token past it, as advance()
        hc.start().extend(plain_tokens(vocab, random.Random(2), 5))


def test_extend_refuses_a_special_token(vocab):
    state = compiled(None, vocab).start()
    special = int(vocab.special.nonzero()[0][0])
    with pytest.raises(LMQRuntimeError, match="special"):
        state.extend([plain_tokens(vocab, random.Random(0), 1)[0], special])
