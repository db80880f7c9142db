"""The errors lmq raises. Every error a user can cause is an `LMQError`."""
from __future__ import annotations


class LMQError(Exception):
    """Base class of every error lmq raises on bad input or a failed query."""


class LMQSyntaxError(LMQError):
    """A query that does not parse. Names the line and column and shows the line with a caret."""

    def __init__(self, message: str, source: str = "", line: int = 0, column: int = 0):
        self.message, self.line, self.column = message, line, column
        text = f"{message} (line {line}, column {column})" if line else message
        lines = source.splitlines()
        if 0 < line <= len(lines):
            text += "\n    " + lines[line - 1].expandtabs(1) + "\n    " + " " * max(column - 1, 0) + "^"
        super().__init__(text)


class LMQCompileError(LMQError):
    """A query that parses but cannot be compiled (raised before any model call)."""


class LMQUnknownConstraintError(LMQCompileError):
    """A `where` clause calls a constraint function lmq does not know."""


class LMQUnknownVariableError(LMQCompileError):
    """A constraint or expression refers to a variable or hole that does not exist."""


class LMQConstraintConflictError(LMQCompileError):
    """A hole is constrained in ways no value can satisfy (for example `X in []`)."""


class LMQNotSupportedError(LMQCompileError):
    """A form the grammar accepts but this version of lmq does not run yet (for example `beam`)."""


class LMQInputError(LMQError):
    """A query was called with missing or unexpected inputs."""


class LMQRuntimeError(LMQError):
    """A query failed while running: a Python expression raised, a constraint could not be met."""


class LMQLengthError(LMQRuntimeError):
    """A hole could not be closed within the query's `max_len` tokens."""


class LMQUnsatisfiedError(LMQRuntimeError):
    """A hole's value could not satisfy its constraint: no token could extend it and it could not end there, or
    a stop rule (its token limit, STOPS_AT, STOPS_BEFORE) ended it where the rest of the constraint does not let
    it end. `text`: the value so far."""

    def __init__(self, message: str, text: str = ""):
        super().__init__(message)
        self.text = text

    @classmethod
    def after(cls, text: str) -> "LMQUnsatisfiedError":
        """No token can extend the value `text`, and it may not end there."""
        return cls(f"the constraint cannot be satisfied after {text!r}", text)

    @classmethod
    def cut(cls, rule: str, text: str) -> "LMQUnsatisfiedError":
        """The stop rule `rule` ended the value at `text`, where the rest of its constraint does not let it end."""
        return cls(f"the constraint cannot be satisfied: {rule} ended the value at {text!r}, where the rest of its "
                   f"constraint does not let it end", text)


class LMQBackendError(LMQError):
    """A backend could not be found, loaded or used."""
