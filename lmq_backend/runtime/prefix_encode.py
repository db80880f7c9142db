"""Exact tokenization that does not tokenize a recurring prefix again.

A query called over a data set renders prompts that share a long prefix (a few-shot block, a system
prompt, a chat history) and differ at the end. Tokenizing the ~1,100-token prompt of every call costs
~0.5-1 ms, the whole per-call budget at thousands of calls a second. `PrefixEncoder.encode(text)` gives
exactly `tokenizer.encode(text, add_special_tokens=False)`, reusing the ids of a prefix seen before.

Why it is exact. The tokenizers it accepts (`PrefixEncoder.supports`) are byte-level BPE with no
normalizer but NFC, whose pre-tokenizer (GPT-2's, Llama-3's or Qwen's regular expression, digit splits)
cuts the text into pieces that BPE never merges across, and whose added tokens contain no newline. Their
regular expressions never match a newline followed by a non-space character within one piece, and decide
every piece before that point from the characters up to it. So at a *cut* `c` (text[c - 1] is "\\n",
neither text[c - 2] nor text[c] is a space) the ids of any text starting with text[:c + 1] are the ids of
text[:c] followed by the ids of the rest, tokenized alone. (A newline that ends a longer run of whitespace
is no cut: an added token starting at c splits the text before the pre-tokenizer runs, and "\\n\\n\\n"
before it is one piece where before "<" it is two; a lone newline is one piece either way.) The cuts are
chosen from the prefix alone (the first one at least max(STEP, c / SPREAD) characters after the previous
cut c), so two texts sharing a prefix share its cuts, and the ids before a cut are stored under
text[:c + 1].

A text whose ids do not add up to its bytes (a tokenizer the rule above does not describe) is never
stored, and tests compare the result with the tokenizer's own on random texts.
"""
from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

STEP = 512          # characters between cuts, at least; a 32nd of the text before the previous cut beyond 16K
SPREAD = 32         # (the tail tokenized again stays short; the stored keys' characters grow as the text's)
MIN_TEXT = 1024     # shorter texts are tokenized whole
MAX_ENTRIES = 4096  # stored prefixes (least recently used dropped first)
_NEWLINE = re.compile(r"\n(?=\S)")  # a newline before a character that is no space (a literal first: fast)
_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits"}


class PrefixEncoder:
    def __init__(self, encode: Callable[[str], list[int]], n_bytes: np.ndarray):
        """`encode`: the tokenizer's own encode (no special tokens); `n_bytes[id]`: the UTF-8 bytes a token
        spells in text (added tokens: their content)."""
        self._encode = encode
        self._n_bytes = np.asarray(n_bytes, dtype=np.int64)
        self._prefixes: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self.hits = self.misses = 0

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, n_bytes: np.ndarray) -> "PrefixEncoder | None":
        """The encoder of a fast tokenizer it `supports` (calling the Rust tokenizer directly: the
        transformers wrapper around it costs more than a short text's tokenization), else None."""
        spec = _spec(tokenizer)
        if spec is None or not _supported(spec):
            return None
        backend = tokenizer.backend_tokenizer
        spelled = np.array(n_bytes, dtype=np.int64)  # special tokens spell nothing in values, their content here
        for added in spec.get("added_tokens", []):
            if 0 <= added["id"] < len(spelled):
                spelled[added["id"]] = len(added["content"].encode("utf-8"))
        return cls(lambda text: backend.encode(text, add_special_tokens=False).ids, spelled)

    @staticmethod
    def supports(tokenizer: Any) -> bool:
        """Is `tokenizer` one whose pieces never cross a cut (see the module doc)?"""
        spec = _spec(tokenizer)
        return spec is not None and _supported(spec)

    def encode(self, text: str) -> list[int]:
        if len(text) < MIN_TEXT:
            return self._encode(text)
        cuts = _cuts(text)
        for c in reversed(cuts):
            key = text[:c + 1]
            head = self._prefixes.get(key)
            if head is not None:
                self._prefixes.move_to_end(key)
                self.hits += 1
                return list(head) + self._encode(text[c:])
        self.misses += 1
        ids = self._encode(text)
        self._store(text, ids, cuts)
        return ids

    def _store(self, text: str, ids: list[int], cuts: list[int]) -> None:
        if not cuts:
            return
        ends = np.cumsum(self._n_bytes[np.asarray(ids, dtype=np.int64)])
        if not len(ends) or ends[-1] != len(text.encode("utf-8")):
            return  # ids that do not spell the text byte for byte: nothing to cut by
        for c in cuts:
            at = len(text[:c].encode("utf-8"))
            j = int(np.searchsorted(ends, at))
            if j < len(ends) and ends[j] == at:
                self._prefixes[text[:c + 1]] = tuple(ids[:j + 1])
                self._prefixes.move_to_end(text[:c + 1])
        while len(self._prefixes) > MAX_ENTRIES:
            self._prefixes.popitem(last=False)


def _spec(tokenizer: Any) -> dict | None:
    """The fast tokenizer's JSON description, or None (a slow Python tokenizer: tokenized whole)."""
    try:
        return json.loads(tokenizer.backend_tokenizer.to_str())
    except Exception:  # noqa: BLE001 - no Rust tokenizer or no JSON form
        return None


def _supported(spec: dict) -> bool:
    norm, pre = spec.get("normalizer"), spec.get("pre_tokenizer")
    if (spec.get("model") or {}).get("type") != "BPE" or pre is None:
        return False
    if norm is not None and norm.get("type") != "NFC":
        return False
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if not all(s.get("type") in _PRE_TOKENIZERS for s in steps):
        return False
    if not any(s.get("type") == "ByteLevel" for s in steps) and (spec.get("decoder") or {}).get("type") != "ByteLevel":
        return False
    if any(s.get("type") == "ByteLevel" and s.get("add_prefix_space") for s in steps):
        return False
    return not any("\n" in a.get("content", "") for a in spec.get("added_tokens", []))


def _cuts(text: str) -> list[int]:
    """Positions c (text[c - 1] == "\\n" and neither text[c - 2] nor text[c] a space, c < len(text)), the first
    at or after STEP and each at least max(STEP, c / SPREAD) after the one before, c: a function of the prefix
    up to each cut. (Python's \\s holds every character the tokenizers' \\s does, and more: never a cut too many.)"""
    cuts: list[int] = []
    at = STEP
    for m in _NEWLINE.finditer(text, STEP - 1):
        c = m.end()
        if c >= at and not text[c - 2].isspace():  # str.isspace is the \s of a str pattern
            cuts.append(c)
            at = c + max(STEP, c // SPREAD)
    return cuts
