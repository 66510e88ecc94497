"""Unit tests of labkit.checks.nb11_decode: each visible check of 11_determinism's exercise 3 passes the solution's
invariant decode and, on a known wrong answer, raises AssertionError naming the rule it breaks; right answers written
another way pass; the given dynamic decode is correct but fails batch invariance (the test can fail).

The answer comes from the solution notebook, the mistakes from tests/mutants/nb11.py; CAUGHT names the check that
must catch each.
"""
from __future__ import annotations

import pytest
from check_module_cases import cases

from labkit.checks import nb11_decode
from labkit.determinism import decode as detdecode

SETUP = ("import math\nimport torch\nimport labkit as lk\nMODE = lk.tritonmode.setup()\nimport triton\n"
         "split_partials = lk.detdecode.split_partials\n")
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
CHECKS = ["own_combine", "matches_float64", "batch_invariant", "same_bits_over_orders", "keeps_the_contract"]
globals().update(cases("nb11", "ex3_invariant_decode", nb11_decode, "invariant_decode", CAUGHT, CHECKS, SETUP))


def test_the_given_dynamic_decode_is_correct_but_not_batch_invariant():
    def dynamic(q, k_cache, v_cache, lens, split_size=48):   # the exercise's signature; the split size is its own
        return detdecode.dynamic_decode(q, k_cache, v_cache, lens)
    nb11_decode.matches_float64(dynamic)
    with pytest.raises(AssertionError, match="批次不變"):
        nb11_decode.batch_invariant(dynamic)
