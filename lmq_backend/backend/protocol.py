"""The backend protocol: what the query runtime asks of a model (the registry of named backends is
`registry.py`).

The runtime builds a query's prompt as a `Sequence` of segments (template text, interpolated values,
generated values). It calls, in order, `extend` for literal text, `generate` to fill a hole under a
constraint, and `score` for a `distribution` clause; `release` always runs at the end (also on failure
or cancellation). Beam decoders pick tokens themselves: `next_tokens` lists a hole's next choices, `fork`
copies a sequence for a new beam, `append` adds the value a beam chose. Each segment is tokenized on its own, the same way whatever the backend caches, so
cached and uncached runs see the same token ids.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    import numpy as np

    from ..cache.stats import CacheStats, StepInfo
    from ..engine.picks import Sampler
    from ..text.vocab import VocabIndex

DEFAULT_MAX_LEN = 2048  # a sequence's most tokens where the query names no max_len


class HoleState(Protocol):
    """What `Backend.generate` asks of a hole's constraint, token by token (the runtime's
    `constraints.HoleState` is one; its module says what each call means)."""

    text: str

    def allowed(self) -> np.ndarray | None:
        """bool [V]: the tokens that may extend the value (None: every non-special token)."""

    def can_end(self) -> bool:
        """May the value end here?"""

    def advance(self, token: int) -> Any:
        """Append a token; a stop (`text`, `keep`, `tail`) when a stop rule fired, else None."""


@dataclass(frozen=True, slots=True)
class NextTokens:
    """What `Backend.next_tokens` returns: token ids and their log-probabilities, best first, and the
    log-probability of ending the value here (None: the value cannot end here)."""

    ids: list[int]
    logprobs: list[float]
    end: float | None


@dataclass(eq=False)
class Sequence:
    """A query's prompt as it is built: token ids, text, and the backend's handle on its cached prefix.
    `on_token`, if set, is called with each token `generate` appends to a hole's value, once the hole's
    constraint has taken it (for streaming; it must return quickly and never raise)."""

    template: str
    ids: list[int] = field(default_factory=list)
    text: str = ""
    max_len: int = DEFAULT_MAX_LEN
    handle: Any = None  # owned by the backend (e.g. the pinned trie node)
    on_token: Callable[[int], None] | None = None


class Backend(abc.ABC):
    """A model that queries run on. Subclasses implement the five methods below."""

    name: str = "backend"

    @property
    @abc.abstractmethod
    def vocab(self) -> "VocabIndex":
        """The vocabulary index of the backend's tokenizer (for constraint masks)."""

    @abc.abstractmethod
    def sequence(self, template: str, max_len: int | None = None) -> Sequence:
        """A new, empty sequence (holding the tokenizer's start tokens, if any) for a query template."""

    @abc.abstractmethod
    async def extend(self, seq: Sequence, text: str, literal: list[tuple[int, int]] = ()) -> None:
        """Append literal text as one segment. `literal`: spans of `text` that are values written into the prompt
        (`{expr}`): plain text, where a special token's text (`<|im_end|>`) is not that token."""

    @abc.abstractmethod
    async def generate(self, seq: Sequence, state: "HoleState", sampler: "Sampler") -> str:
        """Fill a hole: generate tokens under `state` with `sampler`, append them, return the value."""

    @abc.abstractmethod
    async def score(self, seq: Sequence, options: list[str]) -> list[float]:
        """Log-probability of each option as the continuation of `seq` (seq is not changed)."""

    async def score_tokens(self, seq: Sequence, continuations: list[list[int]]) -> list[list[float]]:
        """Per-token log-probabilities of each continuation (token ids) after `seq` (seq is not changed)."""
        raise NotImplementedError(f"{type(self).__name__} cannot score token ids")

    async def next_tokens(self, seq: Sequence, tokens: list[int], k: int, allowed: "np.ndarray | None",
                          can_end: bool) -> "NextTokens":
        """The choices of a decoder that picks tokens itself (beam search) after `seq.ids + tokens`, where
        `tokens` are a hole's tokens so far: the `k` most likely tokens that extend the value (in `allowed`,
        None: every token a value may hold), best first; and when `can_end`, ending the value here, scored as
        the most likely token that cannot extend it (as `generate` ends a hole under greedy decoding).
        Log-probabilities are the model's, over every token (the mask does not renormalise them). With no
        token to extend the value, no forward runs: ending is free (0.0) if `can_end`. `seq` keeps its ids
        and text; its handle may move to a cached node covering `tokens`, so that the next call, with one
        more token, computes that token alone. Raises LMQLengthError past `seq.max_len` unless `can_end`."""
        raise NotImplementedError(f"{type(self).__name__} cannot list next tokens (no beam decoding)")

    def fork(self, seq: Sequence) -> Sequence:
        """A copy of `seq` (ids, text, the cached prefix it holds); release each of them."""
        return Sequence(seq.template, list(seq.ids), seq.text, seq.max_len)

    def append(self, seq: Sequence, ids: list[int], text: str) -> None:
        """Append a value whose token ids the decoder chose (`ids`, reading as `text`) as one segment."""
        seq.ids.extend(ids)
        seq.text += text

    @abc.abstractmethod
    def release(self, seq: Sequence) -> None:
        """The query is done with `seq` (finished, failed or cancelled): drop its pins."""

    def chat_template(self) -> Callable[[list[dict[str, str]], bool], str] | None:
        """The model's chat template, for queries with role tags: `render(messages, add_generation_prompt)`
        -> the text of the conversation (`messages`: {"role", "content"} dicts) as the model reads it after
        the sequence's start tokens. None: the model has no chat template."""
        return None

    def stats(self) -> "CacheStats":
        from ..cache.stats import CacheStats

        return CacheStats()

    def reset_stats(self) -> None:
        pass

    def record_call(self, template: str, seconds: float) -> None:
        """A query call of `template` finished in `seconds` (for per-template latency stats)."""

    def on_step(self, callback: Callable[["StepInfo"], None] | None) -> None:
        """Call `callback(StepInfo)` after every model forward (None removes it); for live monitoring."""
