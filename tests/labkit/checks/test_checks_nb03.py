"""Unit tests of labkit.checks.nb03 and nb03_positions: each visible check of 03_long_sequence_training passes the
solution's answers and, on a known wrong answer (tests/mutants/nb03.py), raises AssertionError naming the rule it
breaks."""
from __future__ import annotations

import inspect
import re
import sys
from types import SimpleNamespace

import pytest
import torch
from mutants import load
from notebook_grader import answers_namespace

from labkit.checks import nb03, nb03_positions

SPEC = load("nb03")
ANSWER = {  # grade_id -> name its answer cell defines
    "ex1_fit_coefficients": "fit_memory_coefficients", "ex2_chunked_ce": "chunked_cross_entropy",
    "ex3_extend_positions": "extend_learned_positions", "ex4_rope": "rope",
}
CHECKS = {  # check -> (grade_id, a mistake of tests/mutants/nb03.py, words of the message that names its rule)
    nb03.fit_recovers_coefficients: ("ex1_fit_coefficients", "numpy floats returned", "returns a dict of three Python floats"),
    nb03.fit_minimizes_relative_error: ("ex1_fit_coefficients", "absolute instead of relative error",
                                        "minimizes the relative error"),
    nb03.fit_refuses_underdetermined_runs: ("ex1_fit_coefficients", "underdetermined runs accepted",
                                            "flash runs only -> ValueError"),
    nb03.ce_matches_full_float64: ("ex2_chunked_ce", "fp32 for fp64 inputs", "a float64 scalar for float64 inputs"),
    nb03.ce_keeps_the_contract: ("ex2_chunked_ce", ".view instead of .reshape (non-contiguous hidden)",
                                 "chunked_cross_entropy：輸入可以是 view"),
    nb03.ce_holds_one_chunk_at_a_time: ("ex2_chunked_ce", "all logits at once", "at most one chunk of logits at a time"),
    nb03.ce_low_precision_in_float32: ("ex2_chunked_ce", "softmax in the input dtype (bf16)",
                                       "softmax and loss in float32 for bf16 inputs"),
    nb03.ce_large_logits_stay_finite: ("ex2_chunked_ce", "log-sum-exp without the row max", "large logits"),
    nb03_positions.extend_tiles_the_table: ("ex3_extend_positions", "repeat_interleave instead of tiling",
                                            "row i = old row i mod 32"),
    nb03_positions.extend_keeps_grad_dtype_and_device: ("ex3_extend_positions", "frozen table made trainable",
                                                        "a frozen table stays frozen"),
    nb03_positions.extend_refuses_no_growth: ("ex3_extend_positions", "same length accepted",
                                              "extend a 32-position table to 32: ValueError"),
    nb03_positions.rope_rotates_pairs: ("ex4_rope", "rotate_half sign", "rope: D = 2"),
    nb03_positions.rope_float64_any_shape: ("ex4_rope", "fp32 angles for fp64", "float64 accuracy"),
    nb03_positions.rope_scores_depend_on_distance: ("ex4_rope", None, "scores at distance 0 all equal"),
    nb03_positions.rope_angles_in_fp32: ("ex4_rope", "angles in half precision", "angles in fp32"),
    nb03_positions.rope_keeps_the_contract: ("ex4_rope", "cos/sin cached in a module-level dict keyed by (N, D): the base ignored",
                                             "rope：不留跨呼叫的狀態"),
}
CONTRACT = {  # mistake of ex4 -> the rule of rope_keeps_the_contract it breaks
    "cos/sin from an lru_cache'd helper that takes (N, D) and reads the base from a global": "rope：不留跨呼叫的狀態",
    "leading dimensions flattened with .view (x assumed contiguous)": "rope：輸入可以是 view",
    "rotation written in place into x.to(acc).contiguous() (the caller's fp32 x)": "rope：不修改輸入",
    "tables built on the CPU": "rope：跟著輸入的裝置",
}


SETUP = "import numpy as np\nimport torch\nimport torch.nn.functional as F\n"


def _answers(grade_id: str | None = None, mistake: str | None = None) -> dict:
    return answers_namespace(SPEC, SETUP, grade_id, mistake)


@pytest.fixture(scope="module")
def solution():
    return _answers()


def _wrong(check, solution):
    """The wrong answer for ``check``: its mutant, or (no mutant breaks relative positions) rope of x scaled per row."""
    grade_id, mistake, _ = CHECKS[check]
    if mistake is None:
        right = solution["rope"]
        return lambda x, base=10000.0: right(x * (1 + torch.arange(x.shape[-2], dtype=x.dtype)[:, None] / 50), base)
    return _answers(grade_id, mistake)[ANSWER[grade_id]]


def test_every_check_of_the_modules_is_tested():
    public = {f for m in (nb03, nb03_positions) for name, f in vars(m).items() if inspect.isfunction(f)
              and not name.startswith("_") and f.__module__ == m.__name__}
    helpers = {nb03.model_bytes, nb03.model_runs, nb03_positions.rope_complex}
    assert public - helpers == set(CHECKS), sorted(f.__qualname__ for f in public ^ set(CHECKS) - helpers)


@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f"{f.__module__.split('.')[-1]}.{f.__name__}")
def test_check_passes_the_solution(check, solution):
    check(solution[ANSWER[CHECKS[check][0]]])


@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f"{f.__module__.split('.')[-1]}.{f.__name__}")
def test_check_names_the_rule_a_wrong_answer_breaks(check, solution):
    with pytest.raises(AssertionError, match=re.escape(CHECKS[check][2])):
        check(_wrong(check, solution))


@pytest.mark.parametrize("mistake", CONTRACT)
def test_the_rope_contract_names_each_rule_a_wrong_answer_breaks(mistake):
    with pytest.raises(AssertionError, match=re.escape(CONTRACT[mistake])):
        nb03_positions.rope_keeps_the_contract(_answers("ex4_rope", mistake)["rope"])


@pytest.mark.parametrize("accepted", [name for name, _, _ in SPEC.ACCEPTED["ex4_rope"]])
def test_the_rope_contract_passes_right_answers_written_another_way(accepted):
    as_mistakes = SimpleNamespace(ASSIGNMENT=SPEC.ASSIGNMENT, MISTAKES=SPEC.ACCEPTED)
    rope = answers_namespace(as_mistakes, SETUP, "ex4_rope", accepted)["rope"]
    nb03_positions.rope_keeps_the_contract(rope)
    nb03_positions.rope_rotates_pairs(rope)


def test_model_runs_hold_the_memory_models_bytes():
    runs = nb03.model_runs(nb03.ODD, nb03.TINIES[:1], lens=(64,), batches=(2,))
    assert list(runs["flash"]) == [False, True] and (runs["saved_bytes"] > 0).all()
    assert runs["saved_bytes"][0] > runs["saved_bytes"][1]  # standard attention also keeps the N x N scores


def test_rope_complex_is_the_solutions_rope_in_float64(solution):
    x = torch.randn(2, 7, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(nb03_positions.rope_complex(x, 300.0), solution["rope"](x, base=300.0))


def test_the_modules_are_reached_from_the_notebook_import():
    import labkit as lk

    assert lk.checks.nb03 is sys.modules["labkit.checks.nb03"]
    assert lk.checks.nb03_positions is sys.modules["labkit.checks.nb03_positions"]
