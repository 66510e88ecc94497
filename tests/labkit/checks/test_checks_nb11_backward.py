"""Unit tests of labkit.checks.nb11_backward: each visible check of 11_determinism's exercise 2 passes the solution's
deterministic backward and, on a known wrong answer, raises AssertionError naming the rule it breaks; right answers
written another way pass every check (the mistake that keeps the atomics fails the bit check: it can fail). Through
the interpreter on a CPU.

The answer comes from the solution notebook, the mistakes from tests/mutants/nb11.py; CAUGHT names the check that
must catch each.
"""
from __future__ import annotations

from check_module_cases import cases

from labkit.checks import nb11_backward

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
CHECKS = ["own_code", "matches_float64", "within_2x", "same_bits_over_orders", "keeps_the_contract"]
globals().update(cases("nb11", "ex2_det_backward", nb11_backward, "deterministic_backward", CAUGHT, CHECKS))
