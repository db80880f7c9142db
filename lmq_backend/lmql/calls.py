"""LMQL's model calls (`generate`, `score`) on an lmq backend: the torch side of the LMQL plugin.

LMQL's scheduler calls `generate`/`score` synchronously from its worker thread (or its event loop) with
a left-padded numpy batch and re-sends whole prompts every call. Each row is stripped of its padding and
run as its own lmq sequence (`seq.ids` = LMQL's token ids, so the trie matches them), all rows of a call
together with `asyncio.gather` on one dedicated event loop, so that lmq's scheduler batches them and
every call prefills only what the trie does not hold.

lmq's model process (process.py) serves LMQL's LMTP calls one by one instead, without LMQL's scheduler:
`stream_generate` and `stream_score` run one call on the caller's event loop and hand each of its tokens to
`emit` as an LMTP token payload, in the form LMQL's own scheduler sends (`TokenStreamer`, `ScoreStreamer`).
Concurrent calls then batch in lmq's scheduler as lmq's own queries do.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from lmql.models.lmtp.backends.lmtp_model import LMTPModelResult

from ..backend.protocol import Backend
from ..runtime.constraints import Stop
from ..runtime.decoders import Greedy, Sampler, Sampling

MASK_RANGE = 50.0  # a token whose LMQL bias lies this far below the row's largest bias is disallowed
SPARSE = 4096     # an allow-list of at most this many tokens is picked from and scored on those tokens alone
MASKS = 64        # distinct biases whose masks a model keeps (least recently used dropped first)


# ----- one event loop for all LMQL calls in this process --------------------------------------------

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def run(coro):
    """Run `coro` on the plugin's event loop (a daemon thread) and wait for it: the engine's scheduler is
    asyncio-based and must see the concurrent rows of a call in one loop."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="lmq-lmql-loop", daemon=True).start()
    return asyncio.run_coroutine_threadsafe(coro, _loop).result()


def _forget_loop() -> None:  # a forked child (LMQL's model subprocess) has no loop thread
    global _loop, _loop_lock
    _loop, _loop_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_loop)


async def _gather(coros) -> None:
    """Run the rows of one call concurrently; if one fails, cancel the others (their seqs are released)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


# ----- one generate() call: LMQL's bias as a hole constraint, tokens streamed as whole-batch steps -----

@dataclass(slots=True, eq=False)
class _Mask:
    """LMQL's logit bias of a row, converted once per distinct bias (`LMQLCalls.mask`). `bias` [V] float32 is
    added to the logits; `allowed` [V] bool (`allowed_np` its read-only numpy view, which the engine's masks
    memoize by identity) are the tokens within MASK_RANGE of the largest bias; `ids` the allowed tokens in
    increasing order where there are at most SPARSE of them (else None), `bias_at_ids` their biases."""

    bias: torch.Tensor
    allowed: torch.Tensor
    allowed_np: np.ndarray
    can_end: bool
    n_allowed: int
    ids: np.ndarray | None
    bias_at_ids: torch.Tensor | None
    _on: dict = field(default_factory=dict)  # device -> (ids, bias_at_ids) there, or (bias, allowed) there

    @classmethod
    def of(cls, dense: torch.Tensor, special: np.ndarray) -> "_Mask":
        allowed = dense >= dense.max() - MASK_RANGE
        allowed_np = allowed.numpy()
        allowed_np.flags.writeable = False
        n = int(allowed_np.sum())
        ids = np.flatnonzero(allowed_np) if n <= SPARSE else None
        return cls(dense, allowed, allowed_np, bool(allowed_np[special].any()), n, ids,
                   dense[torch.from_numpy(ids)] if ids is not None else None)

    def sparse_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids int64, their biases float32) on `device`."""
        key = ("sparse", device)
        if key not in self._on:
            self._on[key] = (torch.from_numpy(self.ids).to(device), self.bias_at_ids.to(device))
        return self._on[key]

    def dense_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(bias, allowed) [V] on `device`."""
        key = ("dense", device)
        if key not in self._on:
            self._on[key] = (self.bias.to(device), self.allowed.to(device))
        return self._on[key]


@dataclass(slots=True, eq=False)
class _LogProbs:
    """A pick's log-probabilities over a vocabulary of `size` tokens: `values` at the tokens `ids` (increasing;
    -inf at every other token), or `values` [size] where `ids` is None."""

    values: np.ndarray
    ids: np.ndarray | None
    size: int

    def at(self, token: int) -> float:
        if self.ids is None:
            return float(self.values[token])
        k = int(np.searchsorted(self.ids, token))
        return float(self.values[k]) if k < len(self.ids) and self.ids[k] == token else float("-inf")

    def dense(self) -> np.ndarray:
        if self.ids is None:
            return self.values
        out = np.full(self.size, -np.inf, dtype=np.float32)
        out[self.ids] = self.values
        return out

    def top(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k largest (values, token ids), largest first, as LMQL's `nputil.topk(sorted=True)` gives them."""
        from lmql.utils.nputil import topk

        if self.ids is None or k > len(self.ids):
            values, indices = topk(self.dense()[None], k, sorted=True, axis=-1)
            return values[0], indices[0]
        values, at = topk(self.values[None], k, sorted=True, axis=-1)
        return values[0], self.ids[at[0]]


class _BiasState:
    """A HoleState (see runtime/constraints.py) for one row: the tokens LMQL's bias allows, ending where
    it allows a special token (EOS), a Stop after max_new_tokens."""

    checks_tokens = False  # its mask is at hand

    def __init__(self, allowed: np.ndarray, can_end: bool, max_new_tokens: int, vocab):
        self._allowed, self._can_end, self.max_new_tokens, self.vocab = allowed, can_end, max_new_tokens, vocab
        self.tokens: list[int] = []

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def text(self) -> str:
        return self.vocab.decode_bytes(self.tokens).decode("utf-8", errors="replace")

    def allowed(self) -> np.ndarray:
        return self._allowed if self.n_tokens < self.max_new_tokens else np.zeros_like(self._allowed)

    def can_end(self) -> bool:
        return self._can_end

    def advance(self, token_id: int) -> Stop | None:
        self.tokens.append(int(token_id))
        if self.n_tokens >= self.max_new_tokens:
            return Stop(text=self.text, keep=self.n_tokens, tail="")
        return None


class _BiasSampler(Sampler):
    """Adds LMQL's bias to the logits, keeps the pick inside the allowed tokens and reports every pick
    (with its log-probabilities, as LMQL's streamer wants them) to the batch. An allow-list of at most
    SPARSE tokens is read, picked from and scored on those tokens alone; a greedy pick is the first maximal
    biased logit either way, a sampled one draws from the same [V] row either way."""

    def __init__(self, inner: Sampler, mask: _Mask, batch: "_Batch | _Stream", row: int):
        self.inner, self.mask, self.batch, self.row = inner, mask, batch, row
        self.greedy = type(inner) is Greedy and inner.knobs is None

    def select(self, logits: torch.Tensor, allowed: torch.Tensor | None) -> int:
        m, device = self.mask, logits.device
        if m.ids is not None:
            ids, bias = m.sparse_on(device)
            biased = logits[ids].float() + bias
            if allowed is not None:  # the engine narrows to value tokens while the hole cannot end
                biased = biased.masked_fill(~allowed.to(device)[ids], float("-inf"))
            if self.greedy:
                token = int(m.ids[int(torch.argmax(biased))])
            else:
                row = torch.full((len(logits),), float("-inf"), device=device)
                row[ids] = biased
                token = self.inner.select(row, None)
            ids_scored = m.ids
        else:
            bias, mask = m.dense_on(device)
            if allowed is not None:
                mask = mask & allowed.to(device)
            biased = (logits.float() + bias).masked_fill(~mask, float("-inf"))
            token = self.inner.select(biased, None)
            ids_scored = None
        scores = torch.log_softmax(biased, dim=-1).cpu().numpy().astype(np.float32)
        self.batch.push(self.row, token, _LogProbs(scores, ids_scored, m.bias.numel()))
        return token


class _Batch:
    """The new tokens of all rows of one generate() call. LMQL's streamer takes whole-batch steps
    (`streamer(input_ids [B, T+k+1], [logprobs [B, V]])`) and never the last one, which generate()
    returns; rows that ended early are padded with EOS, as transformers' generate does."""

    def __init__(self, input_ids: np.ndarray, streamer, eos: int, special: np.ndarray, max_new_tokens: int):
        self.input_ids, self.streamer, self.eos, self.special = input_ids, streamer, eos, special
        self.max_new_tokens = max_new_tokens
        self.tokens: list[list[int]] = [[] for _ in input_ids]
        self.scores: list[list[np.ndarray | None]] = [[] for _ in input_ids]
        self.done = [False] * len(input_ids)
        self.emitted = 0  # steps handed to the streamer
        self.pad_scores = np.full(len(special), -np.inf, dtype=np.float32)
        self.pad_scores[eos] = 0.0

    def push(self, row: int, token: int, scores: _LogProbs) -> None:
        self.tokens[row].append(int(token))
        self.scores[row].append(scores.dense())
        self._emit()

    def finish(self, row: int) -> None:
        t = self.tokens[row]
        if not t or (not self.special[t[-1]] and len(t) < self.max_new_tokens):
            t.append(self.eos)  # the engine ended the row without a pick (only special tokens allowed)
            self.scores[row].append(self.pad_scores)
        self.done[row] = True
        self._emit()

    def _step(self, k: int) -> list[np.ndarray] | None:
        """The log-probabilities of step k of every row, None while a running row has not reached it."""
        scores = []
        for t, s, done in zip(self.tokens, self.scores, self.done):
            if k < len(t):
                scores.append(s[k])
            elif done:
                scores.append(self.pad_scores)
            else:
                return None
        return scores

    def _emit(self) -> None:
        """Stream every complete step but the newest (which may be the last one, that generate() returns)."""
        while self.emitted + 1 < max(len(t) for t in self.tokens):
            scores = self._step(self.emitted)
            if scores is None:
                return
            self.emitted += 1
            if self.streamer is not None:
                self.streamer(self._sequences(self.emitted), [np.stack(scores)])
            for s in self.scores:  # streamed: not needed again
                if len(s) >= self.emitted:
                    s[self.emitted - 1] = None

    def _sequences(self, n: int) -> np.ndarray:
        new = np.asarray([t[:n] + [self.eos] * (n - len(t[:n])) for t in self.tokens], dtype=self.input_ids.dtype)
        return np.concatenate([self.input_ids, new.reshape(len(self.tokens), n)], axis=1)

    def result(self) -> LMTPModelResult:
        self._emit()
        n = max(len(t) for t in self.tokens)
        return LMTPModelResult(sequences=self._sequences(n), scores=[np.stack(self._step(n - 1))])


class _Stream:
    """The picks of one call as LMQL's LMTP token payloads (`lmtp_scheduler.TokenStreamer`'s form), each handed
    to `emit` once the next pick (or the call's end) shows whether it was the last: the batch's `push` and
    `finish` for a single row."""

    def __init__(self, emit, eos: int, special: np.ndarray, max_new_tokens: int, top_logprobs: int):
        self.emit, self.eos, self.special, self.max_new_tokens = emit, eos, special, max_new_tokens
        self.top_logprobs = max(1, int(top_logprobs))
        self.held: tuple[int, _LogProbs] | None = None
        self.n = 0

    def push(self, row: int, token: int, scores: _LogProbs) -> None:
        if self.held is not None:
            self._send(*self.held, last=False)
        self.held, self.n = (int(token), scores), self.n + 1

    def finish(self, row: int) -> None:
        if self.held is None or (not self.special[self.held[0]] and self.n < self.max_new_tokens):
            if self.held is not None:   # the engine ended the row without a pick (only special tokens allowed)
                self._send(*self.held, last=False)
            self.held = (self.eos, _LogProbs(np.zeros(1, dtype=np.float32), np.array([self.eos]), len(self.special)))
        self._send(*self.held, last=True)

    def _send(self, token: int, scores: _LogProbs, last: bool) -> None:
        values, indices = scores.top(self.top_logprobs)
        score = scores.at(token)
        self.emit({"token": token, "logprob": score,
                   "finish_reason": "stop" if token == self.eos else "length" if last else None,
                   "top_logprobs": {token: score, **{int(i): float(v) for v, i in zip(values, indices)}}})


# ----- the calls -------------------------------------------------------------------------------------

class LMQLCalls:
    """`generate` and `score` as LMQL's LMTP model interface defines them, served by `backend`."""

    def __init__(self, backend: Backend, mask_chunk: int = 1):
        self.backend, self.mask_chunk = backend, mask_chunk
        vocab = backend.vocab
        eos = getattr(vocab.tokenizer, "eos_token_id", None)
        self.eos_token_id = int(eos if eos is not None else min(vocab.eos_ids))
        self._masks: OrderedDict[tuple, _Mask] = OrderedDict()  # a bias's key -> its mask (`mask`)
        self._masks_lock = threading.Lock()  # (LMQL's scheduler thread and the plugin's loop both convert)

    def generate(self, input_ids, attention_mask, temperature, max_new_tokens, bias_tensor, streamer,
                 **kwargs) -> LMTPModelResult:
        input_ids = np.asarray(input_ids, dtype=np.int64)
        attention_mask = np.asarray(attention_mask)
        top_p = float(kwargs.pop("top_p", 1.0))
        if kwargs:
            warnings.warn(f"lmq: ignoring LMQL decoding arguments {sorted(kwargs)}")
        masks = [self.mask(b) for b in (bias_tensor if bias_tensor is not None else [None] * len(input_ids))]
        if all(m.n_allowed < self.backend.vocab.size // 2 for m in masks):
            # LMQL keys the tokens of a call by the allow-list of its first step; the next step has
            # another (a choice's next prefix, EOS), so tokens generated under this one go unused
            max_new_tokens = min(max_new_tokens, self.mask_chunk)
        batch = _Batch(input_ids, streamer, self.eos_token_id, self.backend.vocab.special, max_new_tokens)
        inner = (lambda: Greedy()) if temperature == 0 else (lambda: Sampling(temperature, top_p))
        run(_gather([self._generate_row(batch, i, ids[mask != 0].tolist(), m, inner(), max_new_tokens)
                      for i, (ids, mask, m) in enumerate(zip(input_ids, attention_mask, masks))]))
        return batch.result()

    async def stream_generate(self, prompt: list[int], logit_bias: dict | None, kwargs: dict, emit) -> None:
        """One LMTP GENERATE call (as LMQL's scheduler runs a batch of one: `max_tokens` 32, `temperature` 0
        unless given), on the running event loop; each token goes to `emit` as a payload (see `_Stream`)."""
        kwargs = dict(kwargs)
        max_new_tokens = int(kwargs.pop("max_tokens", 32))
        temperature = float(kwargs.pop("temperature", 0.0))
        top_logprobs = int(kwargs.pop("top_logprobs", 1))
        top_p = float(kwargs.pop("top_p", 1.0))
        if kwargs:
            warnings.warn(f"lmq: ignoring LMQL decoding arguments {sorted(kwargs)}")
        mask = self.mask(logit_bias)
        if mask.n_allowed < self.backend.vocab.size // 2:   # see `generate`
            max_new_tokens = min(max_new_tokens, self.mask_chunk)
        stream = _Stream(emit, self.eos_token_id, self.backend.vocab.special, max_new_tokens, top_logprobs)
        inner = Greedy() if temperature == 0 else Sampling(temperature, top_p)
        await self._generate_row(stream, 0, [int(t) for t in prompt], mask, inner, max_new_tokens)

    async def stream_score(self, prompt: list[int], scored: list[int], emit) -> None:
        """One LMTP SCORE call: the log-probability of each token of `scored` after `prompt` (and the ones of
        `scored` before it) to `emit`, the last with finish reason "stop" (`ScoreStreamer`'s form)."""
        ids = [int(t) for t in prompt] + [int(t) for t in scored]
        start = max(1, len(prompt))   # the first token of a sequence has no score (0, as in `score`)
        lps = [0.0] * (start - len(prompt))
        if start < len(ids):
            seq = self.backend.sequence(template="lmql", max_len=1 << 30)
            seq.ids = ids[:start]
            try:
                [row] = await self.backend.score_tokens(seq, [ids[start:]])
            finally:
                self.backend.release(seq)
            lps += [float(x) for x in row]
        for j, (token, lp) in enumerate(zip(scored, lps)):
            emit({"token": int(token), "logprob": lp, "finish_reason": "stop" if j == len(scored) - 1 else None})

    def mask(self, bias) -> _Mask:
        """LMQL's logit bias of a row (a {token: value} dict, a dense row, or None) as a `_Mask`, made once per
        distinct bias: LMQL masks with +100 on an allow-list or -100 on a deny-list, and a query's calls
        repeat a few of them (a choice's first tokens, EOS)."""
        if isinstance(bias, dict):
            key = ("dict", frozenset(bias.items()))
        elif bias is not None:
            bias = np.asarray(bias, dtype=np.float32)
            key = ("row", hashlib.blake2b(bias.tobytes(), digest_size=16).digest())
        else:
            key = ("none",)
        with self._masks_lock:
            mask = self._masks.get(key)
            if mask is not None:
                self._masks.move_to_end(key)
                return mask
        vocab = self.backend.vocab
        dense = torch.zeros(vocab.size, dtype=torch.float32)
        if isinstance(bias, dict):
            if bias:
                dense[torch.tensor([int(k) for k in bias])] = torch.tensor([float(v) for v in bias.values()])
        elif bias is not None:
            b = torch.from_numpy(bias)[: vocab.size]
            dense[: len(b)] = b
        mask = _Mask.of(dense, vocab.special)
        with self._masks_lock:
            self._masks[key] = mask
            while len(self._masks) > MASKS:
                self._masks.popitem(last=False)
        return mask

    async def _generate_row(self, batch: "_Batch | _Stream", row: int, ids: list[int], mask: _Mask,
                            inner: Sampler, max_new_tokens: int) -> None:
        backend = self.backend
        state = _BiasState(mask.allowed_np, mask.can_end, max_new_tokens, backend.vocab)
        seq = backend.sequence(template="lmql", max_len=1 << 30)
        seq.ids = ids
        try:
            await backend.generate(seq, state, _BiasSampler(inner, mask, batch, row))
        finally:
            backend.release(seq)
        batch.finish(row)

    # ----- score ----------------------------------------------------------------------------------

    def score(self, input_ids, attention_mask, **kwargs) -> np.ndarray:
        """Log-probabilities [B, T] of each token given the ones before it (0 where not computed)."""
        input_ids = np.asarray(input_ids, dtype=np.int64)
        attention_mask = np.asarray(attention_mask)
        offsets = _lmql_scoring_offsets(len(input_ids))
        out = np.zeros(input_ids.shape, dtype=np.float32)

        async def score_row(i: int) -> None:
            pad = int((attention_mask[i] == 0).sum())
            ids = input_ids[i, pad:].tolist()
            start = max(1, offsets[i] - pad) if offsets is not None else 1
            if start >= len(ids):
                return
            seq = self.backend.sequence(template="lmql", max_len=1 << 30)
            seq.ids = ids[:start]
            try:
                [lps] = await self.backend.score_tokens(seq, [ids[start:]])
            finally:
                self.backend.release(seq)
            out[i, pad + start:] = lps

        run(_gather([score_row(i) for i in range(len(input_ids))]))
        return out


def _lmql_scoring_offsets(n_rows: int) -> list[int] | None:
    """Where, per row of a score() batch (in padded columns), the tokens LMQL wants scored begin.

    LMQL 0.7.3's `Scheduler.process_batch` holds them (`GenerateBatch.scoring_offsets`) but calls
    `model.score(input_ids, attention_mask)` without them; they are read from its frame, so that only the
    scored tokens are computed and the prompt before them comes from the trie. If they are not found
    (another LMQL version), whole rows are scored: exact, but without reuse."""
    from lmql.models.lmtp.lmtp_scheduler import GenerateBatch

    frame = sys._getframe(1)
    for _ in range(4):
        frame = frame.f_back
        if frame is None:
            return None
        b = frame.f_locals.get("b")
        if isinstance(b, GenerateBatch) and b.scoring_offsets is not None and len(b.scoring_offsets) == n_rows:
            return [int(o) for o in b.scoring_offsets]
    return None
