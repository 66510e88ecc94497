"""Run an exercise's answer and test cells in-process, as a notebook kernel would, to grade answers.

A solution notebook (nbgrader source) gives each exercise an answer cell (``grade_id``) and a test cell
(``grade_id + "_tests"``); the released notebook gives the blank answer. :class:`NotebookRunner` executes
chosen setup cells and the answers in one namespace, compiles every cell under its own file name in
``linecache`` (so ``inspect.getsource`` works, as in IPython) and grades an answer against the visible
part of the test cell, then the whole cell with the hidden tests.

Used in: tests/course/test_grader_strength.py.
"""
from __future__ import annotations

import contextlib
import io
import itertools
import json
import linecache
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = re.compile(r"### BEGIN HIDDEN TESTS.*?### END HIDDEN TESTS\n?", re.S)
_serial = itertools.count()


def _source(cell: dict) -> str:
    return "".join(cell["source"])


def _grade_id(cell: dict) -> str:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id", "")


@dataclass(frozen=True)
class Exercise:
    """One autograded exercise: answer, its blank release version and its test cell (sources)."""

    grade_id: str
    answer: str
    blank: str
    tests: str

    @property
    def visible(self) -> str:
        """The test cell as students see it: the hidden block removed (as nbgrader does)."""
        return HIDDEN.sub("", self.tests)

    @property
    def hidden_then_rest(self) -> str | None:
        """What the whole cell runs after its visible checks, for a cell that is visible checks, then the hidden block,
        then lines that students see too (``lk.grading.passed(...)``): the hidden block and those lines. None for a cell
        laid out otherwise (then the whole cell is run again)."""
        found = list(HIDDEN.finditer(self.tests))
        if len(found) != 1:
            return None
        rest = self.tests[found[0].start():]
        try:
            compile(rest, "<hidden>", "exec")
        except SyntaxError:   # the block sits inside an indented statement: it cannot run on its own
            return None
        return rest

    def mutate(self, old: str, new: str) -> str:
        """The answer with ``old`` replaced by ``new``; ``old`` must occur exactly once."""
        count = self.answer.count(old)
        assert count == 1, f"{self.grade_id}: {old!r} occurs {count} times in the answer"
        return self.answer.replace(old, new)


def exercises(assignment: str) -> list[Exercise]:
    """The autograded exercises of ``solutions/<assignment>``, in notebook order."""
    solution = json.loads((ROOT / "solutions" / assignment / f"{assignment}.ipynb").read_text(encoding="utf-8"))
    release = json.loads((ROOT / "notebooks" / assignment / f"{assignment}.ipynb").read_text(encoding="utf-8"))
    cells = {_grade_id(c): _source(c) for c in solution["cells"] if c["cell_type"] == "code" and _grade_id(c)}
    blanks = {_grade_id(c): _source(c) for c in release["cells"] if c["cell_type"] == "code" and _grade_id(c)}
    return [Exercise(gid, cells[gid], blanks[gid], cells[gid + "_tests"])
            for gid in cells if gid + "_tests" in cells]


def setup_cells(assignment: str, markers: list[str]) -> list[str]:
    """Sources of the ungraded code cells holding one of ``markers`` (e.g. the profile cell), in order."""
    solution = json.loads((ROOT / "solutions" / assignment / f"{assignment}.ipynb").read_text(encoding="utf-8"))
    found = [_source(c) for c in solution["cells"] if c["cell_type"] == "code" and not _grade_id(c)
             and any(m in _source(c) for m in markers)]
    assert len(found) == len(markers), f"{assignment}: {len(found)} setup cells for {len(markers)} markers"
    return found


class NotebookRunner:
    """One namespace per notebook, like one kernel; cell output is swallowed."""

    def __init__(self):
        self.namespace = {"__name__": "__main__", "display": lambda *args, **kwargs: None}

    def run(self, source: str) -> None:
        """Execute a cell; compiled under a fresh file name kept in linecache, as IPython does."""
        filename = f"<cell-{next(_serial)}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(source, filename, "exec"), self.namespace)  # noqa: S102 - a notebook cell

    def fails(self, source: str) -> bool:
        """Whether the cell raises (any exception: a failed check or an error in the answer)."""
        try:
            self.run(source)
        except Exception:  # noqa: BLE001 - any error fails the test cell, as in nbgrader
            return True
        return False

    def grade(self, exercise: Exercise, answer: str) -> str:
        """Outcome of ``answer``: "visible", "hidden" (caught only by the hidden tests) or "passed".

        The solution's answer is executed again afterwards, so later exercises see the right code.

        The visible part runs first; only when it passes do the hidden tests run, in the namespace the visible
        part left, as they do in the whole cell (which runs the visible checks once, not again: the cost of grader
        strength is in those checks). A cell whose hidden block cannot run on its own is run whole again.
        """
        try:
            self.run(answer)
            if self.fails(exercise.visible):
                return "visible"
            rest = exercise.hidden_then_rest
            return "hidden" if self.fails(exercise.tests if rest is None else rest) else "passed"
        finally:
            self.run(exercise.answer)


def answers_namespace(spec, setup: str, grade_id: str | None = None, mistake: str | None = None) -> dict:
    """A notebook namespace holding ``setup`` and every answer cell of ``spec.ASSIGNMENT`` (a tests/mutants module), the
    one of ``grade_id`` with ``mistake`` (a name in ``spec.MISTAKES[grade_id]``) substituted. Used by tests/labkit/checks/."""
    runner = NotebookRunner()
    runner.run(setup)
    for e in exercises(spec.ASSIGNMENT):
        if e.grade_id != grade_id:
            runner.run(e.answer)
            continue
        (old, new), = [(old, new) for what, old, new in spec.MISTAKES[grade_id] if what == mistake]
        runner.run(e.mutate(old, new))
    return runner.namespace
