"""Start-up (issue #16): what `import lmq_backend` and the LMQL plugin import load (checked by module, not
by the clock), and the vocabulary index kept on disk: loaded, it is the index built from the tokenizer;
its key changes with the tokenizer's files, the size and the code that builds it."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from lmq_backend.text import vocab_cache
from lmq_backend.text.vocab import VocabIndex

from support.folders import copy_without_weights

HEAVY = ("torch", "transformers", "lark", "numpy", "lmql.models.lmtp.backends")


def modules_after(statement: str) -> set[str]:
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return set(json.loads(done.stdout))


@pytest.mark.parametrize("statement", ["import lmq_backend", "import lmq_backend.lmql.hook",
                                       "import lmq_backend.lmql.plugin"])
def test_imports_load_nothing_heavy(statement):
    loaded = modules_after(statement)
    assert not {m for m in loaded if m.split(".")[0] in HEAVY or m in HEAVY}, statement


def test_names_load_on_first_use():
    loaded = modules_after("import lmq_backend as lmq\nlmq.compile\nlmq.LMQError")
    assert "lmq_backend.runtime.query" in loaded and "lmq_backend.backend.hf" not in loaded
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        import lmq_backend

        lmq_backend.nothing  # noqa: B018


@pytest.fixture
def tokenizer_folder(tmp_path):
    return copy_without_weights(tmp_path / "tok")


def load_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def same_index(a: VocabIndex, b: VocabIndex) -> None:
    assert a.size == b.size and a.token_bytes == b.token_bytes and a.eos_ids == b.eos_ids
    for name in ("special", "nonspecial", "n_bytes", "n_chars", "_utf8_next0", "sorted_ids"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.sorted_bytes == b.sorted_bytes and a.token_prefixes == b.token_prefixes
    assert a.bytes_to_ids.keys() == b.bytes_to_ids.keys()
    assert all(np.array_equal(a.bytes_to_ids[k], b.bytes_to_ids[k]) for k in a.bytes_to_ids)


def test_the_vocabulary_index_from_disk_is_the_built_one(tokenizer_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("LMQ_CACHE_DIR", str(tmp_path / "cache"))
    size = 49152
    built = VocabIndex(load_tokenizer(tokenizer_folder), size)
    first = vocab_cache.vocab_index(load_tokenizer(tokenizer_folder), size)  # builds and writes
    [entry] = (tmp_path / "cache" / "vocab").iterdir()
    tok = load_tokenizer(tokenizer_folder)
    with monkeypatch.context() as m:  # from disk: nothing is built
        m.setattr(VocabIndex, "__init__", lambda *a: pytest.fail("the index was built again"))
        loaded = vocab_cache.vocab_index(tok, size)
    assert loaded is not first
    same_index(loaded, built)
    assert VocabIndex.for_tokenizer(tok, size=size) is loaded  # memoized like a built one
    # it works as one: encoding, masks, decoding
    text = "Hello, world! 123"
    assert loaded.encode(text) == built.encode(text)
    assert np.array_equal(loaded.tokens_matching(r"[0-9]+"), built.tokens_matching(r"[0-9]+"))
    assert loaded.decode_bytes(loaded.encode(text)) == text.encode()
    # a corrupt entry is rebuilt, not an error
    entry.write_bytes(b"not a pickle")
    same_index(vocab_cache.vocab_index(load_tokenizer(tokenizer_folder), size), built)


def test_the_key_changes_with_what_the_index_is_built_from(tokenizer_folder, monkeypatch, tmp_path):
    key = vocab_cache.cache_key(tokenizer_folder, 49152)
    assert vocab_cache.cache_key(tokenizer_folder, 49152) == key
    assert vocab_cache.cache_key(tokenizer_folder, 49153) != key
    config = tokenizer_folder / "tokenizer_config.json"
    config.write_text(config.read_text() + " ")
    assert vocab_cache.cache_key(tokenizer_folder, 49152) != key
    key = vocab_cache.cache_key(tokenizer_folder, 49152)
    source = tmp_path / "vocab.py"
    source.write_text("# another version of the index's code\n")
    monkeypatch.setattr(vocab_cache.vocab_module, "__file__", str(source))
    assert vocab_cache.cache_key(tokenizer_folder, 49152) != key
    key = vocab_cache.cache_key(tokenizer_folder, 49152)
    stored = tmp_path / "vocab_cache.py"
    stored.write_text("# another way to store the index\n")
    monkeypatch.setattr(vocab_cache, "__file__", str(stored))
    assert vocab_cache.cache_key(tokenizer_folder, 49152) != key
    import tokenizers
    import transformers

    for library in (transformers, tokenizers):
        key = vocab_cache.cache_key(tokenizer_folder, 49152)
        monkeypatch.setattr(library, "__version__", library.__version__ + ".other")
        assert vocab_cache.cache_key(tokenizer_folder, 49152) != key, library.__name__


QUERY = '''argmax
    "Q: {question}\\nA:[ANSWER]" where STOPS_AT(ANSWER, "\\n") and len(TOKENS(ANSWER)) < 20
    if ANSWER == " yes":
        "Why?[WHY]"
from "default"
where len(WHY) < 80
'''


def test_the_grammars_tables_from_disk_parse_as_the_built_ones(monkeypatch, tmp_path):
    from lark import Lark

    from lmq_backend.language import parser

    monkeypatch.setattr(parser, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(parser, "_lark", None)
    built = parser.parse_query(QUERY)  # builds the tables and writes them
    assert (tmp_path / "lark" / "lmq.lark-cache").exists()
    monkeypatch.setattr(parser, "_lark", None)
    monkeypatch.setattr(Lark, "_build_parser", lambda self: pytest.fail("the tables were built again"))
    assert parser.parse_query(QUERY) == built
    with pytest.raises(parser.LMQSyntaxError):
        parser.parse_query('argmax\n    "unclosed\n')
