"""The plugin's patch of LMQL's prompt parser (`hook._patch_qstrings`: plain text in one step, not one character
at a time): the same statements as LMQL's own parser, or the same error, on prompts of every shape it reads."""
from __future__ import annotations

import random

import pytest

import lmql  # noqa: F401 - (the hook patches LMQL's modules as they are imported)
from lmql.language import qstrings

from lmq_backend.lmql import hook

PATCHED = qstrings.QstringParser.skip
OWN = getattr(PATCHED, "lmqls_own", None)

PROMPTS = [
    "", "plain text only", "Review: great\nSentiment:[CLS]", "[CLS]", "[CLS] and then [X] end",
    "a [[literal]] bracket and {{braces}} and ]] alone", "{f-expression} then [VAR]", "tail {x}", "x{",
    "[@decorator VAR]", "[@a @b(1) VAR]", "[VAR: int]", "[argmax VAR]", "[fn(VAR)] after", "[obj.attr]",
    "{:user} hello {:assistant}[ANSWER]", "ends with [", "ends with [[", "{", "{}", "[]", "text [ VAR ] more",
    "line one\nline two [A]\n{b}\n[[c]]", "unicode é ü 中文 [Z] 🙂 {w}",
]


def parse(prompt: str, mode: str, own: bool):
    """(statements as reprs, None) or (None, the error's type and text), with LMQL's own skip or the patch."""
    qstrings.QstringParser.skip = OWN if own else PATCHED
    try:
        return [repr(s) for s in qstrings.QstringParser(mode=mode).parse(prompt)], None
    except Exception as e:  # noqa: BLE001 - the same error is the same answer
        return None, (type(e).__name__, str(e))
    finally:
        qstrings.QstringParser.skip = PATCHED


def random_prompts(n: int) -> list[str]:
    rng = random.Random(0)
    pieces = ["a", "b c", "\n", "[", "]", "{", "}", "[X]", "{y}", "[[", "]]", "{{", "}}", "[@d X]", "[X: int]", ":"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) for _ in range(n)]


def test_the_patch_is_installed():
    assert getattr(PATCHED, "_lmq", False) and OWN is not None


@pytest.mark.parametrize("mode", ["all", "square-only"])
def test_prompts_parse_as_with_lmqls_own_parser(mode):
    for prompt in PROMPTS + random_prompts(400):
        assert parse(prompt, mode, own=False) == parse(prompt, mode, own=True), prompt


def test_patching_twice_wraps_once():
    hook._patch_qstrings(qstrings)
    assert qstrings.QstringParser.skip is PATCHED
