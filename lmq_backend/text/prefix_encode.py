"""Exact tokenization that does not tokenize a recurring prefix, or word, again.

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

The text after the cut (all of it, for a short text or no stored prefix) is split at *word cuts* too: a
space between two printable ASCII characters (text[p] == " ", text[p - 1] and text[p + 1] in "!".."~"). None
of the accepted expressions (GPT-2's, Llama-3's, Qwen's) has a piece holding a non-space character followed
by a space, and none looks behind, so a piece starts at every word cut whatever came before; NFC composes
nothing across a space; and with no added token containing a space or taking the whitespace after it
(`rstrip`), none spans one. So the ids of the text are the ids of its *words* (the pieces between word cuts:
" coffee", " week.\nSummary:"), each tokenized alone, which are kept by text (`MAX_WORDS`): a new prompt tail
costs a dictionary lookup a word, and its unseen words one call of the tokenizer (joined in order, they meet
at word cuts again: each but the last ends in a printable character, each but the first starts with " X").

Where no token of the vocabulary holds a digit with another character (SmolLM2's spells each digit alone: BPE
merges no digit with anything) and no added token holds a digit, words are cut at *digit cuts* too: before an
ASCII digit that follows a printable ASCII character other than a space, and after one before any printable
ASCII character. A digit begins a piece of every accepted expression unless a space or a digit comes before
it (the first is no cut: "  1" is pieced " ", " 1", and "  " alone may be one token), and a piece of digits
ends at its last digit; inside a piece of digits, BPE joins none. So a number is its digits' ids, each kept:
a call's new number (a counter, a date, an order id) costs no call of the tokenizer.

A text whose ids do not add up to its bytes (a tokenizer the rule above does not describe) is never
stored, and tests compare the result with the tokenizer's own on random texts.
"""
from __future__ import annotations

import json
import re
from collections import OrderedDict
from itertools import chain
from typing import Any, Callable

import numpy as np

STEP = 512          # characters between cuts, at least; a 32nd of the text before the previous cut beyond 16K
SPREAD = 32         # (the tail tokenized again stays short; the stored keys' characters grow as the text's)
MIN_TEXT = 1024     # no prefix of a shorter text is stored (it is tokenized by its words)
MAX_ENTRIES = 4096  # stored prefixes (least recently used dropped first)
RECENT = 4          # keys found last whose cuts are remembered
MAX_WORDS = 1 << 15  # words kept (all dropped when full: a cache of the tokenizer's own ids, refilled on use)
MAX_WORD = MIN_TEXT  # longer words (text with no word cut) are tokenized, not kept
_NEWLINE = re.compile(r"\n(?=\S)")  # a newline before a character that is no space (a literal first: fast)
_WORD_CUT = re.compile(r"(?= [!-~])(?<=[!-~])")  # before a space between printable ASCII characters
# the digit cuts: before an ASCII digit after a printable ASCII character but a space, after one
_DIGIT_CUT = re.compile(r"(?<=[!-~])(?=[0-9])|(?<=[0-9])(?=[ -~])")
_DIGIT = re.compile(r"[0-9]")
_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits"}
# Split expressions whose pieces never hold a non-space character followed by a space (Llama-3's, Qwen2's,
# GPT-2's): word cuts are exact under them (ByteLevel's own expression, use_regex, is GPT-2's)
_WORD_SPLITS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
}


class PrefixEncoder:
    def __init__(self, encode: Callable[[str], list[int]], n_bytes: np.ndarray, words: bool = False,
                 digits: bool = False):
        """`encode`: the tokenizer's own encode (no special tokens); `n_bytes[id]`: the UTF-8 bytes a token
        spells in text (added tokens: their content); `words`: are word cuts exact (`_word_cuts_exact`)?
        `digits`: and digit cuts (`_digits_alone`)?"""
        self._encode = encode
        self._digits = words and digits
        self._n_bytes = np.asarray(n_bytes, dtype=np.int64)
        self._n_bytes_list: list[int] = self._n_bytes.tolist()
        self._words: dict[str, tuple[int, ...]] | None = {} if words else None
        self._prefixes: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        # the keys found last, with the cuts up to their own (a text starting with one has those cuts, so only
        # the characters after it are searched for more): a data set's calls share one
        self._recent: list[tuple[str, tuple[int, ...]]] = []
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
        return cls(lambda text: backend.encode(text, add_special_tokens=False).ids, spelled,
                   words=_word_cuts_exact(spec), digits=_digits_alone(spec))

    @staticmethod
    def supports(tokenizer: Any) -> bool:
        """Is `tokenizer` one whose pieces never cross a cut (see the module doc)?"""
        spec = _spec(tokenizer)
        return spec is not None and _supported(spec)

    def encode(self, text: str) -> list[int]:
        if len(text) < MIN_TEXT:
            return self._encode_words(text)
        cuts = self._cuts_of(text)
        for k in range(len(cuts) - 1, -1, -1):
            c = cuts[k]
            key = text[:c + 1]
            head = self._prefixes.get(key)
            if head is not None:
                self._prefixes.move_to_end(key)
                self._remember(key, cuts[:k + 1])
                self.hits += 1
                return [*head, *self._encode_words(text[c:])]
        self.misses += 1
        ids = self._encode_words(text)  # a new prompt's words were mostly seen before
        self._store(text, ids, cuts)
        return ids

    def _encode_words(self, text: str) -> list[int]:
        """The ids of `text` from the ids of its words (see the module doc); the unseen ones tokenized in one
        call, joined, their ids split at the words' byte ends."""
        words = self._words
        if words is None:
            return self._encode(text)
        if not text:
            return []
        parts = self.split(text)
        found = list(map(words.get, parts))
        if None in found:
            new = [i for i, f in enumerate(found) if f is None]
            for run in self._runs(parts, new):
                ids = self._encode("".join(parts[i] for i in run))
                split = self._split(ids, [len(parts[i].encode("utf-8")) for i in run])
                if split is None:
                    return self._encode(text)  # ids not split at the words: not this rule's tokenizer
                for i, word_ids in zip(run, split):
                    found[i] = word_ids
            if len(words) + len(new) > MAX_WORDS:
                words.clear()
            for i in new:
                if len(parts[i]) <= MAX_WORD:
                    words[parts[i]] = found[i]
        return list(chain.from_iterable(found))

    def split(self, text: str) -> list[str]:
        """`text`'s words: cut at word cuts, and at digit cuts where they are exact (a digit cut at a word's
        edge is a word cut: a word's digit cuts are those of the whole text within it)."""
        parts = _WORD_CUT.split(text)
        if self._digits and _DIGIT.search(text) is not None:
            parts = [piece for part in parts for piece in (_DIGIT_CUT.split(part) if _DIGIT.search(part) else (part,))]
        return parts

    def _runs(self, parts: list[str], new: list[int]) -> list[list[int]]:
        """The new words (`new`: indices in `parts`) in runs that are tokenized joined, each in one call: a word
        joins the run before it where the two meet at a cut (always at word cuts alone; a word that a digit cut
        began after a digit, " x" after "9", meets no word ending in a letter)."""
        runs: list[list[int]] = []
        for i in new:
            if runs and (not self._digits or _meet(parts[runs[-1][-1]], parts[i])):
                runs[-1].append(i)
            else:
                runs.append([i])
        return runs

    def _split(self, ids: list[int], lengths: list[int]) -> list[tuple[int, ...]] | None:
        """`ids` cut into the words of `lengths` bytes each: a word's ids are those whose bytes end within it,
        each word at least one, the last id ending where the last word does; None where the ids' byte ends
        do not meet the words' ends. (A loop over the few ids of a prompt's new words: numpy's calls cost
        more than it at this size.)"""
        if not lengths:
            return None if ids else []
        n_bytes = self._n_bytes_list
        out, start, at, k, end = [], 0, 0, 0, lengths[0]
        for j, token in enumerate(ids):
            at += n_bytes[token]
            if at < end:
                continue
            if at > end:
                return None
            out.append(tuple(ids[start:j + 1]))
            start, k = j + 1, k + 1
            if k == len(lengths):
                break
            end += lengths[k]
        return out if k == len(lengths) and start == len(ids) else None

    def _cuts_of(self, text: str) -> list[int]:
        """`_cuts(text)`, searching only past the longest recent key the text starts with."""
        for key, cuts in self._recent:
            if text.startswith(key):
                return list(cuts) + _cuts(text, cuts[-1])
        return _cuts(text)

    def _remember(self, key: str, cuts: list[int]) -> None:
        recent = [(k, c) for k, c in self._recent if k != key]
        recent.append((key, tuple(cuts)))
        recent.sort(key=lambda kc: -len(kc[0]))  # longest first: the first that matches is the best
        self._recent = recent[:RECENT]

    def _store(self, text: str, ids: list[int], cuts: list[int]) -> None:
        if not cuts:
            return
        ends = np.cumsum(self._n_bytes[np.asarray(ids, dtype=np.int64)])
        if not len(ends) or ends[-1] != len(text.encode("utf-8")):
            return  # ids that do not spell the text byte for byte: nothing to cut by
        stored = None
        for k, c in enumerate(cuts):
            at = len(text[:c].encode("utf-8"))
            j = int(np.searchsorted(ends, at))
            if j < len(ends) and ends[j] == at:
                self._prefixes[text[:c + 1]] = tuple(ids[:j + 1])
                self._prefixes.move_to_end(text[:c + 1])
                stored = k
        while len(self._prefixes) > MAX_ENTRIES:
            self._prefixes.popitem(last=False)
        if stored is not None:
            self._remember(text[:cuts[stored] + 1], cuts[:stored + 1])


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


def _word_cuts_exact(spec: dict) -> bool:
    """Are word cuts exact for this (`_supported`) tokenizer: every expression one that starts a piece at a
    word cut, no added token spanning one?"""
    pre = spec["pre_tokenizer"]
    for s in pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]:
        if s.get("type") == "Split" and ((s.get("pattern") or {}).get("Regex") not in _WORD_SPLITS
                                         or s.get("behavior") != "Isolated" or s.get("invert")):
            return False
    return not any(" " in a.get("content", "") or a.get("rstrip") for a in spec.get("added_tokens", []))


def _meet(before: str, after: str) -> bool:
    """Do two words joined meet at a cut (a word cut or a digit cut)?"""
    around = before[-1] + after[:2]
    return _WORD_CUT.match(around, 1) is not None or _DIGIT_CUT.match(around, 1) is not None


def _digits_alone(spec: dict) -> bool:
    """Does no token of the (byte-level: an ASCII digit is itself in its tokens' strings) vocabulary hold a digit
    with another character, and no added token a digit?"""
    vocab = (spec.get("model") or {}).get("vocab")
    if not isinstance(vocab, dict):
        return False
    if any(len(token) > 1 and _DIGIT.search(token) for token in vocab):
        return False
    return not any(_DIGIT.search(a.get("content", "")) for a in spec.get("added_tokens", []))


def _cuts(text: str, after: int | None = None) -> list[int]:
    """Positions c (text[c - 1] == "\\n" and neither text[c - 2] nor text[c] a space, c < len(text)), the first
    at or after STEP and each at least max(STEP, c / SPREAD) after the one before, c: a function of the prefix
    up to each cut. (Python's \\s holds every character the tokenizers' \\s does, and more: never a cut too many.)
    `after`: a cut of the text; those after it (the earlier ones are the caller's)."""
    cuts: list[int] = []
    at = STEP if after is None else after + max(STEP, after // SPREAD)
    for m in _NEWLINE.finditer(text, at - 1):
        c = m.end()
        if c >= at and not text[c - 2].isspace():  # str.isspace is the \s of a str pattern
            cuts.append(c)
            at = c + max(STEP, c // SPREAD)
    return cuts
