"""LMQL's tokenizer for `lmq:SPEC` models, read with the `tokenizers` library alone.

LMQL's own Hugging Face tokenizer (`lmql.runtime.tokenizers.hf_tokenizer.TransformersTokenizer`) loads the
folder with transformers' `AutoTokenizer`, which imports transformers and torch in LMQL's process: seconds
of the plugin's first call, for a tokenizer that the model process loads again. `LMQTokenizer` has its
interface and gives the same answers for folders whose tokenizer transformers itself runs as the plain
`tokenizers` backend (`"tokenizer_class": "TokenizersBackend"` in tokenizer_config.json, as lmq's converted
default model has, with nothing for transformers to add or patch: `_as_loaded`): ids, tokens, decoding,
special ids and vocabulary read from the same tokenizer.json.
Any other folder (or tokenizer arguments) keeps LMQL's own path (`for_folder` returns None).

LMQL tokenizes every prompt whole, and in lmq's plugin its ids travel as the decimal strings of the ids
("token bytes" of `decode_tokens_bytes`, read back by `convert_token_bytes_to_ids`). A few-shot prompt
recurs with a new tail, so its ids come from lmq's prefix encoder (`text/prefix_encode.py`: exactly the
tokenizer's ids, without tokenizing a prefix seen before) where it takes the tokenizer, and the id <->
string tables are made once.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

CLASSES = ("TokenizersBackend",)  # transformers runs these as `tokenizers.Tokenizer` with nothing added
RECENT = 8  # texts whose ids a tokenizer keeps: LMQL tokenizes each prompt twice (as ids, and as token bytes)


def for_folder(folder: str, **kwargs) -> "LMQTokenizer | None":
    """An `LMQTokenizer` for the folder, or None where LMQL's own tokenizer must load it."""
    path = Path(folder)
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    if kwargs or config.get("tokenizer_class") not in CLASSES or not (path / "tokenizer.json").is_file():
        return None
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return None
    tokenizer = LMQTokenizer(str(path), config)
    return tokenizer if _as_loaded(tokenizer.tokenizer, config) else None


def _as_loaded(tokenizer, config: dict) -> bool:
    """True where transformers' TokenizersBackend would run tokenizer.json as it is: every special or added
    token of the config already in it (else transformers adds them), no special tokens split, and a
    vocabulary under the size at which transformers patches Mistral tokenizers' regular expressions."""
    named = [_token(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                                            "cls_token", "mask_token")]
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
    extra = list(extra.values()) if isinstance(extra, dict) else list(extra)
    added = [_token(v) for v in (config.get("added_tokens_decoder") or {}).values()]
    tokens = [t for t in named + [_token(t) for t in extra] + added if t is not None]
    return (not config.get("split_special_tokens") and tokenizer.get_vocab_size() <= 100000
            and all(tokenizer.token_to_id(t) is not None for t in tokens))


def _token(value) -> str | None:
    """A special token's text from tokenizer_config.json (a string, or an added-token dict)."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class LMQTokenizer:
    """`TransformersTokenizer`'s interface (lmql/runtime/tokenizers/hf_tokenizer.py) over `tokenizers`."""

    def __init__(self, model_identifier: str, config: dict):
        from tokenizers import Tokenizer

        self.model_identifier = model_identifier
        self.tokenizer = _plain(Tokenizer.from_file(str(Path(model_identifier) / "tokenizer.json")))
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._bpe = type(self.tokenizer.model).__name__ == "BPE"
        self._bos = self._id(config.get("bos_token"))
        self._eos = self._id(config.get("eos_token"))
        self._recent: dict[tuple[str, bool], list[int]] = {}
        self._tables: tuple | None = None
        self._start_tables()

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """The ids of `text`, from the last RECENT texts' where it is one of them."""
        key = (text, bool(add_special_tokens))
        ids = self._recent.get(key)
        if ids is None:
            encoder = self._prefix_encoder() if not add_special_tokens else None
            ids = encoder.encode(text) if encoder else \
                self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
            if len(self._recent) >= RECENT:
                self._recent.pop(next(iter(self._recent)))
            self._recent[key] = ids
        return list(ids)

    def _prefix_encoder(self):
        """lmq's prefix encoder of this tokenizer (False: it takes none), made at the first call."""
        return self._made()[0]

    def _made(self) -> tuple:
        """(prefix encoder or False, id -> token string bytes list, token string bytes -> id dict), made once
        (`_start_tables` begins it on a thread when the tokenizer loads)."""
        if self._tables is None:
            with self._tables_lock:
                if self._tables is None:
                    self._tables = _tables(self.tokenizer)
        return self._tables

    def _start_tables(self) -> None:
        """Make the tables on a thread: LMQL loads the tokenizer as its first call starts the model process,
        which takes far longer."""
        self._tables_lock = threading.Lock()
        threading.Thread(target=self._made, name="lmq-lmql-tokenizer-tables", daemon=True).start()

    def _id(self, value) -> int | None:
        text = _token(value)
        return None if text is None else self.tokenizer.token_to_id(text)

    def __getstate__(self):
        return {"model_identifier": self.model_identifier, "tokenizer": self.tokenizer.to_str(),
                "clean_up": self.clean_up_tokenization_spaces, "bos": self._bos, "eos": self._eos}

    def __setstate__(self, state):
        from tokenizers import Tokenizer

        self.model_identifier = state["model_identifier"]
        self.tokenizer = _plain(Tokenizer.from_str(state["tokenizer"]))
        self.clean_up_tokenization_spaces = state["clean_up"]
        self._bpe = type(self.tokenizer.model).__name__ == "BPE"
        self._bos, self._eos = state["bos"], state["eos"]
        self._recent = {}
        self._tables = None
        self._start_tables()

    # ----- what LMQL calls ------------------------------------------------------------------------------

    def tokenize(self, text, asbytes=False, add_special_tokens=False):
        if asbytes:
            return self.decode_tokens_bytes(self(text, add_special_tokens=add_special_tokens)["input_ids"])
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).tokens

    def decode_tokens_bytes(self, ids):
        table = self._made()[1]
        try:
            return [table[i] if i >= 0 else f"{i}".encode("utf-8") for i in ids]
        except (IndexError, TypeError):  # (an id outside the vocabulary, or not an int)
            return [f"{i}".encode("utf-8") for i in ids]

    def decode(self, ids, clean_up_tokenization_spaces=None):
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        if clean and not self._bpe:  # transformers skips the clean-up for BPE models (it would corrupt them)
            text = _clean_up(text)
        return text

    def convert_bytes_to_string(self, token_bytes):
        return self.decode(self.convert_token_bytes_to_ids(token_bytes))

    def convert_token_bytes_to_ids(self, tokens):
        table = self._made()[2]
        try:
            return [table[t] for t in tokens]
        except KeyError:
            return [int(t.decode("utf-8")) for t in tokens]

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": self._ids(text, add_special_tokens)}

    def get_vocab(self) -> dict[str, int]:
        return self.tokenizer.get_vocab(with_added_tokens=True)

    @property
    def vocab(self) -> dict[str, int]:
        return self.get_vocab()

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=False)

    @property
    def eos_token_id(self):
        return self._eos

    @property
    def bos_token_id(self):
        return self._bos

    def convert_tokens_to_string(self, tokens):
        decoder = self.tokenizer.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    @property
    def name(self):
        return "hf-" + self.model_identifier

    def backend(self):
        return "tokenizers (lmq)"


class _Backed:
    """A bare `tokenizers.Tokenizer` as lmq's text layer reads a transformers tokenizer: its Rust
    `backend_tokenizer` and the pieces of ids."""

    def __init__(self, tokenizer):
        self.backend_tokenizer = tokenizer

    def convert_ids_to_tokens(self, ids):
        return [self.backend_tokenizer.id_to_token(i) for i in ids]


def _tables(tokenizer) -> tuple:
    """`LMQTokenizer._made`'s tables for a `tokenizers.Tokenizer`."""
    from ..text.prefix_encode import PrefixEncoder
    from ..text.token_bytes import token_bytes_table

    n = tokenizer.get_vocab_size(with_added_tokens=True)
    backed = _Backed(tokenizer)
    n_bytes = [len(b) for b in token_bytes_table(backed, n)[0]]
    encoder = PrefixEncoder.for_tokenizer(backed, n_bytes) or False
    as_bytes = [f"{i}".encode("utf-8") for i in range(n)]
    return encoder, as_bytes, {b: i for i, b in enumerate(as_bytes)}


def _plain(tokenizer):
    """No truncation and no padding: what transformers sets for a call without those arguments."""
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _clean_up(text: str) -> str:
    """transformers' `clean_up_tokenization` (for WordPiece-style tokenizers)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text
