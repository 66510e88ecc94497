"""Unit tests of labkit.checks.nb11_backward: each visible check of 11_determinism's exercise 2 passes the solution's
deterministic backward and, on a known wrong answer, raises AssertionError naming the rule it breaks; right answers
written another way pass every check (the mistake that keeps the atomics fails the bit check: it can fail). Through
the interpreter on a CPU.

The answer comes from the solution notebook, the mistakes from tests/mutants/nb11.py; CAUGHT names the check that
must catch each.
"""
from __future__ import annotations

import pytest
from mutants import load
from notebook_grader import NotebookRunner, exercises

from labkit.checks import nb11_backward

SETUP = "import math\nimport torch\nimport labkit as lk\nMODE = lk.tritonmode.setup()\nimport triton\nimport triton.language as tl\n"
SPEC = load("nb11")
ANSWER = next(e.answer for e in exercises(SPEC.ASSIGNMENT) if e.grade_id == "ex2_det_backward")
CAUGHT = {  # mistake -> the visible check of labkit.checks.nb11_backward that catches it
    'atomics kept (every share added into slot 0)': 'same_bits_over_orders',
    'one slot shared by every key block (the last program to store wins)': 'matches_float64',
    'dq share not scaled by sm_scale': 'matches_float64',
    'causal top-left aligned (j <= i)': 'matches_float64',
    'D not subtracted (dS = P * dP)': 'matches_float64',
    'lse not subtracted (P = exp(S))': 'matches_float64',
    'dK not scaled by sm_scale': 'matches_float64',
    'each dQ share atomically added into its own zeroed slot': 'own_code',
    'block_m and block_n ignored (16 each)': 'own_code',
    "lse's -inf rows overwritten in place (the caller's lse)": 'keeps_the_contract',
    'dq returned in fp32 for bf16 and fp16 inputs': 'within_2x',
    "dQ slots in the input's dtype": 'own_code',
    'the given atomic backward called': 'own_code',
}
MISTAKES = {name: (old, new, CAUGHT[name]) for name, old, new in SPEC.MISTAKES["ex2_det_backward"]}
CHECKS = ["own_code", "matches_float64", "within_2x", "same_bits_over_orders", "keeps_the_contract"]


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
    getattr(nb11_backward, check)(solution["deterministic_backward"])


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_mistake_fails_its_check(mistake):
    old, new, check = MISTAKES[mistake]
    assert ANSWER.count(old) == 1, f"{mistake}: the text to replace is not in the answer once"
    with pytest.raises(AssertionError, match="deterministic_backward"):
        getattr(nb11_backward, check)(_namespace(ANSWER.replace(old, new))["deterministic_backward"])


@pytest.mark.parametrize("accepted", [a[0] for a in SPEC.ACCEPTED["ex2_det_backward"]])
def test_accepted_answer_passes(accepted):
    old, new = next((o, n) for name, o, n in SPEC.ACCEPTED["ex2_det_backward"] if name == accepted)
    ns = _namespace(ANSWER.replace(old, new))
    for check in CHECKS:
        getattr(nb11_backward, check)(ns["deterministic_backward"])
