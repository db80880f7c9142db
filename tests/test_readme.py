"""The README's query examples are checked against the grammar, so the syntax reference cannot drift."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmq_backend.language import check_query, parse_query

README = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```lmq\n(.*?)```", README, flags=re.S)


def test_the_readme_has_query_blocks():
    assert len(BLOCKS) >= 1


@pytest.mark.parametrize("block", BLOCKS)
def test_every_lmq_block_of_the_readme_parses(block):
    check_query(parse_query(block))


# ----- the README's Python blocks, executed --------------------------------------------------------------

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from support.readme_blocks import python_blocks  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PYTHON = python_blocks(README)
LMQL_BLOCKS = [i for i, b in enumerate(PYTHON) if re.search(r"^import lmql$", b, flags=re.M)]
LMQ_BLOCKS = [i for i in range(len(PYTHON)) if i not in LMQL_BLOCKS]
# what a block leaves to the reader: the profiling block maps `classify` over `inputs`
PRELUDE = {"inputs": [json.loads(line) for line in (ROOT / "examples" / "reviews.jsonl").read_text().splitlines()]}
OPTIONS = (" positive", " negative", " neutral")


def run_blocks(indices: list[int]) -> tuple[list[str], str]:
    """Run README Python blocks in order in one fresh interpreter (one namespace, as __main__): what each
    printed, and the stderr of the whole run."""
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "support" / "readme_blocks.py"), str(ROOT / "README.md"),
                           *map(str, indices), "--prelude", json.dumps(PRELUDE)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


def test_every_python_block_is_run_here():
    assert "path/to/model-dir" not in "".join(PYTHON)  # a placeholder folder would need a real one here
    assert len(PYTHON) == 4 and len(LMQL_BLOCKS) == 1  # a new block: give it checks below


@pytest.fixture(scope="module")
def lmq_blocks():
    return run_blocks(LMQ_BLOCKS)


@pytest.mark.slow
def test_the_first_query_block(lmq_blocks):
    [first, *_], _ = lmq_blocks
    m = re.fullmatch(r"( \w+) (Review: Great food, friendly staff\.\nSentiment:( \w+))\n(.*)\n", first)
    assert m, first
    cls, prompt, in_prompt, answer = m.groups()
    assert cls == in_prompt == " positive" and prompt.endswith(cls)
    assert "Paris" in answer and answer == answer.strip()  # STOPS_AT "\n", then .strip()


@pytest.mark.slow
def test_the_language_tour_block(lmq_blocks):
    """Roles, typed holes, a nested query, a tool awaited, a while loop and streaming, on the default model."""
    [_, tour, _], _ = lmq_blocks
    typed, streamed = tour.split("\n", 1)
    *kinds, line = typed.split(" ", 2)
    assert kinds == ["int", "bool"] and line == line.strip() and line
    assert streamed.endswith("|") and streamed.replace("|", "").strip().isdigit()  # DAYS, token by token


@pytest.mark.slow
def test_the_profiling_block(lmq_blocks):
    [_, _, profiling], stderr = lmq_blocks
    head, *table, last = profiling.strip().splitlines()
    hit_rate, p95 = map(float, head.split())
    stats = json.loads(last)
    calls = len(PRELUDE["inputs"])
    assert stats["calls"] == calls and stats["token_hit_rate"] == hit_rate > 0
    # `classify` is named by its first line after the decoder's
    assert stats["per_template"]['"Review: {review}\\nSentiment:[CLS]"']["p95_seconds"] == p95 > 0
    assert stats["tokens_requested"] == stats["tokens_reused"] + stats["tokens_prefilled"]
    total = next(line for line in table if line.startswith("total")).split()
    assert int(total[1]) == calls and total[5] == f"{100 * hit_rate:.1f}%"
    # log_steps: a line per forward on stderr, which add up to the counters
    steps = re.findall(r"^\[lmq\] (prefill|decode) batch=(\d+) #new-token=(\d+) #cached-token=(\d+) [\d.]+ ms$",
                       stderr, flags=re.M)
    prefills = [(int(n), int(c)) for kind, _, n, c in steps if kind == "prefill"]
    assert sum(n for n, _ in prefills) == stats["tokens_prefilled"]
    assert sum(c for _, c in prefills) == stats["tokens_reused"]
    assert sum(int(n) for kind, _, n, _ in steps if kind == "decode") == stats["tokens_decoded"]


@pytest.mark.slow
def test_the_lmql_block_answers_as_lmq_does(lmq_blocks, tmp_path):
    """The LMQL block, saved as a script and run (LMQL reads a query function's source from its file; its
    default `local:` mode runs the model in a subprocess), classifies the first block's review with the same
    prompt and options: it prints the same answer."""
    import lmql  # noqa: F401  (the `lmql` extra: the README's install has it)
    [first, *_], _ = lmq_blocks
    [index] = LMQL_BLOCKS
    script = tmp_path / "readme_lmql.py"
    script.write_text(PYTHON[index])
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout == first.split(" Review:")[0] + "\n"
