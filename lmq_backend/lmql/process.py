"""One model process per lmq model SPEC for LMQL's `local:lmq:SPEC` models, shared by all their handles.

LMQL's own subprocess client starts a process per distinct set of `lmql.model(...)` arguments (each
loading the model again) and waits forever if that process fails. Here, every handle of a SPEC talks to
one process (`python -m lmq_backend.lmql.process SPEC`, a fresh interpreter: nothing is forked from a
process that may hold threads), which keeps one `ArgumentSet` (a backend) per argument set, so handles whose backend
arguments agree share one backend and its trie. A reader thread delivers the process's messages to each
stream's event loop; when the process ends, every open and later call raises.

The model process answers LMQL's LMTP commands (GENERATE, SCORE, MODEL_INFO) itself, as LMQL's `TokenSession`
would, but without LMQL's scheduler: that one runs a batch at a time on a worker thread (calls arriving
meanwhile wait for the whole batch) and polls its output queue every 10 ms. Each call is a task on the
process's event loop (`LMQLCalls.stream_generate` / `stream_score`) whose tokens are sent as they are picked;
concurrent calls batch in lmq's scheduler.

Only SPECs a fresh process can load are served here ("default", "hf:<dir>", a folder); a name registered
with `lmq.register_backend` in this interpreter stays with LMQL's forked process, which inherits it.
"""
from __future__ import annotations

import asyncio
import atexit
import os
import pickle
import subprocess
import sys
import threading
from itertools import count
from multiprocessing.connection import Connection
from pathlib import Path

REQUEST_TIMEOUT_S = 30.0

_processes: dict[str, "ModelProcess"] = {}
_processes_lock = threading.Lock()


def handle_or_none(identifier: str, kwargs: dict) -> "ProcessHandle | None":
    """A handle on the model process of `lmq:SPEC` (started if none runs), or None where this module does
    not serve SPEC. Never raises: LMQL calls this in a task whose exceptions no caller sees."""
    spec = identifier.split(":", 1)[1]
    if spec != "default" and not Path(spec.removeprefix("hf:")).is_dir():
        return None
    with _processes_lock:
        process = _processes.get(spec)
        if process is None or process.failure is not None:
            process = _processes[spec] = ModelProcess(spec)
    return ProcessHandle(process, identifier, kwargs)


class ModelProcess:
    """The parent's side of one model process: a pipe each way, a reader thread, the open streams."""

    def __init__(self, spec: str):
        self.spec = spec
        self.failure: str | None = None
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = count(1)
        self._argument_sets: set[bytes] = set()
        self._lock = threading.Lock()  # the pipe, _streams, _argument_sets
        from_parent, to_child = os.pipe()  # (read end, write end)
        from_child, to_parent = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lmq_backend.lmql.process", spec, str(from_parent), str(to_parent)],
                pass_fds=(from_parent, to_parent))
        except OSError as e:
            self.proc = None
            self.failure = f"could not start the lmq model process for {spec!r}: {e}"
            return
        finally:
            os.close(from_parent)
            os.close(to_parent)
        self._out = Connection(to_child, readable=False)
        self._in = Connection(from_child, writable=False)
        threading.Thread(target=self._read, name=f"lmq-model-process-{spec}", daemon=True).start()
        atexit.register(self.close)

    def open_stream(self) -> tuple[int, asyncio.Queue]:
        """A new stream id and the queue its messages arrive on, in the running event loop."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            stream_id = next(self._ids)
            self._streams[stream_id] = (asyncio.get_running_loop(), queue)
            if self.failure is not None:
                queue.put_nowait({"stream_id": stream_id, "error": self.failure})
        return stream_id, queue

    def close_stream(self, stream_id: int) -> None:
        with self._lock:
            self._streams.pop(stream_id, None)

    def send(self, args_key: bytes, kwargs: dict, cmd: str, payload: dict) -> None:
        with self._lock:
            if self.failure is not None:
                return  # (the stream has its error already)
            try:
                if args_key not in self._argument_sets:
                    self._out.send(("ARGUMENTS", args_key, kwargs))
                    self._argument_sets.add(args_key)
                self._out.send((args_key, cmd, payload))
            except OSError as e:
                self._fail(f"the lmq model process for {self.spec!r} is gone ({e})")

    def _read(self) -> None:
        while True:
            try:
                kind, payload = self._in.recv()
            except (EOFError, OSError):
                break
            self._deliver(payload.get("stream_id"), payload)
        code = self.proc.wait()
        why = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        with self._lock:
            self._fail(f"the lmq model process for {self.spec!r} {why} (its error output is above)")

    def _deliver(self, stream_id, payload) -> None:
        with self._lock:
            target = self._streams.get(stream_id)
        if target is not None:
            loop, queue = target
            try:
                loop.call_soon_threadsafe(queue.put_nowait, payload)
            except RuntimeError:  # that event loop is closed: nobody waits on this stream any more
                self.close_stream(stream_id)

    def _fail(self, message: str) -> None:  # (holds _lock)
        if self.failure is None:
            self.failure = message
        for stream_id, (loop, queue) in list(self._streams.items()):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, {"stream_id": stream_id, "error": self.failure})
            except RuntimeError:
                pass

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class ProcessHandle:
    """What LMQL's `LMTPDcModel` uses as its LMTP client (`generate`, `score`, `request`, `close`) for one
    `lmql.model(...)` argument set."""

    def __init__(self, process: ModelProcess, identifier: str, kwargs: dict):
        self.process, self.model_identifier, self.kwargs = process, identifier, dict(kwargs)
        try:
            self.args_key = pickle.dumps(sorted(self.kwargs.items()))
        except Exception as e:  # noqa: BLE001 - reported by the first call
            self.args_key, self.error = b"", f"lmql.model arguments must be picklable for lmq's model process: {e}"
        else:
            self.error = None

    def ref(self) -> "ProcessHandle":
        return self

    async def close(self) -> None:  # the process serves other handles; it ends with this interpreter
        pass

    async def request(self, name: str, payload) -> dict:
        [reply] = [m async for m in self._stream(name, {"data": payload}, until_first=True)]
        return reply

    async def generate(self, prompt, **kwargs):
        payload = {**kwargs, "prompt": prompt}
        if payload.get("logit_bias") is None:
            payload.pop("logit_bias", None)
        async for token in self._stream("GENERATE", payload):
            yield token

    async def score(self, prompt, scored_prompt, **kwargs):
        async for token in self._stream("SCORE", {**kwargs, "prompt": prompt, "scored": scored_prompt}):
            yield token

    async def _stream(self, cmd: str, payload: dict, until_first: bool = False):
        from lmql.models.lmtp.errors import LMTPStreamError

        if self.error is not None:
            raise LMTPStreamError(self.error)
        stream_id, queue = self.process.open_stream()
        streamed = False
        try:
            self.process.send(self.args_key, self.kwargs, cmd,
                              {**payload, "model": self.model_identifier, "stream_id": stream_id})
            while True:
                if until_first:
                    item = await asyncio.wait_for(queue.get(), REQUEST_TIMEOUT_S)
                else:
                    item = await queue.get()
                if item.get("error") is not None:
                    if streamed:
                        # LMQL's cache reads the tokens after the first and only warns of an error there, leaving
                        # its call waiting for them: the stream ends, LMQL asks again, and that request gets the
                        # error at its first token (a process that died stays failed) or is served
                        return
                    raise LMTPStreamError(item["error"])
                streamed = True
                yield item
                if until_first or item.get("finish_reason") is not None:
                    return
        finally:
            self.process.close_stream(stream_id)


# ----- the model process ------------------------------------------------------------------------------

class ArgumentSet:
    """One argument set of `lmql.model(...)` in the model process: its `LMQModel`s (one per model identifier,
    made on first use as LMQL's `LMTPModel.load` would), answering LMTP commands with `send(payload)`."""

    def __init__(self, kwargs: dict, send):
        self.kwargs, self.send = dict(kwargs), send
        self.models: dict[str, object] = {}

    def model(self, identifier: str):
        if identifier not in self.models:
            from .plugin import LMQModel

            self.models[identifier] = LMQModel(identifier, **self.kwargs)   # (a failure: raised by `calls`)
        return self.models[identifier]

    async def handle(self, cmd: str, payload: dict) -> None:
        stream_id = payload.get("stream_id")

        def emit(token: dict) -> None:
            self.send({**token, "stream_id": stream_id})

        try:
            model = self.model(payload["model"])
            if cmd == "GENERATE":
                kwargs = {k: v for k, v in payload.items() if k not in ("model", "stream_id", "prompt", "logit_bias")}
                await model.calls.stream_generate(payload["prompt"], payload.get("logit_bias"), kwargs, emit)
            elif cmd == "SCORE":
                await model.calls.stream_score(payload["prompt"], payload["scored"], emit)
            elif cmd == "MODEL_INFO":
                self.send({"stream_id": stream_id, "model_info": model.model_info()})
            else:
                raise ValueError(f"unknown LMTP command {cmd!r}")
        except Exception as e:  # noqa: BLE001 - the caller's stream gets it
            self.send({"stream_id": stream_id, "error": f"{type(e).__name__}: {e}"})


async def _serve(spec: str, inbox: Connection, outbox: Connection) -> None:
    from . import plugin  # noqa: F401 - registers LMQModel

    send_lock = threading.Lock()

    def send(payload: dict) -> None:
        with send_lock:
            outbox.send(("TOKEN", payload))

    argument_sets: dict[bytes, ArgumentSet] = {}
    tasks: set[asyncio.Task] = set()
    loop = asyncio.get_running_loop()
    closed = loop.create_future()

    def take(messages: list) -> None:  # (on the loop) calls start at once, those that came together in one
        for message in messages:           # loop iteration: their prefills go into the engine's next step together
            if message[0] == "ARGUMENTS":
                _, key, kwargs = message
                if not argument_sets:
                    threading.Thread(target=_preload, args=(spec, dict(kwargs)), daemon=True).start()
                argument_sets[key] = ArgumentSet(kwargs, send)
            else:
                key, cmd, payload = message
                task = asyncio.ensure_future(argument_sets[key].handle(cmd, payload))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

    def read() -> None:  # (a thread) every message reaches the loop as soon as it arrives, not one per step, with
        while True:      # every other message already in the pipe
            try:
                messages = [inbox.recv()]
                while inbox.poll():
                    messages.append(inbox.recv())
            except (EOFError, OSError):
                break
            loop.call_soon_threadsafe(take, messages)
        loop.call_soon_threadsafe(lambda: closed.done() or closed.set_result(None))

    threading.Thread(target=read, name="lmq-model-process-inbox", daemon=True).start()
    await closed  # the parent is gone


def _preload(spec: str, kwargs: dict) -> None:
    """Load the first handle's backend while LMQL's client still loads its tokenizer (LMQL loads models on
    the first call); failures are left to LMQModel, which reports them to the caller."""
    from .plugin import backend_arguments, backend_for

    try:
        backend_for(spec, **backend_arguments(kwargs))
    except Exception:  # noqa: BLE001
        pass


def main() -> None:
    """The model process. LMQ_LMQL_PROFILE=FILE: its event loop runs under cProfile, whose statistics are
    written to FILE (`pstats`) when the parent goes."""
    spec, inbox_fd, outbox_fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    inbox, outbox = Connection(inbox_fd, writable=False), Connection(outbox_fd, readable=False)
    profile_to = os.environ.get("LMQ_LMQL_PROFILE")
    try:
        if profile_to:
            import cProfile
            import signal

            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # (the parent's atexit ends the process)
            profiler = cProfile.Profile()
            try:
                profiler.runcall(asyncio.run, _serve(spec, inbox, outbox))
            finally:
                profiler.dump_stats(profile_to)
        else:
            asyncio.run(_serve(spec, inbox, outbox))
    finally:
        os._exit(0)  # LMQL's scheduler threads are not daemons everywhere


if __name__ == "__main__":
    main()
