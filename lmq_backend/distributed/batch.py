"""Batch jobs: many calls of one query, grouped by prefix and cut into chunks, results in input order; and the
inputs of such a job read from a Ray Dataset, a JSONL file or a Parquet file."""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from .prefix_tree import common_prefix_length
from .replica import Outcome


def chunk_order(texts: list[str], chunk_size: int, share: float = 0.5) -> list[list[int]]:
    """Input indices cut into chunks of at most `chunk_size`, after sorting by prompt text, so that inputs
    whose prompts share a prefix sit in the same chunks (and chunks of one prefix follow each other). A
    chunk also ends where a text shares less than `share` of itself with the one before (a new prefix): a
    chunk is routed as one call, by its first text."""
    order = sorted(range(len(texts)), key=texts.__getitem__)
    size = max(1, chunk_size)
    chunks: list[list[int]] = []
    for i in order:
        if chunks and len(chunks[-1]) < size:
            before, text = texts[chunks[-1][-1]], texts[i]
            if common_prefix_length(before, text) >= share * len(text):
                chunks[-1].append(i)
                continue
        chunks.append([i])
    return chunks


async def run_batch(client, key: str, box: list, texts: list[str], inputs: list[dict], *, chunk_size: int,
                    concurrency: int, progress: str | None) -> list[Outcome]:
    """Every input's outcome, in input order. At most `concurrency` calls are in flight (whole chunks);
    `progress` names a progress bar (None: no bar)."""
    outcomes: list[Outcome | None] = [None] * len(inputs)
    chunks = chunk_order(texts, chunk_size)
    slots = asyncio.Semaphore(max(1, concurrency // max(1, chunk_size)))
    bar = None
    if progress is not None:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(inputs), desc=progress, unit="call", file=sys.stderr)

    async def one(chunk: list[int]) -> None:
        async with slots:
            results = await client._call_many(key, box, texts[chunk[0]], [inputs[i] for i in chunk])
        for i, outcome in zip(chunk, results):
            outcomes[i] = outcome
        if bar is not None:
            bar.update(len(chunk))

    try:
        await asyncio.gather(*(one(c) for c in chunks))
    finally:
        if bar is not None:
            bar.close()
    return outcomes  # type: ignore[return-value]


def _plain(value: Any) -> Any:
    """A Ray Data value as plain Python (numpy arrays and scalars from Arrow columns become lists and
    numbers), so that the query sees what a JSON reader would give it."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def read_rows(source) -> list[dict]:
    """The rows of a Ray Dataset (in order), of a `.jsonl` file (one JSON object a line, blank lines
    skipped) or of a `.parquet` file (one column per input); a list or other iterable of dicts is taken as
    it is. Files are read here, in this process: a job's inputs are small next to its outputs' compute."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.suffix.lower() == ".jsonl":
            with open(path, encoding="utf-8") as f:
                return [json.loads(line) for line in f if line.strip()]
        if path.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        raise ValueError(f"cannot read {path}: give a .jsonl or .parquet file, or a Ray Dataset")
    import ray.data

    if isinstance(source, ray.data.Dataset):
        ctx = ray.data.DataContext.get_current()
        keep, ctx.execution_options.preserve_order = ctx.execution_options.preserve_order, True
        try:
            return [_plain(dict(row)) for row in source.iter_rows()]
        finally:
            ctx.execution_options.preserve_order = keep
    return [dict(row) for row in source]
