"""A hole state written to the required part of the `HoleState` contract (lmq_backend.runtime.constraints.hole)
only: allowed, can_end, advance and text; no `allows` / `checks_tokens` (optional: the backend asks such a
state for its masks)."""
from __future__ import annotations


class Record:
    """A hole of exactly n tokens that records them."""

    def __init__(self, n: int):
        self.n, self.tokens, self.text = n, [], ""

    def allowed(self):
        return None

    def can_end(self) -> bool:
        return False

    def advance(self, token_id: int):
        from lmq_backend.runtime.constraints import Stop

        self.tokens.append(token_id)
        return Stop(text="", keep=len(self.tokens), tail="") if len(self.tokens) == self.n else None
