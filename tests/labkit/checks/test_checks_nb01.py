"""Unit tests of labkit.checks.nb01*: each visible check of 01_setup_and_comparison passes the solution's answers
and, on a known wrong answer (tests/mutants/nb01.py), raises AssertionError naming the rule it breaks."""
from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import pytest
from mutants import load
from notebook_grader import answers_namespace

from labkit.checks import nb01, nb01_backward, nb01_forward, nb01_function, nb01_softmax, nb01_standard

SPEC = load("nb01")
ANSWER = {  # the answer each module's checks take: (grade_id, name the answer cell defines)
    nb01: ("ex2_score_matrix_bytes", "score_matrix_bytes"),
    nb01_standard: ("ex1_standard_attention", "standard_attention"),
    nb01_softmax: ("ex3_online_softmax", "online_softmax"),
    nb01_forward: ("ex4_flash_forward", "flash_attention_forward"),
    nb01_backward: ("ex5a_flash_backward", "flash_attention_backward"),
    nb01_function: ("ex5b_flash_function", "FlashAttention2"),
}
CHECKS = {  # check -> (a mistake of tests/mutants/nb01.py, words of the message that names its rule)
    nb01.score_bytes_for_every_dtype: ("bits instead of bytes", "score_matrix_bytes(1, 1, 1024, fp32)"),
    nb01.score_bytes_exact_python_int: ("product in 32-bit integers (wraps past 2**31)", "超過 2**31 的值"),
    nb01_standard.writes_its_own_softmax: ("torch.softmax for the weights", "自己寫 softmax 與 LSE"),
    nb01_standard.matches_reference: ("mask argument ignored", "o with mask [B, 1, N, Nk]"),
    nb01_standard.scale_zero_is_used: ("scale=0.0 taken as not given", "scale=0.0 is used"),
    nb01_standard.empty_rows_give_zero: ("NaN on an empty row", "no NaN"),
    nb01_standard.subtracts_row_max: ("global max instead of the row max", "scores near 1e4"),
    nb01_standard.float64_in_float64: ("fp32 accumulator for fp64", "float64"),
    nb01_standard.row_max_after_mask: ("row max taken before masking", "hidden keys with the largest scores"),
    nb01_standard.low_precision_statistics_in_fp32: ("sum l in the input dtype", "(2x rule)"),
    nb01_standard.keeps_the_contract: ("causal mask AND-ed into the caller's mask in place (mask &= tril)",
                                       "standard_attention：不修改輸入] 呼叫之後，傳入的 mask"),
    nb01_softmax.writes_its_own_softmax: ("torch.softmax itself", "自己寫 softmax"),
    nb01_softmax.matches_softmax: ("missing rescale of l", "online_softmax(block_size=16)"),
    nb01_softmax.keeps_a_running_max: ("running max starts at 0", "every value near -1e4"),
    nb01_softmax.float64_in_float64: ("fp32 accumulator for fp64", "float64"),
    nb01_softmax.statistics_in_fp32: ("running max and sum in the input dtype", "(2x rule)"),
    nb01_softmax.block_steps_in_fp32: ("x - m subtracted in the input dtype before the fp32 exp", "每個機率的相對誤差"),
    nb01_softmax.streams_blocks_in_two_passes: ("three passes: the row max first, then the sum", "two passes over x"),
    nb01_softmax.keeps_the_contract: ("second pass subtracts m in place from a block of x (xb -= m)", "online_softmax：不修改輸入"),
    nb01_forward.writes_its_own_code: ("SDPA for the output", "自己寫"),
    nb01_forward.matches_reference: ("missing rescale of O", "o (causal=False, blocks=32,16)"),
    nb01_forward.causal_bottom_right: ("tile mask aligned top-left", "causal N=24, Nk=57"),
    nb01_forward.skips_tiles_above_the_diagonal: ("causal tiles masked but not skipped", "causal block skipping"),
    nb01_forward.keeps_a_running_max: ("tile max taken before the causal mask", "hidden keys with the largest scores"),
    nb01_forward.float64_in_float64: ("fp32 accumulator for fp64", "float64"),
    nb01_forward.accumulators_in_fp32: ("O accumulator rounded to the input dtype each tile", "(2x rule)"),
    nb01_forward.outer_loop_over_q_blocks: ("K/V blocks outside, Q blocks inside (v1 order)", "outer loop over Q blocks"),
    nb01_forward.no_n_by_n_tensor: ("tile mask cut from a full N x Nk causal mask", "no N x N tensor"),
    nb01_forward.keeps_the_contract: ("block of q scaled in place (qi *= scale)", "flash_attention_forward：不修改輸入"),
    nb01_backward.writes_its_own_code: ("autograd through standard attention", "自己寫"),
    nb01_backward.matches_autograd: ("missing D term in dS", "dq (causal=False)"),
    nb01_backward.causal_bottom_right: ("NaN for rows that see no key", "no NaN"),
    nb01_backward.skips_tiles_above_the_diagonal: ("causal tiles masked but not skipped", "causal tile skipping"),
    nb01_backward.accumulates_in_fp32: ("dq, dk, dv accumulated in the input dtype", "blocks 4 (2x rule)"),
    nb01_backward.statistics_in_fp32: ("D from the bf16/fp16 product and sum (no upcast)", "D from bfloat16 o and do"),
    nb01_backward.keeps_the_contract: ("rows that see no key: the caller's lse set to +inf in place",
                                       "flash_attention_backward：不修改輸入] 呼叫之後，傳入的 第 5 個參數"),
    nb01_function.writes_its_own_code: ("backward by autograd through the tiled forward", "not autograd"),
    nb01_function.matches_autograd_and_saves_lse: ("extra statistic saved", "saved log-sum-exp"),
    nb01_function.causal_bottom_right: ("causal flag lost for backward", "causal N=24, Nk=70, dq (float64)"),
    nb01_function.bf16_o_and_fp32_lse: ("lse saved in the input dtype", "save an fp32 lse"),
    nb01_function.no_n_by_n_tensor: ("forward through standard_attention (N x N scores)", "forward: no N x N tensor"),
    nb01_function.keeps_is_causal_per_call: ("is_causal kept on the class, not on ctx", "is_causal 留在自己的 ctx 上"),
    nb01_function.works_on_views: ("leading dims flattened with .view (fails on a transposed q)", "輸入可以是 view"),
}
MORE = [  # (check, mistake, words): the other mistakes of a class each contract check is there for
    (nb01_standard.keeps_the_contract, "causal mask built without device= (on the CPU)", "跟著輸入的裝置（device）"),
    (nb01_softmax.keeps_the_contract, "running max built without device= (on the CPU)", "跟著輸入的裝置（device）"),
    (nb01_forward.keeps_the_contract, "tile mask columns built without device= (on the CPU)", "跟著輸入的裝置（device）"),
    (nb01_backward.keeps_the_contract, "tile mask columns built without device= (on the CPU)", "跟著輸入的裝置（device）"),
    (nb01_function.keeps_is_causal_per_call, "is_causal kept in a module-level global, not on ctx", "is_causal 留在自己的 ctx 上"),
]
ORDER_FREE = {  # check of how the blocks are read -> the ACCEPTED answer (another block order) it must pass
    nb01_softmax.streams_blocks_in_two_passes: "first pass right to left (the prose sets no order)",
    nb01_forward.outer_loop_over_q_blocks: "Q blocks visited last to first (they run in parallel on a GPU)",
}


def _answers(grade_id: str | None = None, mistake: str | None = None) -> dict:
    """Every answer cell of the notebook, the one of ``grade_id`` with ``mistake`` substituted."""
    return answers_namespace(SPEC, "import torch\n", grade_id, mistake)


def _accepted(grade_id: str, what: str) -> dict:
    """Every answer cell of the notebook, the one of ``grade_id`` rewritten as ACCEPTED's ``what``."""
    (old, new), = [(old, new) for name, old, new in SPEC.ACCEPTED[grade_id] if name == what]
    spec = SimpleNamespace(ASSIGNMENT=SPEC.ASSIGNMENT, MISTAKES={grade_id: [(what, old, new)]})
    return answers_namespace(spec, "import torch\n", grade_id, what)


def _exercise(check) -> tuple[str, str]:
    """(grade_id, name of the answer) that ``check`` takes."""
    return ANSWER[sys.modules[check.__module__]]


@pytest.fixture(scope="module")
def solution():
    return _answers()


def test_every_check_of_the_modules_is_tested():
    public = {f for m in ANSWER for name, f in vars(m).items() if callable(f) and not name.startswith("_")
              and getattr(f, "__module__", "") == m.__name__ and not isinstance(f, type)}
    helpers = {nb01.causal_keep, nb01.plain_attention, nb01.reference_grads, nb01.plain_grads, nb01.check_against_reference, nb01_softmax.within_2x,
               nb01_softmax.streamed, nb01_backward.d_term_in_fp32, nb01.reads_per_index}
    assert public - helpers == set(CHECKS), sorted(f.__qualname__ for f in public ^ set(CHECKS) - helpers)


@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f"{f.__module__.split('.')[-1]}.{f.__name__}")
def test_check_passes_the_solution(check, solution):
    check(solution[_exercise(check)[1]])


@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f"{f.__module__.split('.')[-1]}.{f.__name__}")
def test_check_names_the_rule_a_wrong_answer_breaks(check):
    mistake, words = CHECKS[check]
    grade_id, name = _exercise(check)
    with pytest.raises(AssertionError, match=re.escape(words)):
        check(_answers(grade_id, mistake)[name])


@pytest.mark.parametrize("check, mistake, words", MORE, ids=[m for _, m, _ in MORE])
def test_contract_checks_name_each_class_of_mistake(check, mistake, words):
    grade_id, name = _exercise(check)
    with pytest.raises(AssertionError, match=re.escape(words)):
        check(_answers(grade_id, mistake)[name])


@pytest.mark.parametrize("check", ORDER_FREE, ids=lambda f: f.__name__)
def test_block_order_is_free(check):
    grade_id, name = _exercise(check)
    check(_accepted(grade_id, ORDER_FREE[check])[name])


def test_reads_per_index_counts_each_read_once_and_a_block_read_twice_in_a_row_once():
    assert nb01.reads_per_index([(4, 4), (0, 4), (0, 4), (4, 4), (0, 4)], 8) == [2] * 4 + [2] * 4
    assert nb01.reads_per_index([(0, 3), (3, 3), (0, 6)], 5) == [2] * 5
