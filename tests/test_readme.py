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
