"""Streaming a query call: `async for event in query.stream(**inputs)`.

Events, in the order they happen:
- a chat message opens (`role` its role, no text);
- prompt text the query writes (`variable` None; `role`: the chat message it belongs to, if any);
- a hole's text as its tokens are decided (`variable` the hole's name, `text` what was added since its last
  event): token by token, whole UTF-8 characters only, and only text that stays in the value (a
  `STOPS_BEFORE` string's first characters wait until it is clear they are not the stop string's), so that
  a hole's events add up to its final text; a distribution's choice, a nested query's value, in one event;
- last, one event with `done` True and the call's `result` (a Result, the query's return value, or a list).

`index` tells the results of `sample(n > 1)` apart. Beam decoders choose among whole programs: their stream
holds the final event only.
"""
from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Any, Callable

from .constraints import HoleConstraint, HoleState


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One event of a stream (see the module docstring)."""

    variable: str | None = None
    text: str = ""
    role: str | None = None
    index: int = 0
    done: bool = False
    result: Any = None


Emit = Callable[[StreamEvent], None]


class HoleStream:
    """The token callback of one hole (`Sequence.on_token`): emits the text the hole's value gained."""

    def __init__(self, emit: Emit, variable: str, constraint: HoleConstraint, state: HoleState, index: int = 0):
        self.emit, self.variable, self.state, self.index = emit, variable, state, index
        # bytes a STOPS_BEFORE string may still take back
        self.holdback = max((len(rule.s) - 1 for rule in constraint.stops if rule.before), default=0)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.fed = 0
        self.sent = ""

    def __call__(self, token: int) -> None:
        try:
            stop = self.state.stopped
            if stop is not None:
                self._send(stop.text)
                return
            value = self.state.value_bytes
            end = len(value) - self.holdback
            if end > self.fed:
                self._send(self.sent + self.decoder.decode(value[self.fed:end]))
                self.fed = end
        except Exception:  # noqa: BLE001 - a stream never breaks the engine's step; the final value follows
            pass

    def finish(self, value: str) -> None:
        """The hole is done with `value`: the rest of it."""
        self._send(value)

    def _send(self, text: str) -> None:
        if len(text) > len(self.sent) and text.startswith(self.sent):
            self.emit(StreamEvent(self.variable, text[len(self.sent):], index=self.index))
            self.sent = text
