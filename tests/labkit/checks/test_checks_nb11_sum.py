"""Unit tests of labkit.checks.nb11_sum: each visible check of 11_determinism's exercise 1 passes the solution's
fixed_order_sum and, on a known wrong answer, raises AssertionError naming the rule it breaks; the right answer written
another way passes; calling the given atomic_sum fails own_code. Through the interpreter on a CPU.

The answer comes from the solution notebook, the mistakes from tests/mutants/nb11.py; CAUGHT names the check that
must catch each.
"""
from __future__ import annotations

import pytest
from check_module_cases import cases

from labkit.checks import nb11_sum
from labkit.determinism import reduce as detreduce

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
CHECKS = ["own_code", "same_bits_over_orders", "matches_float64", "keeps_the_contract"]
globals().update(cases("nb11", "ex1_fixed_order_sum", nb11_sum, "fixed_order_sum", CAUGHT, CHECKS))


def test_the_given_atomic_sum_is_not_own_code():
    with pytest.raises(AssertionError, match="atomic_sum"):
        nb11_sum.own_code(lambda x, block: detreduce.atomic_sum(x, block))
