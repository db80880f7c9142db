"""lmq: LMQL-style constrained generation on local Hugging Face models, with a prefix trie of KV caches."""
from .backend.protocol import Backend, Sequence, get_backend, register_backend
from .cache.stats import CacheStats, TemplateStats
from .errors import (
    LMQBackendError, LMQCompileError, LMQConstraintConflictError, LMQError, LMQInputError, LMQLengthError,
    LMQNotSupportedError, LMQRuntimeError, LMQSyntaxError, LMQUnknownConstraintError, LMQUnknownVariableError,
)
from .runtime.interpreter import Result
from .runtime.query import Query, compile, query


def __getattr__(name: str):
    if name == "HFBackend":  # imports torch and transformers: only when asked for
        from .backend.hf import HFBackend

        return HFBackend
    raise AttributeError(f"module 'lmq_backend' has no attribute {name!r}")


__all__ = [
    "Backend", "CacheStats", "HFBackend", "LMQBackendError", "LMQCompileError", "LMQConstraintConflictError",
    "LMQError", "LMQInputError", "LMQLengthError", "LMQNotSupportedError", "LMQRuntimeError", "LMQSyntaxError",
    "LMQUnknownConstraintError", "LMQUnknownVariableError", "Query", "Result", "Sequence", "TemplateStats",
    "compile", "get_backend", "query", "register_backend",
]
