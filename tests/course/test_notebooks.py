"""The course as an instructor ships it: release consistency and the nbgrader round trip.

- notebooks/ is exactly what ``nbgrader generate_assignment`` makes from solutions/ (byte-compared),
  and holds no solution text, hidden tests or outputs;
- every assignment has autograded exercises with hidden tests and a written question;
- autograding in a temporary course directory gives a perfect submission full marks, the blank
  release zero, and still grades a submission whose cell raises.

The round trip's perfect submission is the solution notebook (its answers, the hidden tests restored): autograding
it executes every solution notebook, under the run guard (tests/conftest.py), and asserts that no cell raised. (nbval
executed them a second time until 2026-12: the same cells, about a tenth of `make test`'s time.)

One temporary course holds every assignment: one ``generate_assignment "*"`` and one ``autograde "*"`` (nbgrader
started twice, not once per assignment and step).
"""
from __future__ import annotations

import json

import pytest
from labkit.course.bundle import MARKERS
from nbgrader_course import (ASSIGNMENTS, ROOT, load, make_course, nbgrader_cells, perfect_submission,
                             run_nbgrader, scores, submit)


def test_there_are_assignments():
    assert ASSIGNMENTS, "no solutions/NN_slug/NN_slug.ipynb found"


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """A temporary course holding every assignment, where one ``nbgrader generate_assignment "*"`` released them all
    (one nbgrader start and gradebook, not one per assignment); the release test reads it, the round trip grades in it."""
    course = make_course(tmp_path_factory.mktemp("course"), ASSIGNMENTS)
    run_nbgrader(course, "generate_assignment", "*")
    return course


@pytest.mark.slow
@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_release_is_regenerated_from_solutions(course, assignment):
    fresh = course / "notebooks" / assignment / f"{assignment}.ipynb"
    committed = ROOT / "notebooks" / assignment / f"{assignment}.ipynb"
    assert committed.exists(), f"run `make release`: {committed} is missing"
    assert fresh.read_bytes() == committed.read_bytes(), (
        f"{committed} is stale: regenerate it from solutions/ with `make release`")


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_release_holds_no_solutions_hidden_tests_or_outputs(assignment):
    release = ROOT / "notebooks" / assignment / f"{assignment}.ipynb"
    text = release.read_text(encoding="utf-8")
    for marker in MARKERS:
        assert marker not in text, f"{release} contains {marker!r}"
    for path in (release, ROOT / "solutions" / assignment / f"{assignment}.ipynb"):
        for cell in load(path)["cells"]:
            assert not cell.get("outputs") and cell.get("execution_count") is None, f"outputs committed in {path}"


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_assignment_has_graded_exercises(assignment):
    nb = load(ROOT / "solutions" / assignment / f"{assignment}.ipynb")
    tests = nbgrader_cells(nb, grade=True, solution=False)
    written = [c for c in nbgrader_cells(nb, grade=True, solution=True) if c["cell_type"] == "markdown"]
    assert 3 <= len(tests) <= 8, f"{assignment}: {len(tests)} autograded test cells"
    assert written, f"{assignment}: no manually graded written question"
    for cell in tests:
        source = "".join(cell["source"])
        grade_id = cell["metadata"]["nbgrader"]["grade_id"]
        assert grade_id.isascii() and cell["metadata"]["nbgrader"]["points"] > 0
        assert "lk.grading." in source and "### BEGIN HIDDEN TESTS" in source, f"{assignment}:{grade_id}"
    for cell in nb["cells"]:
        assert cell.get("metadata", {}).get("nbgrader", {}).get("schema_version", 3) == 3


def _broken_submission(perfect: dict) -> dict:
    """A perfect submission whose first answer cell raises."""
    broken = json.loads(json.dumps(perfect))
    first = next(c for c in nbgrader_cells(broken, solution=True) if c["cell_type"] == "code")
    first["source"] = "raise RuntimeError('a student bug')"
    return broken


# A submission whose first answer raises is graded by nbgrader's machinery alike in every notebook: tried in the
# quickest one only (each autograded submission runs the whole notebook: minutes on two cores).
BROKEN_TRIED_IN = "04_performance_analysis"


@pytest.fixture(scope="module")
def autograded(course):
    """Every assignment's students submitted (perfect, blank, and in BROKEN_TRIED_IN broken), then one
    ``nbgrader autograde "*"`` for all of them (one nbgrader start; each notebook still runs in a kernel of its own).
    Returns (the course, the students per assignment, nbgrader's completed process)."""
    students = {}
    for assignment in ASSIGNMENTS:
        release = load(course / "notebooks" / assignment / f"{assignment}.ipynb")
        perfect = perfect_submission(release, load(course / "solutions" / assignment / f"{assignment}.ipynb"))
        students[assignment] = {"perfect": perfect, "blank": release}
        if assignment == BROKEN_TRIED_IN:
            students[assignment]["broken"] = _broken_submission(perfect)
        for student, nb in students[assignment].items():
            submit(course, student, assignment, nb)
    graded = run_nbgrader(course, "autograde", "*", check=False, timeout=3600)   # every notebook: minutes each
    return course, students, graded


def test_autograde_of_every_assignment_exits_cleanly(autograded):
    _, _, graded = autograded
    assert graded.returncode == 0, f"nbgrader autograde failed:\n{graded.stdout[-3000:]}\n{graded.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_autograde_round_trip(autograded, assignment):
    course, students, graded = autograded
    students = students[assignment]
    assert all((course / "autograded" / s / assignment / f"{assignment}.ipynb").exists() for s in students), (
        f"nbgrader autograde did not grade every {assignment} submission:\n{graded.stdout[-3000:]}\n{graded.stderr[-3000:]}")
    score, max_score, _ = scores(course, assignment, "perfect")
    assert max_score > 0 and score == max_score, f"perfect submission scored {score}/{max_score}"
    blank_score, _, blank_total = scores(course, assignment, "blank")
    assert blank_score == 0 and blank_total == 0, f"blank release scored {blank_score}"
    if "broken" in students:
        broken_score, _, _ = scores(course, assignment, "broken")
        assert 0 <= broken_score < max_score, f"broken submission scored {broken_score}/{max_score}"
    graded = course / "autograded" / "perfect" / assignment / f"{assignment}.ipynb"
    errors = [(c.get("id"), o) for c in load(graded)["cells"] for o in c.get("outputs", [])
              if o["output_type"] == "error"]
    assert not errors, "the solution (the perfect submission) raised in " + "; ".join(
        f"{cell_id}: {o['ename']}: {o['evalue'][:500]}" for cell_id, o in errors)
    blank = load(course / "autograded" / "blank" / assignment / f"{assignment}.ipynb")
    crashed = [c for c in blank["cells"] if c["cell_type"] == "code" and not c["metadata"].get("nbgrader", {}).get("grade")
               and not c["metadata"].get("nbgrader", {}).get("solution")
               and any(o["output_type"] == "error" for o in c.get("outputs", []))]
    assert not crashed, (
        f"blank {assignment}: a cell that is neither an answer nor a test raised "
        f"({crashed[0].get('id')}: {next(o for o in crashed[0]['outputs'] if o['output_type'] == 'error')['ename']}); "
        "a cell that needs an unfinished exercise says which one to finish (lk.grading.answered) instead of a traceback")
