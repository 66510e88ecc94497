"""Unit tests of labkit.checks.nb11_decode: each visible check of 11_determinism's exercise 3 passes the solution's
invariant decode and, on a known wrong answer, raises AssertionError naming the rule it breaks; right answers written
another way pass; the given dynamic decode is correct but fails batch invariance (the test can fail).

The answer comes from the solution notebook, the mistakes from tests/mutants/nb11.py; CAUGHT names the check that
must catch each.
"""
from __future__ import annotations

import pytest
from mutants import load
from notebook_grader import NotebookRunner, exercises

from labkit.checks import nb11_decode
from labkit.determinism import decode as detdecode

SETUP = ("import math\nimport torch\nimport labkit as lk\nMODE = lk.tritonmode.setup()\nimport triton\n"
         "split_partials = lk.detdecode.split_partials\n")
SPEC = load("nb11")
ANSWER = next(e.answer for e in exercises(SPEC.ASSIGNMENT) if e.grade_id == "ex3_invariant_decode")
CAUGHT = {  # mistake -> the visible check of labkit.checks.nb11_decode that catches it
    'split count from the batch (the launch heuristic)': 'batch_invariant',
    'split size derived from the longest request (4 splits)': 'batch_invariant',
    'no max subtracted in the combine': 'matches_float64',
    "the combine shifted by the batch's largest lse, not each request's": 'batch_invariant',
    'partials averaged, not weighted by their lse': 'matches_float64',
    'the split_size argument ignored (always 48)': 'batch_invariant',
    'o left in fp32 for bf16 q': 'matches_float64',
    "the partials rounded to q's dtype before the combine": 'matches_float64',
    "the combine divided in q's dtype": 'matches_float64',
    'the given combine called': 'own_combine',
}
MISTAKES = {name: (old, new, CAUGHT[name]) for name, old, new in SPEC.MISTAKES["ex3_invariant_decode"]}
CHECKS = ["own_combine", "matches_float64", "batch_invariant", "same_bits_over_orders", "keeps_the_contract"]


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
    getattr(nb11_decode, check)(solution["invariant_decode"])


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_mistake_fails_its_check(mistake):
    old, new, check = MISTAKES[mistake]
    assert ANSWER.count(old) == 1, f"{mistake}: the text to replace is not in the answer once"
    with pytest.raises(AssertionError, match="invariant_decode"):
        getattr(nb11_decode, check)(_namespace(ANSWER.replace(old, new))["invariant_decode"])


@pytest.mark.parametrize("accepted", [a[0] for a in SPEC.ACCEPTED["ex3_invariant_decode"]])
def test_accepted_answer_passes(accepted):
    old, new = next((o, n) for name, o, n in SPEC.ACCEPTED["ex3_invariant_decode"] if name == accepted)
    ns = _namespace(ANSWER.replace(old, new))
    for check in CHECKS:
        getattr(nb11_decode, check)(ns["invariant_decode"])


def test_the_given_dynamic_decode_is_correct_but_not_batch_invariant():
    def dynamic(q, k_cache, v_cache, lens, split_size=48):   # the exercise's signature; the split size is its own
        return detdecode.dynamic_decode(q, k_cache, v_cache, lens)
    nb11_decode.matches_float64(dynamic)
    with pytest.raises(AssertionError, match="批次不變"):
        nb11_decode.batch_invariant(dynamic)
