"""One model process per lmq model SPEC for LMQL's `local:lmq:SPEC` models, shared by all their handles.

LMQL's own subprocess client starts a process per distinct set of `lmql.model(...)` arguments (each
loading the model again) and waits forever if that process fails. Here, every handle of a SPEC talks to
one process (`python -m lmq_backend.lmql.process SPEC`, a fresh interpreter: nothing is forked from a
process that may hold threads), which keeps one LMQL `TokenSession` per argument set, so handles whose
backend arguments agree share one backend and its trie. A reader thread delivers the process's messages
to each stream's event loop; when the process ends, every open and later call raises.

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
        self._sessions: set[bytes] = set()
        self._lock = threading.Lock()  # the pipe, _streams, _sessions
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

    def send(self, session: bytes, kwargs: dict, cmd: str, payload: dict) -> None:
        with self._lock:
            if self.failure is not None:
                return  # (the stream has its error already)
            try:
                if session not in self._sessions:
                    self._out.send(("SESSION", session, kwargs))
                    self._sessions.add(session)
                self._out.send((session, cmd, payload))
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
            self.session = pickle.dumps(sorted(self.kwargs.items()))
        except Exception as e:  # noqa: BLE001 - reported by the first call
            self.session, self.error = b"", f"lmql.model arguments must be picklable for lmq's model process: {e}"
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
        try:
            self.process.send(self.session, self.kwargs, cmd,
                              {**payload, "model": self.model_identifier, "stream_id": stream_id})
            while True:
                if until_first:
                    item = await asyncio.wait_for(queue.get(), REQUEST_TIMEOUT_S)
                else:
                    item = await queue.get()
                if item.get("error") is not None:
                    raise LMTPStreamError(item["error"])
                yield item
                if until_first or item.get("finish_reason") is not None:
                    return
        finally:
            self.process.close_stream(stream_id)


# ----- the model process ------------------------------------------------------------------------------

async def _serve(spec: str, inbox: Connection, outbox: Connection) -> None:
    from lmql.models.lmtp.lmtp_scheduler import TokenSession

    from . import plugin  # noqa: F401 - registers LMQModel

    send_lock = threading.Lock()

    class Transport:
        async def send(self, kind, payload):
            with send_lock:
                outbox.send((kind, payload))

    sessions: dict[bytes, TokenSession] = {}
    loop = asyncio.get_running_loop()
    while True:
        try:
            message = await loop.run_in_executor(None, inbox.recv)
        except (EOFError, OSError):
            return  # the parent is gone
        if message[0] == "SESSION":
            _, key, kwargs = message
            if not sessions:
                threading.Thread(target=_preload, args=(spec, dict(kwargs)), daemon=True).start()
            sessions[key] = TokenSession(Transport(), kwargs)
        else:
            key, cmd, payload = message
            await sessions[key].handle(cmd, payload)


def _preload(spec: str, kwargs: dict) -> None:
    """Load the first handle's backend while LMQL's client still loads its tokenizer (LMQL loads models on
    the first call); failures are left to LMQModel, which reports them to the caller."""
    from .plugin import backend_arguments, backend_for

    try:
        backend_for(spec, **backend_arguments(kwargs))
    except Exception:  # noqa: BLE001
        pass


def main() -> None:
    spec, inbox_fd, outbox_fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    inbox, outbox = Connection(inbox_fd, writable=False), Connection(outbox_fd, readable=False)
    try:
        asyncio.run(_serve(spec, inbox, outbox))
    finally:
        os._exit(0)  # LMQL's scheduler threads are not daemons everywhere


if __name__ == "__main__":
    main()
