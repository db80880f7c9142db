"""LMQL's tokenizer for `lmq:SPEC` without transformers (lmq_backend/lmql/tokenizer.py, issue #16's start-up):
on the default model's folder it gives what LMQL's own transformers-backed tokenizer gives (ids, tokens,
bytes, decoding of every token, special ids, vocabulary), the hook hands it to LMQL for `lmq:` names, and
folders it was not checked for keep LMQL's own tokenizer."""
from __future__ import annotations

import json
import pickle
import random
import shutil
import sys
from pathlib import Path

import pytest

import lmql  # noqa: F401

from lmql.runtime.tokenizer import LMQLTokenizer  # noqa: E402
from lmql.runtime.tokenizers.hf_tokenizer import TransformersTokenizer  # noqa: E402

from lmq_backend.lmql import tokenizer as lmql_tokenizer  # noqa: E402
from lmq_backend.backend.default_model import default_model_dir  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import workloads as W  # noqa: E402

TEXTS = [
    "Hello, world!", " leading space", "two  spaces\tand a tab\n\nnew lines\r\n", "don't I'm we've they're .",
    "Review: Great food.\nSentiment: positive", "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>x", "naïve café – “quotes” … 😀🎉 日本語のテキスト 한국어", "def f(x):\n    return x ** 2  # code",
    "1234567890 3.14159 -42 1e-9", "", " ", "\n", "a" * 300, "ÿ\u00a0\u2009\u200b", "[X] {y} ]] [[",
]


@pytest.fixture(scope="module")
def pair():
    folder = str(default_model_dir())
    ours = lmql_tokenizer.for_folder(folder)
    assert ours is not None
    return ours, TransformersTokenizer.from_pretrained(folder)


def test_the_implementation_answers_as_lmqls(pair):
    ours, theirs = pair
    assert (ours.vocab_size, ours.eos_token_id, ours.bos_token_id) == \
        (theirs.vocab_size, theirs.eos_token_id, theirs.bos_token_id)
    assert ours.get_vocab() == theirs.tokenizer.get_vocab()
    for text in TEXTS:
        for special in (False, True):
            assert ours(text, add_special_tokens=special) == \
                {"input_ids": theirs(text, add_special_tokens=special)["input_ids"]}, text
        assert ours.tokenize(text) == theirs.tokenize(text), text
        assert ours.tokenize(text, asbytes=True) == theirs.tokenize(text, asbytes=True), text
        tokens = theirs.tokenize(text)
        assert ours.convert_tokens_to_string(tokens) == theirs.convert_tokens_to_string(tokens)
        ids = theirs(text)["input_ids"]
        for clean in (None, False, True):
            kw = {} if clean is None else {"clean_up_tokenization_spaces": clean}
            assert ours.decode(ids, **kw) == theirs.decode(ids, **kw), (text, clean)
        as_bytes = theirs.decode_tokens_bytes(ids)
        assert ours.convert_bytes_to_string(as_bytes) == theirs.convert_bytes_to_string(as_bytes)


def test_recurring_prompts_give_the_tokenizers_ids(pair):
    """Prompts that share a few-shot prefix and differ at the end (their ids partly from the prefix encoder's
    stored prefixes and words) get exactly the ids transformers' tokenizer gives them, as do their ids'
    strings and back; no tail tokenized with the prefix is cached under another text."""
    ours, theirs = pair
    rng = random.Random(5)
    shots = W.w1_shots()
    tails = W.w1_reviews(12) + ["", "\n", " x", "日本語 😀", "a" * 700, "\n\nReview:  two  spaces"]
    for tail in tails + [rng.choice(tails) + rng.choice(TEXTS) for _ in range(12)]:
        for text in (f"{shots}Review: {tail}\nSentiment:", f"{shots[:-rng.randrange(1, 200)]}{tail}", tail + shots):
            ids = theirs(text)["input_ids"]
            assert ours(text)["input_ids"] == ids, text[-80:]
            as_bytes = ours.decode_tokens_bytes(ids)
            assert as_bytes == theirs.decode_tokens_bytes(ids) and ours.convert_token_bytes_to_ids(as_bytes) == ids
    assert ours._prefix_encoder().hits > 0  # (the prefixes were reused)


def test_it_pickles(pair):
    ours, _ = pair
    again = pickle.loads(pickle.dumps(ours))
    assert again(TEXTS[7]) == ours(TEXTS[7]) and again.decode([1, 2, 3]) == ours.decode([1, 2, 3])
    assert (again.eos_token_id, again.bos_token_id) == (ours.eos_token_id, ours.bos_token_id)


def test_every_token_decodes_as_lmqls(pair):
    ours, theirs = pair
    for i in range(ours.vocab_size):
        assert ours.decode([i], clean_up_tokenization_spaces=False) == \
            theirs.tokenizer.decode([i], clean_up_tokenization_spaces=False), i


def test_lmqls_tokenizer_over_it_answers_as_over_lmqls(pair):
    ours, theirs = (LMQLTokenizer("m", tokenizer_impl=t) for t in pair)
    assert (ours.vocab_size, ours.vocab_range) == (theirs.vocab_size, theirs.vocab_range)
    for text in TEXTS + ["<lmql:x/> tag " + TEXTS[5]]:
        ids = theirs(text)["input_ids"]
        assert ours(text)["input_ids"] == ids
        assert ours.tokenize(text) == theirs.tokenize(text)
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode_bytes(ids) == theirs.decode_bytes(ids)
        assert ours.convert_bytes_to_string(theirs.decode_bytes(ids)) == \
            theirs.convert_bytes_to_string(theirs.decode_bytes(ids))


def test_lmq_names_get_it_and_other_folders_keep_lmqls(tmp_path):
    from lmql.runtime import tokenizer as lmql_tokenizer_module

    import lmq_backend.lmql.plugin  # noqa: F401 - installs the hook (the .pth file does at start-up)

    t = lmql_tokenizer_module._load_tokenizer("lmq:default", "auto")
    assert type(t.tokenizer_impl).__name__ == "LMQTokenizer"
    assert lmql_tokenizer.for_folder(str(default_model_dir()), use_fast=True) is None  # tokenizer arguments
    other = tmp_path / "other"
    shutil.copytree(default_model_dir(), other, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "LlamaTokenizer"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    assert lmql_tokenizer.for_folder(str(other)) is None
    config["tokenizer_class"] = "TokenizersBackend"
    config["eos_token"] = "<|a token transformers would add|>"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    assert lmql_tokenizer.for_folder(str(other)) is None
    (other / "tokenizer_config.json").unlink()
    assert lmql_tokenizer.for_folder(str(other)) is None
