"""docs/language.md, the language tour: its query blocks parse and check, and its Python blocks run in order in
one fresh interpreter on the default model, printing what the tour says they print."""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lmq_backend.language import check_query, parse_query
from support.readme_blocks import python_blocks

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "language.md"
TEXT = DOC.read_text(encoding="utf-8")
QUERIES = re.findall(r"```lmq\n(.*?)```", TEXT, flags=re.S)
PYTHON = python_blocks(TEXT)


@pytest.mark.parametrize("block", QUERIES)
def test_every_query_block_parses(block):
    check_query(parse_query(block))


def test_every_python_query_parses():
    sources = [s for block in PYTHON for s in re.findall(r"r'''\n(.*?)'''", block, flags=re.S)]
    assert len(sources) >= 8
    for source in sources:
        check_query(parse_query(source))


@pytest.fixture(scope="module")
def printed():
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "readme_blocks.py"), str(DOC),
                           *map(str, range(len(PYTHON)))], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
def test_the_tour_runs(printed):
    basics, chat, typed, nested, agent, stream, beams, knobs, triage = printed
    assert "Paris" in basics.splitlines()[0] and "the moon" in basics
    assert chat.startswith("<|im_start|>system\nYou are a helpful assistant.") and chat.count("<|im_start|>") == 5
    legs, in_france, country = typed.split()
    assert int(legs) == 9 and in_france == "True" and country == "France"
    capital, *prompt = nested.splitlines()
    assert "Paris" in capital and "Answer in a few words" not in "\n".join(prompt)
    city, fact, n = ast.literal_eval(agent.strip())
    assert city in ("Paris", "Rome", "Berlin") and isinstance(n, int)
    answer, _, final = stream.partition("\n--- ")
    assert answer == final.strip() and "Paris" in answer
    scores = [float(line.split(" ", 1)[0]) for line in beams.strip().splitlines()]
    assert len(scores) == 2 and scores == sorted(scores, reverse=True)
    plain, penalised, sampled = map(ast.literal_eval, knobs.splitlines())
    assert plain.count("apple") >= 3 and "apple" not in penalised and isinstance(sampled, str)
    distribution, cls = triage.rsplit(" ", 1)
    assert cls.strip() in ("positive", "negative")
