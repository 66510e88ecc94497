"""Unit tests of labkit.checks.nb02 and nb02_model: each visible check of 02_gpt2_integration passes the solution's
answers and, on a known wrong answer (tests/mutants/nb02.py), raises AssertionError naming the rule it breaks."""
from __future__ import annotations

import inspect
import re

import pytest
from mutants import load
from notebook_grader import answers_namespace

from labkit.models import hf_attention
from labkit.checks import nb02, nb02_model

SPEC = load("nb02")
SETUP = ("import torch\nimport labkit as lk\nfrom transformers import AttentionInterface\n"
         "from transformers.masking_utils import AttentionMaskInterface, sdpa_mask\n")
CHECKS = {  # check -> (grade_id, a mistake of tests/mutants/nb02.py, words of the message that names its rule)
    nb02.own_formula: ("ex1_attention", "calls SDPA", "不呼叫 SDPA 或 labkit"),
    nb02.returns_output_and_none: ("ex1_attention", "[B, H, N, D] returned", "輸出排列 [B, N, H, D]"),
    nb02.keeps_the_contract: ("ex1_attention", "caller's query scaled in place", "my_attention：不修改輸入"),
    nb02.follows_scaling_and_masks: ("ex1_attention", "causal mask aligned top-left", "因果規則對齊右下角"),
    nb02.output_dtype_follows_value: ("ex1_attention", "fp64 inputs computed in fp32", "fp64 輸入以 fp64 計算"),
    nb02.precision_large_scores: ("ex1_attention", "scores and softmax in the input dtype", "分數很大"),
    nb02.precision_row_sum: ("ex1_attention", "own softmax: fp32 exp, its sum rounded to the input dtype",
                             "value 在每個 key 都相同"),
    nb02.precision_each_probability: ("ex1_attention", "scale rounded to the input dtype (a bf16 tensor)", "每個機率的相對誤差"),
    nb02.mask_on_query_device: ("ex1_attention", "causal mask on the default device", "the causal mask on query's device"),
    nb02_model.registers_in_both_tables: ("ex2_register", "eager_mask registered (an additive float mask)",
                                          "遮罩函式是 transformers 的 sdpa_mask"),
    nb02_model.refuses_flash_names: ("ex2_register", "registered before the 'flash' check", "拋出 ValueError 的名字沒有被註冊"),
    nb02_model.padding_mask_applied: ("ex2_register", "mask function returns None", "遮罩函式有作用"),
    nb02_model.agreement_returns_floats: ("ex3_agreement", "tensor returned, not a float", "是 Python float"),
    nb02_model.agreement_errors_and_rule: ("ex3_agreement", "no 1e-6 floor (<= kept)", "靠 1e-6 的下限通過"),
    nb02_model.agreement_eval_and_float64: ("ex3_agreement", "relative L2 in fp32", "在 float64 計算"),
    nb02_model.pads_both_sides: ("ex4_padding", "right pads keep the last position", "的 position_ids"),
    nb02_model.width_default_and_side: ("ex4_padding", "default side right", "side 預設為"),
    nb02_model.left_padded_logits_match_alone: ("ex4_padding", "position ids ignore the padding", "vs 單獨跑的 logits"),
    nb02_model.does_not_call_generate: ("ex5_decode", "calls model.generate", "不呼叫 model.generate"),
    nb02_model.decodes_like_without_cache: ("ex5_decode", "first position's logits", "有快取與沒有快取的 token 相同"),
}
HELPERS = {nb02.reference_bnhd, nb02.constant_v_case, nb02.identity_v_case, nb02_model.fresh_name, nb02_model.padded_vs_alone,
           nb02_model.rel_l2, nb02_model.errors, nb02_model.no_scaling, nb02_model.agreement_tiny, nb02_model.loud,
           nb02_model.as_long, nb02_model.without_cache, nb02_model.decode_uses_kv_cache}


def _answers(grade_id: str | None = None, mistake: str | None = None) -> dict:
    """Every answer cell of the notebook, the one of ``grade_id`` with ``mistake`` substituted."""
    return answers_namespace(SPEC, SETUP, grade_id, mistake)


def _run(check, ns: dict) -> None:
    """``check`` on the answers it names (its parameters are the answers' names); ``name``: a name registered fresh."""
    if check is nb02_model.padding_mask_applied:
        check(ns["register_attention"](nb02_model.fresh_name("test_checks"), hf_attention.attention_forward))
    else:
        check(*(ns[p] for p in inspect.signature(check).parameters))


def test_every_check_of_the_modules_is_tested():
    public = {f for m in (nb02, nb02_model) for name, f in vars(m).items() if inspect.isfunction(f)
              and not name.startswith("_") and f.__module__ == m.__name__}
    assert public - HELPERS == set(CHECKS), sorted(f.__qualname__ for f in public ^ set(CHECKS) - HELPERS)


CONTRACT = [  # (check, grade_id, a mistake of the contract's classes, words of the message that names its rule)
    (nb02.keeps_the_contract, "ex1_attention", "caller's mask inverted in place", "my_attention：不修改輸入"),
    (nb02.keeps_the_contract, "ex1_attention", "q and k flattened with .view (fails on transformers' transposed views)",
     "my_attention：輸入可以是 view"),
    (nb02.keeps_the_contract, "ex1_attention", "causal mask cached by query length", "my_attention：不留跨呼叫的狀態"),
    (nb02.keeps_the_contract, "ex1_attention", "causal mask on the default device", "my_attention：跟著輸入的裝置"),
    (nb02.keeps_the_contract, "ex1_attention", "scaling=0.0 taken as not given", "scaling=0.0 照用"),
    (nb02_model.registers_in_both_tables, "ex2_register", "first fn kept for every name", "register_attention：不留跨呼叫的狀態"),
    (nb02_model.pads_both_sides, "ex4_padding", "caller's lists padded in place", "pad_batch：不修改輸入"),
    (nb02_model.decodes_like_without_cache, "ex5_decode", "prompt tensor grown in place (set_)", "greedy_decode：不修改輸入"),
]


@pytest.mark.parametrize("check, grade_id, mistake, words", CONTRACT, ids=lambda x: getattr(x, "__name__", None))
def test_the_contract_checks_name_their_rule(check, grade_id, mistake, words):
    with pytest.raises(AssertionError, match=re.escape(words)):
        _run(check, _answers(grade_id, mistake))


@pytest.mark.parametrize("check", list(CHECKS), ids=lambda f: f.__name__)
def test_check_passes_the_solution_and_names_the_rule_a_mistake_breaks(check):
    _run(check, _answers())
    grade_id, mistake, words = CHECKS[check]
    with pytest.raises(AssertionError, match=re.escape(words)):
        _run(check, _answers(grade_id, mistake))
