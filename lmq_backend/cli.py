"""The `lmq` command line: `lmq run FILE.lmq [--var k=v ...] [--model M] [--stream]`,
`lmq profile FILE.lmq --inputs data.jsonl [...]` (see `lmq_backend.profile`) and `lmq cache ls|clear` (the
disk tier of the prefix cache: `lmq_backend.cache.disk_tier`)."""
from __future__ import annotations

import argparse
import ast as pyast
import dataclasses
import enum
import json
import sys

from .errors import LMQError, LMQInputError


def _read_source(path: str) -> str:
    """The query text of FILE (`-`: standard input). A text with no statement (empty, blank or comments only) is
    refused: it would run an empty query."""
    if path == "-":
        text, name = sys.stdin.read(), "standard input"
    else:
        try:
            with open(path, encoding="utf-8") as f:
                text, name = f.read(), path
        except OSError as e:
            raise SystemExit(f"lmq: cannot read {path}: {e.strerror}") from None
    if all(not line.strip() or line.lstrip().startswith("#") for line in text.splitlines()):
        raise SystemExit(f"lmq: no query in {name}: it is {'empty' if not text.strip() else 'comments only'}")
    return text


def _parse_vars(items: list[str]) -> dict:
    """`k=v` gives the string v; `k:=v` gives the Python literal v (a number, list, ...)."""
    out = {}
    for item in items:
        if ":=" in item and item.index(":=") < item.index("=") + 1:
            key, raw = item.split(":=", 1)
            try:
                out[key] = pyast.literal_eval(raw)
            except (ValueError, SyntaxError):
                raise SystemExit(f"lmq: --var {item}: {raw!r} is not a Python literal") from None
        elif "=" in item:
            key, value = item.split("=", 1)
            out[key] = value
        else:
            raise SystemExit(f"lmq: --var {item}: write it as name=value (text) or name:=literal")
    return out


def _jsonable(value):
    """A query's returned value as JSON would hold it: tuples and sets as lists, dataclasses and pydantic models as
    objects, enums as their values; anything else JSON has no form for, its repr."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # a pydantic model
        return _jsonable(value.model_dump())
    if isinstance(value, enum.Enum):
        return _jsonable(value.value)
    return repr(value)


def _run_streaming(query, inputs: dict):
    """Print the prompt and the holes' text as the query writes and decides it (a chat's messages each on a line
    of their own, after their role); the result once done."""
    import asyncio

    async def printing():
        async for event in query.stream(**inputs):
            if event.done:
                print(flush=True)
                return event.result
            if event.variable is None and event.role is not None and not event.text:  # a message opens
                print(f"\n{event.role}: ", end="")
            print(event.text, end="", flush=True)

    return asyncio.run(printing())


def cmd_run(args) -> int:
    import lmq_backend as lmq

    from .profile import query_inputs, unknown_inputs

    query = lmq.Query(_read_source(args.file), name=args.file if args.file != "-" else "stdin",
                      model=args.model)
    inputs = _parse_vars(args.var)
    if (unknown := unknown_inputs(inputs, query_inputs(query)[1])) is not None:  # as `lmq profile` refuses them
        raise LMQInputError(f"--var: {unknown}")
    if args.stream and query.decoder.n == 1 and not query.decoder.beam and not args.json:
        result = _run_streaming(query, inputs)
        if isinstance(result, lmq.Result):
            print("---")
            for name, value in result.variables.items():
                print(f"{name} = {value!r}")
        else:
            print("---")
            print(result)
        return 0
    result = query.run_sync(**inputs)
    # a list is n results only for n > 1: a query may also return a list (one result, printed as itself)
    results = result if query.decoder.n > 1 or query.decoder.beam else [result]
    if args.json:
        print(json.dumps([_jsonable(r.__dict__ if isinstance(r, lmq.Result) else r) for r in results],
                         indent=2, default=repr))
        return 0
    for i, r in enumerate(results):
        if len(results) > 1:
            print(f"=== {'beam' if query.decoder.beam else 'result'} {i + 1} of {len(results)} ===")
        if not isinstance(r, lmq.Result):
            print(r)
            continue
        print(r.prompt)
        print("---")
        for name, value in r.variables.items():
            print(f"{name} = {value!r}")
        if r.score is not None:
            print(f"score = {r.score:.4f}")
        if r.distribution:
            print("distribution:")
            for option, p in sorted(r.distribution.items(), key=lambda kv: -kv[1]):
                print(f"  {p:7.4f}  {option!r}")
    return 0


def _cache_folder(args):
    from pathlib import Path

    from .cache.disk_tier import check_folder, default_folder

    folder = Path(args.dir).expanduser() if args.dir else default_folder()
    if folder is None:
        raise SystemExit("lmq: the disk tier is off ($LMQ_DISK_CACHE); name a folder with --dir")
    try:
        check_folder(folder)
    except NotADirectoryError as e:
        raise SystemExit(f"lmq: {e}") from None
    return folder


def cmd_cache_ls(args) -> int:
    from .cache.disk_tier import usage
    from .cache.stats import format_bytes

    folder = _cache_folder(args)
    models = usage(folder)
    if args.json:
        print(json.dumps({"folder": str(folder), "models": [
            {"key": u.key, "files": u.files, "bytes": u.bytes, **u.description} for u in models]}, indent=2))
        return 0
    print(f"disk tier: {folder}")
    if not models:
        print("no cached K/V")
        return 0
    rows = [("model", "key", "dtype", "device", "files", "bytes")]
    for u in models:
        d = u.description
        rows.append((str(d.get("name", "?")), u.key[:12], str(d.get("weights_dtype", d.get("dtype", "?"))),
                     str(d.get("device", "?")), str(u.files), format_bytes(u.bytes)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    print(f"total: {sum(u.files for u in models)} files, {format_bytes(sum(u.bytes for u in models))} "
          f"in {len(models)} model{'s' * (len(models) != 1)}")
    return 0


def cmd_cache_clear(args) -> int:
    from .cache.disk_tier import clear, usage
    from .cache.stats import format_bytes

    folder = _cache_folder(args)
    if args.model is None:
        files, nbytes = clear(folder)
    else:
        keys = _cached_model_keys(usage(folder), args.model)
        files = nbytes = 0
        for key in keys:
            f, n = clear(folder, key)
            files, nbytes = files + f, nbytes + n
    print(f"removed {files} files, {format_bytes(nbytes)} from {folder}")
    return 0


def _cached_model_keys(models: list, model: str) -> list[str]:
    """The keys of the cached models `--model` names: a key or its start (at least 4 characters, as `ls` shows
    it), or a name as `from` gives it (`default`, `hf:<dir>`, a folder); none is an error listing them."""
    given = model.strip()
    names = {given, given.removeprefix("hf:")}
    if given == "default":
        from .backend.default_model import default_model_dir

        names.add(str(default_model_dir()))
    keys = [u.key for u in models if str(u.description.get("name", "")) in names
            or (len(given) >= 4 and u.key.startswith(given))]
    if not keys:
        cached = ", ".join(f"{u.description.get('name', '?')} ({u.key[:12]})" for u in models) or "none"
        raise LMQInputError(f"cache clear --model {model!r}: no cached model of that key or name (cached: {cached})")
    return keys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmq", description="Run LMQL-style queries on local Hugging Face models, with a prefix KV cache.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="run a query file and print the filled prompt and variables")
    run.add_argument("file", help="a .lmq query file, or - for standard input")
    run.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                     help="an input of the query: NAME=text, or NAME:=python-literal (repeatable)")
    run.add_argument("--model", default=None,
                     help='model to use instead of the query\'s `from`: "default", "hf:<dir>" or a registered name')
    run.add_argument("--json", action="store_true", help="print the results as JSON")
    run.add_argument("--stream", action="store_true",
                     help="print the prompt and each hole's text as it is decided (one result: not for sample(n>1) "
                          "or beam decoders, which print their results at the end)")
    run.set_defaults(func=cmd_run)
    profile = sub.add_parser(
        "profile", help="run a query over a JSONL file of inputs and report cache hit rates and latency",
        description="Run a query once per line of a JSONL file (each line a JSON object of the query's inputs) "
                    "and print, per query template and in total: calls, prompt tokens, tokens reused from the "
                    "prefix cache / prefilled / decoded, the token hit rate (reused / prompt tokens, counted per "
                    "prefill), p50/p95 call latency, and the cache's evictions, bytes in use and nodes.")
    from .profile import add_arguments

    add_arguments(profile)
    profile.add_argument("--cluster", metavar="N|NAME", default=None,
                         help="run on a Ray cluster (pip install 'lmq-backend[ray]'): N starts N replicas of the model "
                              "here, NAME uses the served endpoint of that name; prints the replicas' statistics "
                              "summed, then per replica")
    profile.set_defaults(func=cmd_profile)
    cache = sub.add_parser(
        "cache", help="show or clear the prefix cache's disk tier",
        description="The disk tier keeps long prompt prefixes' K/V in files, so that a later process with the same "
                    "model prefills only what is new. Its folder: --dir, else $LMQ_DISK_CACHE, else "
                    "~/.cache/lmq/kv ($LMQ_CACHE_DIR/kv).")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True, metavar="ls|clear")
    ls = cache_sub.add_parser("ls", help="list the models with cached K/V: files and bytes")
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.set_defaults(func=cmd_cache_ls)
    clear = cache_sub.add_parser("clear", help="remove the cached K/V files (of every model, or of one)")
    clear.add_argument("--model", default=None, metavar="KEY|NAME",
                       help="only this model's files: a key (or its start, as `ls` shows it) or a name "
                            "(`default`, a folder)")
    clear.set_defaults(func=cmd_cache_clear)
    for p in (ls, clear):
        p.add_argument("--dir", default=None, help="the disk tier's folder (default: as above)")
    return parser


def cmd_profile(args) -> int:
    if getattr(args, "cluster", None):
        from .distributed.profile import run_cli
    else:
        from .profile import run_cli

    return run_cli(args, _read_source)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except LMQError as e:
        print(f"lmq: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
