"""What a query run has written, and what of it the backend's sequence holds.

Prompt text collects until the next hole (or a `distribution`, or the end of the query) and goes to the
backend as one segment (`flush`): so a chunk is tokenized as a whole, as the model saw such text in training,
and the same way on every call whatever the cache holds. Segment boundaries fall only where a generated value
begins or ends.

- `Transcript`: a plain prompt: the sequence gets the text as written.
- `ChatTranscript`: a chat (a query with role tags): messages that `{:system}`, `{:user}` and `{:assistant}`
  open, rendered by the model's own chat template at each flush. The model reads the rendering of the
  conversation so far: every message before the last closed; the last one open, cut where its content ends:
  an assistant message as the template's generation prompt followed by its content so far, any other role's
  message rendered with a marker after its content and cut at the marker. The sequence gets what the
  rendering adds to the text it holds, so that each turn sends only its own text, and the prefix trie
  serves the rest. A template that renders an earlier message differently once a later one exists (the
  rendering no longer starts with the text the sequence holds) gets a fresh sequence holding the whole
  rendering (`rerenders` counts them; the prefix trie still serves the tokens the two share).
"""
from __future__ import annotations

from typing import Callable

from ..backend.protocol import Backend, Sequence
from ..errors import LMQRuntimeError

_CUT = "\ue000lmq\ue000"  # after the content of an open message that is not the assistant's: rendered, then cut


class Transcript:
    """A plain prompt's text not yet sent to the backend."""

    chat = False

    def __init__(self) -> None:
        self.pending: list[str] = []
        self.literal: list[tuple[int, int]] = []  # spans of "".join(pending) that are values (`write`)
        self._length = 0

    @property
    def has_message(self) -> bool:
        return True

    def open(self, role: str) -> None:
        raise LMQRuntimeError(f"a role tag {{:{role}}} in a query without a chat transcript")

    def write(self, text: str, literal: bool = False) -> None:
        """Prompt text: template text, or an interpolated value (`literal`: plain text to the model, a special
        token's text in it no special token)."""
        self.pending.append(text)
        if literal and text:
            self.literal.append((self._length, self._length + len(text)))
        self._length += len(text)

    def generated(self, text: str) -> None:
        """A value the backend appended to the sequence itself (a hole's, a distribution's choice)."""

    async def flush(self, backend: Backend, seq: Sequence, final: bool = False) -> Sequence:
        """Send what the sequence lacks; returns the sequence that holds the prompt now (`seq`, or for a chat
        re-rendered, a fresh one: `seq` is released then). `final`: the query has ended."""
        if self.pending:
            text, literal = "".join(self.pending), self.literal
            self.pending, self.literal, self._length = [], [], 0
            if literal:
                await backend.extend(seq, text, literal)
            else:
                await backend.extend(seq, text)
        return seq

    def copy(self) -> "Transcript":
        out = Transcript()
        out.pending, out.literal, out._length = list(self.pending), list(self.literal), self._length
        return out


class ChatTranscript(Transcript):
    """A chat's messages, rendered by `render(messages, add_generation_prompt)` (`Backend.chat_template`)."""

    chat = True

    def __init__(self, render: Callable[[list[dict[str, str]], bool], str]):
        super().__init__()
        self.render = render
        self.messages: list[list[str]] = []  # [role, content so far]
        self.rerenders = 0

    @property
    def has_message(self) -> bool:
        return bool(self.messages)

    def open(self, role: str) -> None:
        self.messages.append([role, ""])

    def write(self, text: str, literal: bool = False) -> None:
        self.messages[-1][1] += text  # (a value as the template renders it: as `apply_chat_template` does)

    def generated(self, text: str) -> None:
        self.messages[-1][1] += text

    def rendering(self, final: bool) -> str:
        """The conversation as the model reads it: every message closed if `final`, else the last one open."""
        msgs = [{"role": role, "content": content} for role, content in self.messages]
        if final or not msgs:
            return self._render(msgs, False) if msgs else ""
        last = msgs[-1]
        if last["role"] == "assistant":
            return self._render(msgs[:-1], True) + last["content"]
        text = self._render([*msgs[:-1], {"role": last["role"], "content": last["content"] + _CUT}], False)
        if text.count(_CUT) != 1:
            raise LMQRuntimeError(f"the chat template does not render a {last['role']} message's content as "
                                  f"written: a hole cannot stand inside it")
        return text[: text.index(_CUT)]

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        try:
            return self.render(messages, add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template's own check (roles must alternate, no system role, ...)
            roles = ", ".join(m["role"] for m in messages)
            raise LMQRuntimeError(f"the model's chat template refuses the conversation ({roles}): "
                                  f"{type(e).__name__}: {e}") from e

    async def flush(self, backend: Backend, seq: Sequence, final: bool = False) -> Sequence:
        text = self.rendering(final)
        if text.startswith(seq.text):
            if len(text) > len(seq.text):
                await backend.extend(seq, text[len(seq.text):])
            return seq
        self.rerenders += 1
        fresh = backend.sequence(seq.template, seq.max_len)
        try:
            await backend.extend(fresh, text)
        except BaseException:
            backend.release(fresh)
            raise
        backend.release(seq)
        return fresh

    def copy(self) -> "ChatTranscript":
        out = ChatTranscript(self.render)
        out.messages = [list(m) for m in self.messages]
        out.rerenders = self.rerenders
        return out
