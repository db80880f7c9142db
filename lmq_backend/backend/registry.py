"""The registry of named backends: what `from "name"` in a query finds.

A name maps to a backend, or to a factory called on first use (lazy loading). "default" (the embedded
model) and "hf:<dir>" (a local model folder) build an `HFBackend` when first asked for.
"""
from __future__ import annotations

from typing import Callable

from ..errors import LMQBackendError
from .protocol import Backend

_REGISTRY: dict[str, Backend] = {}
_FACTORIES: dict[str, Callable[[], Backend]] = {}


def register_backend(name: str, backend: Backend | Callable[[], Backend]) -> None:
    """Make `backend` available as `from "name"`; a callable is called on first use (lazy loading)."""
    if isinstance(backend, Backend):
        _REGISTRY[name] = backend
    elif callable(backend):
        _FACTORIES[name] = backend
        _REGISTRY.pop(name, None)
    else:
        raise TypeError(f"register_backend expects a Backend or a factory, got {type(backend).__name__}")


def get_backend(name: str = "default") -> Backend:
    """The backend behind a name: a registered name, "default" (the embedded model) or "hf:<dir>"."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in _FACTORIES:
        _REGISTRY[name] = _FACTORIES.pop(name)()
        return _REGISTRY[name]
    if name == "default" or name.startswith("hf:"):
        from .hf import HFBackend

        _REGISTRY[name] = HFBackend("default" if name == "default" else name[3:])
        return _REGISTRY[name]
    known = ", ".join(sorted({"default", *_REGISTRY, *_FACTORIES})) or "none"
    raise LMQBackendError(f"unknown model {name!r}: registered backends are {known}; use 'hf:<dir>' for a local model folder")
