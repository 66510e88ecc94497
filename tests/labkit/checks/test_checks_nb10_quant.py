"""Unit tests of labkit.checks.nb10_quant and nb10_pipeline: each visible check of 10_fp8_attention's exercises 1, 2
and 4 passes the reference answers (over a torch stand-in of exercise 3's kernel) and, on each mistake of the
mutants draft, raises AssertionError naming the rule it breaks; the right answers written another way pass all."""
from __future__ import annotations

import inspect
import re

import pytest
import torch
from fp8_standin import fp8_attention
from nb10_answers_loader import SPEC as spec
from nb10_answers_loader import answers

from labkit.checks import nb10_pipeline as pipe
from labkit.checks import nb10_quant as quant

CHECKS = {  # grade_id -> its visible checks, in the test cell's order
    "ex1_quantizers": [quant.per_tensor_scale_and_round_trip, quant.zero_gives_descale_one, quant.per_block_tiles_along_n,
                       quant.e5m2_supported, quant.bad_arguments_refused, quant.quantizers_keep_the_contract],
    "ex2_rotation": [quant.hadamard_is_sylvester, quant.rotation_is_random_and_orthogonal,
                     quant.rotate_qk_keeps_scores_and_dtypes],
    "ex4_pipeline": [pipe.pipeline_hands_over, pipe.pipeline_meets_goals],
}
CAUGHT = {  # mistake -> (the check that catches it, words of the rule its message names)
    "no clamp before the cast (per tensor)": (quant.per_tensor_scale_and_round_trip, "轉型前先 clamp 到 ±fmax"),
    "no clamp before the cast (per block)": (quant.per_block_tiles_along_n, "轉型前先 clamp 到 ±fmax"),
    "clamp to the input dtype's max": (quant.per_tensor_scale_and_round_trip, "轉型前先 clamp 到 ±fmax"),
    "amax == 0 not handled (descale 0, x8 NaN)": (quant.zero_gives_descale_one, "輸出沒有 NaN"),
    "descale in x's dtype (amax not cast to fp32)": (quant.per_tensor_scale_and_round_trip, "descale 是 fp32 的 0 維張量"),
    "fmax hard-coded to 448": (quant.e5m2_supported, "descale = amax / 57344"),
    "multiplied by the descale instead of divided": (quant.per_tensor_scale_and_round_trip, "不超過半個 FP8 間距"),
    "the scale returned instead of the descale": (quant.per_tensor_scale_and_round_trip, "descale = amax / 448"),
    "one scale per head instead of per tile": (quant.per_block_tiles_along_n, "每塊的 descale = 該塊的 amax / 448"),
    "the short last tile dropped (N // block)": (quant.per_block_tiles_along_n, "x8 是 x 形狀的 float8_e4m3fn"),
    "any dtype accepted (per tensor)": (quant.bad_arguments_refused, "quantize_per_tensor(x, torch.bfloat16)"),
    "divided in place (changes a float32 x)": (quant.quantizers_keep_the_contract, "：不修改輸入"),
    "descale rebuilt from a Python float (no device=)": (quant.quantizers_keep_the_contract, "跟著輸入的裝置"),
    "descale returned as a Python float": (quant.per_tensor_scale_and_round_trip, "descale 是 fp32 的 0 維張量"),
    "hadamard without the minus block": (quant.hadamard_is_sylvester, "hadamard(2) @ hadamard(2).T = d·I"),
    "hadamard normalized by sqrt(d)": (quant.hadamard_is_sylvester, "hadamard(2) @ hadamard(2).T = d·I"),
    "no power-of-two test": (quant.hadamard_is_sylvester, "hadamard(3) raise ValueError"),
    "no random signs (plain H / sqrt(d))": (quant.rotation_is_random_and_orthogonal, "的正負號來自 generator"),
    "generator ignored": (quant.rotation_is_random_and_orthogonal, "的正負號來自 generator"),
    "signs on the columns": (quant.rotation_is_random_and_orthogonal, "的正負號來自 generator"),
    "divided by d instead of sqrt(d)": (quant.rotation_is_random_and_orthogonal, "R Rᵀ = I"),
    "k rotated by R transposed": (quant.rotate_qk_keeps_scores_and_dtypes, "x @ R 在 FP32 裡算、只捨入一次"),
    "rotated in the input dtype (R rounded to bf16)": (quant.rotate_qk_keeps_scores_and_dtypes, "x @ R 在 FP32 裡算"),
    "rotated in place (changes a float32 q)": (quant.rotate_qk_keeps_scores_and_dtypes, "：不修改輸入"),
    "rotate_qk returns fp32": (quant.rotate_qk_keeps_scores_and_dtypes, "輸出保留 q、k 的 dtype 與形狀"),
    "generator=None replaced by a fixed seed (every R alike)": (quant.rotation_is_random_and_orthogonal, "generator=None"),
    "a rotation drawn for q and another for k": (pipe.pipeline_hands_over, "k8 · k_descale ≈ k R"),
    "v rotated too": (pipe.pipeline_hands_over, "v8 · v_descale ≈ v"),
    "generator not passed to random_rotation": (pipe.pipeline_hands_over, "q8 · q_descale ≈ q R"),
    "k and v quantized with block_m": (pipe.pipeline_hands_over, "：執行"),
    "p_scale not passed to fp8_attention": (pipe.pipeline_hands_over, "選項原樣傳給 fp8_attention"),
    "reverse not passed to fp8_attention": (pipe.pipeline_hands_over, "選項原樣傳給 fp8_attention"),
    "block sizes not passed to fp8_attention": (pipe.pipeline_hands_over, "：執行"),
    "quant='tensor' ignored (always per block)": (pipe.pipeline_hands_over, "每個張量一個 descale（0 維）"),
    "rotation only with per-block scaling": (pipe.pipeline_hands_over, "quant='tensor', rotate=True"),
}
MISTAKES = {what: (gid, old, new) for gid, table in spec.MISTAKES.items() if gid in CHECKS for what, old, new in table}


def run_checks(checks, namespace: dict) -> None:
    """Each check called with the answers its parameters name."""
    for check in checks:
        check(*(namespace[p] for p in inspect.signature(check).parameters if p in namespace))


def test_every_mistake_is_caught_and_there_are_enough():
    assert set(CAUGHT) == set(MISTAKES)
    counts = {gid: len(table) for gid, table in spec.MISTAKES.items()}
    assert counts["ex1_quantizers"] >= 8 and counts["ex2_rotation"] >= 5 and counts["ex4_pipeline"] >= 4
    assert set(spec.RULES) - {"ex3_fp8_kernel"} == set(CHECKS)


def test_the_reference_answers_pass_every_check():
    run_checks([c for checks in CHECKS.values() for c in checks], answers(fp8_attention))


@pytest.mark.parametrize("what", list(CAUGHT))
def test_each_mistake_fails_the_check_that_names_it(what):
    gid, old, new = MISTAKES[what]
    check, words = CAUGHT[what]
    with pytest.raises(AssertionError, match=re.escape(words)):
        run_checks([check], answers(fp8_attention, replace=(gid, old, new)))


@pytest.mark.parametrize("gid, what", [(gid, what) for gid, table in spec.ACCEPTED.items() if gid in CHECKS for what, _, _ in table])
def test_right_answers_written_another_way_pass(gid, what):
    (old, new), = [(o, n) for w, o, n in spec.ACCEPTED[gid] if w == what]
    run_checks(CHECKS[gid], answers(fp8_attention, replace=(gid, old, new)))


def test_the_cast_watch_sees_a_value_past_max_that_this_cpu_saturates():
    x = torch.tensor([500.0, 1.0])
    assert x.to(torch.float8_e4m3fn).float()[0] == 448 or torch.isnan(x.to(torch.float8_e4m3fn).float()[0])
    with pytest.raises(AssertionError, match="轉型前先 clamp"):
        quant.casts_to_fp8(lambda: (x.to(torch.float8_e4m3fn), torch.tensor(1.0)), "plain cast")


def test_the_recording_puts_fp8_attention_back_even_when_the_check_fails():
    namespace = answers(fp8_attention, replace=MISTAKES["v rotated too"])
    with pytest.raises(AssertionError):
        pipe.pipeline_hands_over(namespace["fp8_pipeline"])
    assert namespace["fp8_attention"] is fp8_attention
