"""lmq: LMQL-style constrained generation on local Hugging Face models, with a prefix trie of KV caches.

Names are imported on first use (PEP 562): `import lmq_backend` loads no torch, transformers or lark, so
that it stays cheap for the CLI, the LMQL plugin and the `lmq-lmql.pth` hook (`hook.py`).
"""
from __future__ import annotations

from importlib import import_module

_WHERE = {
    "lmq_backend.backend.protocol": ("Backend", "Sequence"),
    "lmq_backend.backend.registry": ("register_backend",),
    "lmq_backend.backend.hf": ("HFBackend",),
    "lmq_backend.cache.stats": ("CacheStats", "TemplateStats"),
    "lmq_backend.errors": (
        "LMQBackendError", "LMQCompileError", "LMQConstraintConflictError", "LMQError", "LMQInputError",
        "LMQLengthError", "LMQNotSupportedError", "LMQRuntimeError", "LMQSyntaxError",
        "LMQUnknownConstraintError", "LMQUnknownVariableError", "LMQUnsatisfiedError",
    ),
    "lmq_backend.runtime.interpreter": ("Result",),
    "lmq_backend.runtime.query": ("Query", "compile", "query"),
    "lmq_backend.runtime.ready": ("get_backend",),
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'lmq_backend' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
