"""Visible tests of 08_decode_attention's exercise 4: ``combine_partials(o_part, lse_part, dtype)`` (o_part [B, H_q, S, d]
fp32, lse_part [B, H_q, S] fp32 -> o [B, H_q, d] in dtype, lse [B, H_q] fp32) through the student's ``_combine_kernel``.
The partials come from the float64 reference over chosen key ranges, rounded to fp32.

Used in: 08_decode_attention (test cells of ex4)
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from labkit.checks import contract
from labkit.core import grading
from labkit.tritonlab import mode as tritonmode
from labkit.checks import nb08_kernels
from labkit.checks.nb08_kernels import Helpers

MERGE_HINT = ("w_s = exp(lse_s - m)，m = max_s lse_s；lse = m + log Σ w_s，o = Σ w_s·o_s / Σ w_s："
              "每段乘上自己的權重（不是直接平均），lse 用自然對數的 exp/log（部分結果的 lse 是自然對數）。")


def reference_partials(H: Helpers, q, k, v, cuts, lens=None):
    """Partials over key ranges [cuts[s], min(cuts[s+1], lens[b])) (lens: all keys by default): fp32 o [B, H_q, S, d],
    lse [B, H_q, S]."""
    b = q.shape[0]
    lens = torch.full((b,), k.shape[1]) if lens is None else lens
    parts = [H.reference(q, k, v, torch.full((b,), lo), torch.minimum(torch.full((b,), hi), lens)) for lo, hi in zip(cuts, cuts[1:])]
    return torch.stack([o for o, _ in parts], 2).float(), torch.stack([lse for _, lse in parts], 2).float()


def merges_like_reference(combine_partials: Callable, H: Helpers, o_part, lse_part, o_ref, lse_ref, what: str, hint: str,
                          dtype=torch.float32, atol=1e-5):
    """combine_partials(o_part, lse_part, dtype): one launch of _combine_kernel, no NaN, lse and o against (o_ref, lse_ref)."""
    with tritonmode.launches() as launched:
        o, lse = combine_partials(o_part.to(H.device), lse_part.to(H.device), dtype)
    name = f"combine_partials（S={o_part.shape[2]}）：{what}"
    nb08_kernels.launched_once(launched, "_combine_kernel", name)
    grading.check_true(not o.isnan().any() and not lse.isnan().any(), name=name + "：沒有 NaN",
                       detail=f"o 有 {int(o.isnan().sum())} 個 NaN，lse 有 {int(lse.isnan().sum())} 個。",
                       hint="全部都是 -inf 時 m = -inf，lse_s - m 是 NaN：平移量改用 0（tl.where(m == -inf, 0, m)），"
                            "總和 0 時 o = 0、lse = -inf（不要 0/0、log(0) 再加上 -inf）。")
    grading.check_tensor(lse.double(), lse_ref, name=name + "：lse = log Σ e^{lse_s}", atol=atol, hint=hint)
    grading.check_tensor(o.double(), o_ref, name=name + "：o = Σ e^{lse_s - lse} o_s", atol=atol, hint=hint)
    return o, lse


def staged_cases(combine_partials: Callable, H: Helpers) -> None:
    """q [2, 4, 16], a cache [2, 50, 2, 16]: three uneven splits; S = 1; S = 4 with an empty last split; lse shifted by
    +-1e4 (atol 5e-3: fp32 holds lse to ~1e-3 there); a sequence of length 0 beside one with keys in its first splits;
    S = 17 (BLOCK_S = 32, the split count of batch 1 on 132 SMs) with d = 32."""
    q, k, v = H.inputs(2, 4, 2, 50, 16, seed=21)
    o_ref, lse_ref = H.reference(q, k, v)
    merges_like_reference(combine_partials, H, *reference_partials(H, q, k, v, [0, 7, 30, 50]), o_ref, lse_ref,
                          "三段不等長（7、23、20 個鍵）", MERGE_HINT)
    merges_like_reference(combine_partials, H, *reference_partials(H, q, k, v, [0, 50]), o_ref, lse_ref, "S = 1：原樣輸出",
                          "S = 1 時 w = 1：o = o_0、lse = lse_0；BLOCK_S 補到 2 的次方，多的位置讀成 -inf（權重 0）。")
    merges_like_reference(combine_partials, H, *reference_partials(H, q, k, v, [0, 20, 40, 50, 50]), o_ref, lse_ref,
                          "S = 4，最後一段沒有鍵（lse = -inf）", "lse_s = -inf 的段權重 exp(-inf) = 0；遮罩外（s >= S）的位置也讀成 -inf。" + MERGE_HINT)
    for shift in (1e4, -1e4):
        o_part, lse_part = reference_partials(H, q, k, v, [0, 7, 30, 50])
        merges_like_reference(combine_partials, H, o_part, lse_part + shift, o_ref, lse_ref + shift, f"lse 約 {shift:+.0e}（不可溢位）",
                              "不可直接算 exp(lse_s)：exp(1e4) 是 inf，exp(-1e4) 是 0。先減去最大值 m，只對差取 exp。", atol=5e-3)
    lens = torch.tensor([0, 12])                                                          # sequence 0: no key at all
    merges_like_reference(combine_partials, H, *reference_partials(H, q, k, v, [0, 8, 16, 24], lens),
                          *H.reference(q, k, v, torch.zeros(2, dtype=torch.long), lens),
                          "長度 0 的序列（全部 -inf）與只有前段有鍵的序列", "整列都是 -inf：o = 0、lse = -inf。")
    q, k, v = H.inputs(1, 4, 2, 50, 32, seed=22)
    merges_like_reference(combine_partials, H, *reference_partials(H, q, k, v, list(range(0, 50, 3)) + [50]), *H.reference(q, k, v),
                          "S = 17（BLOCK_S = 32）、d = 32",
                          "S、BLOCK_S、HEAD_DIM 都是核心的參數：offs_s 的長度用 BLOCK_S、offs_d 的長度用 HEAD_DIM，"
                          "不要寫死前面例子的 4 段或 d = 16（132 個 SM、batch 1 時 S = 17）。")


def keeps_the_contract(combine_partials: Callable, H: Helpers) -> None:
    """Partials o [2, 2, 3, 16], lse [2, 2, 3]: unchanged after the call; transposed and sliced views of them give the o and
    lse their contiguous copies give."""
    q, k, v = H.inputs(2, 2, 2, 50, 16, seed=21)
    o_part, lse_part = (t.to(H.device) for t in reference_partials(H, q, k, v, [0, 7, 30, 50]))
    contract.check_inputs_unchanged(combine_partials, o_part, lse_part, torch.float32, name="combine_partials")
    contract.check_views(combine_partials, o_part, lse_part, torch.float32, name="combine_partials")


def _merge64(o_part, lse_part):
    """float64 merge of partials without -inf rows: (o [B, H_q, d], lse [B, H_q])."""
    lse = torch.logsumexp(lse_part.double(), -1)
    return (torch.exp(lse_part.double() - lse[..., None])[..., None] * o_part.double()).sum(-2), lse


def rounded_once_at_store(combine_partials: Callable, H: Helpers) -> None:
    """o in the requested dtype (bf16, near the float64 attention); then the precision rule: merged in fp32, o rounded
    once, at its store. Against the float64 merge of the same fp32 partials (S = 3: BLOCK_S = 4) a bf16 or fp16 o may be off
    by that one rounding (rtol = eps); partials or weights rounded before the sum are off by a rounding of each part."""
    q, k, v = H.inputs(2, 4, 2, 50, 16, seed=21)
    o_part, lse_part = reference_partials(H, q, k, v, [0, 7, 30, 50])
    ob, _ = combine_partials(o_part.to(H.device), lse_part.to(H.device), torch.bfloat16)
    grading.check_true(ob.dtype == torch.bfloat16, name="combine_partials：o 存成要求的 dtype（bf16）",
                       detail=f"得到 {ob.dtype}。", hint="tl.store(o_ptr + ..., o.to(o_ptr.dtype.element_ty))。")
    grading.check_tensor(ob.double(), H.reference(q, k, v)[0], name="combine_partials：bf16 的 o", atol=2e-2,
                         hint="以 fp32 合併，最後才轉成輸出的 dtype。")
    o_part, lse_part = reference_partials(H, q, k, v, [0, 3, 20, 50])
    o64, lse64 = _merge64(o_part, lse_part)
    for dt in (torch.bfloat16, torch.float16):
        o_low, lse_low = combine_partials(o_part.to(H.device), lse_part.to(H.device), dt)
        rule = f"合併以 fp32 計算，o 只在存回時捨入成 {str(dt)[6:]} 一次，lse 以 fp32 存"
        grading.check_tensor(lse_low.double(), lse64, name=f"combine_partials：o 存成 {str(dt)[6:]} 時的 lse（fp32）", atol=1e-5,
                             hint=f"規則：{rule}。lse 存進 fp32 的 lse_ptr，不要先 .to(o_ptr.dtype.element_ty)（bf16 只有約 3 位有效數字）。")
        grading.check_tensor(o_low.double(), o64, name=f"combine_partials：{str(dt)[6:]} 的 o 只在存回時捨入一次", atol=1e-6,
                             rtol=torch.finfo(dt).eps,
                             hint=f"規則：{rule}。o_s 與權重 w 都留在 fp32 相乘相加、除以總和，最後 tl.store 時才 .to(o_ptr.dtype.element_ty)；"
                                  "先把 o_s 或 w 轉成輸出的 dtype，每一段各捨入一次。")


def reads_only_s_splits(kernel, H: Helpers) -> None:
    """Interpreter only: _combine_kernel on S = 3 partials per row (BLOCK_S = 4) followed by spare rows: the 4th lane of
    each row is not read (elements counted)."""
    if not nb08_kernels.interpreted():
        return
    q, k, v = H.inputs(2, 4, 2, 50, 16, seed=21)
    o_part, lse_part = reference_partials(H, q, k, v, [0, 3, 20, 50])
    r, s, d = o_part.shape[0] * o_part.shape[1], o_part.shape[2], o_part.shape[3]
    _, o_rows = grading.with_spare_rows(o_part.reshape(r * s, d).to(H.device))
    _, lse_rows = grading.with_spare_rows(lse_part.reshape(r * s).to(H.device))
    with tritonmode.loaded_elements() as count:
        kernel[(r,)](o_rows, lse_rows, torch.empty(r, d, device=H.device), torch.empty(r, device=H.device), s, HEAD_DIM=d, BLOCK_S=4)
    once = o_part.numel() + lse_part.numel()
    grading.check_true(count["elements"] <= once, name="combine_partials：只讀 S 段部分結果（BLOCK_S 補出來的位置不讀）",
                       detail=f"讀了 {count['elements']:,} 個元素；o_part 與 lse_part 各讀一次是 {once:,} 個。",
                       hint="o_s 的 tl.load 也要 mask=valid[:, None]（s >= S）：那些位置是下一列的部分結果，最後一列更在張量之外。")


def own_code_compiles(combine_partials: Callable, H: Helpers) -> None:
    """No logsumexp, logaddexp, softmax or the reference; _combine_kernel compiles for sm80 and sm90."""
    nb08_kernels.own_kernel(combine_partials, H, "combine_partials：你自己的核心",
                            forbid=(torch.logsumexp, torch.logaddexp, torch.softmax, F.softmax))
    q, k, v = H.inputs(2, 4, 2, 50, 16, seed=21)
    o_part, lse_part = reference_partials(H, q, k, v, [0, 3, 20, 50])
    nb08_kernels.compiles(lambda: combine_partials(o_part.to(H.device), lse_part.to(H.device), torch.float32), "_combine_kernel")
