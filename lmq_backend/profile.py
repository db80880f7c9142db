"""`lmq profile`: run a query over a JSONL file of inputs and report what the prefix cache saved.

    lmq profile FILE.lmq --inputs data.jsonl [--concurrency N] [--json] [--plot out.png]
                         [--on-error skip|stop] [--model M] [--log-steps]

Python users get the same pieces: `read_inputs`, `profile_query` (returns a `ProfileReport`),
`plot_report`, and `log_steps(backend)` for a live line per model forward.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Callable, Iterable

from .backend.protocol import Backend
from .cache.stats import CacheStats, StepInfo, format_table
from .errors import LMQError, LMQInputError
from .language import free_names

ON_ERROR = ("stop", "skip")


# ----- live step log ---------------------------------------------------------------------------------

def format_step(info: StepInfo) -> str:
    """One line per model forward, as serving engines log them:
    `[lmq] prefill batch=3 #new-token=75 #cached-token=3210 12.3 ms`."""
    return (f"[lmq] {info.kind} batch={info.batch_size} #new-token={info.new_tokens} "
            f"#cached-token={info.cached_tokens} {info.seconds * 1000:.1f} ms")


def log_steps(backend: Backend, file: IO[str] | None = None) -> Callable[[StepInfo], None]:
    """Print a line per model forward of `backend` to `file` (default: sys.stderr at the time of each
    step). Replaces any callback given to `backend.on_step` before; `backend.on_step(None)` stops it.
    Returns the callback."""
    from tqdm import tqdm

    def callback(info: StepInfo) -> None:
        # tqdm.write moves a progress bar drawn on the same stream out of the way of the line
        tqdm.write(format_step(info), file=file if file is not None else sys.stderr)

    backend.on_step(callback)
    return callback


# ----- inputs ---------------------------------------------------------------------------------------

class LMQInputLineError(LMQInputError):
    """A line of an inputs file that cannot be a call of the query."""

    def __init__(self, path: str, line: int, message: str):
        self.path, self.line, self.message = path, line, message
        super().__init__(f"{path}, line {line}: {message}")


def query_inputs(query) -> tuple[set[str], set[str]]:
    """(required, accepted) input names of a compiled query: the names it reads and does not bind
    (`free_names`: a builtin's name alone in `{...}` included) are the ones it takes; those the query's scope
    does not provide are required."""
    accepted = set(free_names(query.ast))
    return accepted - set(query.scope), accepted


def read_inputs(path: str | Path, required: set[str], accepted: set[str]) -> list[tuple[int, dict | LMQInputLineError]]:
    """The lines of a JSONL file as (line number, inputs) or (line number, the error of that line); blank
    lines are skipped. A file that cannot be read raises LMQInputError."""
    path = str(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise LMQInputError(f"cannot read inputs file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise LMQInputError(f"inputs file {path} is not UTF-8 text: {e}") from None
    out: list[tuple[int, dict | LMQInputLineError]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            out.append((number, LMQInputLineError(path, number, f"not valid JSON ({e.msg} at column {e.colno})")))
            continue
        if not isinstance(item, dict):
            out.append((number, LMQInputLineError(
                path, number, f"expected a JSON object of inputs, got {type(item).__name__}")))
            continue
        missing = sorted(required - item.keys())
        problems = []
        if (unknown := unknown_inputs(item, accepted)) is not None:
            problems.append(unknown)
        if missing:
            problems.append(f"missing input {_names(missing)}")
        out.append((number, LMQInputLineError(path, number, "; ".join(problems)) if problems else item))
    return out


def unknown_inputs(names: Iterable[str], accepted: set[str]) -> str | None:
    """What is wrong with inputs named `names` for a query that takes `accepted` (`query_inputs`): the names it
    does not take; None where it takes them all."""
    unknown = sorted(set(names) - accepted)
    if not unknown:
        return None
    return f"the query does not take {_names(unknown)} (it takes: {', '.join(sorted(accepted)) or 'no inputs'})"


def _names(names: list[str]) -> str:
    return ("variable " if len(names) == 1 else "variables ") + ", ".join(repr(n) for n in names)


# ----- the run --------------------------------------------------------------------------------------

@dataclass
class CallRecord:
    """One call of the run. `tokens_requested`/`tokens_reused` are the run's cumulative counters when
    the call finished (for the hit rate over the run)."""

    index: int            # 0-based position among the calls, in input order
    line: int | None      # line of the inputs file (None for inputs not from a file)
    latency: float        # seconds from the call's start to its end
    ok: bool
    error: str | None = None
    finished: int = 0     # 0-based order in which the calls finished
    tokens_requested: int = 0
    tokens_reused: int = 0


@dataclass
class ProfileReport:
    query: str
    model: str
    stats: CacheStats
    records: list[CallRecord] = field(default_factory=list)
    skipped_lines: list[dict] = field(default_factory=list)  # {"line", "error"} of input lines not run
    stopped: str | None = None  # why the run stopped early (on_error="stop"), else None
    wall_seconds: float = 0.0
    concurrency: int = 1

    @property
    def errors(self) -> list[CallRecord]:
        return [r for r in self.records if not r.ok]

    def as_dict(self) -> dict:
        return {
            "query": self.query, "model": self.model, "concurrency": self.concurrency,
            "wall_seconds": self.wall_seconds,
            "calls_ok": sum(r.ok for r in self.records), "calls_failed": len(self.errors),
            "lines_skipped": len(self.skipped_lines), "skipped": self.skipped_lines, "stopped": self.stopped,
            "stats": self.stats.as_dict(),
            "calls": [asdict(r) for r in sorted(self.records, key=lambda r: r.index)],
        }

    def summary(self) -> str:
        ok = sum(r.ok for r in self.records)
        parts = [f"{ok} calls in {self.wall_seconds:.1f} s (concurrency {self.concurrency})"]
        if self.errors:
            parts.append(f"{len(self.errors)} failed")
        if self.skipped_lines:
            parts.append(f"{len(self.skipped_lines)} input lines skipped")
        if self.stopped:
            parts.append(f"stopped early: {self.stopped}")
        return "; ".join(parts)


async def profile_query(query, inputs: list[tuple[int | None, dict | LMQInputLineError]] | list[dict], *,
                        backend: Backend | None = None, concurrency: int = 1, on_error: str = "stop",
                        progress: bool = True, error_file: IO[str] | None = None) -> ProfileReport:
    """Run `query` once per inputs (dicts, or (line, dict-or-LMQInputLineError) as `read_inputs` gives),
    at most `concurrency` at a time, timing each call. The backend's statistics are reset first, so the
    report's stats are this run's.

    on_error="stop": the first bad input line or failed call stops the run (calls in flight finish);
    "skip": it is reported on `error_file` (stderr) and counted, and the run goes on."""
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    err = error_file if error_file is not None else sys.stderr
    items = [x if isinstance(x, tuple) else (None, x) for x in inputs]
    backend = backend or query.backend
    backend.reset_stats()
    before = backend.stats()
    report = ProfileReport(query=query.name, model=getattr(backend, "name", type(backend).__name__),
                           stats=before, concurrency=max(1, concurrency))

    # Lines that cannot be calls: reported now; with "stop", only the calls before the first one run.
    runnable: list[tuple[int, int | None, dict]] = []
    for line, item in items:
        if isinstance(item, LMQInputLineError):
            print(f"lmq: {item}", file=err)
            if on_error == "stop":
                report.stopped = str(item)
                break
            report.skipped_lines.append({"line": line, "error": item.message})
            continue
        runnable.append((len(runnable), line, item))

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(runnable), desc=query.name[:30], file=sys.stderr, unit="call")
    semaphore = asyncio.Semaphore(report.concurrency)
    stop = asyncio.Event()

    async def one(index: int, line: int | None, item: dict) -> None:
        async with semaphore:
            if stop.is_set():
                return
            started = time.perf_counter()
            error = None
            try:
                await query.run(dict(item), backend)
            except LMQError as e:
                error = f"{type(e).__name__}: {e}"
            latency = time.perf_counter() - started
            now = backend.stats()
            record = CallRecord(index=index, line=line, latency=latency, ok=error is None, error=error,
                                finished=len(report.records),
                                tokens_requested=now.tokens_requested - before.tokens_requested,
                                tokens_reused=now.tokens_reused - before.tokens_reused)
            report.records.append(record)
            if bar is not None:
                bar.update(1)
            if error is not None:
                where = f"line {line}" if line is not None else f"call {index}"
                print(f"lmq: {where}: {error}", file=err)
                if on_error == "stop" and not stop.is_set():
                    stop.set()
                    report.stopped = f"{where}: {error}"

    started = time.perf_counter()
    try:
        await asyncio.gather(*(one(*x) for x in runnable))
    finally:
        if bar is not None:
            bar.close()
    report.wall_seconds = time.perf_counter() - started
    report.stats = backend.stats().since(before)
    return report


# ----- the plot --------------------------------------------------------------------------------------

def _require_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise LMQInputError("--plot needs matplotlib: pip install 'lmq-backend[plot]'") from None


def plot_report(report: ProfileReport, path: str | Path) -> None:
    """A PNG with two panels over the run (calls in the order they finished): the cumulative token hit
    rate, and each call's latency (failed calls in red)."""
    _require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # the Agg backend, without pyplot's state
    from matplotlib.figure import Figure

    records = sorted(report.records, key=lambda r: r.finished)
    x = [r.finished + 1 for r in records]
    rate = [100 * r.tokens_reused / r.tokens_requested if r.tokens_requested else 0.0 for r in records]
    fig = Figure(figsize=(8, 6), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.plot(x, rate, marker="." if len(x) < 200 else None, color="tab:blue")
    top.set_ylabel("cumulative token hit rate (%)")
    top.set_ylim(0, 100)
    top.grid(alpha=0.3)
    top.set_title(f"lmq profile: {report.query} on {report.model}", fontsize=10)
    for ok, color, label in ((True, "tab:green", "ok"), (False, "tab:red", "failed")):
        pts = [(xi, r.latency * 1000) for xi, r in zip(x, records) if r.ok is ok]
        if pts:
            bottom.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, color=color, label=label)
    bottom.set_ylabel("call latency (ms)")
    bottom.set_xlabel("call (in the order calls finished)")
    bottom.set_ylim(bottom=0)
    bottom.grid(alpha=0.3)
    if report.errors:
        bottom.legend()
    fig.savefig(str(path), format="png", dpi=100)


# ----- the command ----------------------------------------------------------------------------------

def add_arguments(parser) -> None:
    parser.add_argument("file", help="a .lmq query file, or - for standard input")
    parser.add_argument("--inputs", required=True, metavar="DATA.jsonl",
                        help="one JSON object of the query's inputs per line")
    parser.add_argument("--concurrency", type=int, default=1, metavar="N",
                        help="calls in flight at a time (default 1: each latency is one call's own cost; raise it "
                             "to measure a batching backend under load, where latency includes waiting)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document: the statistics and a record per call")
    parser.add_argument("--plot", metavar="OUT.png",
                        help="write a PNG of the cumulative token hit rate and each call's latency")
    parser.add_argument("--on-error", choices=ON_ERROR, default="stop",
                        help="a bad input line or a failed call: stop (default, exit code 2) or skip it and go on")
    parser.add_argument("--model", default=None,
                        help='model to use instead of the query\'s `from`: "default", "hf:<dir>" or a registered name')
    parser.add_argument("--log-steps", action="store_true",
                        help="print a line per model forward to stderr (batch size, new and cached tokens, time)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_cli(args, read_source: Callable[[str], str]) -> int:
    """`lmq profile`: 0 when the run went through (skipped lines included), 2 when it stopped early."""
    import lmq_backend as lmq

    if args.concurrency < 1:
        raise LMQInputError(f"--concurrency must be at least 1, got {args.concurrency}")
    if args.plot:
        _require_matplotlib()
        folder = Path(args.plot).resolve().parent
        if not folder.is_dir():  # (found out before the run, not after it, with its report lost)
            raise LMQInputError(f"--plot {args.plot}: no folder {folder} to write it in")
    query = lmq.Query(read_source(args.file), name=args.file if args.file != "-" else "stdin", model=args.model)
    required, accepted = query_inputs(query)
    inputs = read_inputs(args.inputs, required, accepted)
    backend = query.backend
    if args.log_steps:
        log_steps(backend)
    try:
        report = asyncio.run(profile_query(query, inputs, backend=backend, concurrency=args.concurrency,
                                           on_error=args.on_error, progress=not args.no_progress))
    finally:
        if args.log_steps:
            backend.on_step(None)
    if args.plot:
        try:
            plot_report(report, args.plot)
        except OSError as e:  # the report is printed all the same
            print(f"lmq: --plot {args.plot}: {e.strerror or e}", file=sys.stderr)
            args.plot = None
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(format_table(report.stats))
        print(report.summary())
        if args.plot:
            print(f"plot: {args.plot}")
    return 2 if report.stopped else 0

