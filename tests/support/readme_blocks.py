"""Runs Python blocks of README.md as a user would, in one namespace, and prints what each printed as JSON.

    python tests/support/readme_blocks.py README.md 0 1 [--prelude JSON]

A block may `await` at top level (as in `python -m asyncio` or a notebook), and its source is where `inspect`
finds it, as a notebook's cell's is. The namespace is __main__'s,
so a block's `if __name__ == "__main__":` runs. The prelude defines names a block leaves to the reader.
"""
from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import io
import json
import linecache
import re
import sys


def python_blocks(readme: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", readme, flags=re.S)


def main(argv: list[str]) -> None:
    path, *rest = argv
    prelude = {}
    if "--prelude" in rest:
        i = rest.index("--prelude")
        prelude = json.loads(rest[i + 1])
        del rest[i:i + 2]
    blocks = python_blocks(open(path, encoding="utf-8").read())
    namespace = {"__name__": "__main__", "__builtins__": __builtins__, **prelude}
    outputs = []
    for index in map(int, rest):
        name = f"<README python block {index}>"
        # the block's source where `inspect` looks for it (a notebook keeps each cell's so; `@lmq.query` reads
        # a docstring as written there)
        linecache.cache[name] = (len(blocks[index]), None, blocks[index].splitlines(True), name)
        code = compile(blocks[index], name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            if code.co_flags & inspect.CO_COROUTINE:
                asyncio.run(eval(code, namespace))
            else:
                exec(code, namespace)
        outputs.append(out.getvalue())
    print(json.dumps(outputs))


if __name__ == "__main__":
    main(sys.argv[1:])
