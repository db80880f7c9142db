"""`HFBackend`: any Hugging Face causal LM behind the backend protocol, on lmq's engine.

The backend tokenizes (segment by segment: `extend`), runs a hole's token loop (`generate`, `hole_loop.py`),
scores and lists a beam's choices, and keeps the statistics; the engine (`engine/engine.py`) does the model's
work: every prefill looks up the longest cached prefix of the sequence's token ids in the prefix cache, computes
only the rest and stores what it computed. A sequence's `handle` is its `Pin` on the cached prefix it holds
until it is released. `cache_budget` bounds what the cache keeps (0 turns it off: every prefill computes the
whole prompt, the exact reference behaviour); `kv_budget` bounds the whole K/V store (default: sized from free
memory). Under the prefix cache, the cache tiers (`cache/tiers.py`): `host_cache` bounds host memory that evicted
prefixes move to, `disk_cache` names the folder that long prefixes are written to for later processes
(`disk_budget` bounds it).
"""
from __future__ import annotations

import atexit
import gc
from pathlib import Path

import torch

from ..cache.disk_tier import resolve_folder
from ..cache.fingerprint import folder_fingerprint, state_fingerprint
from ..cache.prefix_cache import Pin
from ..cache.stats import CacheStats, TemplateStats
from ..cache.tiers import TierOptions
from ..engine.compat import PRETRAINED
from ..engine.engine import Engine
from ..engine.picks import Choices, Sampler
from ..engine.quantize import QUANTIZED_DTYPES
from ..engine.rows import Preempted, PrefillRequest, Row
from ..errors import LMQBackendError, LMQLengthError, LMQRuntimeError
from ..text.vocab import VocabIndex
from ..text.vocab_cache import vocab_index
from .budgets import parse_bytes
from .hole_loop import FreeHoles, HoleLoop
from .masks import PickMasks
from .protocol import DEFAULT_MAX_LEN, Backend, HoleState, NextTokens, Sequence


def _resolve_dtype(dtype, device: str) -> torch.dtype:
    if str(dtype) in QUANTIZED_DTYPES:  # weight-only quantized: loaded in float32, then quantized
        if device != "cpu":
            raise LMQBackendError(f"dtype {dtype!r} (weight-only quantized) runs on the CPU only")
        return torch.float32
    if dtype is None:
        return torch.float32 if device == "cpu" else torch.bfloat16
    resolved = dtype if isinstance(dtype, torch.dtype) else MODEL_DTYPES.get(str(dtype).removeprefix("torch."))
    if resolved not in MODEL_DTYPES.values():
        raise LMQBackendError(f"unknown dtype {dtype!r}: use {', '.join(MODEL_DTYPES)}, or on a CPU "
                              f"{' or '.join(QUANTIZED_DTYPES)} (weight-only quantized)")
    return resolved


# the dtypes a model's weights and K/V are computed in (`dtype=`; torch's own names, or the torch.dtype)
MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float64": torch.float64}


_frozen = False


def _freeze_once() -> None:
    """After the process's first backend is set up, what is alive (the model, tokenizer and vocabulary
    index: hundreds of thousands of objects) goes out of the collector's sight, so a full collection no longer
    walks it (one in the middle of 256 concurrent calls stalls them all); vLLM does the same after its
    start-up. Once a process: a frozen object is never collected, so freezing at every backend would keep each
    earlier backend that was dropped. No collection first: it would walk the same objects at start-up, and
    free nothing; cyclic garbage that exists at this moment stays, once. Unfrozen at exit, so the
    interpreter's teardown collects it (else nanobind, under triton, reports every binding it lost)."""
    global _frozen
    if not _frozen:
        _frozen = True
        gc.freeze()
        atexit.register(gc.unfreeze)


def _tier_options(host_cache, disk_cache, disk_budget, fingerprint, name: str,
                  weights_dtype: str | None = None) -> TierOptions:
    """The cache tiers a backend's settings ask for (`HFBackend`'s docstring): `fingerprint()` names the
    weights, `weights_dtype` a quantized dtype (else the store's)."""
    return TierOptions(host_bytes=None if host_cache == "auto" else parse_bytes(host_cache, "host_cache"),
                       folder=resolve_folder(disk_cache), disk_bytes=parse_bytes(disk_budget, "disk_budget"),
                       fingerprint=fingerprint, weights_dtype=weights_dtype, name=name)


class HFBackend(Backend):
    """A local Hugging Face causal LM: `HFBackend("path/or/dir", device=, dtype=, cache_budget=)`.

    `path` may be "default" for the embedded SmolLM2-135M-Instruct. `dtype` "int8" or "int4": weight-only
    quantized on the CPU (`engine/quantize.py`; the default model's "int4" is its shipped Q4_1 file). Use
    `HFBackend.from_model` to wrap a model and tokenizer you already hold (quantized or not).

    Cache tiers: `host_cache` ("auto": none, see `cache.tiers.TierOptions`; or bytes of pinned host
    memory on a GPU, all pinned when the backend is made; plain memory on the CPU); `disk_cache` ("default": `lmq cache ls` shows the folder, $LMQ_DISK_CACHE=off turns it
    off; a folder; None for none) within `disk_budget`, shared by every process of the same model."""

    def __init__(self, path: str | Path = "default", device: str | None = None, dtype=None,
                 cache_budget: int | str = "2GB", name: str | None = None, max_batch: int = 256,
                 kv_budget: int | str | None = None, host_cache: int | str = "auto",
                 disk_cache: str | Path | bool | None = "default", disk_budget: int | str = "10GB"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf_file = None
        if str(path) == "default":
            from .default_model import default_model_dir, gguf_path

            path, gguf_file = default_model_dir(), gguf_path()
        if not Path(path).is_dir():
            raise LMQBackendError(f"no model folder at {path!s} (lmq loads local folders only, never a hub)")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        torch_dtype = _resolve_dtype(dtype, device)  # (a dtype it does not know, before the model loads)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype, **PRETRAINED)
        except Exception as e:  # noqa: BLE001 - any loader failure is a backend error for the user
            raise LMQBackendError(f"could not load a causal LM from {path!s}: {e}") from e
        if str(dtype) in QUANTIZED_DTYPES:  # "int4" of the default model: its shipped Q4_1 weights as they are
            from .gguf_weights import quantize_weights

            quantize_weights(model, str(dtype), gguf_file)
        name = name or str(path)
        folder = Path(path)
        tiers = _tier_options(host_cache, disk_cache, disk_budget, lambda: folder_fingerprint(folder), name,
                              str(dtype) if str(dtype) in QUANTIZED_DTYPES else None)
        self._setup(model.to(device).eval(), tokenizer, cache_budget, name, max_batch, kv_budget,
                    weights_folder=folder, tiers=tiers)

    @classmethod
    def from_model(cls, model, tokenizer, cache_budget: int | str = "2GB", name: str = "model",
                   max_batch: int = 256, kv_budget: int | str | None = None, host_cache: int | str = "auto",
                   disk_cache: str | Path | bool | None = None, disk_budget: int | str = "10GB") -> "HFBackend":
        """A backend over a model object. Its disk tier is off unless `disk_cache` is given: weights in memory
        may change in place, which the fingerprint (a sample of them) cannot always see."""
        backend = cls.__new__(cls)
        tiers = _tier_options(host_cache, disk_cache, disk_budget, lambda: state_fingerprint(model), name)
        backend._setup(model.eval(), tokenizer, cache_budget, name, max_batch, kv_budget, tiers=tiers)
        return backend

    def _setup(self, model, tokenizer, cache_budget, name: str, max_batch: int = 256, kv_budget=None,
               weights_folder: Path | None = None, tiers: TierOptions | None = None) -> None:
        self.name = name
        self.model, self.tokenizer = model, tokenizer
        self.engine = Engine(model, max_batch=max_batch,
                             kv_budget=None if kv_budget is None else parse_bytes(kv_budget, "kv_budget"),
                             cache_budget=parse_bytes(cache_budget, "cache_budget"), weights_folder=weights_folder,
                             tiers=tiers)
        runner = self.engine.runner
        self._vocab = vocab_index(tokenizer, runner.vocab_size)  # (from disk after the first load)
        self._vocab.prefix_encoder()  # (now, not in the first call)
        self.masks = PickMasks(self._vocab, len(tokenizer), runner.device)
        self.free_holes = FreeHoles(self.masks.extendable)
        runner.set_greedy_masks(list(self.masks.greedy), after=self.masks.proposals.after)
        with_special = tokenizer("x").input_ids
        plain = tokenizer("x", add_special_tokens=False).input_ids
        self._start_ids = list(with_special[: len(with_special) - len(plain)]) if with_special[-len(plain):] == plain else []
        self.max_positions = getattr(model.config, "max_position_embeddings", None) or DEFAULT_MAX_LEN
        self.reset_stats()
        _freeze_once()

    # the engine's parts, for inspection (tests, tools)
    runner = property(lambda self: self.engine.runner)
    store = property(lambda self: self.engine.store)
    trie = property(lambda self: self.engine.cache.trie)
    tiers = property(lambda self: self.engine.cache.tiers)
    scheduler = property(lambda self: self.engine.scheduler)

    # ----- protocol --------------------------------------------------------------------------------

    @property
    def vocab(self) -> VocabIndex:
        return self._vocab

    def sequence(self, template: str, max_len: int | None = None) -> Sequence:
        max_len = min(max_len or DEFAULT_MAX_LEN, self.max_positions)
        return Sequence(template=template, ids=list(self._start_ids), max_len=max_len)

    async def extend(self, seq: Sequence, text: str, literal: list[tuple[int, int]] = ()) -> None:
        if text:
            vocab = self._vocab
            if literal and vocab.specials_in(text, literal):  # (a value holds a special token's text)
                seq.ids.extend(vocab.encode_literal(text, literal, continuation=bool(seq.text)))
            else:
                seq.ids.extend(vocab.encode_continuation(text) if seq.text else vocab.encode(text))
            seq.text += text
            self.check_length(seq, len(seq.ids))

    async def generate(self, seq: Sequence, state: HoleState, sampler: Sampler) -> str:
        hole = HoleLoop(self, seq, state, sampler)
        engine, pin = self.engine, self._pin(seq)
        logits, hole.row = await self._prefill(seq, seq.ids, len(seq.ids), draw=hole.draw)
        try:
            step = hole.start(logits)
            while step is not None:  # the scheduler runs the hole's steps (`HoleLoop.feed`) until it is done
                try:
                    await engine.decode(hole.row, *step, then=hole, group=hole.group)
                    step = None
                except Preempted:  # out of the batch to free slots: prefill the tokens so far again
                    logits, hole.row = await self._prefill(seq, seq.ids + hole.generated, len(seq.ids),
                                                           draw=hole.draw, first=True)
                    step = hole.resume(logits)
            prompt_len = hole.prompt_len
            value, value_ids, computed = hole.value(engine.length(hole.row) - prompt_len)
            if computed and pin.node is not None and pin.depth == prompt_len:
                engine.extend(pin, hole.generated[:computed], hole.row, prompt_len)
        finally:
            engine.release(hole.row)
            self._count_decoded(seq, hole.decoded)
        seq.ids.extend(value_ids)
        seq.text += value
        return value

    async def score_tokens(self, seq: Sequence, continuations: list[list[int]]) -> list[list[float]]:
        self.check_length(seq, len(seq.ids) + max(map(len, continuations), default=0))  # (an option is prompt)
        logits, row = await self._prefill(seq, seq.ids, len(seq.ids))
        try:
            return self.engine.score(row, len(seq.ids), logits, continuations)
        finally:
            self.engine.release(row)

    async def score(self, seq: Sequence, options: list[str]) -> list[float]:
        per_token = await self.score_tokens(seq, [self._vocab.encode_continuation(o) for o in options])
        return [sum(lps) for lps in per_token]

    async def next_tokens(self, seq: Sequence, tokens: list[int], k: int, allowed, can_end: bool) -> NextTokens:
        masks = self.masks
        extendable, extends, extend = masks.under(allowed)
        if not extends:
            return NextTokens([], [], 0.0 if can_end else None)
        if self.at_max_len(seq, len(seq.ids) + len(tokens), can_end):
            return NextTokens([], [], 0.0)
        if allowed is None:  # an unconstrained step: the mask is on the device already
            extend, count = masks.extendable_on_device, masks.extendable_count
        else:
            count = int(extendable.sum())
        ask = Choices(k, extend, count, can_end, masks.pickable)
        # a row only for this prefill (its new tokens go to the cache): a beam never holds a row while it
        # waits for the other beams' choices, so the batch's decode steps never wait for it; the step takes
        # the choices of all the beams it prefills at once
        ids = seq.ids + list(tokens)
        _, row = await self._prefill(seq, ids, len(ids), choices=ask)
        self.engine.release(row)
        return NextTokens(*row.chosen)

    def fork(self, seq: Sequence) -> Sequence:
        copy = Sequence(seq.template, list(seq.ids), seq.text, seq.max_len)
        if isinstance(seq.handle, Pin):
            copy.handle = self.engine.cache.fork(seq.handle)
        return copy

    def release(self, seq: Sequence) -> None:
        if isinstance(seq.handle, Pin):
            self.engine.cache.release(seq.handle)

    def chat_template(self):
        if not getattr(self.tokenizer, "chat_template", None):
            return None
        return self._render_chat

    def _render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """`apply_chat_template` as text, less the start tokens' text the template writes itself (a
        `{{ bos_token }}`): a sequence holds them already."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        start = self.tokenizer.decode(self._start_ids) if self._start_ids else ""
        return text[len(start):] if start and text.startswith(start) else text

    def on_step(self, callback) -> None:
        self.engine.scheduler.on_step = callback

    def close(self) -> None:
        """Give the backend's memory back now: its K/V store (on a GPU, half the free memory by default), the
        cached prefixes and the engine's buffers; queries still waiting fail, later ones are refused. It runs
        when the backend is dropped, too: the scheduler's step task, cancelled with its event loop, leaves a
        cycle of frames through the scheduler that only a collection frees (never, for the process's first
        backend, whose objects `_freeze_once` froze)."""
        engine = self.__dict__.get("engine")
        if engine is not None:  # (None: `_setup` failed part way)
            engine.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - (interpreter shutdown) nothing to give back to then
            pass

    # ----- statistics ------------------------------------------------------------------------------

    def reset_stats(self) -> None:
        self._totals = TemplateStats()
        self._templates: dict[str, TemplateStats] = {}
        self._evictions_at_reset = self.engine.cache.evictions
        self._tiers_at_reset = self.engine.cache.tier_counts()

    def record_call(self, template: str, seconds: float) -> None:
        self._template(template).record_call(seconds)
        self._totals.calls += 1

    def stats(self) -> CacheStats:
        t, cache = self._totals, self.engine.cache
        return CacheStats(
            lookups=t.lookups, hits=t.hits, tokens_requested=t.tokens_requested,
            tokens_reused=t.tokens_reused, tokens_prefilled=t.tokens_prefilled,
            tokens_decoded=t.tokens_decoded, evictions=cache.evictions - self._evictions_at_reset,
            bytes_in_use=cache.bytes_in_use, nodes=len(cache), pinned_nodes=cache.pinned_nodes(),
            **cache.tier_counts(since=self._tiers_at_reset),
            per_template={k: v.copy() for k, v in self._templates.items()},
        )

    def _template(self, template: str) -> TemplateStats:
        t = self._templates.get(template)
        if t is None:  # (not setdefault: that would build a TemplateStats on every call)
            t = self._templates[template] = TemplateStats.live()
        return t

    # ----- the engine's requests ---------------------------------------------------------------------

    async def _prefill(self, seq: Sequence, ids: list[int], stored: int, draw=None, choices: Choices | None = None,
                       first: bool = False) -> tuple[torch.Tensor, Row]:
        """The engine's prefill of `ids` (the sequence's, then tokens of its hole or beam), of which the first
        `stored` go to the prefix cache, under the sequence's pin; counted in the statistics."""
        if not ids:
            raise LMQRuntimeError("a hole cannot come first: the prompt needs some text before the first hole")
        self.check_length(seq, len(ids))
        request = PrefillRequest(self._pin(seq), ids, stored, draw, choices)
        logits, row = await self.engine.prefill(request, first)
        for t in (self._totals, self._template(seq.template)):
            t.record_prefill(len(ids), request.cached)
        return logits, row

    def _pin(self, seq: Sequence) -> Pin:
        """The sequence's pin on the cached prefix (a new one, holding none, at first)."""
        if seq.handle is None:
            seq.handle = Pin()
        return seq.handle

    # ----- lengths ----------------------------------------------------------------------------------

    def check_length(self, seq: Sequence, n: int) -> None:
        """Raises the length error where a prompt of `n` tokens passes the sequence's max_len (or the model's
        context window, where that binds)."""
        if n > seq.max_len >= self.max_positions:  # the model's window binds (`sequence` caps max_len by it)
            raise LMQLengthError(f"the prompt needs {n} tokens, more than the model's context window of "
                                 f"{self.max_positions} positions (max_position_embeddings)")
        if n > seq.max_len:
            raise LMQLengthError(
                f"the prompt needs {n} tokens, more than max_len={seq.max_len}; raise it with "
                f"`argmax(max_len=...)` (the model allows {self.max_positions})")

    def at_max_len(self, seq: Sequence, n: int, can_end: bool) -> bool:
        """Must a value with the prompt at `n` tokens end here (max_len)? Raises the length error where the
        value cannot end."""
        if n < seq.max_len:
            return False
        if not can_end:
            self.check_length(seq, n + 1)
        return True

    def _count_decoded(self, seq: Sequence, n: int) -> None:
        self._totals.tokens_decoded += n
        self._template(seq.template).tokens_decoded += n
