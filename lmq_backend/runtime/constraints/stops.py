"""Stop rules: STOPS_AT / STOPS_BEFORE end a hole where a string occurs in its value, and what a hole
reports when one fires (`Stop`). `len(TOKENS(X)) < n` ends a hole too; `HoleState` counts its tokens."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Stop:
    """A stop rule fired: the hole's final value `text`; the first `keep` appended tokens lie wholly inside
    it and `tail` is the rest of `text` after them (part of a later token's text), "" if none."""

    text: str
    keep: int
    tail: str


class _StopString:
    def __init__(self, s: str, before: bool):
        self.s, self.before = s.encode("utf-8"), before

    def end(self, value: bytearray, old_len: int) -> int | None:
        """The end (in bytes) of the final value if the stop string now occurs, else None."""
        i = value.find(self.s, max(0, old_len - len(self.s) + 1))
        if i < 0:
            return None
        return i if self.before else i + len(self.s)
