"""`lmql.model("local:lmq:SPEC")` with lmq installed and nothing else: the hook that makes LMQL find lmq.

LMQL 0.7.3 has no plugin discovery: no entry points, and `import lmql` imports neither torch nor
transformers (whose own hooks could run code). Its model classes live in `LMTPModel.registry`, filled by
imports; a tokenizer is found only through tiktoken, Hugging Face names/folders or its slow GPT-2
tokenizer, none of which knows "lmq:default". So the wheel ships one line, `lmq-lmql.pth`, which
`site` runs at start-up: `install()` below adds an import hook (stdlib only; `import lmq_backend` loads
nothing else) that acts only when LMQL's own modules are imported:

  - `lmql.runtime.tokenizer`: a tokenizer name "lmq:SPEC" (LMQL's default: the model name) loads the
    tokenizer folder of SPEC (`plugin.tokenizer_dir`), with the `tokenizers` library alone where that
    gives transformers' answers (`tokenizer.py`);
  - `lmql.models.lmtp.backends.lmtp_model`: `LMTPModel.registry["lmq"] = plugin.LMQModel`;
  - `lmql.models.lmtp.lmtp_dcmodel`: `local:lmq:SPEC` models in LMQL's subprocess mode run in lmq's model
    process for SPEC (`process.py`: one per SPEC, failures raised to the caller);
  - `lmql.models.lmtp.backends.transformers_model` (LMQL's own transformers backend, which imports torch)
    loads on first use instead of with every LMQL model (`_Deferred`);
  - `lmql.ops.token_set`: a token set compared with "∅" or "*" (LMQL's constraint code does it hundreds of
    times a call, and once more for each side of every comparison of two sets) asks its boolean mask
    whether any or all of it is set, instead of summing all of the vocabulary's entries (`mask.sum()`: ~15
    us a comparison against ~1: ~40% of LMQL's client time a W1 call): the same answers
    (`_patch_token_sets`);
  - `lmql.language.qstrings`: LMQL's prompt parser moves over plain text one character at a time, each step
    copying the rest of the prompt (`self.s = self.s[n:]`: quadratic, ~3 ms for a 4,600-character few-shot
    prompt); a run of plain text now goes in one step, to the next "[" (or "{" where the parser reads
    f-expressions): the same statements (`_patch_qstrings`).

LMQ_LMQL_HOOK=0 turns the .pth file's hook off; `import lmq_backend.lmql.plugin` installs it anyway.
"""
from __future__ import annotations

import os
import sys

PREFIX = "lmq:"


def _wrap(owner, name: str, make) -> None:
    """Replace `owner.name` with `make(it)` (a function that may call LMQL's own, kept on it as `lmqls_own`),
    once: a replacement already there is left."""
    own = getattr(owner, name)
    if getattr(own, "_lmq", False):
        return
    replacement = make(own)
    replacement._lmq, replacement.lmqls_own = True, own
    setattr(owner, name, replacement)


def _patch_tokenizer(module) -> None:
    _wrap(module, "_load_tokenizer", lambda load: _tokenizer_loader(module, load))


def _tokenizer_loader(module, load):
    def _load_tokenizer(model_identifier, type, **kwargs):
        if isinstance(model_identifier, str) and model_identifier.startswith(PREFIX):
            from .plugin import tokenizer_dir
            from .tokenizer import for_folder

            model_identifier = tokenizer_dir(model_identifier[len(PREFIX):])
            impl = for_folder(model_identifier, **kwargs) if type in ("auto", "hf") else None
            if impl is not None:  # without transformers (and torch) in LMQL's process
                return module.LMQLTokenizer(model_identifier, tokenizer_impl=impl)
        return load(model_identifier, type, **kwargs)
    return _load_tokenizer


def _patch_registry(module) -> None:
    try:
        from .plugin import LMQModel  # (imports nothing heavy)
    except ImportError:  # the plugin is importing LMQL itself: its own install() registers it when done
        return
    module.LMTPModel.registry["lmq"] = LMQModel


def _patch_processes(module) -> None:
    _wrap(module.lmtp_model, "inprocess_client_constructor_factory", _client_factory)


def _client_factory(factory):
    def inprocess_client_constructor_factory(self, identifier, **kwargs):
        if identifier.startswith(PREFIX) and not self.async_transport:
            from .process import handle_or_none

            handle = handle_or_none(identifier, kwargs)
            if handle is not None:
                return handle
        return factory(self, identifier, **kwargs)
    return inprocess_client_constructor_factory


def _patch_token_sets(module) -> None:
    _wrap(module.TokenSetConcrete, "__eq__", _token_set_eq)


def _token_set_eq(eq):
    def __eq__(self, other):
        mask = self.mask
        if type(other) is str and getattr(mask, "dtype", None) == bool and mask.ndim == 1:
            if other == "∅":  # (LMQL: mask.sum() == 0)
                return not mask.any()
            if other == "*":  # (LMQL: mask.sum() == mask.shape[0])
                return bool(mask.all())
        return eq(self, other)
    return __eq__


def _patch_qstrings(module) -> None:
    _wrap(module.QstringParser, "skip", _qstring_skip)


def _qstring_skip(skip):
    def fast_skip(self, n, swallow=False):
        # LMQL's parse() skips one plain character of text at a time (in its "string" state, the only
        # skip(1) that keeps what it skips there); the characters up to the next one that parse() treats
        # otherwise ("[", and "{" in mode "all") would each be skipped the same way
        if n == 1 and not swallow and self.state == "string":
            text = self.s
            end = text.find("[", 1)
            if self.mode == "all":
                brace = text.find("{", 1)
                if brace != -1 and (end == -1 or brace < end):
                    end = brace
            n = len(text) if end == -1 else end
        return skip(self, n, swallow)
    return fast_skip


PATCHES = {
    "lmql.runtime.tokenizer": _patch_tokenizer,
    "lmql.models.lmtp.backends.lmtp_model": _patch_registry,
    "lmql.models.lmtp.lmtp_dcmodel": _patch_processes,
    "lmql.ops.token_set": _patch_token_sets,
    "lmql.language.qstrings": _patch_qstrings,
}
TRANSFORMERS_BACKEND = "lmql.models.lmtp.backends.transformers_model"  # deferred: see _Deferred


class _Loader:
    """Runs the module's own loader, then patches the module (plain classes: importing `importlib.abc` is not
    free at start-up)."""

    def __init__(self, inner, patch):
        self.inner, self.patch = inner, patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.patch(module)


class _Deferred:
    """Loads LMQL's transformers backend on first use, not when any LMQL model is made: LMQL's
    `lmql.models.lmtp.backends` imports it eagerly, and it imports torch (seconds of CPU in LMQL's process,
    where `local:lmq:` models need neither). The module's attributes and `LMTPModel.registry["transformers"]`
    load it then; it registers itself as it would have at import."""

    def __init__(self, spec):
        import threading

        self.spec, self.real, self.lock = spec, None, threading.Lock()

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        from lmql.models.lmtp.backends.lmtp_model import LMTPModel

        module.__file__ = self.spec.origin
        module.__getattr__ = self._attribute
        LMTPModel.registry["transformers"] = lambda *args, **kwargs: self.load().TransformersLLM(*args, **kwargs)

    def _attribute(self, name: str):
        if name.startswith("__"):  # (`inspect` asks every module in sys.modules for some)
            raise AttributeError(name)
        return getattr(self.load(), name)

    def load(self):
        with self.lock:
            if self.real is None:
                import importlib.util

                real = importlib.util.module_from_spec(self.spec)
                sys.modules[self.spec.name] = real
                self.spec.loader.exec_module(real)
                self.real = real
            return self.real


class _Finder:
    def find_spec(self, fullname, path, target=None):
        patch = PATCHES.get(fullname)
        if patch is None and (fullname != TRANSFORMERS_BACKEND or "torch" in sys.modules):
            return None
        for finder in sys.meta_path:  # the spec the other finders give, with its loader wrapped
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    if patch is None:
                        import importlib.machinery

                        return importlib.machinery.ModuleSpec(fullname, _Deferred(spec), origin=spec.origin)
                    spec.loader = _Loader(spec.loader, patch)
                return spec
        return None


def install(at_startup: bool = False) -> None:
    """Patch LMQL's modules already imported and hook those imported later (idempotent). `at_startup`:
    called by the .pth file, which LMQ_LMQL_HOOK=0 turns off."""
    if at_startup and os.environ.get("LMQ_LMQL_HOOK", "1") == "0":
        return
    for name, patch in PATCHES.items():
        module = sys.modules.get(name)
        if module is not None and not getattr(module.__spec__, "_initializing", False):
            patch(module)  # (one still importing is patched by its wrapped loader when done)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
