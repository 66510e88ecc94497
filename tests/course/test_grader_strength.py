"""The autograders reject wrong answers, and the visible tests already say why, before submission.

Per notebook, ``tests/mutants/nbNN.py`` lists the rules each exercise's prose states, plausible
student mistakes (an off-by-one tile bound, a missing rescale, a mask convention, a dtype slip, a
library call where the exercise is to write it) and answers fitted to the visible cases, each as a
text substitution in the solution's answer. Each runs against the exercise's test cell, visible part
first, then with the hidden tests (tests/support/notebook_grader.py, one namespace per notebook, cpu profile):

- the solution passes the whole cell; the blank release answer fails the visible part;
- every mistake fails a VISIBLE test (the student hears of it before submitting), except at most one
  per notebook, named in ``HIDDEN_ONLY`` with why, which must fail the full cell;
- every answer fitted to the visible cases passes them and fails the hidden tests (they vary the
  instances), and every exercise has one;
- every right answer written another way that the prose allows (``ACCEPTED``) passes the whole cell.

``-rA`` (or ``-s``) shows the per-notebook table. The README's instructor table of rules is built
from the same modules (:func:`rules_table`).
"""
from __future__ import annotations

import collections
import re
from pathlib import Path

import pytest
from mutants import NOTEBOOKS, load
from notebook_grader import NotebookRunner, exercises, setup_cells

pytestmark = pytest.mark.slow
README = Path(__file__).resolve().parents[2] / "README.md"
MIN_MISTAKES = 3


@pytest.fixture(scope="module")
def graded():
    """notebook -> grade_id -> {"solution", "blank", ("mistake"|"fitted"|"accepted", name): outcome}, once per notebook."""
    cache = {}

    def grade(name: str) -> dict:
        if name not in cache:
            spec = load(name)
            runner, items = NotebookRunner(), exercises(spec.ASSIGNMENT)
            for source in setup_cells(spec.ASSIGNMENT, spec.SETUP) + [e.answer for e in items]:
                runner.run(source)
            result = {}
            for e in items:
                outcomes = {"solution": runner.grade(e, e.answer), "blank": runner.grade(e, e.blank)}
                for kind, table in (("mistake", spec.MISTAKES), ("fitted", spec.FITTED),
                                    ("accepted", getattr(spec, "ACCEPTED", {}))):
                    for what, old, new in table.get(e.grade_id, []):
                        outcomes[(kind, what)] = runner.grade(e, e.mutate(old, new))
                result[e.grade_id] = outcomes
            cache[name] = result
        return cache[name]

    return grade


def tried(results: dict, kind: str) -> list[tuple[str, str, str]]:
    """(grade_id, name, outcome) of every answer of one ``kind`` ("mistake", "fitted", "accepted") in a graded notebook."""
    return [(gid, key[1], outcome) for gid, outcomes in results.items()
            for key, outcome in outcomes.items() if isinstance(key, tuple) and key[0] == kind]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_exercise_states_its_rules_and_has_mistakes_and_a_fitted_answer(name):
    spec = load(name)
    ids = [e.grade_id for e in exercises(spec.ASSIGNMENT)]
    assert ids, f"{spec.ASSIGNMENT} has no autograded exercise"
    for table in ("RULES", "MISTAKES", "FITTED"):
        assert set(getattr(spec, table)) == set(ids), f"{name}.{table} covers {sorted(getattr(spec, table))}, exercises: {ids}"
    thin = {gid: len(m) for gid, m in spec.MISTAKES.items() if len(m) < MIN_MISTAKES}
    assert not thin, f"{name}: fewer than {MIN_MISTAKES} mistakes for {thin}"
    assert all(spec.RULES[gid] and spec.FITTED[gid] for gid in ids)
    assert set(getattr(spec, "ACCEPTED", {})) <= set(ids), f"{name}.ACCEPTED names an exercise that does not exist"
    assert len(spec.HIDDEN_ONLY) <= 1, f"{name}: at most one mistake may escape the visible tests"
    for gid, what in spec.HIDDEN_ONLY:
        assert what in {m[0] for m in spec.MISTAKES[gid]} and spec.HIDDEN_ONLY[(gid, what)].strip()


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_solution_passes_and_blank_fails_visibly(graded, name):
    for gid, outcomes in graded(name).items():
        assert outcomes["solution"] == "passed", f"{name}:{gid}: the solution fails its own tests"
        assert outcomes["blank"] == "visible", f"{name}:{gid}: the blank answer passes the visible tests"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_mistake_fails_a_visible_test(graded, name):
    spec, wrong = load(name), []
    for gid, what, outcome in tried(graded(name), "mistake"):
        expected = "hidden" if (gid, what) in spec.HIDDEN_ONLY else "visible"
        if outcome != expected:
            wrong.append(f"{gid}: {what!r} is {outcome}, expected {expected}")
    assert not wrong, f"{name}: " + "; ".join(wrong)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_answers_fitted_to_the_visible_cases_fail_the_hidden_tests(graded, name):
    wrong = [f"{gid}: {what!r} is {outcome}" for gid, what, outcome in tried(graded(name), "fitted")
             if outcome != "hidden"]
    assert not wrong, f"{name} (fitted answers must pass the visible tests and fail the hidden ones): " + "; ".join(wrong)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_right_answers_written_another_way_pass(graded, name):
    wrong = [f"{gid}: {what!r} is {outcome}" for gid, what, outcome in tried(graded(name), "accepted")
             if outcome != "passed"]
    assert not wrong, f"{name} (answers the prose allows must pass the whole cell): " + "; ".join(wrong)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_report_table(graded, name):
    """A notebook's line: mistakes tried / caught by the visible tests / caught only by the hidden ones / missed (-rA).

    One line per notebook, so that each runs where its notebook was graded (tests/conftest.py groups by notebook)."""
    counts = collections.Counter(outcome for _, _, outcome in tried(graded(name), "mistake"))
    fitted = len(tried(graded(name), "fitted"))
    print(f"\n{'notebook':<28}{'mistakes':>9}{'visible':>9}{'hidden only':>13}{'missed':>8}{'fitted':>8}\n"
          f"{load(name).ASSIGNMENT:<28}{sum(counts.values()):>9}{counts['visible']:>9}{counts['hidden']:>13}"
          f"{counts['passed']:>8}{fitted:>8}")


def rules_table() -> str:
    """The README's instructor table: for each exercise, the rules its visible tests check."""
    rows = ["| notebook | exercise | the visible tests check |", "|---|---|---|"]
    for name in NOTEBOOKS:
        spec = load(name)
        for e in exercises(spec.ASSIGNMENT):
            rows.append(f"| {spec.ASSIGNMENT[:2]} | `{e.grade_id}` | {'; '.join(spec.RULES[e.grade_id])} |")
    return "\n".join(rows)


def test_readme_lists_the_rules_the_visible_tests_check():
    text = README.read_text(encoding="utf-8")
    found = re.search(r"<!-- rules table -->\n(.*?)\n<!-- end rules table -->", text, re.S)
    assert found, "README: no '<!-- rules table -->' block in the instructor section"
    assert found.group(1).strip() == rules_table(), (
        "README's rules table is stale: paste the output of\n"
        "  python -c 'import sys; sys.path[:0] = [\"tests\"]; import test_grader_strength as t; print(t.rules_table())'")
