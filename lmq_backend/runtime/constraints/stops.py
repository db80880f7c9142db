"""Stop rules: STOPS_AT / STOPS_BEFORE end a hole where a string occurs in its value, and what a hole
reports when one fires (`Stop`). `len(TOKENS(X)) < n` ends a hole too; `HoleState` counts its tokens."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Stop:
    """A stop rule fired: the hole's final value `text`; the first `keep` appended tokens lie wholly inside
    it and `tail` is the rest of `text` after them (part of a later token's text), "" if none. `broken`: the
    rest of the hole's constraint does not allow the value to end there (what the rule that fired was, for
    the error that the value is not taken: "" while it does)."""

    text: str
    keep: int
    tail: str
    broken: str = ""


class _StopString:
    def __init__(self, s: str, before: bool):
        self.s, self.before = s.encode("utf-8"), before

    def __str__(self) -> str:
        return f"{'STOPS_BEFORE' if self.before else 'STOPS_AT'}({self.s.decode('utf-8')!r})"

    def end(self, value: bytearray, old_len: int) -> int | None:
        """The end (in bytes) of the final value if the stop string now occurs, else None."""
        i = value.find(self.s, max(0, old_len - len(self.s) + 1))
        if i < 0:
            return None
        return i if self.before else i + len(self.s)
