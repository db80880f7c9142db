"""The query text: normalised (`normalize_source`), with offset <-> (line, column) positions (`_Source`)."""
from __future__ import annotations

import bisect
import re
import textwrap

from ..errors import LMQSyntaxError


class _Source:
    """The normalised source text, with offset -> (line, column) conversion (both 1-based)."""

    def __init__(self, text: str):
        self.text = text
        self.line_starts = [0] + [m.end() for m in re.finditer("\n", text)]

    def pos(self, offset: int) -> tuple[int, int]:
        offset = max(0, min(offset, len(self.text)))
        i = bisect.bisect_right(self.line_starts, offset) - 1
        return i + 1, offset - self.line_starts[i] + 1

    def offset(self, line: int, column: int) -> int:
        line = max(1, min(line, len(self.line_starts)))
        return self.line_starts[line - 1] + max(column - 1, 0)

    def error(self, message: str, line: int, column: int) -> LMQSyntaxError:
        return LMQSyntaxError(message, self.text, line, column)


_MARKER = re.compile(r"[ \t]*(lmql|lmq)[ \t]*")


def normalize_source(source: str) -> str:
    """Line endings to `\\n`, a first non-blank line `lmql`/`lmq` blanked (line numbers are kept),
    `textwrap.dedent`, trailing whitespace dropped."""
    if isinstance(source, bytes):
        source = source.decode("utf-8")
    if not isinstance(source, str):
        raise LMQSyntaxError(f"a query must be a string, not {type(source).__name__}")
    text = source.replace("\r\n", "\n").replace("\r", "\n")
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.strip():
            if _MARKER.fullmatch(line):
                lines[i] = ""
            break
    text = textwrap.dedent("\n".join(lines))
    return text.rstrip()
