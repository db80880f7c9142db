"""VocabIndex: token bytes, specials, lookups and memoization, on SmolLM2 and on tiny tokenizers built here
(GPT-2-style byte-level BPE, Llama-2-style SentencePiece BPE with byte fallback, a Unigram/Metaspace one)."""
from __future__ import annotations

import gc
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from lmq_backend.text.vocab import VocabIndex, bytes_to_unicode

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there! numbers 12345 and 67890.",
    "naïve café résumé — 日本語のテキスト 🎉",
    "def f(x):\n    return x * 2\n",
] * 20


@pytest.fixture(scope="module")
def smollm():
    import transformers

    from lmq_backend.backend.default_model import default_model_dir

    return transformers.AutoTokenizer.from_pretrained(str(default_model_dir()))


@pytest.fixture(scope="module")
def gpt2_style():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    t = ByteLevelBPETokenizer()
    t.train_from_iterator(CORPUS, vocab_size=600, min_frequency=1, special_tokens=["<|endoftext|>"])
    return PreTrainedTokenizerFast(tokenizer_object=t._tokenizer, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def llama_style():
    from support.tiny import llama_style_tokenizer

    return llama_style_tokenizer()


@pytest.fixture(scope="module")
def unigram_style():
    from tokenizers import SentencePieceUnigramTokenizer
    from transformers import PreTrainedTokenizerFast

    t = SentencePieceUnigramTokenizer()
    t.train_from_iterator(CORPUS, vocab_size=200, special_tokens=["<unk>", "</s>"], unk_token="<unk>")
    return PreTrainedTokenizerFast(tokenizer_object=t._tokenizer, unk_token="<unk>", eos_token="</s>")


# ----- SmolLM2 -------------------------------------------------------------------------------------------

def test_smollm_basics(smollm):
    v = VocabIndex.for_tokenizer(smollm)
    assert v.size == 49152 == len(v.token_bytes)
    assert 2 in v.eos_ids and v.special[2] and v.token_bytes[2] == b""
    assert v.special[:17].all() and not v.special[17:].all()
    assert v.special.dtype == bool and v.special.shape == (v.size,)
    assert v.token_bytes[v.encode(" hello")[0]] == b" hello"
    assert VocabIndex.for_tokenizer(smollm) is v  # memoized


# (SmolLM2's vocabulary has no token for a few bytes (0x04, 0x16, 0xF1, ...): its tokenizer drops them)
text_st = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=40) | \
    st.text(alphabet=" \n\tabcxyz.,!?0123456789éüß日本語🎉", max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(s=text_st)
def test_smollm_bytes_roundtrip(smollm, s):
    v = VocabIndex.for_tokenizer(smollm)
    ids = v.encode(s)
    assert all(not v.special[i] for i in ids)
    got = v.decode_bytes(ids)
    assume(smollm.decode(ids) == s)  # a character the vocabulary cannot spell is dropped by the tokenizer
    assert got == s.encode("utf-8")


def test_size_larger_than_tokenizer(smollm):
    v = VocabIndex.for_tokenizer(smollm, size=49152 + 128)
    assert v.size == 49280 and len(v.token_bytes) == 49280
    assert v.special[49152:].all()
    assert VocabIndex.for_tokenizer(smollm, size=49280) is v
    assert VocabIndex.for_tokenizer(smollm) is not v
    assert not v.tokens_containing("a")[49152:].any()
    from lmq_backend.runtime.constraints import compile_hole_constraint

    s = compile_hole_constraint(None, eval, v).start()
    assert s.allowed() is None
    assert v.ll_tokenizer().vocab_size == 49280


def test_encode_lru(smollm):
    """A tokenizer the prefix encoder takes is encoded by its kept words (no LRU of whole texts); any other
    through the LRU. Either way a caller gets a fresh list."""
    from support.tiny import llama_style_tokenizer

    for tok, words in ((smollm, True), (llama_style_tokenizer(), False)):
        v = VocabIndex.for_tokenizer(tok)
        a = v.encode("some segment of a prompt")
        a.append(-1)  # callers get a fresh list
        b = v.encode("some segment of a prompt")
        assert b == tok.encode("some segment of a prompt", add_special_tokens=False)
        assert v._encode_cached.cache_info().hits == (0 if words else 1)
        assert bool(v._prefix_encoder) == words and (not words or " prompt" in v._prefix_encoder._words)


def test_lookups(smollm):
    v = VocabIndex.for_tokenizer(smollm)
    ids = v.ids_starting_with(b" hel")
    assert len(ids) > 3 and all(v.token_bytes[i].startswith(b" hel") for i in ids)
    brute = {i for i, b in enumerate(v.token_bytes) if b.startswith(b" hel") and not v.special[i]}
    assert set(ids.tolist()) == brute
    assert set(v.ids_starting_with(b"\xff").tolist()) == {i for i, b in enumerate(v.token_bytes)
                                                         if b.startswith(b"\xff") and not v.special[i]}
    m = v.tokens_containing("\n")
    assert m is v.tokens_containing(b"\n")  # memoized
    assert set(np.flatnonzero(m).tolist()) == {i for i, b in enumerate(v.token_bytes) if b"\n" in b}
    d = v.tokens_matching(rb"[0-9]+")
    assert d is v.tokens_matching(rb"[0-9]+")
    assert d[v.bytes_to_ids[b"7"]].all() and not d[v.bytes_to_ids[b"a"]].any()
    for i in np.flatnonzero(d)[:50]:
        assert v.token_bytes[i].isdigit()
    # character counts add up token by token (with the pending UTF-8 continuation bytes as state)
    for s in ["héllo 日本語 🎉!", "abc", "🎉🎉🎉 ü"]:
        pending, n = 0, 0
        for t in v.encode(s):
            chars, nxt = v.utf8_tables(pending)
            n, pending = n + int(chars[t]), int(nxt[t])
        assert n == len(s) and pending == 0


def test_llguidance_agrees(smollm):
    v = VocabIndex.for_tokenizer(smollm)
    ll = v.ll_tokenizer()
    assert ll is v.ll_tokenizer()
    for i in range(v.size):
        if not v.special[i]:
            assert ll.decode_bytes([i]) == v.token_bytes[i], i


def test_memo_released():
    """A tokenizer and its index are collected together."""
    import weakref

    class Tok:
        eos_token_id = 1
        all_special_ids = [1]

        def __len__(self):
            return 3

        def convert_ids_to_tokens(self, ids):
            return ["a", "</s>", "b"]

        def encode(self, s, add_special_tokens=False):
            return [0 if c == "a" else 2 for c in s]

    t = Tok()
    v = VocabIndex.for_tokenizer(t)
    assert v.token_bytes == [b"a", b"", b"b"] and v.eos_ids == {1}
    assert VocabIndex.for_tokenizer(t) is v
    assert v.encode("ab") == [0, 2]
    ref = weakref.ref(t)
    del t, v
    gc.collect()
    assert ref() is None


# ----- other tokenizer families --------------------------------------------------------------------------

SAMPLES = ["the quick brown fox", "hello world, hello!", " leading space", "naïve café", "日本語 🎉",
           "tabs\tand\nnewlines", "12345.678"]


def test_gpt2_style(gpt2_style):
    v = VocabIndex.for_tokenizer(gpt2_style)
    assert v.eos_ids == {gpt2_style.eos_token_id} and v.special[gpt2_style.eos_token_id]
    # the 256 byte tokens of the byte-level alphabet
    assert all(bytes([b]) in v.bytes_to_ids for b in range(256))
    assert len(bytes_to_unicode()) == 256
    rng = random.Random(0)
    for s in SAMPLES + ["".join(chr(rng.randrange(32, 0x3000)) for _ in range(20)) for _ in range(20)]:
        assert v.decode_bytes(v.encode(s)) == s.encode("utf-8"), s
    ll = v.ll_tokenizer()
    for i in range(v.size):
        if not v.special[i] and b"\xff" not in v.token_bytes[i]:  # llguidance reserves 0xFF (never in UTF-8)
            assert ll.decode_bytes([i]) == v.token_bytes[i]


def test_llama_style(llama_style):
    v = VocabIndex.for_tokenizer(llama_style)
    assert v.eos_ids == {2} and v.special[:3].all()
    assert v.token_bytes[llama_style.convert_tokens_to_ids("<0x41>")] == b"A"
    assert v.token_bytes[llama_style.convert_tokens_to_ids("▁hello")] == b" hello"
    for s in SAMPLES:
        ids = v.encode(s)
        # SentencePiece prepends "▁" to a segment: its bytes are a space plus the text
        assert v.decode_bytes(ids) == b" " + s.encode("utf-8").replace(b"\x00", b""), s
    ll = v.ll_tokenizer()
    for i in range(v.size):
        if not v.special[i] and b"\xff" not in v.token_bytes[i]:  # llguidance reserves 0xFF (never in UTF-8)
            assert ll.decode_bytes([i]) == v.token_bytes[i], i


def test_unigram_style(unigram_style):
    v = VocabIndex.for_tokenizer(unigram_style)
    assert v.special[unigram_style.convert_tokens_to_ids("<unk>")]
    for s in ["the quick brown fox", "hello world"]:
        assert v.decode_bytes(v.encode(s)).strip() == s.encode()
    assert all(b" " not in b or b.startswith(b" ") or b.count(b" ") for b in v.token_bytes)
    assert not any("▁".encode() in b for b in v.token_bytes)


def test_constraints_on_other_tokenizers(gpt2_style, llama_style):
    from lmq_backend.language import ast
    from lmq_backend.runtime.constraints import compile_hole_constraint

    span = ast.Span(1, 1)
    opts = ["hello world", "the fox", "日本"]
    expr = ast.PyExpr(repr(opts), compile(repr(opts), "<t>", "eval"), frozenset(), span)
    rx = ast.PyExpr("'[0-9]{2,4}'", compile("'[0-9]{2,4}'", "<t>", "eval"), frozenset(), span)
    for tok in (gpt2_style, llama_style):
        v = VocabIndex.for_tokenizer(tok)
        for c, ok in [(ast.Choice("X", expr, span), lambda t: t in opts),
                      (ast.Call("REGEX", "X", (rx,), span), lambda t: t.isdigit() and 2 <= len(t) <= 4)]:
            hc = compile_hole_constraint(c, lambda e: eval(e.code), v)
            rng = random.Random(0)
            for _ in range(20):
                s = hc.start()
                while True:
                    m = s.allowed()
                    ids = np.flatnonzero(m)
                    if len(ids) == 0 or (s.can_end() and rng.random() < 0.3):
                        break
                    s.advance(int(ids[rng.randrange(len(ids))]))
                assert s.can_end() and ok(s.text), s.text
