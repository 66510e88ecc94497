"""Unit tests of labkit.checks.nb05*: each visible check of 05_precision_analysis passes the solution's answers
and, on a known wrong answer (tests/mutants/nb05.py), raises AssertionError naming the rule it breaks."""
from __future__ import annotations

import inspect
import re
import sys
from types import SimpleNamespace

import pytest
import torch
from mutants import load
from notebook_grader import answers_namespace

from labkit.checks import nb05, nb05_layernorm, nb05_policy

SPEC = load("nb05")
ANSWER = {  # grade_id -> name its answer cell defines
    "ex1_accumulate": "accumulate", "ex2_error_report": "error_report",
    "ex3_layernorm": "layer_norm_fp32_stats", "ex4_policy": "precision_policy",
}
CHECKS = {  # check -> (grade_id, a mistake of tests/mutants/nb05.py, words of the message that names its rule)
    nb05.sums_in_own_loop: ("ex1_accumulate", "torch.sum", "不可用 torch.sum / cumsum"),
    nb05.sums_leave_values_unchanged: ("ex1_accumulate",
                                       "accumulator started from values[0] and added in place (changes the caller's values)",
                                       "accumulate（float16 的 values 與累加器，compensated=False"),
    nb05.sums_round_every_step: ("ex1_accumulate", "Kahan with a final correction s - c", "Kahan 補償求和回傳累加器 s"),
    nb05.fp32_accumulator_within_2x: ("ex1_accumulate", "in-place add into an accumulator of the values' dtype",
                                      "fp32 累加器：torch.bfloat16 的 values 累加成 FP32"),
    nb05.report_has_four_floats_by_the_formulas: ("ex2_error_report", "tensors instead of floats", "是 Python float"),
    nb05.report_computes_in_float64: ("ex2_error_report", "difference taken in the input dtype", "差也在 float64 算"),
    nb05.report_sees_one_vector_of_any_layout: ("ex2_error_report", "cosine per row, averaged", "把整個張量當成一個向量"),
    nb05.report_refuses_only_an_all_zero_reference: ("ex2_error_report", "zero reference accepted", "reference 全為 0"),
    nb05.report_leaves_inputs_unchanged: ("ex2_error_report", "in-place difference (changes a float64 candidate)",
                                          "：不修改輸入"),
    nb05_layernorm.uses_no_ready_made_norm: ("ex3_layernorm", "F.layer_norm on fp32", "不可呼叫任何現成的正規化函式或層"),
    nb05_layernorm.normalizes_last_dim_with_affine: ("ex3_layernorm", "weight ignored", "對最後一維正規化"),
    nb05_layernorm.fp32_two_pass_statistics: ("ex3_layernorm", "statistics in half precision", "統計量在 FP32、用 two-pass"),
    nb05_layernorm.affine_in_fp32_within_2x: ("ex3_layernorm", "affine in half (y cast to x.dtype before x weight + bias)",
                                              "2 倍規則"),
    nb05_layernorm.fp32_params_keep_x_dtype: ("ex3_layernorm", "output in weight's dtype", "bf16 的 x、fp32 的 weight 與 bias"),
    nb05_layernorm.eps_inside_the_sqrt: ("ex3_layernorm", "eps hard-coded to the default", "用呼叫者傳入的 eps"),
    nb05_layernorm.small_eps_kept_in_fp32: ("ex3_layernorm", "eps rounded to x's dtype (torch.tensor(eps).to(x))",
                                            "eps 很小時輸出仍是有限值（float16 的 x、eps=1e-08"),
    nb05_layernorm.layernorm_keeps_the_contract: ("ex3_layernorm", "in-place centring (changes a float32 x)",
                                                  "：不修改輸入"),
    nb05_policy.training_dtypes: ("ex4_policy", "half-precision weights while training", "訓練時 precision_policy('residual_stream', bf16)"),
    nb05_policy.inference_dtypes: ("ex4_policy", "optimizer state in amp_dtype at inference",
                                   "推論時 precision_policy('optimizer_state', bf16) 仍是 FP32"),
    nb05_policy.refuses_fp32_flash_and_unknown_ops: ("ex4_policy", "ValueError without a message", "ValueError 的訊息說明原因"),
}


SETUP = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"
CONTRACT = {  # mistake of ex3 -> the rule of layernorm_keeps_the_contract it breaks
    "rows flattened with .view (x assumed contiguous)": "：輸入可以是 view",
    "eps as a one-element tensor made on the CPU": "：跟著輸入的裝置",
}


def _answers(grade_id: str | None = None, mistake: str | None = None) -> dict:
    """Every answer cell of the notebook, the one of ``grade_id`` with ``mistake`` substituted."""
    return answers_namespace(SPEC, SETUP, grade_id, mistake)


def _run(check, fn) -> None:
    """``check(fn)``, with a generator seeded 0 where the check draws its inputs from one (as ex3's cell does)."""
    if "g" in inspect.signature(check).parameters:
        check(fn, torch.Generator().manual_seed(0))
    else:
        check(fn)


@pytest.fixture(scope="module")
def solution():
    return _answers()


def test_every_check_of_the_modules_is_tested():
    modules = (nb05, nb05_layernorm, nb05_policy)
    public = {f for m in modules for name, f in vars(m).items() if inspect.isfunction(f) and not name.startswith("_")
              and f.__module__ == m.__name__}
    helpers = {nb05.returns_0d_in, nb05_layernorm.cancelling_inputs}
    assert public - helpers == set(CHECKS), sorted(f.__qualname__ for f in public ^ set(CHECKS) - helpers)


@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f"{f.__module__.split('.')[-1]}.{f.__name__}")
def test_check_passes_the_solution(check, solution):
    _run(check, solution[ANSWER[CHECKS[check][0]]])


@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f"{f.__module__.split('.')[-1]}.{f.__name__}")
def test_check_names_the_rule_a_wrong_answer_breaks(check):
    grade_id, mistake, words = CHECKS[check]
    with pytest.raises(AssertionError, match=re.escape(words)):
        _run(check, _answers(grade_id, mistake)[ANSWER[grade_id]])


@pytest.mark.parametrize("mistake", CONTRACT)
def test_the_layernorm_contract_names_each_rule_a_wrong_answer_breaks(mistake):
    with pytest.raises(AssertionError, match=re.escape(CONTRACT[mistake])):
        nb05_layernorm.layernorm_keeps_the_contract(_answers("ex3_layernorm", mistake)["layer_norm_fp32_stats"])


@pytest.mark.parametrize("accepted", [name for name, _, _ in SPEC.ACCEPTED["ex3_layernorm"]])
def test_the_new_layernorm_checks_pass_right_answers_written_another_way(accepted):
    as_mistakes = SimpleNamespace(ASSIGNMENT=SPEC.ASSIGNMENT, MISTAKES=SPEC.ACCEPTED)
    fn = answers_namespace(as_mistakes, SETUP, "ex3_layernorm", accepted)["layer_norm_fp32_stats"]
    nb05_layernorm.small_eps_kept_in_fp32(fn)
    nb05_layernorm.layernorm_keeps_the_contract(fn)


def test_returns_0d_in_names_the_call():
    nb05.returns_0d_in(torch.zeros((), dtype=torch.float16), torch.float16, "accumulate(x, float16)")
    for wrong in (0.25, torch.zeros(1, dtype=torch.float16), torch.zeros((), dtype=torch.float32)):
        with pytest.raises(AssertionError, match=re.escape("accumulate(x, float16) 回傳 acc_dtype 的 0 維張量")):
            nb05.returns_0d_in(wrong, torch.float16, "accumulate(x, float16)")


def test_cancelling_inputs_give_a_small_output_from_a_large_weight():
    x, w, b = nb05_layernorm.cancelling_inputs(torch.bfloat16, 3, (5, 40))
    assert (x.shape, w.shape, b.shape) == ((5, 40), (40,), (40,)) and {x.dtype, w.dtype, b.dtype} == {torch.bfloat16}
    y = torch.nn.functional.layer_norm(x.double(), (40,), w.double(), b.double())
    assert y.abs().mean() < 0.1 * w.double().abs().mean()


def test_the_module_is_reached_from_the_notebook_import():
    import labkit as lk

    assert lk.checks.nb05_layernorm is sys.modules["labkit.checks.nb05_layernorm"]
    assert lk.checks.nb05_policy is sys.modules["labkit.checks.nb05_policy"]
