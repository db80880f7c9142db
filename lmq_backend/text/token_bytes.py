"""What a tokenizer's ids are as bytes: the exact UTF-8 bytes each token contributes to decoded text (byte-level
BPE through the GPT-2 alphabet, SentencePiece's `▁` and `<0xNN>` byte fallback, added tokens' literal
content), which ids are special, which end a sequence, how many ids there are. Read once per tokenizer by
`vocab.VocabIndex`."""
from __future__ import annotations

import json
import os
import re
from typing import Any

__all__ = ["bytes_to_unicode", "token_bytes_table", "tokenizer_length", "eos_ids", "utf8_scan", "utf8_continues"]


def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-level alphabet: byte -> printable unicode character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_DECODER = {c: b for b, c in bytes_to_unicode().items()}
_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

def _decoder_types(node: Any, out: set[str]) -> set[str]:
    if isinstance(node, dict):
        t = node.get("type")
        if isinstance(t, str):
            out.add(t)
            if t == "Replace" and node.get("content") == " ":
                pattern = node.get("pattern") or {}
                if isinstance(pattern, dict) and pattern.get("String") == "▁":
                    out.add("ReplaceMetaspace")
        for v in node.values():
            _decoder_types(v, out)
    elif isinstance(node, list):
        for v in node:
            _decoder_types(v, out)
    return out


def tokenizer_length(tokenizer: Any) -> int:
    try:
        n = len(tokenizer)
    except TypeError:
        n = int(getattr(tokenizer, "vocab_size"))
    try:
        ids = [int(i) for i in getattr(tokenizer, "get_vocab")().values()]
        if ids:
            n = max(n, max(ids) + 1)
    except Exception:
        pass
    return n


def utf8_scan(b: bytes, pending: int) -> tuple[int, int]:
    """(characters added, continuation bytes still expected) for bytes `b` after `pending` expected."""
    chars = 0
    for c in b:
        if c & 0xC0 == 0x80:
            if pending:
                pending -= 1
            else:
                chars += 1
        else:
            chars += 1
            pending = 1 if 0xC0 <= c < 0xE0 else 2 if 0xE0 <= c < 0xF0 else 3 if 0xF0 <= c < 0xF8 else 0
    return chars, pending


def utf8_continues(b: bytes, pending: int) -> bool:
    """Do bytes `b` keep UTF-8 well-formed after `pending` expected continuation bytes: the continuation bytes
    first, then whole characters (the last of them maybe unfinished)? Lead bytes as `utf8_scan` reads them;
    C0, C1 and F5-FF, which no character starts with, not."""
    for c in b:
        if c & 0xC0 == 0x80:
            if not pending:
                return False
            pending -= 1
        elif pending or 0x80 <= c < 0xC2 or c >= 0xF5:
            return False
        else:
            pending = 0 if c < 0x80 else 1 if c < 0xE0 else 2 if c < 0xF0 else 3
    return True


def eos_ids(tokenizer: Any) -> set[int]:
    out: set[int] = set()

    def add(v: Any) -> None:
        if isinstance(v, int):
            out.add(v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                add(x)

    add(getattr(tokenizer, "eos_token_id", None))
    gc = getattr(tokenizer, "generation_config", None)
    if gc is not None:
        add(getattr(gc, "eos_token_id", None))
    path = getattr(tokenizer, "name_or_path", None)
    if isinstance(path, (str, os.PathLike)) and os.path.isdir(path):
        f = os.path.join(path, "generation_config.json")
        if os.path.isfile(f):
            try:
                with open(f, encoding="utf-8") as fh:
                    add(json.load(fh).get("eos_token_id"))
            except (OSError, ValueError):
                pass
    return out


def token_bytes_table(tokenizer: Any, n: int) -> tuple[list[bytes], set[int]]:
    """(bytes of each id < n, ids of special tokens)."""
    special: set[int] = set(int(i) for i in (getattr(tokenizer, "all_special_ids", None) or []))
    added: dict[int, Any] = {}
    try:
        added = dict(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    except Exception:
        added = {}
    for i, t in added.items():
        if getattr(t, "special", False):
            special.add(int(i))

    kind = "generic"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_fallback = False
    if backend is not None:
        try:
            spec = json.loads(backend.to_str())
            types = _decoder_types(spec.get("decoder"), set())
            model = spec.get("model") or {}
            byte_fallback = bool(model.get("byte_fallback")) or "ByteFallback" in types
            if "ByteLevel" in types:
                kind = "bytelevel"
            elif "Metaspace" in types or "ReplaceMetaspace" in types or byte_fallback:
                kind = "sentencepiece"
        except Exception:
            kind = "generic"
    elif hasattr(tokenizer, "sp_model"):
        kind = "sentencepiece"
        byte_fallback = True

    try:
        pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    except Exception:
        pieces = [None] * n

    out: list[bytes] = []
    for i in range(n):
        if i in special:
            out.append(b"")
            continue
        t = added.get(i)
        if t is not None:
            out.append(str(getattr(t, "content", t)).encode("utf-8"))
            continue
        piece = pieces[i]
        if piece is None:
            out.append(b"")
            continue
        if isinstance(piece, bytes):
            out.append(piece)
            continue
        if kind == "bytelevel":
            try:
                out.append(bytes(_BYTE_DECODER[c] for c in piece))
            except KeyError:
                out.append(piece.encode("utf-8"))
        elif kind == "sentencepiece":
            m = _SP_BYTE.fullmatch(piece) if byte_fallback else None
            out.append(bytes([int(m.group(1), 16)]) if m else piece.replace("▁", " ").encode("utf-8"))
        else:
            try:
                text = tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            except Exception:
                text = piece
            out.append(text.encode("utf-8"))
    return out, special
