"""The course as an instructor ships it: release consistency and the nbgrader round trip.

- notebooks/ is exactly what ``nbgrader generate_assignment`` makes from solutions/ (byte-compared),
  and holds no solution text, hidden tests or outputs;
- every assignment has autograded exercises with hidden tests and a written question;
- autograding in a temporary course directory gives a perfect submission full marks, the blank
  release zero, and still grades a submission whose cell raises.

The solution notebooks themselves are executed by nbval (see the README's test command).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ASSIGNMENTS = sorted(p.name for p in (ROOT / "solutions").iterdir() if (p / f"{p.name}.ipynb").exists())
MARKERS = re.compile(r"^\s*### (BEGIN|END) (SOLUTION|HIDDEN TESTS)\s*$")


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _nbgrader_cells(nb: dict, **flags) -> list[dict]:
    return [c for c in nb["cells"]
            if all(c.get("metadata", {}).get("nbgrader", {}).get(k) == v for k, v in flags.items())]


def _nbgrader(course: Path, *args: str) -> subprocess.CompletedProcess:
    # nbgrader runs `alembic` from PATH when it creates the gradebook: put this venv first.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = dict(os.environ, PATH=path, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "nbgrader", *args, "--force"], cwd=course, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _course(tmp_path: Path, assignment: str) -> Path:
    """A temporary course directory holding one assignment's source and the course config."""
    course = tmp_path / "course"
    shutil.copytree(ROOT / "solutions" / assignment, course / "solutions" / assignment)
    shutil.copy(ROOT / "nbgrader_config.py", course)
    return course


def test_there_are_assignments():
    assert ASSIGNMENTS, "no solutions/NN_slug/NN_slug.ipynb found"


@pytest.mark.slow
@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_release_is_regenerated_from_solutions(tmp_path, assignment):
    course = _course(tmp_path, assignment)
    _nbgrader(course, "generate_assignment", assignment)
    fresh = course / "notebooks" / assignment / f"{assignment}.ipynb"
    committed = ROOT / "notebooks" / assignment / f"{assignment}.ipynb"
    assert committed.exists(), f"run `make release`: {committed} is missing"
    assert fresh.read_bytes() == committed.read_bytes(), (
        f"{committed} is stale: regenerate it from solutions/ with `make release`")


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_release_holds_no_solutions_hidden_tests_or_outputs(assignment):
    release = ROOT / "notebooks" / assignment / f"{assignment}.ipynb"
    text = release.read_text(encoding="utf-8")
    for marker in ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"):
        assert marker not in text, f"{release} contains {marker!r}"
    for path in (release, ROOT / "solutions" / assignment / f"{assignment}.ipynb"):
        for cell in _load(path)["cells"]:
            assert not cell.get("outputs") and cell.get("execution_count") is None, f"outputs committed in {path}"


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_assignment_has_graded_exercises(assignment):
    nb = _load(ROOT / "solutions" / assignment / f"{assignment}.ipynb")
    tests = _nbgrader_cells(nb, grade=True, solution=False)
    written = [c for c in _nbgrader_cells(nb, grade=True, solution=True) if c["cell_type"] == "markdown"]
    assert 3 <= len(tests) <= 8, f"{assignment}: {len(tests)} autograded test cells"
    assert written, f"{assignment}: no manually graded written question"
    for cell in tests:
        source = "".join(cell["source"])
        grade_id = cell["metadata"]["nbgrader"]["grade_id"]
        assert grade_id.isascii() and cell["metadata"]["nbgrader"]["points"] > 0
        assert "lk.grading." in source and "### BEGIN HIDDEN TESTS" in source, f"{assignment}:{grade_id}"
    for cell in nb["cells"]:
        assert cell.get("metadata", {}).get("nbgrader", {}).get("schema_version", 3) == 3


def _perfect_submission(release: dict, solution: dict) -> dict:
    """The release with every answer cell filled in by the instructor's solution."""
    answers = {c["metadata"]["nbgrader"]["grade_id"]: c for c in _nbgrader_cells(solution, solution=True)}
    filled = json.loads(json.dumps(release))
    for cell in _nbgrader_cells(filled, solution=True):
        source = "".join(answers[cell["metadata"]["nbgrader"]["grade_id"]]["source"])
        cell["source"] = "\n".join(ln for ln in source.splitlines() if not MARKERS.match(ln))
    return filled


def _broken_submission(perfect: dict) -> dict:
    """A perfect submission whose first answer cell raises."""
    broken = json.loads(json.dumps(perfect))
    first = next(c for c in _nbgrader_cells(broken, solution=True) if c["cell_type"] == "code")
    first["source"] = "raise RuntimeError('a student bug')"
    return broken


def _scores(course: Path, assignment: str, student: str) -> tuple[float, float, float]:
    """(auto score, auto max, total score) of one autograded submission."""
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        nb = gb.find_submission_notebook(assignment, assignment, student)
        auto = [g for g in nb.grades if g.cell.cell_type == "code"]
        return (sum(g.score for g in auto), sum(g.max_score for g in auto), nb.score)


@pytest.mark.slow
@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_autograde_round_trip(tmp_path, assignment):
    course = _course(tmp_path, assignment)
    _nbgrader(course, "generate_assignment", assignment)
    release = _load(course / "notebooks" / assignment / f"{assignment}.ipynb")
    perfect = _perfect_submission(release, _load(course / "solutions" / assignment / f"{assignment}.ipynb"))
    for student, nb in {"perfect": perfect, "blank": release, "broken": _broken_submission(perfect)}.items():
        target = course / "submitted" / student / assignment / f"{assignment}.ipynb"
        target.parent.mkdir(parents=True)
        target.write_text(json.dumps(nb), encoding="utf-8")
    _nbgrader(course, "autograde", assignment)

    score, max_score, _ = _scores(course, assignment, "perfect")
    assert max_score > 0 and score == max_score, f"perfect submission scored {score}/{max_score}"
    blank_score, _, blank_total = _scores(course, assignment, "blank")
    assert blank_score == 0 and blank_total == 0, f"blank release scored {blank_score}"
    broken_score, _, _ = _scores(course, assignment, "broken")
    assert 0 <= broken_score < max_score, f"broken submission scored {broken_score}/{max_score}"
    graded = course / "autograded" / "perfect" / assignment / f"{assignment}.ipynb"
    errors = [o for c in _load(graded)["cells"] for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors, f"perfect submission raised: {errors[0]['ename']}: {errors[0]['evalue']}"
