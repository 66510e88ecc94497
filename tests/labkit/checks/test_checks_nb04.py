"""Unit tests of labkit.checks.nb04: each visible check of 04_performance_analysis passes the solution's answers and,
on a known wrong answer (tests/mutants/nb04.py), raises AssertionError naming the rule it breaks."""
from __future__ import annotations

import inspect
import re

import pytest
from mutants import load
from notebook_grader import answers_namespace

from labkit.checks import nb04

SPEC = load("nb04")
CHECKS = {  # check -> (grade_id, a mistake of tests/mutants/nb04.py, words of the message that names its rule)
    nb04.phase_counts_by_hand: ("ex1_phase_counts", "softmax FLOPs", "softmax 5·N²"),
    nb04.flash_bytes_by_hand: ("ex2_flash_bytes", "ceil written as round(N / block_m + 0.5)", "奇數倍時不多算一塊"),
    nb04.intensity_rules: ("ex2_flash_bytes", "integer division", "arithmetic_intensity = flop / nbytes"),
    nb04.roofline_values: ("ex3_roofline", "min taken before multiplying by the bandwidth", "2 TB/s 的機器"),
    nb04.ridge_point: ("ex3_roofline", "ridge = peak (bandwidth taken as 1 TB/s)", "1.5 TB/s 的機器"),
    nb04.design_matrix_columns: ("ex4_predictor", "int32 columns (overflow)", "GPU 大小的設定不溢位"),
    nb04.fit_least_relative_error: ("ex4_predictor", "plain least squares", "最小化相對誤差"),
    nb04.mape_rules: ("ex4_predictor", "Series kept (index alignment)", "索引不是 0, 1, 2"),
}


def _answers(grade_id: str | None = None, mistake: str | None = None) -> dict:
    """Every answer cell of the notebook, the one of ``grade_id`` with ``mistake`` substituted."""
    return answers_namespace(SPEC, "import numpy as np\nimport pandas as pd\nimport torch\n", grade_id, mistake)


def test_every_check_of_the_module_is_tested():
    public = {f for name, f in vars(nb04).items() if inspect.isfunction(f) and not name.startswith("_")
              and f.__module__ == nb04.__name__}
    assert public == set(CHECKS), sorted(f.__qualname__ for f in public ^ set(CHECKS))


CONTRACT = [  # (check, a mistake of the contract's classes, words of the message that names its rule)
    (nb04.design_matrix_columns, "causal factor added as a column of the caller's df", "design_matrix：不修改輸入（df）"),
    (nb04.fit_least_relative_error, "X divided by y in place (the caller's array)", "fit_time_model：不修改輸入（X）"),
    (nb04.flash_bytes_by_hand, "elem_bytes ignored (bf16's 2 hard-coded)", "T_r 無條件進位"),
]


@pytest.mark.parametrize("check, mistake, words", CONTRACT, ids=lambda x: getattr(x, "__name__", None))
def test_the_contract_checks_name_their_rule(check, mistake, words):
    wrong = _answers("ex4_predictor" if check is not nb04.flash_bytes_by_hand else "ex2_flash_bytes", mistake)
    with pytest.raises(AssertionError, match=re.escape(words)):
        check(*(wrong[p] for p in inspect.signature(check).parameters))


@pytest.mark.parametrize("check", list(CHECKS), ids=lambda f: f.__name__)
def test_check_passes_the_solution_and_names_the_rule_a_mistake_breaks(check):
    answers = list(inspect.signature(check).parameters)  # a check's parameters are the answers' names
    solution = _answers()
    check(*(solution[p] for p in answers))
    grade_id, mistake, words = CHECKS[check]
    wrong = _answers(grade_id, mistake)
    with pytest.raises(AssertionError, match=re.escape(words)):
        check(*(wrong[p] for p in answers))
