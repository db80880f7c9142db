"""lmq as a model backend for LMQL 0.7.3 (LMQL issue #263 asks for KV-cache reuse): LMQL's queries, lmq's trie.

    import lmql
    m = lmql.model("local:lmq:default")       # with lmq installed, nothing else to import or pass
    lmql.run_sync('"Q: 2+2=?\\nA:[X]" where INT(X)', model=m)

LMQL resolves `local:NAME` by stripping `local:` and calling `LMTPModel.load(NAME)`, which hands names
of the form `lmq:SPEC` to the class registered as "lmq" (`LMQModel`, below). SPEC is what
`lmq_backend.get_backend` takes ("default", a registered name, "hf:<dir>") or a model folder. LMQL 0.7.3
discovers no plugins, so the wheel ships `lmq-lmql.pth`, which makes `import lmql` register the class and
teach LMQL lmq's tokenizers and model processes (`hook.py`); importing this module does the same.

Where the model runs:
  - default `local:` mode: one model process per SPEC (`process.py`), shared by every
    `lmql.model("local:lmq:SPEC", ...)` handle of this interpreter; a failure there (a bad folder, an
    exception while loading or serving, the process dying) is raised to the LMQL caller. (A name
    registered with `lmq.register_backend` in this interpreter runs in LMQL's forked process instead,
    which inherits it; its load failures reach the caller too, through `LMQModel`.)
  - `async_transport=True`: LMQL's scheduler runs in this process (`get_backend(SPEC).stats()` shows the
    cache at work).
  - an LMTP server: `python -m lmq_backend.lmql.plugin lmq:default --port 8080`, then
    `lmql.model("lmq:default", endpoint="localhost:8080")`.
"""
from __future__ import annotations

import sys
import threading
import traceback
import warnings
from pathlib import Path

from . import hook as lmql_hook

__all__ = ["LMQModel", "model", "tokenizer_dir", "backend_for", "backend_arguments"]

BACKEND_ARGS = ("device", "dtype", "cache_budget")


# ----- backends: one per (SPEC, arguments) in a process -------------------------------------------------

_backends: dict[tuple, object] = {}
_backends_lock = threading.Lock()  # a second handle waits for the first one's load instead of loading twice


def _is_folder(spec: str) -> bool:
    return Path(spec.removeprefix("hf:")).is_dir()


def backend_for(spec: str, **kwargs):
    """The lmq backend for `lmq:SPEC`: a name `get_backend` knows, or a model folder. Keyword arguments
    (device, dtype, cache_budget) load a new HFBackend for it."""
    key = (spec, tuple(sorted(kwargs.items())))
    with _backends_lock:
        if key not in _backends:
            if not kwargs:
                from ..backend.registry import get_backend

                _backends[key] = get_backend(spec if not Path(spec).is_dir() else f"hf:{spec}")
            else:
                from ..backend.hf import HFBackend

                _backends[key] = HFBackend(spec.removeprefix("hf:"), **kwargs)
        return _backends[key]


def backend_arguments(kwargs: dict) -> dict:
    """lmq's backend arguments out of LMQL's model arguments (removed from `kwargs`). LMQL renames dtype=
    to torch_dtype= and cuda=True to device_map="auto"; like LMQL's own backend, cuda=True on a machine
    without CUDA runs on the CPU, with a warning."""
    args = {k: kwargs.pop(k) for k in BACKEND_ARGS if k in kwargs}
    if "torch_dtype" in kwargs:
        dtype = kwargs.pop("torch_dtype")
        args["dtype"] = str(dtype).removeprefix("torch.")
    if kwargs.pop("device_map", None) == "auto" and "device" not in args:
        import torch

        if torch.cuda.is_available():
            args["device"] = "cuda"
        else:
            warnings.warn("lmq: cuda=True, but CUDA is not available here: the model runs on the CPU")
            args["device"] = "cpu"
    return args


def tokenizer_dir(spec: str) -> str:
    """The tokenizer folder of `lmq:SPEC`, for LMQL's tokenizer (loaded in LMQL's process)."""
    if spec == "default":
        from ..backend.default_model import default_model_dir

        return str(default_model_dir())
    if _is_folder(spec):
        return spec.removeprefix("hf:")
    from ..backend.registry import get_backend

    return str(getattr(get_backend(spec).vocab.tokenizer, "name_or_path", "") or "")


def model(spec: str = "default", **kwargs):
    """`lmql.model("local:lmq:SPEC", **kwargs)` with LMQL given the tokenizer folder of SPEC's backend explicitly
    (what the model string alone does when the hook is installed)."""
    import lmql

    kwargs.setdefault("tokenizer", tokenizer_dir(spec))
    return lmql.model(f"local:lmq:{spec}", **kwargs)


# ----- the LMTP model class ---------------------------------------------------------------------------

class LMQModel:
    """LMQL's LMTP model interface (`lmql.models.lmtp.backends.lmtp_model.LMTPModel`: `generate`, `score`,
    `eos_token_id`, `max_batch_size`, `model_info`) served by an lmq backend. Not a subclass: importing
    LMQL's `lmtp_model` imports transformers and torch, and this module loads with neither.

    Never raises while loading: LMQL loads models on a scheduler thread whose exceptions no client sees
    (the client would wait forever). A load failure is kept and raised by every call instead, which
    LMQL's scheduler sends to the caller as an error."""

    max_batch_size: int = 32

    def __init__(self, model_identifier: str, **kwargs):
        self.model_identifier = model_identifier
        self.spec = model_identifier.split(":", 1)[1] if model_identifier.startswith("lmq:") else model_identifier
        self.failure: str | None = None
        self._calls = None
        try:
            self.max_batch_size = int(kwargs.pop("batch_size", 32))
            mask_chunk = int(kwargs.pop("mask_chunk", 1))  # tokens per call when every row has an allow-list
            kwargs.pop("silent", None)
            args = backend_arguments(kwargs)
            if kwargs:
                warnings.warn(f"lmq: ignoring LMQL model arguments {sorted(kwargs)}")
            from .calls import LMQLCalls

            self._calls = LMQLCalls(backend_for(self.spec, **args), mask_chunk=mask_chunk)
        except BaseException as e:  # noqa: BLE001 - reported to LMQL's caller by generate/score
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            self.failure = f"lmq could not load the model {model_identifier!r}: {type(e).__name__}: {e}"
            print(f"{self.failure}\n{traceback.format_exc()}", file=sys.stderr, flush=True)

    @property
    def backend(self):
        return self._serving().backend

    @property
    def calls(self):
        """The `LMQLCalls` serving this model (raises the load failure, if any)."""
        return self._serving()

    @property
    def mask_chunk(self) -> int:
        return self._serving().mask_chunk

    @property
    def eos_token_id(self) -> int:
        return self._serving().eos_token_id

    def model_info(self):
        info = {"model": self.model_identifier, "model_type": "lmq"}
        return {**info, "error": self.failure} if self.failure else {**info, "backend": self._calls.backend.name}

    def generate(self, input_ids, attention_mask, temperature, max_new_tokens, bias_tensor, streamer, **kwargs):
        return self._serving().generate(input_ids, attention_mask, temperature, max_new_tokens, bias_tensor,
                                        streamer, **kwargs)

    def score(self, input_ids, attention_mask, **kwargs):
        return self._serving().score(input_ids, attention_mask, **kwargs)

    def _serving(self):
        if self.failure is not None:
            from ..errors import LMQBackendError

            raise LMQBackendError(self.failure)
        return self._calls


lmql_hook.install()  # registers LMQModel with LMQL now, or when LMQL's model registry is imported


if __name__ == "__main__":  # an LMTP server for lmq models: python -m lmq_backend.lmql.plugin lmq:default --port 8080
    import argparse

    from lmql.models.lmtp.lmtp_serve import serve

    parser = argparse.ArgumentParser(description="Serve an lmq model as an LMQL (LMTP) endpoint")
    parser.add_argument("model", help="lmq:SPEC, e.g. lmq:default or lmq:/path/to/model-dir")
    parser.add_argument("--host", default="localhost")
    parser.add_argument("--port", type=int, default=8080)
    a = parser.parse_args()
    serve(a.model, host=a.host, port=a.port, static=True)
