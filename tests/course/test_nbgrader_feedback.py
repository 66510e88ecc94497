"""Feedback keeps the hidden tests hidden; autograde reports only real edits (nbgrader_config.py's plugins).

One temporary course directory holds assignment 01 (the cheapest to execute on the cpu profile) and two
submissions: ``blank`` (the release, untouched) and ``wrong``: exercise 1 has the classic ``scale or ...``
bug (a visible test fails) and its test cell was replaced with ``pass`` (restored by autograde); exercise
2 is right for every dtype the visible tests try and wrong for the others (only hidden tests fail). A
module-scoped fixture runs generate_assignment, autograde and generate_feedback once (~100 s of nbgrader
runs on a busy 2-core machine, ~35 s of them per executed notebook).
"""
from __future__ import annotations

import html
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from nbgrader_course import load, make_course, nbgrader_cells, perfect_submission, run_nbgrader, submit

A = "01_setup_and_comparison"
EX1, EX2 = "ex1_standard_attention", "ex2_score_matrix_bytes"
HIDDEN = re.compile(r"### BEGIN HIDDEN TESTS\n(.*?)### END HIDDEN TESTS", re.S)
# Shorter hidden lines are too generic to tell a leak from code the release shows anyway.
MIN_HIDDEN_CHARS = 20
HIDDEN_ONLY = """def score_matrix_bytes(batch, heads, seq_len, dtype):
    sizes = {torch.float32: 4, torch.bfloat16: 2, torch.float64: 8, torch.float16: 2, torch.int8: 1, torch.bool: 1,
             torch.complex64: 8}
    return int(batch) * int(heads) * int(seq_len) ** 2 * sizes.get(dtype, 4)"""
SCALE_RIGHT, SCALE_BUG = "scale = q.shape[-1] ** -0.5 if scale is None else scale", "scale = scale or q.shape[-1] ** -0.5"
# What the visible check says about that bug (labkit/checks/nb01_standard.py), and the hidden case exercise 2 fails.
VISIBLE_MESSAGE = ("standard_attention: scale=0.0 is used (o = mean of v)", "只有 scale is None 時才用預設的 1/sqrt(d)")
HIDDEN_FAILURE = "score_matrix_bytes(2, 3, 100, torch.int16)"
STUDENTS = ("blank", "wrong")


def _cell(nb: dict, grade_id: str) -> dict:
    return next(c for c in nb["cells"] if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") == grade_id)


def page_text(path: Path) -> str:
    """The text a reader sees in an HTML page: tags (syntax highlighting splits code into spans) and entities undone."""
    return html.unescape(re.sub(r"<[^>]+>", "", path.read_text(encoding="utf-8")))


def hidden_lines(solution: dict) -> set[str]:
    """Lines of the solution's hidden-test regions, long enough to tell apart and shown nowhere else in it."""
    sources = ["".join(c["source"]) for c in solution["cells"]]
    lines = {ln.strip() for src in sources for block in HIDDEN.findall(src) for ln in block.splitlines()}
    elsewhere = "\n".join(HIDDEN.sub("", src) for src in sources)
    return {ln for ln in lines if len(ln) >= MIN_HIDDEN_CHARS and ln not in elsewhere}


@pytest.fixture(scope="module")
def fed_back(tmp_path_factory):
    course = make_course(tmp_path_factory.mktemp("feedback"), A)
    solution = load(course / "solutions" / A / f"{A}.ipynb")
    run_nbgrader(course, "generate_assignment", A)
    release = load(course / "notebooks" / A / f"{A}.ipynb")
    perfect = perfect_submission(release, solution)
    wrong = json.loads(json.dumps(perfect))
    ex1 = _cell(wrong, EX1)
    assert SCALE_RIGHT in ex1["source"], f"{A}'s solution of exercise 1 no longer has the line this test breaks"
    ex1["source"] = ex1["source"].replace(SCALE_RIGHT, SCALE_BUG)
    _cell(wrong, f"{EX1}_tests")["source"] = "pass"
    _cell(wrong, EX2)["source"] = HIDDEN_ONLY
    submit(course, "blank", A, release)
    submit(course, "wrong", A, wrong)
    autograde = run_nbgrader(course, "autograde", A)
    run_nbgrader(course, "generate_feedback", A)
    return SimpleNamespace(course=course, solution=solution, log=autograde.stdout + autograde.stderr,
                           hidden=hidden_lines(solution))


def _feedback(fed_back, student: str) -> str:
    return page_text(fed_back.course / "feedback" / student / A / f"{A}.html")


@pytest.mark.slow
def test_hidden_lines_are_found_where_they_are(fed_back):
    """The leak check can fail: the autograded notebooks (hidden tests restored) hold every hidden line."""
    assert len(fed_back.hidden) >= 5, f"too few distinctive hidden-test lines to check: {fed_back.hidden}"
    graded = load(fed_back.course / "autograded" / "wrong" / A / f"{A}.ipynb")
    text = "\n".join("".join(c["source"]) for c in graded["cells"])
    assert all(ln in text for ln in fed_back.hidden)


@pytest.mark.slow
@pytest.mark.parametrize("student", STUDENTS)
def test_feedback_shows_no_hidden_test(fed_back, student):
    text = _feedback(fed_back, student)
    assert "HIDDEN TESTS" not in text
    leaked = sorted(ln for ln in fed_back.hidden if ln in text)
    assert not leaked, f"{student}'s feedback shows {len(leaked)} hidden-test lines, e.g. {leaked[0]!r}"


@pytest.mark.slow
def test_feedback_keeps_the_messages_a_student_needs(fed_back):
    text = _feedback(fed_back, "wrong")
    assert all(part in text for part in VISIBLE_MESSAGE), "the visible check's message is missing"
    # exercise 2 fails only hidden tests: the student still learns which case failed and what was expected
    assert f"AssertionError: [{HIDDEN_FAILURE}]" in text


@pytest.mark.slow
def test_feedback_scores_are_the_gradebook_scores(fed_back):
    from nbgrader.api import Gradebook

    order = [c["metadata"]["nbgrader"]["grade_id"] for c in nbgrader_cells(fed_back.solution, grade=True)]
    with Gradebook(f"sqlite:///{fed_back.course / 'gradebook.db'}") as gb:
        for student in STUDENTS:
            nb = gb.find_submission_notebook(A, A, student)
            grades = {g.name: (g.score, g.max_score) for g in nb.grades}
            text = _feedback(fed_back, student)
            shown = [(float(s), float(m)) for s, m in re.findall(r"Score: (\S+) / (\S+) \(Top\)", text)]
            assert shown == [grades[g] for g in order], f"{student}: feedback {shown}, gradebook {grades}"
            assert f"Score: {nb.score} / {nb.max_score})" in text
    assert grades[f"{EX1}_tests"][0] == grades[f"{EX2}_tests"][0] == 0, "wrong's exercises 1-2 were not graded wrong"


@pytest.mark.slow
def test_autograde_reports_only_the_edited_test_cell(fed_back):
    changed = [ln for ln in fed_back.log.splitlines() if "has changed" in ln]
    assert len(changed) == 1 and f"cell {EX1}_tests has changed" in changed[0], changed
    graded = load(fed_back.course / "autograded" / "blank" / A / f"{A}.ipynb")
    restored = "".join(_cell(graded, f"{EX2}_tests")["source"])
    assert restored == "".join(_cell(fed_back.solution, f"{EX2}_tests")["source"]), "hidden tests not restored"
