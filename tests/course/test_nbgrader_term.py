"""An instructor's term through nbgrader's own exchange, and what nbgrader_config.py's plugins change in it.

One temporary folder holds the course (tests/support/tiny_assignment.py's assignment: the course's cell
structure in the standard library only, a kernel runs it in about a second), its
exchange (``c.Exchange.root`` of nbgrader_config.py: exchange/ beside the config, made 1777 as the README
says), the instructor's HOME and one HOME per student. A module-scoped fixture runs, with the files checked
where nbgrader puts them at each step: generate_assignment, release_assignment, fetch_assignment and submit for two students (each in their
own HOME, as their own student id, given the exchange root and course id on the command line), collect,
autograde, generate_feedback, release_feedback, fetch_feedback. The two submissions: ``blank`` (the release,
untouched) and ``wrong``: exercise 1 has the classic ``scale or ...`` bug (a visible test fails) and its test
cell was replaced with ``pass`` (restored by autograde); exercise 2 is right for every struct format the visible
tests try and wrong for the others (only hidden tests fail). Autograde executes the notebook once per student.
The fixture's 11 nbgrader runs took 65 s on a 2-core machine at load 2-2.6 (104 s with notebook 01): most of it
was each command's start (~3.3 s idle, 2 s of it jsonschema importing rfc3987_syntax), not the notebook. Since
run_nbgrader starts nbgrader without rfc3987_syntax (tests/support/nbgrader_course.py), this file takes 36 s of CPU,
60 s before (2026-12-08, both on one loaded 2-core machine).
"""
from __future__ import annotations

import html
import json
import re
import stat
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from nbgrader_course import load, make_course, nbgrader_cells, perfect_submission, run_nbgrader
from tiny_assignment import ASSIGNMENT as A
from tiny_assignment import BYTES_HIDDEN_CHECK, BYTES_VISIBLE_ONLY, EX1, EX2, SCALE_BUG, SCALE_CHECK, SCALE_RIGHT
from tiny_assignment import source_notebook
from traitlets.config.loader import PyFileConfigLoader

HIDDEN = re.compile(r"### BEGIN HIDDEN TESTS\n(.*?)### END HIDDEN TESTS", re.S)
# Shorter hidden lines are too generic to tell a leak from code the release shows anyway.
MIN_HIDDEN_CHARS = 20
# What the visible check says about the scale bug (the check's name and its hint line, as lk.grading writes it).
VISIBLE_MESSAGE = (f"AssertionError: [{SCALE_CHECK}]", "提示（hint）：只有 scale is None 時才用預設的 1/sqrt(d)")
STUDENTS = ("blank", "wrong")
SYSTEM_EXCHANGE = Path("/usr/local/share/nbgrader")   # nbgrader's default exchange root lives under it


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


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def term(tmp_path_factory):
    start, system_exchange_existed = time.monotonic(), SYSTEM_EXCHANGE.exists()
    tmp = tmp_path_factory.mktemp("term")
    course = make_course(tmp, A, source_notebook())
    config = PyFileConfigLoader("nbgrader_config.py", path=str(course)).load_config()
    exchange, course_id = Path(config.Exchange.root), config.CourseDirectory.course_id
    assert exchange == course / "exchange", f"the course's exchange root moved: {exchange}"
    exchange.mkdir(mode=0o755)          # as the README sets one up: world-writable with the sticky bit, as /tmp
    exchange.chmod(0o1777)
    home = {who: tmp / "home" / who for who in ("instructor", *STUDENTS)}
    for path in home.values():
        path.mkdir(parents=True)
    instructor = {"HOME": str(home["instructor"])}
    solution = load(course / "solutions" / A / f"{A}.ipynb")

    run_nbgrader(course, "generate_assignment", A)
    release_path = course / "notebooks" / A / f"{A}.ipynb"
    release = load(release_path)
    released = run_nbgrader(course, "release_assignment", A, env=instructor)
    assert "exchange directory" not in released.stdout + released.stderr, "nbgrader rejected the exchange root"
    outbound = exchange / course_id / "outbound" / A / f"{A}.ipynb"
    assert outbound.read_bytes() == release_path.read_bytes(), "release_assignment did not publish the release"

    wrong = json.loads(json.dumps(perfect_submission(release, solution)))
    ex1 = _cell(wrong, EX1)
    assert SCALE_RIGHT in ex1["source"], f"{A}'s solution of exercise 1 no longer has the line this test breaks"
    ex1["source"] = ex1["source"].replace(SCALE_RIGHT, SCALE_BUG)
    _cell(wrong, f"{EX1}_tests")["source"] = "pass"
    _cell(wrong, EX2)["source"] = BYTES_VISIBLE_ONLY
    student_args = (f"--Exchange.root={exchange}", f"--CourseDirectory.course_id={course_id}")
    for who, nb in zip(STUDENTS, (None, wrong)):
        run_nbgrader(home[who], "fetch_assignment", A, *student_args, force=False, env={"HOME": str(home[who])})
        fetched = home[who] / A / f"{A}.ipynb"
        assert fetched.read_bytes() == release_path.read_bytes(), f"{who} did not fetch the release"
        if nb is not None:
            fetched.write_text(json.dumps(nb), encoding="utf-8")
        # nbgrader takes the student id from the account (all one here): --student gives it, as on a shared login
        run_nbgrader(home[who], "submit", A, *student_args, f"--student={who}", force=False, env={"HOME": str(home[who])})
        inbound = list((exchange / course_id / "inbound").glob(f"{who}+{A}+*/{A}.ipynb"))
        assert len(inbound) == 1 and inbound[0].read_bytes() == fetched.read_bytes(), f"{who}'s submission: {inbound}"

    run_nbgrader(course, "collect", A, force=False, env=instructor)
    for who in STUDENTS:
        collected = course / "submitted" / who / A
        assert (collected / f"{A}.ipynb").read_bytes() == (home[who] / A / f"{A}.ipynb").read_bytes()
        assert (collected / "timestamp.txt").exists(), f"collect left no timestamp for {who}"
    autograde = run_nbgrader(course, "autograde", A, env=instructor)
    run_nbgrader(course, "generate_feedback", A, env=instructor)
    run_nbgrader(course, "release_feedback", A, force=False, env=instructor)
    fetched_feedback = {}
    for who in STUDENTS:
        run_nbgrader(home[who], "fetch_feedback", A, *student_args, force=False, env={"HOME": str(home[who])})
        fetched_feedback[who] = list((home[who] / A / "feedback").glob(f"*/{A}.html"))
    print(f"nbgrader runs took {time.monotonic() - start:.0f} s")
    return SimpleNamespace(course=course, solution=solution, log=autograde.stdout + autograde.stderr,
                           hidden=hidden_lines(solution), exchange=exchange, home=home,
                           fetched_feedback=fetched_feedback, system_exchange_existed=system_exchange_existed)


def _feedback(term, student: str) -> str:
    return page_text(term.course / "feedback" / student / A / f"{A}.html")


@pytest.mark.slow
def test_hidden_lines_are_found_where_they_are(term):
    """The leak check can fail: the autograded notebooks (hidden tests restored) hold every hidden line."""
    assert len(term.hidden) >= 5, f"too few distinctive hidden-test lines to check: {term.hidden}"
    graded = load(term.course / "autograded" / "wrong" / A / f"{A}.ipynb")
    text = "\n".join("".join(c["source"]) for c in graded["cells"])
    assert all(ln in text for ln in term.hidden)


@pytest.mark.slow
@pytest.mark.parametrize("student", STUDENTS)
def test_feedback_shows_no_hidden_test(term, student):
    text = _feedback(term, student)
    assert "HIDDEN TESTS" not in text
    leaked = sorted(ln for ln in term.hidden if ln in text)
    assert not leaked, f"{student}'s feedback shows {len(leaked)} hidden-test lines, e.g. {leaked[0]!r}"


@pytest.mark.slow
def test_feedback_keeps_the_messages_a_student_needs(term):
    text = _feedback(term, "wrong")
    assert all(part in text for part in VISIBLE_MESSAGE), "the visible check's message is missing"
    # exercise 2 fails only hidden tests: the student still learns which case failed and what was expected
    assert f"AssertionError: [{BYTES_HIDDEN_CHECK}]" in text


@pytest.mark.slow
def test_feedback_scores_are_the_gradebook_scores(term):
    from nbgrader.api import Gradebook

    order = [c["metadata"]["nbgrader"]["grade_id"] for c in nbgrader_cells(term.solution, grade=True)]
    with Gradebook(f"sqlite:///{term.course / 'gradebook.db'}") as gb:
        for student in STUDENTS:
            nb = gb.find_submission_notebook(A, A, student)
            grades = {g.name: (g.score, g.max_score) for g in nb.grades}
            text = _feedback(term, student)
            shown = [(float(s), float(m)) for s, m in re.findall(r"Score: (\S+) / (\S+) \(Top\)", text)]
            assert shown == [grades[g] for g in order], f"{student}: feedback {shown}, gradebook {grades}"
            assert f"Score: {nb.score} / {nb.max_score})" in text
    assert grades[f"{EX1}_tests"][0] == grades[f"{EX2}_tests"][0] == 0, "wrong's exercises 1-2 were not graded wrong"


@pytest.mark.slow
def test_autograde_reports_only_the_edited_test_cell(term):
    changed = [ln for ln in term.log.splitlines() if "has changed" in ln]
    assert len(changed) == 1 and f"cell {EX1}_tests has changed" in changed[0], changed
    graded = load(term.course / "autograded" / "blank" / A / f"{A}.ipynb")
    restored = "".join(_cell(graded, f"{EX2}_tests")["source"])
    assert restored == "".join(_cell(term.solution, f"{EX2}_tests")["source"]), "hidden tests not restored"


@pytest.mark.slow
def test_students_fetch_the_feedback_the_instructor_generated(term):
    for who in STUDENTS:
        assert len(term.fetched_feedback[who]) == 1, f"{who} fetched {term.fetched_feedback[who]}"
        generated = term.course / "feedback" / who / A / f"{A}.html"
        assert term.fetched_feedback[who][0].read_bytes() == generated.read_bytes()


@pytest.mark.slow
def test_the_exchange_stays_in_the_course(term):
    assert SYSTEM_EXCHANGE.exists() == term.system_exchange_existed, f"nbgrader touched {SYSTEM_EXCHANGE}"
    # nbgrader accepts a world-writable root with the sticky bit and leaves it so (README, Instructor workflow)
    assert _mode(term.exchange) == 0o1777
