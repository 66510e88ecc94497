"""Helpers for tests that run real nbgrader commands in a temporary course directory.

Used by test_notebooks.py (release and round trip), test_grading_robustness.py and test_nbgrader_term.py (these
two with tiny_assignment.py's notebook) and tiny_assignment.py; pytest puts
tests/ on sys.path (rootdir conftest, no __init__.py), so they import this as ``nbgrader_course``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ASSIGNMENTS = sorted(p.name for p in (ROOT / "solutions").iterdir() if (p / f"{p.name}.ipynb").exists())
MARKERS = re.compile(r"^\s*### (BEGIN|END) (SOLUTION|HIDDEN TESTS)\s*$")


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def write(path: Path, nb: dict) -> Path:
    """Write the notebook ``nb`` as ``path``, making its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(nb), encoding="utf-8")
    return path


def nbgrader_cells(nb: dict, **flags) -> list[dict]:
    return [c for c in nb["cells"]
            if all(c.get("metadata", {}).get("nbgrader", {}).get(k) == v for k, v in flags.items())]


# ``python -m nbgrader`` without jsonschema's optional IRI format checker: importing it (rfc3987_syntax, pulled in
# through nbformat) builds a Lark grammar, 2.5 of nbgrader's 3.9 s of CPU at start (measured 2026-12-08), in every
# one of the tests' ~25 nbgrader runs. No schema nbgrader or nbformat validates uses the "iri" formats.
NBGRADER = "import sys; sys.modules['rfc3987_syntax'] = None; from nbgrader.apps.nbgraderapp import main; main()"


def run_nbgrader(course: Path, *args: str, force: bool = True, check: bool = True,
                 env: dict[str, str] | None = None, timeout: float = 1200) -> subprocess.CompletedProcess:
    """``nbgrader ARGS [--force]`` in ``course`` (any working directory), with ``env`` added to the environment,
    killed after ``timeout`` s; with ``check``, a non-zero exit fails the test."""
    # nbgrader runs `alembic` from PATH when it creates the gradebook: put this venv first.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = dict(os.environ, PATH=path, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore", **(env or {}))
    proc = subprocess.run([sys.executable, "-c", NBGRADER, *args, *(["--force"] if force else [])], cwd=course,
                          env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def make_course(tmp_path: Path, assignment: str | list[str], source: dict | None = None) -> Path:
    """A temporary course directory holding the course config and one assignment's source: the course's
    ``solutions/<assignment>`` (each of a list of assignments), or the nbgrader source notebook ``source`` written
    there."""
    course = tmp_path / "course"
    if source is None:
        for name in [assignment] if isinstance(assignment, str) else assignment:
            shutil.copytree(ROOT / "solutions" / name, course / "solutions" / name)
    else:
        write(course / "solutions" / assignment / f"{assignment}.ipynb", source)
    shutil.copy(ROOT / "nbgrader_config.py", course)
    return course


def perfect_submission(release: dict, solution: dict) -> dict:
    """The release with every answer cell filled in by the instructor's solution."""
    answers = {c["metadata"]["nbgrader"]["grade_id"]: c for c in nbgrader_cells(solution, solution=True)}
    filled = json.loads(json.dumps(release))
    for cell in nbgrader_cells(filled, solution=True):
        source = "".join(answers[cell["metadata"]["nbgrader"]["grade_id"]]["source"])
        cell["source"] = "\n".join(ln for ln in source.splitlines() if not MARKERS.match(ln))
    return filled


def submit(course: Path, student: str, assignment: str, nb: dict, name: str | None = None) -> Path:
    """Write ``nb`` as submitted/<student>/<assignment>/<name or assignment>.ipynb."""
    return write(course / "submitted" / student / assignment / f"{name or assignment}.ipynb", nb)


def scores(course: Path, assignment: str, student: str) -> tuple[float, float, float]:
    """(auto score, auto max, total score) of one autograded submission."""
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        nb = gb.find_submission_notebook(assignment, assignment, student)
        auto = [g for g in nb.grades if g.cell.cell_type == "code"]
        return (sum(g.score for g in auto), sum(g.max_score for g in auto), nb.score)
