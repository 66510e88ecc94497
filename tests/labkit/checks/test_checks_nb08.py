"""Unit tests of labkit.checks.nb08*: visible checks of 08_decode_attention pass the solution's answers and, on a known
wrong answer (tests/mutants/nb08.py), raise AssertionError naming the rule it breaks. The kernels run in Triton's
interpreter, so only checks of a few small launches are tried here (the whole cells: tests/test_grader_strength.py)."""
from __future__ import annotations

import re
import sys

import pytest
import torch
from mutants import load
from notebook_grader import NotebookRunner, exercises, setup_cells

from labkit.checks import contract, nb08, nb08_combine, nb08_decode, nb08_paged, nb08_split

SPEC = load("nb08")
ITEMS = {e.grade_id: e for e in exercises(SPEC.ASSIGNMENT)}
CHECKS = {  # check -> (grade_id, names its arguments take from the notebook, a mistake of tests/mutants/nb08.py, words)
    nb08.kv_bytes_count_each_factor: ("ex1_kv_calculator", ("kv_bytes_per_token",), "layers left out", "kv_bytes_per_token：GPT-2 small，bf16"),
    nb08.context_and_batch_round_down: ("ex1_kv_calculator", ("max_context", "max_batch"),
                                        "largest batch rounded to the nearest integer", "向下取整，不是四捨五入"),
    nb08.calculators_return_ints: ("ex1_kv_calculator", ("kv_bytes_per_token", "max_context", "max_batch"),
                                   "no int() for a float budget", "回傳 Python int"),
    nb08.one_sequence_grows: ("ex5_page_allocator", ("PageAllocator",), "a page too many at the boundary", "佔 ceil(8 / 4) = 2 頁"),
    nb08.sequences_interleave: ("ex5_page_allocator", ("PageAllocator",), "contiguous slots assumed", "兩條序列交錯長大"),
    nb08.out_of_pages_then_free: ("ex5_page_allocator", ("PageAllocator",), "last page partly filled before MemoryError",
                                  "MemoryError 之後什麼都沒變（最後一頁還有空位時也一樣）"),
    nb08_split.split_count: ("ex3_split_kernel", ("choose_num_splits",), "floor instead of ceil for the SM fill",
                             "choose_num_splits(1, 8, 4096, 132, 64)"),
    nb08_decode.padded_rows_not_written: ("ex2_decode_kernel", ("_decode_kernel", "HELPERS"),
                                          "o stored without the row mask (padded rows written)", "多出來的 13 列沒有寫到 o、lse 之外"),
    nb08_decode.kv_read_once: ("ex2_decode_kernel", ("decode_attention", "HELPERS"), None, None),
    nb08_split.offsets_64bit: ("ex3_split_kernel", ("_split_kernel", "HELPERS"), "32-bit offsets (program id not widened)",
                               "位址以 64 位元計算"),
    nb08_combine.reads_only_s_splits: ("ex4_combine_kernel", ("_combine_kernel", "HELPERS"),
                                       "o_s loaded without the split mask (BLOCK_S padding read)", "只讀 S 段部分結果"),
    nb08_paged.padded_rows_not_written: ("ex6_paged_kernel", ("_paged_split_kernel", "HELPERS"),
                                         "partials stored without the row mask", "多出來的列沒有寫到 o_part、lse_part 之外"),
    nb08_paged.offsets_64bit: ("ex6_paged_kernel", ("_paged_split_kernel", "HELPERS"), "page id not widened to 64 bits",
                               "位址以 64 位元計算"),
    nb08.weights_larger_than_memory: ("ex1_kv_calculator", ("max_context", "max_batch"),
                                      "negative budget not clamped at 0 (max_batch)", "max_batch：記憶體比權重小"),
    nb08.out_of_order_free: ("ex5_page_allocator", ("PageAllocator",),
                             "pages handed out by a counter of pages in use (an out-of-order free hands out a page in use)",
                             "沒有一頁同時屬於兩個地方"),
    nb08_decode.other_key_block: ("ex2_decode_kernel", ("_decode_kernel", "HELPERS"), "key block fixed at the interpreter's 16",
                                  "BLOCK_N = 32，不是 notebook 的 16"),
    nb08_decode.keeps_the_contract: ("ex2_decode_kernel", ("decode_attention", "HELPERS"),
                                     "o allocated like q (empty_like copies a transposed q's strides)", "decode_attention：輸入可以是 view"),
    nb08_split.other_key_block: ("ex3_split_kernel", ("_split_kernel", "HELPERS"), "key block fixed at the interpreter's 16",
                                 "BLOCK_N = 32，不是 notebook 的 16"),
    nb08_split.keeps_the_contract: ("ex3_split_kernel", ("split_kv_partials", "HELPERS"),
                                    "lengths handed to the kernel as they come (a strided view read as contiguous)", "間隔取值"),
    nb08_combine.keeps_the_contract: ("ex4_combine_kernel", ("combine_partials", "HELPERS"),
                                      "partials handed to the kernel as they come (a view read as contiguous)",
                                      "combine_partials：輸入可以是 view"),
    nb08_paged.keeps_the_contract: ("ex6_paged_kernel", ("paged_split_partials", "paged_decode", "HELPERS"),
                                    "K pages scaled in place on the host (the caller's cache changed)", "paged_split_partials：不修改輸入"),
}
VIEW_MISTAKES = {  # a given wrapper of 08 -> (grade_id, the mistake that reads a view as contiguous)
    "decode_attention": ("ex2_decode_kernel", "o allocated like q (empty_like copies a transposed q's strides)"),
    "split_kv_partials": ("ex3_split_kernel", "lengths handed to the kernel as they come (a strided view read as contiguous)"),
    "combine_partials": ("ex4_combine_kernel", "partials handed to the kernel as they come (a view read as contiguous)"),
    "paged_split_partials": ("ex6_paged_kernel", "K/V pages handed to the kernel as they come (a view of the pool read as contiguous)"),
}


@pytest.fixture(scope="module")
def runner():
    """One namespace, as one kernel: the setup cells (imports, profile, decode_reference and HELPERS) and every answer."""
    run = NotebookRunner()
    for source in setup_cells(SPEC.ASSIGNMENT, SPEC.SETUP) + [e.answer for e in ITEMS.values()]:
        run.run(source)
    return run


def _call(check, runner) -> None:
    check(*(runner.namespace[name] for name in CHECKS[check][1]))


@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f"{f.__module__.split('.')[-1]}.{f.__name__}")
def test_check_passes_the_solution(check, runner):
    _call(check, runner)


@pytest.mark.parametrize("check", [c for c, spec in CHECKS.items() if spec[3]],
                         ids=lambda f: f"{f.__module__.split('.')[-1]}.{f.__name__}")
def test_check_names_the_rule_a_wrong_answer_breaks(check, runner):
    grade_id, _, mistake, words = CHECKS[check]
    (old, new), = [(old, new) for what, old, new in SPEC.MISTAKES[grade_id] if what == mistake]
    runner.run(ITEMS[grade_id].mutate(old, new))
    try:
        with pytest.raises(AssertionError, match=re.escape(words)):
            _call(check, runner)
    finally:
        runner.run(ITEMS[grade_id].answer)


def test_a_decode_case_names_its_shape_on_a_wrong_answer(runner):
    ns = runner.namespace
    nb08_decode.matches_reference(ns["decode_attention"], ns["HELPERS"], 2, 2, 2, 37, 16, "tail", "")
    (old, new), = [(old, new) for what, old, new in SPEC.MISTAKES["ex2_decode_kernel"] if what == "tail keys not masked"]
    runner.run(ITEMS["ex2_decode_kernel"].mutate(old, new))
    try:
        with pytest.raises(AssertionError, match=re.escape("decode_attention（B=2, H_q=2, H_kv=2, N=37, d=16）：tail")):
            nb08_decode.matches_reference(ns["decode_attention"], ns["HELPERS"], 2, 2, 2, 37, 16, "tail", "")
    finally:
        runner.run(ITEMS["ex2_decode_kernel"].answer)


def test_allocator_state_names_the_sequence(runner):
    alloc = runner.namespace["PageAllocator"](4, 4)
    alloc.append("s", 5)
    nb08.allocator_state_holds(alloc, {"s": 5}, "five tokens")
    assert nb08.expected_slots(alloc, "s", 3, 2).tolist() == [3, 4]
    with pytest.raises(AssertionError, match=re.escape("five tokens：序列 's' 的長度")):
        nb08.allocator_state_holds(alloc, {"s": 6}, "five tokens")


def test_the_modules_are_reached_from_the_notebook_import():
    import labkit as lk

    for part in ("nb08", "nb08_combine", "nb08_decode", "nb08_kernels", "nb08_paged", "nb08_split"):
        assert getattr(lk.checks, part) is sys.modules[f"labkit.checks.{part}"]


def _wrapper_calls(ns) -> dict:
    """Every given wrapper of 08 -> its tensor arguments (small shapes, lengths below the capacity) and fixed ones."""
    q, k, v = ns["decode_inputs"](2, 4, 2, 20, 16, seed=1)
    lens = torch.tensor([20, 7], dtype=torch.int32)
    o_part, lse_part, _ = ns["split_kv_partials"](q, k, v, lens, 2)
    _, _, _, k_pages, v_pages, table, _ = nb08_paged.paged_inputs(ns["HELPERS"], 2, 4, 2, [20, 7], 16, 16, True, seed=1)
    paged = ((q, k_pages, v_pages, table, lens), (2,))
    return {"decode_attention": ((q, k, v), ()), "split_kv_partials": ((q, k, v, lens), (2,)),
            "combine_partials": ((o_part, lse_part), (torch.float32,)), "decode_split": ((q, k, v, lens), (2,)),
            "paged_split_partials": paged, "paged_decode": paged}


@pytest.fixture(scope="module")
def wrappers(runner):
    """The runner with cell-026 run too: decode_split (the given wrapper of exercises 3 and 4) is defined there."""
    runner.run(setup_cells(SPEC.ASSIGNMENT, ["def decode_split("])[0])
    return runner


@pytest.mark.parametrize("wrapper", ["decode_attention", "split_kv_partials", "combine_partials", "decode_split",
                                     "paged_split_partials", "paged_decode"])
def test_every_given_wrapper_answers_views_like_contiguous_inputs_and_keeps_them(wrapper, wrappers):
    ns = wrappers.namespace
    tensors, fixed = _wrapper_calls(ns)[wrapper]
    contract.check_views(ns[wrapper], *tensors, *fixed, name=wrapper, vectors=True)
    contract.check_inputs_unchanged(ns[wrapper], *tensors, *fixed, name=wrapper)


@pytest.mark.parametrize("wrapper", VIEW_MISTAKES)
def test_a_wrapper_reading_a_view_as_contiguous_fails_the_view_check(wrapper, wrappers):
    grade_id, mistake = VIEW_MISTAKES[wrapper]
    (old, new), = [(old, new) for what, old, new in SPEC.MISTAKES[grade_id] if what == mistake]
    tensors, fixed = _wrapper_calls(wrappers.namespace)[wrapper]
    wrappers.run(ITEMS[grade_id].mutate(old, new))
    try:
        with pytest.raises(AssertionError, match=re.escape(f"{wrapper}：輸入可以是 view")):
            contract.check_views(wrappers.namespace[wrapper], *tensors, *fixed, name=wrapper, vectors=True)
    finally:
        wrappers.run(ITEMS[grade_id].answer)
