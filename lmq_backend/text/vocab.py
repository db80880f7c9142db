"""`VocabIndex`: everything the constraint masks need to know about a tokenizer, built once per tokenizer.

The index sees every token as the exact UTF-8 bytes it contributes to decoded text (`token_bytes`, read by
`token_bytes.py`):
byte-level BPE (GPT-2, SmolLM2, Llama-3: the `bytes_to_unicode` alphabet), SentencePiece style (`▁` for a
space, `<0xNN>` byte-fallback tokens) and added tokens (their literal content). Special/control tokens,
ids past the tokenizer (a model whose logits are wider than the tokenizer) and tokens that contribute no
bytes are `special`: they are never part of a value and never in a mask.

The lookup structures make a mask a few numpy operations: `bytes_to_ids` (the tokens spelling exactly some
bytes), a sorted table of token bytes (the tokens starting with some bytes are one bisect range),
`token_prefixes` (every prefix of every token, to prune searches), `n_chars` (characters a token adds:
its bytes that are not UTF-8 continuation bytes, so character counts add up token by token) and memoized
per-pattern boolean arrays (`tokens_matching`, `tokens_containing`). Python loops over the vocabulary
happen once per tokenizer, or once per pattern, never per generation step.
"""
from __future__ import annotations

import bisect
import re
import threading
import weakref
from functools import lru_cache
from typing import Any, Iterable

import numpy as np

from .prefix_encode import PrefixEncoder
from .token_bytes import bytes_to_unicode, eos_ids, token_bytes_table, tokenizer_length, utf8_continues, utf8_scan

__all__ = ["VocabIndex", "bytes_to_unicode"]


_ATTR = "_lmq_vocab_index"
_registry: "weakref.WeakKeyDictionary[Any, dict[int, VocabIndex]]" = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def _increment(prefix: bytes) -> bytes | None:
    """The smallest bytes string greater than every string starting with `prefix` (None: no bound)."""
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    if not p:
        return None
    p[-1] += 1
    return bytes(p)


class VocabIndex:
    """Per-tokenizer tables for vectorised constraint masks. Build with `VocabIndex.for_tokenizer`."""

    size: int
    token_bytes: list[bytes]
    eos_ids: frozenset[int]
    special: np.ndarray
    nonspecial: np.ndarray
    n_chars: np.ndarray
    n_bytes: np.ndarray
    bytes_to_ids: dict[bytes, np.ndarray]
    sorted_bytes: list[bytes]
    sorted_ids: np.ndarray
    token_prefixes: frozenset[bytes]
    max_token_bytes: int

    # ----- construction ---------------------------------------------------------------------------------

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, size: int | None = None) -> "VocabIndex":
        """The index of `tokenizer` for logits of width `size` (default: the tokenizer's length);
        memoized per tokenizer object and size."""
        n_tok = tokenizer_length(tokenizer)
        size = n_tok if size is None else int(size)
        if size <= 0:
            raise ValueError(f"vocabulary size must be positive, not {size}")
        # The memo lives on the tokenizer itself (an attribute), so that tokenizer and index are collected
        # together; a tokenizer that takes no attributes falls back to a module-level weak dictionary.
        with _registry_lock:
            per_size = tokenizer.__dict__.get(_ATTR) if hasattr(tokenizer, "__dict__") else None
            if per_size is None:
                try:
                    per_size = _registry.get(tokenizer)
                except TypeError:
                    per_size = None
            if per_size is not None and size in per_size:
                return per_size[size]
        index = cls(tokenizer, size)
        with _registry_lock:
            per_size = tokenizer.__dict__.get(_ATTR) if hasattr(tokenizer, "__dict__") else None
            if per_size is None:
                per_size = {}
                try:
                    object.__setattr__(tokenizer, _ATTR, per_size)
                except (AttributeError, TypeError):
                    try:
                        per_size = _registry.setdefault(tokenizer, per_size)
                    except TypeError:
                        pass
            return per_size.setdefault(size, index)

    def __init__(self, tokenizer: Any, size: int):
        self.tokenizer = tokenizer
        self.size = size
        n_tok = min(tokenizer_length(tokenizer), size)
        token_bytes, special_ids = token_bytes_table(tokenizer, n_tok)
        token_bytes += [b""] * (size - len(token_bytes))
        self.token_bytes = token_bytes
        self.eos_ids = frozenset(i for i in eos_ids(tokenizer) if 0 <= i < size)

        special = np.zeros(size, dtype=bool)
        special[n_tok:] = True
        for i in special_ids | self.eos_ids:
            if 0 <= i < size:
                special[i] = True
        n_bytes = np.fromiter((len(b) for b in token_bytes), dtype=np.int32, count=size)
        special |= n_bytes == 0
        self.special = special
        self.nonspecial = ~special
        self.n_bytes = n_bytes
        scans = [utf8_scan(b, 0) for b in token_bytes]
        self.n_chars = np.fromiter((c for c, _ in scans), dtype=np.int32, count=size)
        self._utf8_next0 = np.fromiter((e for _, e in scans), dtype=np.int8, count=size)
        self._utf8: dict[int, tuple[np.ndarray, np.ndarray]] = {}

        by_bytes: dict[bytes, list[int]] = {}
        prefixes: set[bytes] = set()
        for i in np.flatnonzero(~special).tolist():
            b = token_bytes[i]
            by_bytes.setdefault(b, []).append(i)
        for b in by_bytes:
            for k in range(1, len(b) + 1):
                prefixes.add(b[:k])
        self.bytes_to_ids = {b: np.asarray(ids, dtype=np.int64) for b, ids in by_bytes.items()}
        self.token_prefixes = frozenset(prefixes)
        self.max_token_bytes = max((len(b) for b in by_bytes), default=0)
        order = sorted(np.flatnonzero(~special).tolist(), key=token_bytes.__getitem__)
        self.sorted_bytes = [token_bytes[i] for i in order]
        self.sorted_ids = np.asarray(order, dtype=np.int64)

        self._matching: dict[Any, np.ndarray] = {}
        self._containing: dict[bytes, np.ndarray] = {}
        self._cache: dict[Any, Any] = {}  # per-vocabulary memo for the constraint runtime
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._prefix_encoder: PrefixEncoder | None | bool = None  # built on first use (see prefix_encode.py)
        self._encode_cached = lru_cache(maxsize=8192)(self._encode_tuple)

    def _encode_tuple(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        """`tokenizer.encode(text, add_special_tokens=False)` (a fresh list): from the prefixes and words the
        prefix encoder keeps, for a tokenizer it takes (prefix_encode.py); else memoized with an LRU."""
        encoder = self.prefix_encoder()
        if encoder:
            return encoder.encode(text)
        return list(self._encode_cached(text))

    def prefix_encoder(self) -> PrefixEncoder | None:
        """The prefix encoder of this tokenizer (None: it takes none), built at the first call: a backend
        calls this at its load, so that the first query's call does not read the tokenizer's tables."""
        if self._prefix_encoder is None:
            self._prefix_encoder = PrefixEncoder.for_tokenizer(self.tokenizer, self.n_bytes) or False
        return self._prefix_encoder or None

    def encode_continuation(self, text: str) -> list[int]:
        """Token ids of `text` as it continues a sequence. SentencePiece tokenizers (Llama-2, Mistral v0.1)
        put a "▁" (a space) before every text they encode; after a generated value that space is not
        in the prompt, so encode behind an anchor ("\n", which never merges) and drop the anchor's ids."""
        if not text or not self._adds_leading_space:
            return self.encode(text)
        return self._behind_anchor(text, self.encode)

    def _behind_anchor(self, text: str, encode) -> list[int]:
        """`encode(text)` as the text continues a sequence: encoded behind "\n", the anchor's ids dropped."""
        anchor = encode("\n")
        ids = encode("\n" + text)
        if ids[: len(anchor)] == anchor and self.decode_bytes(ids[len(anchor):]) == text.encode("utf-8"):
            return ids[len(anchor):]
        return encode(text)

    def specials_in(self, text: str, spans: Iterable[tuple[int, int]]) -> bool:
        """Does a special token's text (`<|im_end|>`, ...) occur in `text` over one of the `spans` (values
        written into a prompt: plain text to the model)?"""
        found = self._special_texts()
        if found is None:
            return False
        return any(found.search(text, max(0, a - self._longest_special + 1), b + self._longest_special - 1)
                   is not None for a, b in spans)

    def encode_literal(self, text: str, spans: list[tuple[int, int]], continuation: bool) -> list[int]:
        """`encode(text)` (`encode_continuation` if `continuation`) but for the special tokens' texts that
        overlap a span of `spans`: those are plain text (their characters' tokens), as if the tokenizer had no
        such token. The text between the special tokens kept is encoded with the tokenizer's special tokens off
        (`encode_special_tokens`), each piece as the tokenizer takes the text after an added token."""
        found = self._special_texts()
        ids = self._special_ids
        out: list[int] = []
        at, first = 0, not continuation
        for m in found.finditer(text) if found is not None else ():
            if any(a < m.end() and m.start() < b for a, b in spans):
                continue  # (inside a value: plain text)
            if m.start() > at:
                out += self._plain(text[at:m.start()], first)
            out.append(ids[m.group()])
            at, first = m.end(), False
        if at < len(text):
            out += self._plain(text[at:], first)
        return out

    def _special_texts(self):
        """A regular expression of the special tokens' texts, longest first (the tokenizer takes the longest
        at a position); None: the tokenizer has none."""
        if not hasattr(self, "_specials_re"):
            added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
            self._special_ids = {t.content: i for i, t in added.items() if getattr(t, "special", False) and t.content}
            texts = sorted(self._special_ids, key=len, reverse=True)
            self._longest_special = len(texts[0]) if texts else 0
            self._specials_re = re.compile("|".join(map(re.escape, texts))) if texts else None
        return self._specials_re

    def _plain(self, text: str, first: bool) -> list[int]:
        """`text`'s ids with the special tokens off; not `first`: as text after an added token or a sequence's
        earlier text (a SentencePiece tokenizer puts no "▁" before it: encoded behind the "\n" anchor)."""
        if first or not self._adds_leading_space:
            return self._encode_plain(text)
        return self._behind_anchor(text, self._encode_plain)

    def _encode_plain(self, text: str) -> list[int]:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and hasattr(backend, "encode_special_tokens"):
            with self._lock:  # (a switch of the tokenizer's own: on for this call only)
                was, backend.encode_special_tokens = backend.encode_special_tokens, True
                try:
                    return backend.encode(text, add_special_tokens=False).ids
                finally:
                    backend.encode_special_tokens = was
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    @property
    def _adds_leading_space(self) -> bool:
        if not hasattr(self, "_leading_space"):
            self._leading_space = self.decode_bytes(self.encode("a")) == b" a"
        return self._leading_space

    def __repr__(self) -> str:
        return f"VocabIndex(size={self.size}, eos_ids={sorted(self.eos_ids)}, special={int(self.special.sum())})"

    # ----- lookups ------------------------------------------------------------------------------------

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        tb = self.token_bytes
        return b"".join(tb[i] for i in ids)

    def ids_of(self, b: bytes) -> np.ndarray | None:
        """The non-special tokens whose bytes are exactly `b` (None if none)."""
        return self.bytes_to_ids.get(b)

    def prefix_range(self, prefix: bytes) -> tuple[int, int]:
        """[lo, hi) in `sorted_bytes`/`sorted_ids` of the non-special tokens starting with `prefix`."""
        lo = bisect.bisect_left(self.sorted_bytes, prefix)
        upper = _increment(prefix)
        hi = len(self.sorted_bytes) if upper is None else bisect.bisect_left(self.sorted_bytes, upper, lo)
        return lo, hi

    def ids_starting_with(self, prefix: bytes) -> np.ndarray:
        lo, hi = self.prefix_range(prefix)
        return self.sorted_ids[lo:hi]

    def ids_prefix_of(self, s: bytes) -> list[np.ndarray]:
        """Arrays of the tokens whose bytes are a non-empty prefix of `s`."""
        out = []
        prefixes = self.token_prefixes
        get = self.bytes_to_ids.get
        for k in range(1, min(len(s), self.max_token_bytes) + 1):
            p = s[:k]
            if p not in prefixes:
                break
            ids = get(p)
            if ids is not None:
                out.append(ids)
        return out

    def tokens_matching(self, pattern: str | bytes) -> np.ndarray:
        """bool[size]: the non-special tokens whose bytes `re.fullmatch` the pattern (a str pattern is
        matched against the UTF-8 decoded token, tokens that are not valid UTF-8 never match). Memoized;
        do not modify the result."""
        key = pattern
        hit = self._matching.get(key)
        if hit is not None:
            return hit
        if isinstance(pattern, bytes):
            rx = re.compile(pattern, re.DOTALL)
            test = lambda b: rx.fullmatch(b) is not None  # noqa: E731
        else:
            rx = re.compile(pattern, re.DOTALL)

            def test(b: bytes) -> bool:
                try:
                    return rx.fullmatch(b.decode("utf-8")) is not None
                except UnicodeDecodeError:
                    return False
        out = np.zeros(self.size, dtype=bool)
        for b, ids in self.bytes_to_ids.items():
            if test(b):
                out[ids] = True
        out.flags.writeable = False
        self._matching[key] = out
        return out

    def tokens_containing(self, s: bytes | str) -> np.ndarray:
        """bool[size]: the non-special tokens whose bytes contain `s`. Memoized; do not modify."""
        if isinstance(s, str):
            s = s.encode("utf-8")
        hit = self._containing.get(s)
        if hit is not None:
            return hit
        out = np.zeros(self.size, dtype=bool)
        if not s:
            out |= self.nonspecial
        else:
            for b, ids in self.bytes_to_ids.items():
                if s in b:
                    out[ids] = True
        out.flags.writeable = False
        self._containing[s] = out
        return out

    def utf8_tables(self, pending: int) -> tuple[np.ndarray, np.ndarray]:
        """(chars, pending_after): for a value whose last character still expects `pending` (0-3) UTF-8
        continuation bytes, the characters each token adds (as `len(value.decode(errors="replace"))` counts
        them: a lead byte counts one, an expected continuation byte none, a stray one one) and the
        continuation bytes still expected after it. `pending == 0` gives `n_chars`."""
        hit = self._utf8.get(pending)
        if hit is None:
            chars, nxt = self.n_chars.copy(), self._utf8_next0.copy()
            if pending:
                for i in np.flatnonzero((self.n_bytes > 0) & self.nonspecial).tolist():
                    b = self.token_bytes[i]
                    if b[0] & 0xC0 == 0x80:
                        chars[i], nxt[i] = utf8_scan(b, pending)
            chars.flags.writeable = False
            nxt.flags.writeable = False
            hit = self._utf8[pending] = (chars, nxt)
        return hit

    def utf8_continuing(self, pending: int) -> np.ndarray:
        """bool [size], read-only: the tokens that keep a value's UTF-8 well-formed where its last character
        still expects `pending` (1-3) continuation bytes (`utf8_continues`): every token a constraint over
        text allows there, so that a pick among them, checked against the constraint, is a pick among what it
        allows (`backend/hole_loop.py`)."""
        def starting() -> list[int]:  # the tokens that begin with a continuation byte (a few dozen)
            tb = self.token_bytes
            return [i for i in np.flatnonzero(self.nonspecial).tolist() if tb[i] and tb[i][0] & 0xC0 == 0x80]

        def build() -> np.ndarray:
            out = np.zeros(self.size, dtype=bool)
            tb = self.token_bytes
            out[[i for i in self.memo("utf8_starting", starting) if utf8_continues(tb[i], pending)]] = True
            out.flags.writeable = False
            return out
        return self.memo(("utf8_continuing", pending), build)

    def memo(self, key: Any, build) -> Any:
        """A value memoized on this index under `key` (built by `build()` the first time)."""
        try:
            return self._cache[key]
        except KeyError:
            value = build()
            return self._cache.setdefault(key, value)

    # ----- llguidance ---------------------------------------------------------------------------------

    def ll_tokenizer(self) -> Any:
        """The llguidance `LLTokenizer` of this tokenizer (built once: about half a second)."""
        if self._ll_tokenizer is None:
            with self._lock:
                if self._ll_tokenizer is None:
                    self._ll_tokenizer = _build_ll_tokenizer(self)
        return self._ll_tokenizer


# ----- helpers ------------------------------------------------------------------------------------------

def _build_ll_tokenizer(index: VocabIndex) -> Any:
    import llguidance

    tok = index.tokenizer
    eos = sorted(index.eos_ids)
    eos_arg: Any = eos[0] if len(eos) == 1 else (eos or None)
    try:
        import llguidance.hf

        return llguidance.hf.from_tokenizer(tok, n_vocab=index.size, eos_token=eos_arg)
    except Exception:
        pass

    # A tokenizer llguidance cannot read (a slow one): describe it from our own byte table.
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTableTokenizer(index)),
                                  n_vocab=index.size, eos_token=eos_arg)


class _ByteTableTokenizer:
    """What `llguidance.TokenizerWrapper` wants, built from a VocabIndex (special tokens as b"\xff<...>")."""

    def __init__(self, index: VocabIndex):
        eos = sorted(index.eos_ids)
        self.eos_token_id = eos[0] if eos else 0
        self.bos_token_id = getattr(index.tokenizer, "bos_token_id", None)
        self.special_token_ids = np.flatnonzero(index.special).tolist()
        self.tokens = [b"\xff<special_%d>" % i if index.special[i] else b for i, b in enumerate(index.token_bytes)]
        self._encode = index.tokenizer.encode

    def __call__(self, s: bytes | str) -> list[int]:
        if isinstance(s, bytes):
            s = s.decode("utf-8", errors="replace")
        return list(self._encode(s, add_special_tokens=False))
