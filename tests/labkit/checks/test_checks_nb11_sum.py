"""Unit tests of labkit.checks.nb11_sum: each visible check of 11_determinism's exercise 1 passes the solution's
fixed_order_sum and, on a known wrong answer, raises AssertionError naming the rule it breaks; the right answer written
another way passes; calling the given atomic_sum fails own_code. Through the interpreter on a CPU.

The answer comes from the solution notebook, the mistakes from tests/mutants/nb11.py; CAUGHT names the check that
must catch each.
"""
from __future__ import annotations

import pytest
from mutants import load
from notebook_grader import NotebookRunner, exercises

from labkit.checks import nb11_sum
from labkit.determinism import reduce as detreduce

SETUP = "import math\nimport torch\nimport labkit as lk\nMODE = lk.tritonmode.setup()\nimport triton\nimport triton.language as tl\n"
SPEC = load("nb11")
ANSWER = next(e.answer for e in exercises(SPEC.ASSIGNMENT) if e.grade_id == "ex1_fixed_order_sum")
CAUGHT = {  # mistake -> the visible check of labkit.checks.nb11_sum that catches it
    'atomics kept (partials added into one cell)': 'same_bits_over_orders',
    'the last, short block dropped (n // block slots)': 'matches_float64',
    'no mask on the last block': 'matches_float64',
    'the combine skips slot 0': 'matches_float64',
    'partials kept in the input dtype': 'matches_float64',
    'x assumed contiguous': 'keeps_the_contract',
    'the block argument ignored (always 64)': 'own_code',
    'the partials summed in PyTorch (only the combine is a kernel)': 'own_code',
    'each partial atomically added into its own zeroed slot': 'own_code',
    '64 slots allocated whatever n and block': 'matches_float64',
    "the caller's x converted to fp32 in place": 'matches_float64',
}
MISTAKES = {name: (old, new, CAUGHT[name]) for name, old, new in SPEC.MISTAKES["ex1_fixed_order_sum"]}
CHECKS = ["own_code", "same_bits_over_orders", "matches_float64", "keeps_the_contract"]


def _namespace(answer: str) -> dict:
    runner = NotebookRunner()
    runner.run(SETUP)
    runner.run(answer)
    return runner.namespace


def test_every_mistake_names_its_check():
    assert set(CAUGHT) == set(MISTAKES)


@pytest.fixture(scope="module")
def solution():
    return _namespace(ANSWER)


@pytest.mark.parametrize("check", CHECKS)
def test_solution_passes(check, solution):
    getattr(nb11_sum, check)(solution["fixed_order_sum"])


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_mistake_fails_its_check(mistake):
    old, new, check = MISTAKES[mistake]
    assert ANSWER.count(old) == 1, f"{mistake}: the text to replace is not in the answer once"
    with pytest.raises(AssertionError, match="fixed_order_sum"):
        getattr(nb11_sum, check)(_namespace(ANSWER.replace(old, new))["fixed_order_sum"])


@pytest.mark.parametrize("accepted", [a[0] for a in SPEC.ACCEPTED["ex1_fixed_order_sum"]])
def test_accepted_answer_passes(accepted):
    old, new = next((o, n) for name, o, n in SPEC.ACCEPTED["ex1_fixed_order_sum"] if name == accepted)
    ns = _namespace(ANSWER.replace(old, new))
    for check in CHECKS:
        getattr(nb11_sum, check)(ns["fixed_order_sum"])


def test_the_given_atomic_sum_is_not_own_code():
    with pytest.raises(AssertionError, match="atomic_sum"):
        nb11_sum.own_code(lambda x, block: detreduce.atomic_sum(x, block))
