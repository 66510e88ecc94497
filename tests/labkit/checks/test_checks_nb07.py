"""Unit tests of labkit.checks.nb07: each visible check of 07_context_parallel passes the solution's answers and, on
a known wrong answer (tests/mutants/nb07.py), raises AssertionError naming the rule it breaks."""
from __future__ import annotations

import inspect
import re
import sys

import pytest
from mutants import load
from notebook_grader import answers_namespace

from labkit.checks import nb07

SPEC = load("nb07")
ANSWER = {"ex1_merge": "merge_partials", "ex2_zigzag": "zigzag_chunks", "ex3_causal_work": "causal_work"}
CHECKS = {  # check -> (grade_id, a mistake of tests/mutants/nb07.py, words of the message that names its rule)
    nb07.merge_equals_full_attention: ("ex1_merge", "plain average, no rescale", "合併的 o 等於對全部鍵的注意力"),
    nb07.merge_keeps_the_contract: ("ex1_merge", "caller's lse1 shifted in place (.to(float64) does not copy)",
                                    "merge_partials：不修改輸入"),
    nb07.merge_handles_empty_rows: ("ex1_merge", "-inf - -inf trap", "兩邊都沒有可見的鍵時不可出現 NaN"),
    nb07.merge_keeps_dtypes: ("ex1_merge", "o returned in o2's dtype", "o 與 o1 同 dtype"),
    nb07.merge_rounds_once: ("ex1_merge", "weighted sum of o in o's dtype (weights cast down)", "只在最後捨入一次"),
    nb07.zigzag_layouts: ("ex2_zigzag", "round-robin instead of head-tail", "裝置 i 拿第 i 段與第 2P-1-i 段"),
    nb07.causal_work_counts: ("ex3_causal_work", "diagonal block counted whole", "整個因果三角形 N(N+1)/2"),
}


def _answers(grade_id: str | None = None, mistake: str | None = None) -> dict:
    return answers_namespace(SPEC, "import torch\n", grade_id, mistake)


@pytest.fixture(scope="module")
def solution():
    return _answers()


def test_every_check_of_the_module_is_tested():
    public = {f for name, f in vars(nb07).items() if inspect.isfunction(f) and not name.startswith("_")
              and f.__module__ == nb07.__name__}
    assert public - {nb07.count_pairs} == set(CHECKS), sorted(f.__qualname__ for f in public ^ set(CHECKS))


@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__)
def test_check_passes_the_solution(check, solution):
    check(solution[ANSWER[CHECKS[check][0]]])


@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__)
def test_check_names_the_rule_a_wrong_answer_breaks(check):
    grade_id, mistake, words = CHECKS[check]
    with pytest.raises(AssertionError, match=re.escape(words)):
        check(_answers(grade_id, mistake)[ANSWER[grade_id]])


@pytest.mark.parametrize("mistake, words", [("o1 flattened with .view (fails on a transposed view)", "merge_partials：輸入可以是 view"),
                                             ("zero shift made on the default device", "merge_partials：跟著輸入的裝置")])
def test_the_contract_names_views_and_device(mistake, words):
    with pytest.raises(AssertionError, match=re.escape(words)):
        nb07.merge_keeps_the_contract(_answers("ex1_merge", mistake)["merge_partials"])


def test_count_pairs_counts_the_causal_pairs_of_its_chunks():
    assert nb07.count_pairs([0], 3) == 6            # the 3 x 3 lower triangle
    assert nb07.count_pairs([1], 2) == 2 * 2 + 3    # chunk 1 sees all of chunk 0 and its own triangle
    assert nb07.count_pairs([0, 1], 2) == 10        # the whole triangle of N = 4


def test_the_module_is_reached_from_the_notebook_import():
    import labkit as lk

    assert lk.checks.nb07 is sys.modules["labkit.checks.nb07"]
