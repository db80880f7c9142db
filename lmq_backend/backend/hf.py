"""`HFBackend`: any Hugging Face causal LM behind the backend protocol, with a prefix trie of KV caches.

Every prefill looks up the longest cached prefix of the sequence's token ids in the trie, computes only
the rest and inserts what it computed; a sequence pins the trie node that covers its prefix until it
is released. K/V live in one paged store (`cache/kv_store.py`): the trie's nodes and the running rows hold
slots of it, and a hit or an insert moves slot numbers, never K/V. `cache_budget` bounds what the trie
keeps (0 turns it off: every prefill computes the whole prompt, the exact reference behaviour);
`kv_budget` bounds the whole store (default: sized from free memory). Below the trie, the cache tiers
(`cache/tiers.py`): `host_cache` bounds host memory that evicted prefixes move to, `disk_cache` names the folder
that long prefixes are written to for later processes (`disk_budget` bounds it).
"""
from __future__ import annotations

import asyncio
import atexit
import gc
import time
import weakref
from pathlib import Path

import numpy as np
import torch

from ..cache.disk_tier import resolve_folder
from ..cache.fingerprint import describe_device, folder_fingerprint, state_fingerprint
from ..cache.kv_store import LAYOUT_VERSION
from ..cache.stats import CacheStats, TemplateStats
from ..cache.tiers import build_tiers
from ..cache.trie import PrefixTrie, TrieNode
from ..engine.compat import PRETRAINED
from ..engine.quantize import QUANTIZED_DTYPES
from ..engine.picks import Choices, Draw, numbering
from ..engine.runner import ModelRunner, PrefillRow
from ..engine.rows import Preempted, Row
from ..engine.scheduler import Scheduler
from ..errors import LMQBackendError, LMQLengthError, LMQRuntimeError
from ..runtime.decoders import DEFAULT_MAX_LEN, Sampler
from ..text.vocab import VocabIndex
from .budgets import default_kv_budget, parse_bytes
from .hole_loop import HoleLoop
from .proposals import Proposals
from .protocol import Backend, NextTokens, Sequence
from ..text.vocab_cache import vocab_index

HOST_CACHE_ON_GPU = "4GB"  # `host_cache="auto"`: a GPU backend's host tier; a CPU backend has none (`cache/host_tier.py`)

def _resolve_dtype(dtype, device: str) -> torch.dtype:
    if str(dtype) in QUANTIZED_DTYPES:  # weight-only quantized: loaded in float32, then quantized
        if device != "cpu":
            raise LMQBackendError(f"dtype {dtype!r} (weight-only quantized) runs on the CPU only")
        return torch.float32
    if dtype is None:
        return torch.float32 if device == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return getattr(torch, str(dtype))
    except AttributeError:
        raise LMQBackendError(f"unknown dtype {dtype!r}") from None


_frozen = False


def _freeze_once() -> None:
    """After the process's first backend is set up, what is alive (the model, tokenizer and vocabulary
    index: ~400K objects) goes out of the collector's sight, so a full collection no longer walks it (one
    took 0.45 s in the middle of 256 concurrent calls on the CPU); vLLM does the same after its start-up.
    Once a process: a frozen object is never collected, so freezing at every backend would keep each
    earlier backend that was dropped (a test run grew to 21 GB). No collection first: it would walk the same
    ~400K objects at start-up (0.29 CPU s for the default backend, which freed nothing); cyclic garbage
    that exists at this moment stays, once. Unfrozen at exit, so the interpreter's teardown collects it
    (else nanobind, under triton, reports every binding it lost)."""
    global _frozen
    if not _frozen:
        _frozen = True
        gc.freeze()
        atexit.register(gc.unfreeze)


class HFBackend(Backend):
    """A local Hugging Face causal LM: `HFBackend("path/or/dir", device=, dtype=, cache_budget=)`.

    `path` may be "default" for the embedded SmolLM2-135M-Instruct. `dtype` "int8" or "int4": weight-only
    quantized on the CPU (`engine/quantize.py`; the default model's "int4" is its shipped Q4_1 file). Use
    `HFBackend.from_model` to wrap a model and tokenizer you already hold (quantized or not).

    Cache tiers: `host_cache` ("auto": 4GB on a GPU, none on the CPU, whose K/V store is host memory already;
    or bytes, 0 for none); `disk_cache` ("default": `lmq cache ls` shows the folder, $LMQ_DISK_CACHE=off turns it
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
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=_resolve_dtype(dtype, device), **PRETRAINED)
        except Exception as e:  # noqa: BLE001 - any loader failure is a backend error for the user
            raise LMQBackendError(f"could not load a causal LM from {path!s}: {e}") from e
        if str(dtype) in QUANTIZED_DTYPES:  # "int4" of the default model: its shipped Q4_1 weights as they are
            from .gguf_weights import quantize_weights

            quantize_weights(model, str(dtype), gguf_file)
        self._setup(model.to(device).eval(), tokenizer, cache_budget, name or str(path), max_batch, kv_budget,
                    weights_folder=Path(path))
        self.tiers = self._tiers(host_cache, disk_cache, disk_budget, lambda: folder_fingerprint(Path(path)),
                                 str(dtype) if str(dtype) in QUANTIZED_DTYPES else None)

    @classmethod
    def from_model(cls, model, tokenizer, cache_budget: int | str = "2GB", name: str = "model",
                   max_batch: int = 256, kv_budget: int | str | None = None, host_cache: int | str = "auto",
                   disk_cache: str | Path | bool | None = None, disk_budget: int | str = "10GB") -> "HFBackend":
        """A backend over a model object. Its disk tier is off unless `disk_cache` is given: weights in memory
        may change in place, which the fingerprint (a sample of them) cannot always see."""
        backend = cls.__new__(cls)
        backend._setup(model.eval(), tokenizer, cache_budget, name, max_batch, kv_budget)
        backend.tiers = backend._tiers(host_cache, disk_cache, disk_budget, lambda: state_fingerprint(model))
        return backend

    def _setup(self, model, tokenizer, cache_budget, name: str, max_batch: int = 256, kv_budget=None,
               weights_folder: Path | None = None) -> None:
        self.name = name
        self.model, self.tokenizer = model, tokenizer
        self.runner = ModelRunner(model, max_batch=max_batch, weights_folder=weights_folder)
        kv_bytes = default_kv_budget(self.runner.device) if kv_budget is None else parse_bytes(kv_budget, "kv_budget")
        self.store = self.runner.new_store(kv_bytes)
        self.trie = PrefixTrie(parse_bytes(cache_budget, "cache_budget"), self.store.bytes_per_token, self.store)
        # the store asks the trie for slots through a weak reference: no cycle holds the store's memory once
        # the backend is dropped (the first backend's objects are frozen, never collected: `_freeze_once`)
        trie, per_token = weakref.proxy(self.trie), self.store.bytes_per_token
        self.store.reclaim = lambda n: trie.evict(n * per_token)
        self.store.evictable = lambda: trie.evictable_bytes() // per_token
        self.tiers = None  # cache tiers (cache/tiers.py): `_tiers`, once the store and the trie exist
        self.scheduler = Scheduler(self.runner, self.store)
        self._vocab = vocab_index(tokenizer, self.runner.vocab_size)  # (from disk after the first load)
        self._extendable = ~self._vocab.special
        self._extendable_any = bool(self._extendable.any())
        self._extendable_count = int(self._extendable.sum())
        self._under: dict[int, tuple] = {}  # id of a constraint's shared mask -> (it, `_extendable_under`'s answer)
        # Ids the tokenizer has (a model's vocabulary may be padded beyond it): the only ones ever picked.
        pickable = np.arange(self._vocab.size) < len(tokenizer)
        self._pick_all = None if pickable.all() else torch.from_numpy(pickable).to(self.runner.device)
        # the masks of steps without a constraint mask of their own (every token; those a checked pick proposes
        # from: see proposals.py): fused GPU steps pick under them on the device, and run the next step ahead
        self._proposals = Proposals(self._vocab, self._extendable, self._pick_all, self.runner.device)
        self._greedy_masks = tuple(self._proposals.masks)
        self._mask_number = numbering(self._greedy_masks)
        self._extendable_on_device = self._proposals.mask(0, False)
        self.runner.set_greedy_masks(list(self._greedy_masks), after=self._proposals.after)
        with_special = tokenizer("x").input_ids
        plain = tokenizer("x", add_special_tokens=False).input_ids
        self._start_ids = list(with_special[: len(with_special) - len(plain)]) if with_special[-len(plain):] == plain else []
        self.max_positions = getattr(model.config, "max_position_embeddings", None) or DEFAULT_MAX_LEN
        self.reset_stats()
        _freeze_once()

    # ----- protocol --------------------------------------------------------------------------------

    @property
    def vocab(self) -> VocabIndex:
        return self._vocab

    def sequence(self, template: str, max_len: int | None = None) -> Sequence:
        max_len = min(max_len or DEFAULT_MAX_LEN, self.max_positions)
        return Sequence(template=template, ids=list(self._start_ids), max_len=max_len)

    async def extend(self, seq: Sequence, text: str) -> None:
        if text:
            seq.ids.extend(self._vocab.encode_continuation(text) if seq.text else self._vocab.encode(text))
            seq.text += text
            self._check_length(seq, len(seq.ids))

    async def generate(self, seq: Sequence, state, sampler: Sampler) -> str:
        hole = HoleLoop(self, seq, state, sampler)
        logits, hole.row = await self.scheduler.prefill(await self._staged(_Prefill(self, seq, draw=hole.draw)))
        try:
            step = hole.start(logits)
            while step is not None:  # the scheduler runs the hole's steps (`HoleLoop.feed`) until it is done
                try:
                    await self.scheduler.decode(hole.row, *step, then=hole.feed)
                    step = None
                except Preempted:  # out of the batch to free slots: prefill the tokens so far again
                    logits, hole.row = await self.scheduler.prefill(_Prefill(self, seq, hole.generated, draw=hole.draw),
                                                                    first=True)
                    step = hole.resume(logits)
            prompt_len = hole.prompt_len
            value, value_ids, computed = hole.value(self.scheduler.pool.length(hole.row.slot) - prompt_len)
            if computed and seq.handle is not None and seq.handle.depth == prompt_len:
                self._insert(seq, seq.handle, hole.generated[:computed], hole.row, prompt_len)
        finally:
            self.scheduler.release(hole.row)
            self._count_decoded(seq, hole.decoded)
        seq.ids.extend(value_ids)
        seq.text += value
        return value

    async def score_tokens(self, seq: Sequence, continuations: list[list[int]]) -> list[list[float]]:
        self._check_length(seq, len(seq.ids) + max(map(len, continuations), default=0))  # (an option is prompt)
        logits, row = await self.scheduler.prefill(await self._staged(_Prefill(self, seq)))
        try:
            prefix = self.scheduler.pool.segment_kv(row.slot, 0, len(seq.ids))
            return self.runner.score(prefix, logits, continuations)
        finally:
            self.scheduler.release(row)

    async def score(self, seq: Sequence, options: list[str]) -> list[float]:
        per_token = await self.score_tokens(seq, [self._vocab.encode_continuation(o) for o in options])
        return [sum(lps) for lps in per_token]

    async def next_tokens(self, seq: Sequence, tokens: list[int], k: int, allowed, can_end: bool) -> NextTokens:
        extendable, extends, extend = self._extendable_under(allowed)
        if not extends:
            return NextTokens([], [], 0.0 if can_end else None)
        if self._ends_at_max_len(seq, len(seq.ids) + len(tokens), can_end):
            return NextTokens([], [], 0.0)
        if allowed is None:  # an unconstrained step: the mask is on the device already
            extend, count = self._extendable_on_device, self._extendable_count
        else:
            count = int(extendable.sum())
        ask = Choices(k, extend, count, can_end, self._pick_all)
        # a row only for this prefill (its new tokens go to the trie): a beam never holds a row while it
        # waits for the other beams' choices, so the batch's decode steps never wait for it; the step takes
        # the choices of all the beams it prefills at once
        _, row = await self.scheduler.prefill(await self._staged(_Prefill(self, seq, tokens, store_all=True,
                                                                           choices=ask)))
        self.scheduler.release(row)
        return NextTokens(*row.chosen)

    def fork(self, seq: Sequence) -> Sequence:
        copy = Sequence(seq.template, list(seq.ids), seq.text, seq.max_len)
        if seq.handle is not None:
            self._pin(copy, seq.handle)
        return copy

    def release(self, seq: Sequence) -> None:
        self._pin(seq, None)

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
        self.scheduler.on_step = callback

    def close(self) -> None:
        """Give the backend's memory back now: its K/V store (on a GPU, half the free memory by default), the
        cached prefixes and the engine's buffers; queries still waiting fail, later ones are refused. It runs
        when the backend is dropped, too: the scheduler's step task, cancelled with its event loop, leaves a
        cycle of frames through the scheduler that only a collection frees (never, for the process's first
        backend, whose objects `_freeze_once` froze)."""
        scheduler = getattr(self, "scheduler", None)
        if scheduler is None or scheduler.closed:  # (`_setup` failed part way, or closed already)
            return
        scheduler.close()
        if self.tiers is not None:  # cache tiers: the files being written are finished
            self.tiers.close()
        self.runner.close()
        self.store.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - (interpreter shutdown) nothing to give back to then
            pass

    # ----- statistics ------------------------------------------------------------------------------

    def reset_stats(self) -> None:
        self._totals = TemplateStats()
        self._templates: dict[str, TemplateStats] = {}
        self._evictions_at_reset = self.trie.evictions
        self._tiers_at_reset = self.tiers.counts() if self.tiers is not None else {}

    def record_call(self, template: str, seconds: float) -> None:
        t = self._template(template)
        t.calls += 1
        t.latencies.append(seconds)
        self._totals.calls += 1

    def stats(self) -> CacheStats:
        t = self._totals
        return CacheStats(
            lookups=t.lookups, hits=t.hits, tokens_requested=t.tokens_requested,
            tokens_reused=t.tokens_reused, tokens_prefilled=t.tokens_prefilled,
            tokens_decoded=t.tokens_decoded, evictions=self.trie.evictions - self._evictions_at_reset,
            bytes_in_use=self.trie.bytes_in_use, nodes=len(self.trie), pinned_nodes=self.trie.pinned_nodes(),
            **(self.tiers.counts(since=self._tiers_at_reset) if self.tiers is not None else {}),
            per_template={k: TemplateStats(**{f: getattr(v, f) for f in TemplateStats.__slots__})
                          for k, v in self._templates.items()},
        )

    def _template(self, template: str) -> TemplateStats:
        t = self._templates.get(template)
        if t is None:  # (not setdefault: that would build a TemplateStats on every call)
            t = self._templates[template] = TemplateStats()
        return t

    # ----- the prefix trie ------------------------------------------------------------------------

    def _check_length(self, seq: Sequence, n: int) -> None:
        if n > seq.max_len >= self.max_positions:  # the model's window binds (`sequence` caps max_len by it)
            raise LMQLengthError(f"the prompt needs {n} tokens, more than the model's context window of "
                                 f"{self.max_positions} positions (max_position_embeddings)")
        if n > seq.max_len:
            raise LMQLengthError(
                f"the prompt needs {n} tokens, more than max_len={seq.max_len}; raise it with "
                f"`argmax(max_len=...)` (the model allows {self.max_positions})")

    def _pin(self, seq: Sequence, node: TrieNode | None) -> None:
        """Move the sequence's pin to `node` (None: drop it)."""
        if node is not None:
            self.trie.pin(node)
        if seq.handle is not None:
            self.trie.unpin(seq.handle)
        seq.handle = node

    def _extendable_under(self, allowed: np.ndarray | None) -> tuple[np.ndarray, bool, torch.Tensor | None]:
        """The tokens that may extend a value where `allowed` (None: every token) are, whether one may, and
        they as a tensor (None where `allowed` is). A read-only `allowed` is a constraint's shared mask
        (`HoleState.allowed`): its answer is memoized by identity, so that the rows in one state pick under one
        mask object (a step stacks and moves it once, not once a row)."""
        if allowed is None:
            return self._extendable, self._extendable_any, None
        shared = not allowed.flags.writeable
        hit = self._under.get(id(allowed)) if shared else None
        if hit is not None and hit[0] is allowed:
            return hit[1:]
        extendable = allowed & self._extendable
        answer = (extendable, bool(extendable.any()), torch.from_numpy(extendable))
        if shared:
            extendable.flags.writeable = False
            if len(self._under) >= 256:
                self._under.clear()
            self._under[id(allowed)] = (allowed, *answer)
        return answer

    def _ends_at_max_len(self, seq: Sequence, n: int, can_end: bool) -> bool:
        """Must a value with the prompt at `n` tokens end here (max_len)? Raises the length error where the
        value cannot end."""
        if n < seq.max_len:
            return False
        if not can_end:
            self._check_length(seq, n + 1)
        return True

    def _greedy_mask(self, pick) -> int | None:
        """Which of the runner's greedy masks `pick` is (a greedy pick under it may come from the device)."""
        return self._mask_number.get(id(pick))

    def _count_decoded(self, seq: Sequence, n: int) -> None:
        self._totals.tokens_decoded += n
        self._template(seq.template).tokens_decoded += n

    def _insert(self, seq: Sequence, parent: TrieNode, ids: list[int], row: Row, start: int) -> None:
        """Store the row's K/V of positions [start, start + len(ids)) under `parent`; pin what was stored."""
        if self.trie.budget_bytes == 0:
            return
        child = self.trie.insert(parent, ids, self.scheduler.pool.segment(row.slot, start, start + len(ids)))
        if child is not None:
            self._pin(seq, child)
            if self.tiers is not None:  # cache tiers: a long new node is written to disk
                self.tiers.inserted(self.trie, child)

    # ----- cache tiers (cache/tiers.py) ------------------------------------------------------------

    def _tiers(self, host_cache, disk_cache, disk_budget, fingerprint, weights_dtype: str | None = None):
        """The tiers under the trie (None: none, or the trie is off); `fingerprint()` names the weights, and
        `weights_dtype` a quantized dtype (else the store's)."""
        if not self.trie.enabled:
            return None
        device = self.runner.device
        if host_cache == "auto":
            host_cache = HOST_CACHE_ON_GPU if device.type == "cuda" else 0
        folder = resolve_folder(disk_cache)
        tiers = build_tiers(self.store, parse_bytes(host_cache, "host_cache"), folder,
                            parse_bytes(disk_budget, "disk_budget"), fingerprint,
                            weights_dtype or str(self.store.dtype).removeprefix("torch."), describe_device(device),
                            LAYOUT_VERSION, self.name)
        if tiers is not None:
            self.trie.on_evict = tiers.evicted
        return tiers

    async def _staged(self, prefill: "_Prefill") -> "_Prefill":
        """The prefill, with the disk tier's files that continue its device and host matches read (off the
        event loop: the batch runs meanwhile) for `prepare` to load."""
        tiers, limit = self.tiers, len(prefill.ids) - 1
        at = None if tiers is None else tiers.stage_from(self.trie, prefill.ids, limit)
        if at is not None:
            prefill.staged = await asyncio.to_thread(tiers.stage, prefill.ids, at, limit)
        return prefill


class _Prefill:
    """A sequence's prefill as the scheduler runs it: look up the trie, then store what was computed."""

    def __init__(self, backend: HFBackend, seq: Sequence, resume: list[int] = (), store_all: bool = False,
                 draw: Draw | None = None, choices: Choices | None = None):
        """`resume`: tokens generated after `seq.ids` by a row that was preempted; they are prefilled too,
        but only the prompt's new part is stored in the trie (as when the row first ran), unless `store_all`
        (a beam's tokens: the next step and the beam's forks read them from the trie). `draw`: the sampled
        pick to make from the logits (the step samples its rows' draws at once); `choices`: a beam's choices
        to take from them (the same)."""
        ids = seq.ids + list(resume) if resume else seq.ids
        self.prompt_len = len(ids) if store_all else len(seq.ids)
        if not ids:
            raise LMQRuntimeError("a hole cannot come first: the prompt needs some text before the first hole")
        backend._check_length(seq, len(ids))
        self.backend, self.seq, self.ids, self.draw, self.choices = backend, seq, ids, draw, choices
        self.node: TrieNode | None = None
        self.cached = 0
        self.staged = []      # cache tiers: the disk tier's segments read for this prefill (`HFBackend._staged`)
        self.prepared = 0.0   # when `prepare` looked its prefix up

    def prepare(self) -> PrefillRow:
        b, trie = self.backend, self.backend.trie
        self.node, self.cached = trie.match(self.ids, limit=len(self.ids) - 1)
        if b.tiers is not None:  # cache tiers: the match goes on in host memory and the staged files
            self.node, self.cached = b.tiers.load(trie, self.node, self.ids, self.cached, len(self.ids) - 1,
                                                  self.staged)
            self.prepared = time.perf_counter()
        b._pin(self.seq, self.node)
        return PrefillRow(trie.path_slots(self.node), self.cached, self.ids[self.cached:])

    def release(self) -> bool:
        held = self.seq.handle is not None
        self.backend._pin(self.seq, None)
        self.node = None
        return held

    def complete(self, logits: torch.Tensor, row: Row) -> None:
        b = self.backend
        for t in (b._totals, b._template(self.seq.template)):
            t.record_prefill(len(self.ids), self.cached)
        if b.tiers is not None:  # cache tiers: the prefill's speed (`CacheTiers.worth`)
            b.tiers.observe_prefill(len(self.ids) - self.cached, time.perf_counter() - self.prepared)
        if self.cached < self.prompt_len:
            b._insert(self.seq, self.node, self.ids[self.cached:self.prompt_len], row, self.cached)
