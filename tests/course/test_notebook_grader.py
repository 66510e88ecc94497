"""tests/support/notebook_grader.py grades as nbgrader would, running each visible check once per answer."""
from __future__ import annotations

from notebook_grader import Exercise, NotebookRunner

TESTS = ("runs['visible'] += 1\nassert f(2) == 4, 'visible'\n"
         "### BEGIN HIDDEN TESTS\nruns['hidden'] += 1\nassert f(3) == 9, 'hidden'\n### END HIDDEN TESTS\n"
         "runs['tail'] += 1\n")
ANSWER = "def f(x):\n    return x * x\n"


def graded(answer: str, tests: str = TESTS) -> tuple[str, dict]:
    runner = NotebookRunner()
    runner.run("runs = dict(visible=0, hidden=0, tail=0)")
    exercise = Exercise("ex", ANSWER, "def f(x):\n    raise NotImplementedError\n", tests)
    return runner.grade(exercise, answer), runner.namespace["runs"]


def test_outcomes_follow_the_visible_then_the_hidden_checks():
    assert graded(ANSWER)[0] == "passed"
    assert graded("def f(x):\n    return 4\n")[0] == "hidden"     # fitted to the visible case
    assert graded("def f(x):\n    return x + 1\n")[0] == "visible"


def test_a_right_answer_runs_the_visible_checks_once_and_the_hidden_block_once():
    outcome, runs = graded(ANSWER)
    assert outcome == "passed" and runs == dict(visible=1, hidden=1, tail=2)


def test_a_hidden_block_inside_an_indented_statement_runs_the_whole_cell_again():
    tests = ("runs['visible'] += 1\nif True:\n### BEGIN HIDDEN TESTS\n    runs['hidden'] += 1\n    assert f(3) == 9\n"
             "### END HIDDEN TESTS\n    pass\n")
    exercise = Exercise("ex", ANSWER, ANSWER, tests)
    assert exercise.hidden_then_rest is None
    assert graded(ANSWER, tests) == ("passed", dict(visible=2, hidden=1, tail=0))
    assert graded("def f(x):\n    return 4\n", tests)[0] == "hidden"
