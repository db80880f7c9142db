"""REGEX, JSON and GRAMMAR on llguidance: its check of an argument, and a mask node over an LLMatcher."""
from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import LMQCompileError, LMQRuntimeError
from ...language import ast
from ...text.vocab import VocabIndex
from .nodes import _Node, _State
from .selection import _span


def _llg_grammar(kind: str, arg: str) -> str:
    import llguidance

    if kind == "REGEX":
        return llguidance.LLMatcher.grammar_from_regex(arg)
    if kind == "JSON":
        return llguidance.LLMatcher.grammar_from_json_schema(arg)
    return llguidance.LLMatcher.grammar_from_lark(arg)


def _llg_validate(kind: str, arg: str, c: ast.Call) -> None:
    """llguidance's own check of a regex / schema / grammar (no tokenizer needed)."""
    import llguidance

    try:
        msg = llguidance.LLMatcher.validate_grammar(_llg_grammar(kind, arg))
    except Exception as e:  # noqa: BLE001 - a malformed argument
        msg = str(e) or type(e).__name__
    if msg and not msg.startswith("WARNING"):
        raise LMQCompileError(f"{kind}({c.var}, ...) cannot be used: {msg.strip()}{_span(c)}")


class _LLGNode(_Node):
    checks_tokens = True  # a mask: 0.01-0.44 ms of the host's time; a token: ~0.6 us (`allows`)
    looks_ahead = False   # (its picks check a token at a time: no mask to look ahead in, `HoleState._looks_ahead`)

    def __init__(self, kind: str, arg: Any, vocab: VocabIndex, where: ast.Call):
        self.vocab = vocab
        try:
            grammar = _llg_grammar(kind, arg)
        except Exception as e:  # noqa: BLE001
            raise LMQRuntimeError(f"{kind}({where.var}, ...) cannot be used: {e}{_span(where)}") from None
        self.template = vocab.memo(("llg", kind, arg), lambda: _new_matcher(vocab, grammar, kind, where))
        # every state starts where the template is: its first mask, computed once (read-only, shared; a
        # permissive REGEX's mask over a Llama-3 vocabulary took ~0.2-0.44 ms of the host's time)
        self.first = vocab.memo(("llg-first", kind, arg), lambda: _mask_of(self.template, vocab))

    def state(self, ctx):
        return _LLGState(self, self.template.deep_copy())


def _new_matcher(vocab: VocabIndex, grammar: str, kind: str, where: ast.Call):
    import llguidance

    m = llguidance.LLMatcher(vocab.ll_tokenizer(), grammar, log_level=0)
    if m.is_error():
        raise LMQRuntimeError(f"{kind}({where.var}, ...): llguidance cannot use it: {m.get_error()}{_span(where)}")
    return m


def _mask_of(m: Any, vocab: VocabIndex) -> np.ndarray:
    """The tokens llguidance's matcher `m` allows next (read-only bool [vocab.size], special tokens excluded;
    none where it stopped)."""
    size = vocab.size
    if m.is_stopped():
        mask = np.zeros(size, dtype=bool)
    else:
        bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little").view(bool)
        if len(mask) >= size:
            mask = mask[:size]
        else:
            mask = np.concatenate([mask, np.zeros(size - len(mask), dtype=bool)])
        mask = mask & vocab.nonspecial
    mask.flags.writeable = False
    return mask


class _LLGState(_State):
    def __init__(self, node: _LLGNode, matcher: Any):
        self.node, self.m, self.dead = node, matcher, False
        self._mask: np.ndarray | None = node.first

    def allowed(self):
        if self._mask is None:
            self._mask = np.zeros(self.node.vocab.size, dtype=bool) if self.dead else _mask_of(self.m, self.node.vocab)
        return self._mask

    def allows(self, tok):
        if self._mask is not None:
            return bool(self._mask[tok])
        return not self.dead and bool(self.node.vocab.nonspecial[tok]) and self.m.validate_tokens([tok]) == 1

    def can_end(self):
        return not self.dead and not self.m.is_error() and self.m.is_accepting()

    def advance(self, tok, old_len):
        self._mask = None
        if not self.dead and not self.m.consume_token(int(tok)):
            self.dead = True
        return not self.dead
