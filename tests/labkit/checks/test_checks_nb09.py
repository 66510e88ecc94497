"""Unit tests of labkit.checks.nb09*: each visible check of 09_flex_attention passes the solution's answers and, on
a known wrong answer (tests/mutants/nb09.py), raises AssertionError naming the rule it breaks.

The Triton checks run through the interpreter on a CPU; the slowest (every mask, the sink cases, the backward's
loaded elements, the compile checks) are left to tests/test_grader_strength.py, which runs the whole test cells
against every mistake.
"""
from __future__ import annotations

import pytest
import torch
from mutants import load
from notebook_grader import NotebookRunner, exercises, setup_cells

from labkit.checks import nb09, nb09_backward, nb09_forward

SPEC = load("nb09")
ITEMS = {e.grade_id: e for e in exercises(SPEC.ASSIGNMENT)}


@pytest.fixture(scope="module")
def ns():
    """One notebook namespace: the setup cells and every solution answer."""
    runner = NotebookRunner()
    for source in setup_cells(SPEC.ASSIGNMENT, SPEC.SETUP) + [e.answer for e in ITEMS.values()]:
        runner.run(source)
    runner.namespace["_runner"] = runner
    return runner.namespace


def _mistake(gid: str, what: str) -> tuple[str, str]:
    return next((old, new) for name, old, new in SPEC.MISTAKES[gid] if name == what)


# check -> (call on the namespace, grade_id, a mistake of tests/mutants/nb09.py, words of the message naming its rule)
CHECKS = {
    "dense_matches_flex": (lambda g: nb09.dense_matches_flex(g["dense_attention"], g["causal"], g["relative_bias"]),
                           "ex1_dense_reference", "mask before score_mod", "遮罩在 score_mod 之後"),
    "dense_empty_rows": (lambda g: nb09.dense_empty_rows(g["dense_attention"]),
                         "ex1_dense_reference", "empty rows divided by l = 0", "看不見任何鍵的列沒有 NaN"),
    "dense_low_precision": (lambda g: nb09.dense_low_precision(g["dense_attention"], g["causal"], g["relative_bias"]),
                            "ex1_dense_reference", "P rounded to the input dtype before P V", "只在最後捨入一次"),
    "mask_mods_follow_rules": (lambda g: nb09.mask_mods_follow_rules(g["sliding_window"], g["document_mask"],
                                                                     g["packed_causal"], g["prefix_lm"]),
                               "ex2_mask_mods", "window off by one (w keys)", "sliding_window(3)"),
    "mask_rule": (lambda g: nb09.mask_rule(g["prefix_lm"](3), lambda i, j: j < 3 or j <= i, 7, "prefix_lm(3)", ""),
                  "ex2_mask_mods", "prefix off by one", "prefix_lm(3)"),
    "score_mods_follow_rules": (lambda g: nb09.score_mods_follow_rules(g["alibi_slopes"], g["alibi"], g["softcap"], g["causal"]),
                                "ex3_score_mods", "softcap in place", "softcap 不改動傳入的分數"),
    "block_lists_match": (lambda g: nb09.block_lists_match(g["block_lists"], g["causal"], g["sliding_window"], g["packed_causal"]),
                          "ex4_block_lists", "indices sorted by an unstable argsort", "每列最多 18 個區塊"),
    "packing_follows_rules": (lambda g: nb09.packing_follows_rules(g["pack"]),
                              "ex8_packing", "one document id for all (contaminated)", "document_ids（長度 3、1、4）"),
    "sink_grad_matches": (lambda g: nb09_forward.sink_grad_matches(g["sink_grad"], 2, 3, 40, 7, "B = 2"),
                          "ex6_sink_grad", "not summed over the batch", "練習 6：B = 2"),
    "sink_grad_matches (bf16)": (lambda g: nb09_forward.sink_grad_matches(g["sink_grad"], 2, 3, 200, 8, "bf16",
                                                                          dtype=torch.bfloat16, d=64),
                                 "ex6_sink_grad", "D in bf16", "練習 6：bf16"),
    "forward_matches": (lambda g: nb09_forward.forward_matches(g["sparse_attention"], "tail", g["causal"], 40, 40, ""),
                        "ex5_sparse_kernel", "K of a partial block loaded past N_K (keep hides it)", "只讀寫傳入的張量，tail"),
    "forward_launch_and_precision": (lambda g: nb09_forward.forward_launch_and_precision(g["sparse_attention"], g["causal"]),
                                     "ex5_sparse_kernel", "fp16 launched with PREC=\"ieee\"", "float16 輸入以 PREC=\"tf32\" 啟動"),
    "forward_reads_listed_blocks": (lambda g: nb09_forward.forward_reads_listed_blocks(g["sparse_attention"], g["sliding_window"]),
                                    "ex5_sparse_kernel", "every key block read (listed or not), masked", "只讀清單上的區塊"),
    "forward_head_offsets_64bit": (lambda g: nb09_forward.forward_head_offsets_64bit(g["_sparse_fwd_kernel"], g["causal"]),
                                   "ex5_sparse_kernel", "lse offset from the 32-bit program id", "64 位元的 head 偏移量"),
    "backward_matches": (lambda g: nb09_backward.backward_matches(g["sparse_attention_backward"], "tail", g["causal"], 40, 72, ""),
                         "ex7_sparse_backward", "dK/dV grid over query blocks", "，tail]"),
    "backward_head_offsets_64bit": (lambda g: nb09_backward.backward_head_offsets_64bit(
        g["_sparse_bwd_dkdv_kernel"], g["_sparse_bwd_dq_kernel"], g["_sparse_bwd_preprocess"],
        {"_sparse_bwd_preprocess": 1}, g["causal"]),
        "ex7_sparse_backward", "32-bit head offsets (preprocess kernel)", "64 位元的 head 偏移量"),
    "backward_precision": (lambda g: nb09_backward.backward_precision(g["sparse_attention_backward"], g["causal"]),
                           "ex7_sparse_backward", "D in the input dtype (D and lse2 from PyTorch)", "D = rowsum(dO ∘ O) 在 fp32 中計算"),
    "dense_matches_flex (scale 0)": (lambda g: nb09.dense_matches_flex(g["dense_attention"], g["causal"], g["relative_bias"]),
                                     "ex1_dense_reference", "scale = 0 read as unset (`scale or 1/sqrt(d)`)", "scale = 0"),
    "dense_empty_rows (score_mod)": (lambda g: nb09.dense_empty_rows(g["dense_attention"]), "ex1_dense_reference",
                                     "empty rows handled only under a mask_mod (a score_mod's -inf row gives NaN)",
                                     "沒有 NaN（score_mod 回傳 -inf）"),
    "dense_contract": (lambda g: nb09.dense_contract(g["dense_attention"], g["causal"]), "ex1_dense_reference",
                       "scores scaled in place on q (the caller's q changed)", "練習 1（float32）：不修改輸入"),
    "sink_grad_matches (fp32 inputs)": (lambda g: nb09_forward.sink_grad_matches(g["sink_grad"], 2, 3, 40, 7, "B = 2"),
                                        "ex6_sink_grad", "o overwritten in place (`.float().mul_()`: the caller's fp32 o)",
                                        "練習 6（fp32 輸入）：不修改輸入"),
    "forward_matches (block 32)": (lambda g: nb09_forward.forward_matches(g["sparse_attention"], "b32", g["causal"], 40, 40, "",
                                                                          block=32),
                                   "ex5_sparse_kernel", "block fixed at the notebook's P.block (the block argument ignored)",
                                   "，b32"),
    "forward_matches (window 0)": (lambda g: nb09_forward.forward_matches(g["sparse_attention"], "w0", g["sliding_window"](0),
                                                                          32, 32, "", mask="window", window=0),
                                   "ex5_sparse_kernel", "window 0 read as no window (`window or N_k`)", "，w0"),
    "forward_reads_listed_blocks (computed)": (
        lambda g: nb09_forward.forward_reads_listed_blocks(g["sparse_attention"], g["sliding_window"]), "ex5_sparse_kernel",
        "every slot of the partial list computed, unlisted ones masked off (reads only listed blocks)", "只算清單上的區塊"),
    "backward_matches (rows that see no key)": (
        lambda g: nb09_backward.backward_matches(g["sparse_attention_backward"], "empty", g["sliding_window"](4), 32, 16, "",
                                                 mask="window", window=4), "ex7_sparse_backward",
        "masked scores set to -inf before exp2 (dK/dV: -inf - lse2 = NaN where lse = -inf)", "，empty"),
    "backward_matches (block 32)": (
        lambda g: nb09_backward.backward_matches(g["sparse_attention_backward"], "b32", g["causal"], 40, 40, "", block=32),
        "ex7_sparse_backward", "block fixed at the notebook's P.block (backward)", "，b32"),
    "backward_matches (inputs unchanged)": (
        lambda g: nb09_backward.backward_matches(g["sparse_attention_backward"], "lse", g["causal"], 16, 16, ""),
        "ex7_sparse_backward", "lse scaled in place (`lse.float().mul_()`: the caller's fp32 lse)", "練習 7（lse）：不修改輸入"),
    "forward_matches (all-zero sink)": (
        lambda g: nb09_forward.forward_matches(g["sparse_attention"], "zero", g["causal"], 40, 40, "", sink=torch.zeros(2)),
        "ex5_sparse_kernel", "an all-zero sink skipped (`sink.any()`: e^0 = 1 left out of every row)", "o，zero"),
    "backward_matches (every block full, dK/dV)": (
        lambda g: nb09_backward.backward_matches(g["sparse_attention_backward"], "full", g["causal"], 64, 64, "",
                                                 lists=nb09_forward.forged_lists(4, full=True),
                                                 allowed=torch.ones(64, 64, dtype=torch.bool)),
        "ex7_sparse_backward", "full blocks masked too (dK/dV kernel)", "dV，full"),
    "backward_matches (every block full, dQ)": (
        lambda g: nb09_backward.backward_matches(g["sparse_attention_backward"], "full", g["causal"], 64, 64, "",
                                                 lists=nb09_forward.forged_lists(4, full=True),
                                                 allowed=torch.ones(64, 64, dtype=torch.bool)),
        "ex7_sparse_backward", "full blocks masked too (dQ kernel)", "dQ，full"),
}


@pytest.mark.parametrize("check", CHECKS)
def test_check_passes_the_solution_and_names_the_rule_a_mistake_breaks(ns, check):
    call, gid, mistake, words = CHECKS[check]
    call(ns)
    exercise, (old, new) = ITEMS[gid], _mistake(gid, mistake)
    try:
        ns["_runner"].run(exercise.mutate(old, new))
        with pytest.raises(AssertionError) as failed:
            call(ns)
    finally:
        ns["_runner"].run(exercise.answer)
    assert words in str(failed.value), str(failed.value)


def test_table_and_attention64_follow_the_conventions():
    allowed = nb09.table(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx + 2, 4, 3)   # rows 0 and 1 see nothing
    assert allowed.dtype == torch.bool and allowed.shape == (4, 3) and not allowed[:2].any()
    q, k, v = (torch.randn(1, 2, n, 8) for n in (4, 3, 3))
    o, lse = nb09.attention64(q, k, v, allowed)
    assert o.dtype == torch.float64 and (o[:, :, :2] == 0).all() and torch.isneginf(lse[:, :, :2]).all()
    sink = torch.tensor([0.5, -1.0])
    o_s, lse_s = nb09.attention64(q, k, v, allowed, sink)
    assert torch.allclose(lse_s[:, :, :2], sink.double().view(1, 2, 1).expand(1, 2, 2)) and (o_s[:, :, :2] == 0).all()
    assert torch.allclose(o_s[:, :, 2:], o[:, :, 2:] * torch.sigmoid(lse[:, :, 2:] - sink.double().view(1, 2, 1)).unsqueeze(-1))


def _as_stored(t: torch.Tensor) -> torch.Tensor:
    """t's storage read as if t were contiguous: what a wrapper blind to strides hands its kernel."""
    return torch.as_strided(t, t.shape, torch.empty(t.shape).stride(), t.storage_offset())


def test_the_contract_checks_pass_the_solution_and_catch_a_changed_sink_and_wrappers_blind_to_strides(ns):
    sparse, backward, causal = ns["sparse_attention"], ns["sparse_attention_backward"], ns["causal"]
    nb09_forward.forward_contract(sparse, causal)
    nb09_backward.backward_contract(backward, causal)

    def scales_the_sink(q, k, v, lists, block, sink=None, **kw):
        return sparse(q, k, v, lists, block, sink=sink.mul_(1.0 + 1e-3), **kw)

    with pytest.raises(AssertionError) as failed:
        nb09_forward.forward_matches(scales_the_sink, "sink", causal, 16, 16, "", sink=torch.tensor([1.5, -0.5]))
    assert "練習 5（sink）：不修改輸入" in str(failed.value), str(failed.value)
    for check, wrong in ((nb09_forward.forward_contract, lambda q, *a, **kw: sparse(_as_stored(q), *a, **kw)),
                         (nb09_backward.backward_contract, lambda q, k, v, o, lse, do, *a, **kw:
                          backward(q, k, v, o, lse, _as_stored(do), *a, **kw))):
        with pytest.raises(AssertionError) as failed:
            check(wrong, causal)
        assert "輸入可以是 view" in str(failed.value), str(failed.value)


def test_check_blocks_computed_allows_twice_the_listed_blocks():
    block_products = 16 * 16 * 16
    nb09_forward.check_blocks_computed({"products": 2 * 3 * 2 * block_products}, 3, 2, name="blocks", hint="")
    with pytest.raises(AssertionError, match="blocks"):
        nb09_forward.check_blocks_computed({"products": 2 * 3 * 2 * block_products + 1}, 3, 2, name="blocks", hint="")
