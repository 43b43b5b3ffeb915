"""Each chapter's prose stays within the learner's budget (DESIGN.md §3b): at most 3,000
words in its markdown cells, counted as `tools/chapters.py` counts them for the reading
times on the landing page. What does not fit moves to an appendix (``appendix_*.ipynb``),
which the main line links and which is run and compared like a chapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chapters import chapter_paths, read_chapter  # tools/chapters.py (pytest's pythonpath)

ROOT = Path(__file__).resolve().parents[2]

MAX_WORDS = 3_000


@pytest.mark.parametrize("path", chapter_paths(ROOT / "notebooks"), ids=lambda p: p.stem)
def test_each_chapter_has_at_most_3000_words_of_prose(path):
    words = read_chapter(path).words
    assert words <= MAX_WORDS, (
        f"{path.name} has {words:,} words of prose, over the budget of {MAX_WORDS:,}: "
        "tighten it, or move a digression into an appendix notebook and link it")


def test_the_count_is_of_markdown_only(tmp_path):
    cells = [{"cell_type": "markdown", "metadata": {}, "source": "# 99 · Words\n\none two"},
             {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
              "source": "print('not prose at all, however long')"}]
    notebook = {"cells": cells, "metadata": {"workbook": {"summary": "s"}},
                "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "99_words.ipynb"
    path.write_text(json.dumps(notebook))
    assert read_chapter(path).words == 6  # "# 99 · Words one two"
