"""The model runner: batched forwards of a Hugging Face causal LM over the rows of a `KVPool`.

Prefill (many new tokens per row) and decode (one token per row) run through the model's normal forward,
with a transformers cache that writes the new K/V into the rows' store slots and reads every column through
their page tables (`compat.pool_cache`), except for Llama-family models: their decode steps run lmq's fused
step (`fused/`), whose kernels read the page tables themselves, and on a GPU so do their prefills
(`FusedDecoder.prefill`, the same layer loop over many tokens). K/V never leave the store: a finished
segment's slots (`pool.segment(...)`) pass to the prefix trie.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..cache.kv_store import KVStore, token_bytes
from ..cache.tiers import Loads
from . import compat
from .attention import PREFILL_READ, model_attention
from .kv_pool import KVPool
from .picks import Choices, Draw, choose, mask_picks, numbering, sample


@dataclass(slots=True)
class PrefillRow:
    """One row of a prefill: `cached` tokens whose K/V are in the trie's store `slots`, then new token `ids`.
    Where `loads` is given, the last `loads.tokens` of the cached tokens have no slots yet: the K/V that the
    cache tiers hold of them is copied into the row's own slots before the forward (`cache.tiers.Loads`)."""

    slots: np.ndarray
    cached: int
    ids: list[int]
    loads: Loads | None = None

    def compute_loads(self) -> None:
        """A tier failed to load the row's loads: the row computes those tokens instead (its length stays the
        same)."""
        self.cached -= self.loads.tokens
        self.ids = [*self.loads.ids, *self.ids]
        self.loads = None


def load(jobs: list[tuple[PrefillRow, np.ndarray]], before=None) -> list | None:
    """The rows' loads into their slots (`jobs`: each row and its own slots for them; again if the prefill is
    retried), through the tiers (`CacheTiers.queue_loads`, after the event `before`); a row whose tier failed
    computes those tokens. Returns the events the prefill's layers wait for (None: none)."""
    if not jobs:
        return None
    failed, ready = jobs[0][0].loads.tiers.queue_loads([(row.loads, slots) for row, slots in jobs], before)
    for i in failed:
        jobs[i][0].compute_loads()
    return ready


class ModelRunner:
    """Runs the model's forwards for the scheduler. Decode steps of Llama-family models go through the fused
    `FusedDecoder`: CUDA-graph captured over a pool preallocated for `max_batch` rows on a GPU, eager over
    the growable pool on the CPU; their prefills run its layer loop too (`fused_prefill`). Other models
    run the model's own forward. `weights_folder`: the folder the model was just
    loaded from, unchanged since; its CPU layout is then kept on disk and taken from there
    (`fused/weight_cache.py`)."""

    def __init__(self, model, max_batch: int = 64, fused: bool | None = None, fused_prefill: bool | None = None,
                 weights_folder: Path | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = model.get_output_embeddings().out_features
        self.kv_shape = compat.kv_shape(model.config)
        self.max_batch = max_batch
        if fused is None:
            fused = _fused_supports(model)
        self.fused = fused
        # Prefills of Llama-family models run the fused step's layer loop (`FusedDecoder.prefill`): on a GPU
        # the model's forward is host-bound (see bench_gpu_query.py); on the CPU the loop reads the K/V
        # through the page tables (the forward gathered every row's columns, every layer) and runs lmq's
        # kernels where calibration chose them.
        self.fused_prefill = fused if fused_prefill is None else fused_prefill
        if self.fused_prefill and not fused:
            raise ValueError("fused_prefill needs the fused decoder (a supported Llama-family model)")
        if fused:  # lay the weights out now: every forward, the first prefill included, reads the same layout
            if weights_folder is not None:
                from .fused.weight_cache import laid_out

                laid_out(model, weights_folder)
            else:
                _fused_module().decoder_weights(model)
            if self.device.type == "cpu":  # the CPU kernels' choices for this model's shapes: measured now, once
                from .fused.cpu_warm_up import warm_up  # per machine, not inside its first queries' calls

                warm_up(model)
        self._decoder = None  # (FusedDecoder, the page table it was built on)
        self.greedy_masks: list[torch.Tensor | None] | None = None
        self._mask_after: torch.Tensor | None = None  # (see set_greedy_masks)
        self._mask_index: dict[int, int] = {}  # id of a greedy mask -> its number
        self._mask_picks = None  # the picks under the greedy masks of a step's logits (`picks.mask_picks`)
        self.picks = None     # the last step's greedy picks (`picks(k, row)`, see set_greedy_masks), or None
        self._sampled = None  # the last step's `DevicePicks` where it sampled rows on the device (see `sample`)
        # on a GPU: an event that completes with the last step's work (its picks on the host), so that the
        # scheduler lets the queries' host work run while the device computes; None: the step is done
        self.ready: torch.cuda.Event | None = None
        compat.use_grouped_attention(model)  # attention.py: GQA on the pool's views, no mask without padding

    @property
    def prefill_read_limit(self) -> int | None:
        """The columns one prefill may read in all (cached and new tokens of every row), or None: no limit.
        The model's forward and the torch attention paths gather them, every layer; the fused prefill on a
        GPU reads them through the page tables (and gathers at most `PREFILL_READ`: see `Prefill.prefill`),
        so there a prefill takes as many rows as the decode batch has seats."""
        return None if self.fused_prefill and self.device.type == "cuda" else PREFILL_READ

    @property
    def prefill_part(self) -> int | None:
        """The most new tokens of one prompt that a prefill step takes while rows decode (a longer prompt is
        prefilled in parts, the rows stepping between them), or None: the scheduler's `max_prefill_tokens`.
        On a CPU 512: a prompt of thousands of tokens in one piece stalls the decoding rows several times as long
        as in parts of 512, at a small cost to its own prefill (BLAS's GEMMs are less efficient at 512 rows:
        `benchmarks/bench_long_prompt.py`); with no rows decoding it is prefilled in one piece."""
        return 512 if self.device.type == "cpu" else None

    def new_store(self, budget_bytes: int) -> KVStore:
        """The K/V store (see `cache/kv_store.py`) with as many token slots as `budget_bytes` holds."""
        slots = max(budget_bytes // token_bytes(*self.kv_shape, self.dtype), 2)
        return KVStore(*self.kv_shape, dtype=self.dtype, device=self.device, capacity=slots)

    def new_pool(self, store: KVStore) -> KVPool:
        if self.fused and self.device.type == "cuda":  # static: CUDA graphs capture the table's address
            return KVPool(store, rows=self.max_batch, columns=4096)
        return KVPool(store)

    def _forward(self, *args, **kwargs):
        """The model's own forward (`compat.forward`), with the engine's choice of attention backends."""
        with model_attention(self.device):
            return compat.forward(self.model, *args, **kwargs)

    def close(self) -> None:
        """Drop the device buffers of the steps (the fused decoder's CUDA graphs and their inputs, the picks'
        masks): the backend was closed. The model and its laid-out weights are the caller's."""
        self._decoder = self._mask_picks = self.picks = self._sampled = self.ready = None
        self.greedy_masks = self._mask_after = None
        self._mask_index = {}

    @property
    def ahead_pending(self) -> bool:
        """Is a step run ahead on the device (`FusedDecoder.run_ahead`) waiting to be taken? Then the pool's
        rows had better stay put: the next step takes it only for the same rows."""
        return self._decoder is not None and self._decoder[0].ahead_pending

    def step_rows(self, n: int) -> int:
        """The rows a decode step of n rows computes (a CUDA-graph step: its bucket's, `FusedDecoder.rows_run`)."""
        return n if self._decoder is None else self._decoder[0].rows_run(n)

    def _fused_decoder(self, pool: KVPool):
        table = pool.device_table()
        if self._decoder is None or self._decoder[1] is not table:  # the table was regrown
            self._decoder = (_fused_module().FusedDecoder(self.model, pool.data, table, self.max_batch,
                                                          greedy_masks=self.greedy_masks,
                                                          mask_after=self._mask_after), table)
        return self._decoder[0]

    def _fused_decode(self, pool: KVPool, tokens: list[int], ahead: list[int | Draw | None] | None,
                      want_logits: bool) -> torch.Tensor | None:
        decoder = self._fused_decoder(pool)
        masks, draws = self._device_picks(ahead) if decoder.masks is not None else (None, None)
        run_ahead = masks is not None and None not in masks
        if masks is not None and not run_ahead:
            masks = [0 if m is None else m for m in masks]
        logits = decoder.step_host(tokens, pool.start[: pool.rows], pool.end, masks,
                                   key=pool.version if run_ahead else None, cascade=pool.shares_prefixes(),
                                   draws=draws)
        if decoder.masks is not None:  # the step picked on the device
            self.picks = self._sampled = decoder.picks
            # no float32 copy of [B, V] where the caller reads the picks only
            logits = None if run_ahead and not want_logits else logits.float()
        else:
            logits = logits.float()
            self.picks = self._greedy_picks(logits)
        self.ready = self._event()  # before a run-ahead step is queued: not waiting for it too
        if run_ahead:
            decoder.run_ahead()  # after the copy of the logits above: it overwrites them
        return logits

    def prefill(self, pool: KVPool, rows: list[PrefillRow]) -> tuple[torch.Tensor, list[int]]:
        """Add `rows` to the pool and prefill them: rows of similar new lengths share a left-padded forward
        (so that padding is at most PAD_WASTE of the tokens computed). Returns (logits [B, V], slots)."""
        self._sampled = None
        if self._decoder is not None:  # (new rows: a step run ahead is not the next step)
            self._decoder[0].discard_ahead()
        parts: list[torch.Tensor] = []
        order: list[int] = []  # the rows in the order of `parts`' rows
        slots: list[int] = [0] * len(rows)
        # room for every group at once: growing the pool group by group would copy it each time
        pool.make_room(pool.rows + len(rows), max(r.cached + len(r.ids) for r in rows), extra=2)
        # the device's work queued before this step (a step run ahead, discarded, may still write the slots of
        # rows that left): the groups' loads from the cache tiers go after it, not after the groups before them
        before = self._event()
        for group in _length_groups([len(r.ids) for r in rows]):
            group_logits, group_slots = self._prefill([rows[i] for i in group], pool, before)
            parts.append(group_logits)
            order += group
            for i, slot in zip(group, group_slots):
                slots[i] = slot
        stacked = parts[0] if len(parts) == 1 else torch.cat(parts)
        if order != list(range(len(rows))):  # (one gather of [B, V], not B rows stacked)
            back = torch.from_numpy(np.argsort(order))
            if stacked.is_cuda:  # from pinned memory: from pageable memory the host would wait for the prefill
                back = back.pin_memory().to(stacked.device, non_blocking=True)
            stacked = stacked[back]
        self.picks = self._greedy_picks(stacked)
        self.ready = self._event()
        return stacked, slots

    # ----- picks ------------------------------------------------------------------------------------------

    def set_greedy_masks(self, masks: list[torch.Tensor | None] | None, after: torch.Tensor | None = None) -> None:
        """Token masks (bool [V], None: every token) under which every step also picks greedily: `picks(k, row)`
        is then `Greedy().select(logits[row], masks[k])`, on a GPU without a host sync on the logits; a fused
        GPU step samples a row sampled under one of the masks too; and a step whose rows all give such a pick
        (`ahead`) runs the next one ahead on those picks (`FusedDecoder.run_ahead`), each row's under mask
        `after[k, token]` (int [K, V]: the mask a row picking `token` under mask k will likely pick under
        next; None: k)."""
        self.greedy_masks, self._mask_after = masks, after
        self._mask_index = numbering(masks)
        self._mask_picks = mask_picks(masks, self.device) if masks else None
        self._decoder = None

    def greedy_mask(self, mask: torch.Tensor | None) -> int | None:
        """Which of the greedy masks `mask` is (the object, not its values), or None."""
        return self._mask_index.get(id(mask))

    def _device_picks(self, ahead: list[int | Draw | None] | None) -> tuple[list | None, dict | None]:
        """The rows' picks as a fused GPU step makes them (`FusedDecoder.step_host`'s `ahead` and `draws`): per
        row the greedy mask, None where the device cannot pick (nor run ahead), and {row: (temperature, u,
        after)} for the rows it samples."""
        if ahead is None:
            return None, None
        masks, draws = list(ahead), {}
        for i, a in enumerate(ahead):
            if isinstance(a, Draw):
                pick = self._device_draw(a)
                masks[i] = None if pick is None else pick[0]
                if pick is not None:
                    draws[i] = pick[1:]
        return masks, draws

    def _device_draw(self, draw: Draw) -> tuple[int, float, float, float] | None:
        """(mask, temperature, u, after) of a draw the device samples: under one of the greedy masks, without
        a nucleus or knobs (`picks.sample` applies those); else None."""
        k = None if draw.temperature <= 0 or draw.top_p < 1 or draw.after is None or draw.knobs is not None \
            else self.greedy_mask(draw.allowed)
        return None if k is None else (k, draw.temperature, draw.u, draw.after)

    @staticmethod
    def choose(logits: torch.Tensor, asks: list[tuple[int, Choices]]) -> list[tuple]:
        """The choices (`picks.choose`) of the rows of a step's logits [B, V] that asked ((row, choices) pairs):
        all at once, one copy to the host."""
        return choose(_rows(logits, [i for i, _ in asks]), [a for _, a in asks])

    def sample(self, logits: torch.Tensor, draws: list[tuple[int, Draw]]) -> list[int]:
        """The samples of the rows of a step's logits [B, V] that gave a draw ((row, draw) pairs; a row may
        come in more than one, with draws of its own): the device's where the step sampled the row with that
        draw, else a few ops for all the others, one copy to the host."""
        out: list[int | None] = [None] * len(draws)
        if self._sampled is not None:
            for k, (i, d) in enumerate(draws):
                pick = self._device_draw(d)
                if pick is not None:
                    out[k] = self._sampled.sampled(i, *pick[:3])
        rest = [k for k, token in enumerate(out) if token is None]
        if rest:
            tokens = sample(_rows(logits, [draws[k][0] for k in rest]), [draws[k][1] for k in rest]).tolist()
            for k, token in zip(rest, tokens):
                out[k] = token
        return out

    def _greedy_picks(self, logits: torch.Tensor):
        """`picks(k, row)`: the greedy pick of each row of `logits` [B, V] under each greedy mask (None without
        greedy masks)."""
        return None if self._mask_picks is None else self._mask_picks(logits)

    def _event(self) -> torch.cuda.Event | None:
        """An event recorded after the work queued so far on the device (None on the CPU)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _after_loads(self, ready: list | None) -> None:
        """The device's next work (a forward that reads every layer's K/V) after the loads' last layer."""
        if ready:
            torch.cuda.current_stream(self.device).wait_event(ready[-1])

    @torch.no_grad()
    def _prefill(self, rows: list[PrefillRow], pool: KVPool, before=None) -> tuple[torch.Tensor, list[int]]:
        """Add `rows` to the pool and run their new tokens as one left-padded forward.

        Row i's cached prefix takes columns [end - n_i - m_i, end - m_i) of its page table (the trie's slots)
        and its m_i new tokens [end - m_i, end) (slots of its own): every row ends at the pool's common
        `end`, so the batch is realigned by construction, through the tables, with no K/V copied. Returns
        (last-position logits [B, V] float32, the rows' slots); raises `OutOfSlots` when the store cannot
        hold their new tokens (the caller removes the rows it added, as after any failed prefill). `before`: an
        event after the device's work that the rows' slots may have been written by before they were theirs
        (None: all the work queued so far)."""
        assert all(r.ids for r in rows), "a prefill row needs at least one new token"
        lengths = [r.cached + len(r.ids) for r in rows]
        longest = max(lengths)
        pool.make_room(pool.rows + len(rows), longest, extra=2)
        slots = pool.add_rows(lengths)
        for slot, row, n in zip(slots, rows, lengths):
            pool.set_row(slot, row.slots, n - len(row.slots))
        # (a row's own slots for the tokens the tiers hold, then for its new ones)
        ready = load([(row, pool.row_slots(slot)[len(row.slots):row.cached])
                      for slot, row in zip(slots, rows) if row.loads is not None], before)
        width = max(len(r.ids) for r in rows)
        if width == 1 and self.fused and slots[0] == 0 and pool.rows == len(rows) <= self.max_batch:
            # One new token a row, and no other rows in the pool: that is a decode step at column end - 1.
            # The fused step costs a fraction of the model's forward (mostly Python, for one token).
            tokens = [r.ids[0] for r in rows]
            self._after_loads(ready)
            return self._fused_decoder(pool).step_host(tokens, pool.start[: pool.rows], pool.end - 1).float(), slots
        if self.fused_prefill:  # (each layer after its loads)
            logits = self._fused_decoder(pool).prefill([(r.ids, r.cached) for r in rows], slots[0], pool.end, ready)
            return logits.float(), slots
        self._after_loads(ready)
        b, first = len(rows), pool.end - longest
        ids = torch.zeros(b, width, dtype=torch.long)
        write = torch.zeros(b, width, dtype=torch.bool)
        positions = torch.zeros(b, width, dtype=torch.long)
        mask = torch.zeros(b, longest, dtype=torch.long)
        for i, (row, n) in enumerate(zip(rows, lengths)):
            m = len(row.ids)
            ids[i, width - m:] = torch.tensor(row.ids)
            write[i, width - m:] = True
            positions[i, width - m:] = torch.arange(row.cached, n)
            mask[i, longest - n:] = 1
        # Without padding (every row as long as the longest, new and cached parts alike) the forward needs
        # no mask: plain causal attention, which lets transformers pick its fastest kernel (faster than with
        # an all-ones mask).
        padded = any(len(r.ids) != width for r in rows)
        ragged = padded or any(n != longest for n in lengths)
        cache = compat.pool_cache(pool, slice(slots[0], slots[-1] + 1), first, longest - width, width,
                                  write if padded else None)
        logits, _ = self._forward(ids.to(self.device), mask.to(self.device) if ragged else None,
                                   positions.to(self.device), cache)
        return logits[:, -1].float(), slots

    @torch.no_grad()
    def decode(self, pool: KVPool, rows: slice, tokens: list[int],
               ahead: list[int | Draw | None] | None = None, want_logits: bool = True) -> torch.Tensor | None:
        """One token for each row of `rows` (a slot range), written at column `end` (-1: any, for a row that
        left the batch: the token of a step run ahead, or 0). The caller advances
        `pool.end` once every row of the pool has been stepped. Returns logits [B, V] float32; `picks`
        holds the step's greedy picks on the device, or None. `ahead`: per row, the greedy mask (an index
        into `greedy_masks`) its next token will likely be picked with, or the draw it will be sampled
        with (a fused GPU step samples it on the device where it can: `sample`), or None (see
        `set_greedy_masks`).
        `want_logits=False`: the caller reads only `picks` where the step made them (then returns None)."""
        self.picks, self.ready, self._sampled = None, None, None
        if self.fused and rows.start == 0 and rows.stop == pool.rows <= self.max_batch:
            return self._fused_decode(pool, tokens, ahead, want_logits)
        starts = pool.start[rows]
        first = min(starts)
        tokens = [max(t, 0) for t in tokens]
        b, length = len(starts), pool.end - first
        mask = None
        if any(s != first for s in starts):  # rows of different lengths: mask each row's padding
            mask = torch.zeros(b, length + 1, dtype=torch.long)
            for i, s in enumerate(starts):
                mask[i, s - first:] = 1
            mask = mask.to(self.device)
        positions = torch.tensor([[pool.end - s] for s in starts])
        cache = compat.pool_cache(pool, rows, first, length, 1)
        logits, _ = self._forward(torch.tensor(tokens)[:, None].to(self.device),
                                   mask, positions.to(self.device), cache)
        return logits[:, -1].float()

    @torch.no_grad()
    def score(self, prefix: torch.Tensor, last_logits: torch.Tensor, options: list[list[int]]) -> list[list[float]]:
        """Per-token log-probabilities of each option after a prompt whose K/V are `prefix` ([L, 2, H, n, D])
        and whose next-token logits are `last_logits`. The options run as one right-padded batch."""
        first = torch.log_softmax(last_logits, dim=-1)
        scores = [[float(first[o[0]])] if o else [] for o in options]
        rows = [(i, o) for i, o in enumerate(options) if len(o) > 1]
        if not rows:
            return scores
        n, width, b = prefix.shape[3], max(len(o) - 1 for _, o in rows), len(rows)
        ids = torch.zeros(b, width, dtype=torch.long)
        mask = torch.zeros(b, n + width, dtype=torch.long)
        mask[:, :n] = 1
        for r, (_, o) in enumerate(rows):
            ids[r, : len(o) - 1] = torch.tensor(o[:-1])
            mask[r, n: n + len(o) - 1] = 1
        positions = torch.arange(n, n + width)[None].expand(b, -1)
        layers = [(prefix[i, 0][None].expand(b, -1, -1, -1), prefix[i, 1][None].expand(b, -1, -1, -1))
                  for i in range(prefix.shape[0])]
        logits, _ = self._forward(ids.to(self.device), mask.to(self.device), positions.to(self.device),
                                   compat.make_cache(layers), logits_to_keep=width)
        logp = torch.log_softmax(logits.float(), dim=-1)
        for r, (i, o) in enumerate(rows):
            targets = torch.tensor(o[1:], device=logp.device)
            scores[i] += logp[r, torch.arange(len(o) - 1, device=logp.device), targets].tolist()
        return scores


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows], without a copy where `rows` is every row in order."""
    if rows == list(range(len(logits))):
        return logits
    return logits[torch.tensor(rows, device=logits.device)]


PAD_WASTE = 0.3  # a prefill forward may compute at most this share of padding on top of the real tokens


def _length_groups(lengths: list[int]) -> list[list[int]]:
    """Indices of rows grouped by new-token count, shortest first, so that a group's padded size
    (rows x longest) stays within (1 + PAD_WASTE) x its real tokens."""
    groups: list[list[int]] = []
    total = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        n = lengths[i]
        if groups and (len(groups[-1]) + 1) * n <= (1 + PAD_WASTE) * (total + n):
            groups[-1].append(i)
            total += n
        else:
            groups.append([i])
            total = n
    return groups


def _fused_module():
    from . import fused as fused_decode  # imports triton

    return fused_decode


def _fused_supports(model) -> bool:
    try:
        return _fused_module().supports(model, require_cuda=False)
    except ImportError:  # no triton on this platform: the model's own forward decodes
        return False

