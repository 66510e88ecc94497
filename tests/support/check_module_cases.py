"""The unit tests every per-exercise check module shares (labkit/checks/nbNN_<part>.py), made once.

For one exercise: the solution's answer (from the solution notebook) passes every check; each mistake of
tests/mutants/nbNN.py fails the check named for it in ``caught`` with an AssertionError that names the graded
function; every accepted answer (a right answer written another way) passes every check; and every mistake names
its check. A test file binds them with ``globals().update(cases(...))`` and adds its own tests beside them, using the
returned ``ANSWER`` and ``namespace``.

Used by: tests/labkit/checks/test_checks_nb11_*.py.
"""
from __future__ import annotations

from types import ModuleType

import pytest
from mutants import load
from notebook_grader import NotebookRunner, exercises

SETUP = "import math\nimport torch\nimport labkit as lk\nMODE = lk.tritonmode.setup()\nimport triton\nimport triton.language as tl\n"


def cases(notebook: str, grade_id: str, module: ModuleType, function: str, caught: dict[str, str], checks: list[str],
          setup: str = SETUP) -> dict:
    """The shared tests of exercise ``grade_id`` of ``tests/mutants/<notebook>.py``, whose graded function is
    ``function`` and whose visible checks are ``module``'s functions ``checks``; ``caught``: mistake -> the check
    that must catch it. Returns the names to bind in the test module."""
    spec = load(notebook)
    answer = next(e.answer for e in exercises(spec.ASSIGNMENT) if e.grade_id == grade_id)
    mistakes = {name: (old, new) for name, old, new in spec.MISTAKES[grade_id]}
    accepted = {name: (old, new) for name, old, new in spec.ACCEPTED.get(grade_id, [])}

    def namespace(text: str) -> dict:
        runner = NotebookRunner()
        runner.run(setup)
        runner.run(text)
        return runner.namespace

    def test_every_mistake_names_its_check():
        assert set(caught) == set(mistakes)

    @pytest.fixture(scope="module")
    def solution():
        return namespace(answer)

    @pytest.mark.parametrize("check", checks)
    def test_solution_passes(check, solution):
        getattr(module, check)(solution[function])

    @pytest.mark.parametrize("mistake", list(mistakes))
    def test_mistake_fails_its_check(mistake):
        old, new = mistakes[mistake]
        assert answer.count(old) == 1, f"{mistake}: the text to replace is not in the answer once"
        with pytest.raises(AssertionError, match=function):
            getattr(module, caught[mistake])(namespace(answer.replace(old, new))[function])

    @pytest.mark.parametrize("name", list(accepted))
    def test_accepted_answer_passes(name):
        old, new = accepted[name]
        ns = namespace(answer.replace(old, new))
        for check in checks:
            getattr(module, check)(ns[function])

    return dict(ANSWER=answer, namespace=namespace, solution=solution,
                test_every_mistake_names_its_check=test_every_mistake_names_its_check,
                test_solution_passes=test_solution_passes, test_mistake_fails_its_check=test_mistake_fails_its_check,
                test_accepted_answer_passes=test_accepted_answer_passes)
