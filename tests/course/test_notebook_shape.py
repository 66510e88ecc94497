"""What a student reads stays about the idea: test machinery lives in labkit.checks, prose comes one idea per cell.

In each released notebook (notebooks/): the visible test cells hold at most a quarter of the code lines, no visible
test cell is longer than 60 lines (it calls named checks; the machinery is in ``labkit/checks/``), and no prose cell
is longer than 1,500 characters (a longer one splits at its own subheadings).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RELEASES = sorted(ROOT.glob("notebooks/*/*.ipynb"))
MAX_TEST_SHARE = 0.25
MAX_TEST_CELL_LINES = 60
MAX_PROSE_CHARS = 1500


def shape(notebook: Path) -> dict:
    """Code lines, visible-test lines per test cell (grade_id -> lines) and prose cell lengths of a released notebook."""
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    lines = lambda cell: len("".join(cell["source"]).splitlines())  # noqa: E731
    graded = lambda cell: cell["metadata"].get("nbgrader", {})  # noqa: E731
    return {"code": sum(lines(c) for c in cells if c["cell_type"] == "code"),
            "tests": {graded(c)["grade_id"]: lines(c) for c in cells if c["cell_type"] == "code"
                      and graded(c).get("grade") and not graded(c).get("solution")},
            "prose": [("".join(c["source"])[:40], len("".join(c["source"]))) for c in cells if c["cell_type"] == "markdown"
                      and not graded(c).get("solution")]}


def test_there_are_releases():
    assert len(RELEASES) >= 9


@pytest.mark.parametrize("notebook", RELEASES, ids=[p.parent.name for p in RELEASES])
def test_visible_tests_are_a_few_named_calls(notebook):
    found = shape(notebook)
    long_cells = {gid: n for gid, n in found["tests"].items() if n > MAX_TEST_CELL_LINES}
    assert not long_cells, f"visible test cells over {MAX_TEST_CELL_LINES} lines: {long_cells}; move the machinery to labkit/checks/"
    share = sum(found["tests"].values()) / found["code"]
    assert share <= MAX_TEST_SHARE, f"visible tests are {share:.0%} of the code a student sees (at most {MAX_TEST_SHARE:.0%})"


@pytest.mark.parametrize("notebook", RELEASES, ids=[p.parent.name for p in RELEASES])
def test_prose_comes_one_idea_per_cell(notebook):
    long_cells = [(start, n) for start, n in shape(notebook)["prose"] if n > MAX_PROSE_CHARS]
    assert not long_cells, f"prose cells over {MAX_PROSE_CHARS} characters (split at their subheadings): {long_cells}"


def test_the_shape_reader_counts_what_a_student_sees(tmp_path):
    test_cell = {"cell_type": "code", "source": ["lk.checks.nb01.x(f)\n", "lk.checks.nb01.y(f)"],
                 "metadata": {"nbgrader": {"grade": True, "solution": False, "grade_id": "ex1_tests"}}}
    answer = {"cell_type": "code", "source": ["def f():\n", "    raise NotImplementedError"],
              "metadata": {"nbgrader": {"grade": False, "solution": True, "grade_id": "ex1"}}}
    prose = {"cell_type": "markdown", "source": ["## 1.\n", "x" * 1600], "metadata": {}}
    (tmp_path / "nb.ipynb").write_text(json.dumps({"cells": [answer, test_cell, prose]}))
    found = shape(tmp_path / "nb.ipynb")
    assert found["code"] == 4 and found["tests"] == {"ex1_tests": 2} and found["prose"][0][1] == 1606
