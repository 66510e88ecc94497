"""Unit tests of labkit.checks.nb06*: each visible check of 06_triton_flashattention passes the solution's answers
and, on a known wrong answer (tests/mutants/nb06.py), raises AssertionError naming the rule it breaks.

The Triton checks run through the interpreter on a CPU; the slowest (the forward and backward in stages, the
compile checks) are left to tests/test_grader_strength.py, which runs the whole test cells against every mistake.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from mutants import load
from notebook_grader import NotebookRunner, exercises, setup_cells

from labkit.checks import nb06, nb06_backward, nb06_forward, nb06_window

SPEC = load("nb06")
ITEMS = {e.grade_id: e for e in exercises(SPEC.ASSIGNMENT)}
DEV = torch.device("cpu")


@pytest.fixture(scope="module")
def runner():
    """One notebook kernel's namespace: the setup cells, then every solution answer."""
    kernel = NotebookRunner()
    for source in [*setup_cells(SPEC.ASSIGNMENT, SPEC.SETUP), *(e.answer for e in ITEMS.values())]:
        kernel.run(source)
    return kernel


@contextlib.contextmanager
def answered_with(kernel: NotebookRunner, gid: str, mistake: str):
    """The exercise's answer replaced by the named mistake of tests/mutants/nb06.py, the solution's again after."""
    old, new = next((old, new) for name, old, new in SPEC.MISTAKES[gid] if name == mistake)
    kernel.run(ITEMS[gid].mutate(old, new))
    try:
        yield
    finally:
        kernel.run(ITEMS[gid].answer)


# check -> (call on the namespace, grade_id, a mistake of tests/mutants/nb06.py, words of the message naming its rule)
CHECKS = {
    "softmax_padding_not_stored": (lambda g: nb06.softmax_padding_not_stored(g["softmax_kernel"], DEV),
                                   "ex1_softmax", "store unmasked (padding lanes written)", "遮罩外的 14 個位置沒有寫出去"),
    "softmax_values": (lambda g: nb06.softmax_values(g["softmax"], DEV),
                       "ex1_softmax", "no max subtraction", "logits in the hundreds"),
    "softmax_block_follows_row": (lambda g: nb06.softmax_block_follows_row(g["softmax"], DEV),
                                  "ex1_softmax", "BLOCK fixed at 1024", "BLOCK for rows of 50"),
    "softmax_values on a transposed view": (lambda g: nb06.softmax_values(g["softmax"], DEV), "ex1_softmax",
                                            "output allocated like the input (its strides)", "softmax：輸入可以是 view"),
    "softmax_block_follows_row past 1024": (lambda g: nb06.softmax_block_follows_row(g["softmax"], DEV),
                                            "ex1_softmax", "BLOCK capped at 1024", "BLOCK for rows of 5000"),
    "softmax_block_follows_row past 4096": (lambda g: nb06.softmax_block_follows_row(g["softmax"], DEV),
                                            "ex1_softmax", "BLOCK capped at 4096", "BLOCK for rows of 5000"),
    "softmax_offsets_64bit": (lambda g: nb06.softmax_offsets_64bit(g["softmax_kernel"], DEV),
                              "ex1_softmax", "32-bit row offsets", "64-bit row offsets"),
    "key_range_rules": (lambda g: nb06_forward.key_range_rules(g["_key_range"], DEV),
                        "ex2_flash_forward", "causal tiles masked, not skipped", "causal tiles skipped"),
    "fwd_tile_rules": (lambda g: nb06_forward.fwd_tile_rules(g["_fwd_tile"], DEV),
                       "ex2_flash_forward", "missing rescale of acc", "acc / l"),
    "padded_query_rows_not_stored": (lambda g: nb06_forward.padded_query_rows_not_stored(g["_fwd_kernel"], DEV),
                                     "ex2_flash_forward", "lse store unmasked", "補出來的列沒有寫到 lse 之外"),
    "query_range_rules": (lambda g: nb06_backward.query_range_rules(g["_query_range"], DEV),
                          "ex3_flash_backward", "query range off by one (drops a needed query tile)",
                          "no needed query tile dropped"),
    "window_tiles_read": (lambda g: nb06_window.window_tiles_read(g["_fwd_gqa_window_kernel"], DEV),
                          "ex5_gqa_window", "window tiles not skipped", "only the key tiles inside the window read"),
}


@pytest.mark.parametrize("check", CHECKS)
def test_check_passes_the_solution_and_names_the_rule_a_mistake_breaks(runner, check):
    call, gid, mistake, words = CHECKS[check]
    call(runner.namespace)
    with answered_with(runner, gid, mistake), pytest.raises(AssertionError, match=words):
        call(runner.namespace)


def test_window_mask_and_reference_follow_the_conventions():
    keep = nb06_window.window_mask(3, 5, True, 1)                 # query i sits at position i + 2
    assert keep.tolist() == [[False, True, True, False, False], [False, False, True, True, False],
                             [False, False, False, True, True]]
    assert nb06_window.window_mask(2, 2, False, None).all()
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    o, lse = nb06_window.gqa_window_reference(q, k, v, True, None)
    o2, lse2 = nb06.attention64(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), True)
    assert o.dtype == torch.float64 and torch.allclose(o, o2) and torch.allclose(lse, lse2)
    assert nb06_window.window_loads(32, 32, 32, 16, True, 0, 16) == 32 * 16 + 2 * 16 * 16 * 2


def test_largest_new_tensor_counts_the_answers_tensors_not_triton_own():
    """On a GPU, @triton.autotune times its configurations at the first call with a 256 MiB L2-flush buffer made by
    Triton's code: not the answer's tensor (it failed 06's 'no [..., N, N_k] tensor' checks on an H100)."""
    made_by_triton = {"__name__": "triton.testing", "torch": torch}
    exec("def flush():\n    return torch.empty(1 << 20)", made_by_triton)
    with nb06.LargestNewTensor() as created:
        made_by_triton["flush"]()
        torch.zeros(3, 5)
    assert created.largest == 15
    with nb06.LargestNewTensor() as created:
        torch.empty(1 << 20)
    assert created.largest == 1 << 20
