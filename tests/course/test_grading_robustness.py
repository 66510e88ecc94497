"""What autograding does with submissions that go wrong, through real nbgrader runs.

One temporary course directory holds one assignment (tests/support/tiny_assignment.py: the course's cell
structure in the standard library only, a kernel runs it in about a second; the real notebooks' round trip is
test_notebooks.py's) and one submission per student; a module-scoped fixture runs
generate_assignment, sets the due date, autogrades everyone in one run, regrades the renamed
notebook once renamed, then runs generate_feedback and export (108 s on a 2-core machine at load 2-2.6, 10 s of
it the infinite loop's timeout; 250 s with notebook 01; the whole file 59 s of CPU since nbgrader starts without
rfc3987_syntax, tests/support/nbgrader_course.py). Observed with nbgrader 0.9.6:

- tampered: a test cell whose source the student replaced (``pass``, a forged "all tests passed")
  is restored from the gradebook, hidden tests included, and graded: the wrong answers score 0;
- infinite loop: the cell is interrupted at ``Execute.timeout`` (CellTimeoutError), its test scores
  0 and every later cell still runs and grades;
- deleted cells: a deleted test cell is *not* put back (``OverwriteCells.add_missing_cells`` is
  False, see nbgrader_config.py): its grade stays empty, counts 0 and is marked as needing manual
  grading; a deleted answer cell makes its test fail (NameError), so it scores 0;
- renamed notebook: ``NN_slug (1).ipynb`` is skipped ("Skipping unknown notebook"), that student's
  autograde fails (nbgrader exits 1 after grading everyone else) and the student exports with 0;
  renaming the file to ``NN_slug.ipynb`` and rerunning autograde for that student grades it;
- late: timestamp.txt after the due date is logged as N seconds late and exported with its
  timestamp; the penalty follows ``LateSubmissionPlugin.penalty_method`` in nbgrader_config.py;
- an answer cell that raises is covered by test_notebooks.py::test_autograde_round_trip.
"""
from __future__ import annotations

import csv
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from nbgrader_course import ROOT, load, make_course, nbgrader_cells, perfect_submission, run_nbgrader, submit
from tiny_assignment import ASSIGNMENT as A
from tiny_assignment import EX1, EX2, EX3, EXERCISES, source_notebook
from traitlets.config.loader import PyFileConfigLoader

# The tiny assignment's cells take milliseconds: 10 s leaves a wide margin on a busy 2-core machine.
TIMEOUT_S = 10
DUE = "2025-03-01 23:59:00 Asia/Taipei"       # 15:59:00 UTC
ON_TIME = "2025-03-01 15:00:00.000000 UTC"    # nbgrader collect's timestamp.txt format
LATE = "2025-03-02 10:00:00.000000 UTC"       # 18 h 01 min after the due date
LATE_S = 18 * 3600 + 60
STUDENTS = ("perfect", "tampered", "looping", "deleted", "renamed", "late")
POLICY = PyFileConfigLoader("nbgrader_config.py", path=str(ROOT)).load_config().LateSubmissionPlugin.penalty_method


def _cell(nb: dict, grade_id: str) -> dict:
    return next(c for c in nb["cells"] if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") == grade_id)


def _without(nb: dict, *grade_ids: str) -> dict:
    keep = [c for c in nb["cells"] if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") not in grade_ids]
    return dict(nb, cells=keep)


def _grades(course: Path, student: str) -> dict[str, SimpleNamespace]:
    """grade_id -> auto_score, score, needs_manual_grade of one student's autograded test cells."""
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        nb = gb.find_submission_notebook(A, A, student)
        return {g.name: SimpleNamespace(auto_score=g.auto_score, score=g.score, needs_manual=g.needs_manual_grade)
                for g in nb.grades if g.cell.cell_type == "code"}


def _export(course: Path, name: str) -> dict[str, dict]:
    run_nbgrader(course, "export", f"--to={name}", force=False)
    with open(course / name, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    students = [r["student_id"] for r in rows]
    assert len(students) == len(set(students)), f"{name}: more than one row for a student: {students}"
    return {r["student_id"]: r for r in rows}


def _outputs(course: Path, student: str, grade_id: str) -> list[dict]:
    return _cell(load(course / "autograded" / student / A / f"{A}.ipynb"), grade_id).get("outputs", [])


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    start = time.monotonic()
    course = make_course(tmp_path_factory.mktemp("robustness"), A, source_notebook())
    solution = load(course / "solutions" / A / f"{A}.ipynb")
    points = {c["metadata"]["nbgrader"]["grade_id"]: c["metadata"]["nbgrader"]["points"]
              for c in nbgrader_cells(solution, grade=True)}
    missing = [f"{ex}_tests" for ex in EXERCISES if f"{ex}_tests" not in points]
    assert not missing, f"{A} no longer has the graded cells this test edits: {missing}"

    run_nbgrader(course, "generate_assignment", A)
    run_nbgrader(course, "db", "assignment", "add", A, f"--duedate={DUE}", force=False)
    release = load(course / "notebooks" / A / f"{A}.ipynb")
    perfect = perfect_submission(release, solution)

    tampered = json.loads(json.dumps(perfect))
    _cell(tampered, EX1)["source"] = _cell(release, EX1)["source"]           # blank: raises NotImplementedError
    _cell(tampered, f"{EX1}_tests")["source"] = "pass"
    _cell(tampered, EX2)["source"] = "def score_matrix_bytes(batch, heads, seq_len, fmt):\n    return 0"
    _cell(tampered, f"{EX2}_tests")["source"] = "print('all tests passed')"
    looping = json.loads(json.dumps(perfect))
    _cell(looping, EX3)["source"] = "while True:\n    pass"
    deleted = _without(perfect, f"{EX2}_tests", EX3)                        # a test cell, an answer cell

    for student, nb in {"perfect": perfect, "tampered": tampered, "looping": looping, "deleted": deleted,
                        "late": perfect}.items():
        submit(course, student, A, nb)
    renamed = submit(course, "renamed", A, perfect, name=f"{A} (1)")
    (course / "submitted" / "perfect" / A / "timestamp.txt").write_text(ON_TIME)
    (course / "submitted" / "late" / A / "timestamp.txt").write_text(LATE)

    autograde = run_nbgrader(course, "autograde", A, f"--Execute.timeout={TIMEOUT_S}", check=False)
    before = SimpleNamespace(
        returncode=autograde.returncode, log=autograde.stdout + autograde.stderr,
        autograded=sorted(p.name for p in (course / "autograded").iterdir()),
        grades={s: _grades(course, s) for s in STUDENTS}, export=_export(course, "before_fix.csv"))

    # The instructor's fix for a renamed notebook (README): rename it, autograde that student again.
    renamed.rename(renamed.with_name(f"{A}.ipynb"))
    run_nbgrader(course, "autograde", A, "--student=renamed", f"--Execute.timeout={TIMEOUT_S}")
    run_nbgrader(course, "generate_feedback", A)
    export = _export(course, "grades.csv")
    auto_max = sum(points[f"{ex}_tests"] for ex in EXERCISES)
    print(f"nbgrader runs took {time.monotonic() - start:.0f} s")
    return SimpleNamespace(course=course, solution=solution, points=points, auto_max=auto_max,
                           max_score=sum(points.values()), before=before, export=export,
                           grades={s: _grades(course, s) for s in STUDENTS})


def _assert_full_marks_except(graded, student: str, zero: set[str]):
    for grade_id, grade in graded.grades[student].items():
        expected = 0 if grade_id in zero else graded.points[grade_id]
        assert grade.score == expected, f"{student}: {grade_id} scored {grade.score}, expected {expected}"


@pytest.mark.slow
def test_tampered_test_cells_are_restored_and_graded(graded):
    tests = {f"{EX1}_tests", f"{EX2}_tests"}
    _assert_full_marks_except(graded, "tampered", zero=tests)
    graded_nb = load(graded.course / "autograded" / "tampered" / A / f"{A}.ipynb")
    for grade_id in tests:
        restored = "".join(_cell(graded_nb, grade_id)["source"])
        assert restored == "".join(_cell(graded.solution, grade_id)["source"]), f"{grade_id} was not restored"
        errors = [o["ename"] for o in _cell(graded_nb, grade_id)["outputs"] if o["output_type"] == "error"]
        assert errors, f"the restored {grade_id} did not fail on the wrong answer"
    assert "all tests passed" not in json.dumps(_cell(graded_nb, f"{EX2}_tests")["outputs"])


@pytest.mark.slow
def test_infinite_loop_times_out_and_later_cells_still_grade(graded):
    assert "Timeout waiting for execute reply" in graded.before.log
    errors = [o.get("ename") for o in _outputs(graded.course, "looping", EX3) if o["output_type"] == "error"]
    assert "CellTimeoutError" in errors, f"{EX3}: {errors}"
    _assert_full_marks_except(graded, "looping", zero={f"{EX3}_tests"})     # ex4 ran after it
    perfect_outputs = json.dumps(load(graded.course / "autograded" / "perfect" / A / f"{A}.ipynb"))
    assert "CellTimeoutError" not in perfect_outputs, f"a normal cell hit the {TIMEOUT_S} s test timeout"


@pytest.mark.slow
def test_deleted_test_cell_scores_zero_and_needs_manual_grading(graded):
    """A deleted test cell is not re-added: no auto score, 0 points, flagged for manual grading.

    A deleted answer cell leaves its test to fail with NameError: 0 points. Everything else grades.
    """
    _assert_full_marks_except(graded, "deleted", zero={f"{EX2}_tests", f"{EX3}_tests"})
    grades = graded.grades["deleted"]
    assert grades[f"{EX2}_tests"].auto_score is None and grades[f"{EX2}_tests"].needs_manual
    assert grades[f"{EX3}_tests"].auto_score == 0 and not grades[f"{EX3}_tests"].needs_manual
    graded_nb = load(graded.course / "autograded" / "deleted" / A / f"{A}.ipynb")
    ids = {c.get("metadata", {}).get("nbgrader", {}).get("grade_id") for c in graded_nb["cells"]}
    assert f"{EX2}_tests" not in ids and EX3 not in ids, "nbgrader put a deleted cell back"
    errors = [o.get("ename") for o in _outputs(graded.course, "deleted", f"{EX3}_tests") if o["output_type"] == "error"]
    assert errors == ["NameError"], errors


@pytest.mark.slow
def test_renamed_notebook_is_reported_and_graded_once_renamed(graded):
    before = graded.before
    assert before.returncode != 0, "autograde should fail for the student whose notebook is renamed"
    skipped = [ln for ln in before.log.splitlines() if "Skipping unknown notebook" in ln]
    assert len(skipped) == 1 and skipped[0].endswith(f"/submitted/renamed/{A}/{A} (1).ipynb"), skipped
    assert f"There was an error processing assignment '{A}' for student 'renamed'" in before.log
    assert before.autograded == sorted(s for s in STUDENTS if s != "renamed"), "the others were not all graded"
    assert all(g.score == 0 for g in before.grades["renamed"].values())
    assert float(before.export["renamed"]["score"]) == 0
    assert float(graded.export["renamed"]["score"]) == graded.auto_max            # after the rename


@pytest.mark.slow
def test_late_submission_is_flagged_by_the_course_policy(graded):
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{graded.course / 'gradebook.db'}") as gb:
        assert gb.find_submission(A, "late").total_seconds_late == LATE_S
        assert gb.find_submission(A, "perfect").total_seconds_late == 0
    assert f"SubmittedAssignment<{A} for late> is {float(LATE_S)} seconds late" in graded.before.log
    late, on_time = graded.export["late"], graded.export["perfect"]
    assert late["duedate"] == "2025-03-01 15:59:00" and late["timestamp"] == "2025-03-02 10:00:00"
    assert on_time["timestamp"] == "2025-03-01 15:00:00"
    raw = float(late["raw_score"])
    assert raw == graded.auto_max
    penalty = {"none": 0.0, "zero": raw}[POLICY]
    assert float(late["late_submission_penalty"]) == penalty
    assert float(late["score"]) == raw - penalty
    assert float(on_time["late_submission_penalty"]) == 0


@pytest.mark.slow
def test_feedback_html_shows_each_students_score(graded):
    for student in STUDENTS:
        html = graded.course / "feedback" / student / A / f"{A}.html"
        assert html.exists(), f"no feedback for {student}"
        score = float(graded.export[student]["score"])
        assert f"{A} (Score: {score:.1f} / {graded.max_score:.1f})" in html.read_text(encoding="utf-8")


@pytest.mark.slow
def test_export_has_one_row_per_student_with_the_right_scores(graded):
    p = graded.points
    penalty = graded.auto_max if POLICY == "zero" else 0
    expected = {
        "perfect": graded.auto_max,
        "tampered": graded.auto_max - p[f"{EX1}_tests"] - p[f"{EX2}_tests"],
        "looping": graded.auto_max - p[f"{EX3}_tests"],
        "deleted": graded.auto_max - p[f"{EX2}_tests"] - p[f"{EX3}_tests"],
        "renamed": graded.auto_max,
        "late": graded.auto_max - penalty,
    }
    assert sorted(graded.export) == sorted(STUDENTS)
    for student, row in graded.export.items():
        assert row["assignment"] == A
        assert float(row["score"]) == expected[student], f"{student}: {row}"
        assert float(row["max_score"]) == graded.max_score      # auto tests + the written question
