"""Visible tests of 05_precision_analysis's exercises 1 and 2: a sum whose accumulator is stored in a chosen dtype
(``accumulate``) and the error measures of a result against a reference (``error_report``).

Each check calls the student's function on seeded inputs and compares with what the rounding rules give: exact
values worked out by hand for a few tiny sums, float64 (or NumPy) for the error measures. A failed check raises
``AssertionError`` through :mod:`labkit.core.grading`, with the message in Traditional Chinese.

Used in: 05_precision_analysis (test cells of ex1, ex2)
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from labkit.checks import contract
from labkit.core import grading

_HALF_SUM_HINT = ("compensated=True 的分支也要先 values.to(acc_dtype)：float32 的 v 減去 fp16 的 c 會被提升成 float32，"
                  "累加器就不再是 fp16；c 記住每次被捨入掉的 1，所以答案是 2056。")


def returns_0d_in(out, dtype: torch.dtype, call: str) -> None:
    """``out``, what ``call`` (the call as the message shows it) returned, is a 0-d tensor of ``dtype``."""
    got = f"{type(out).__name__}（dtype={out.dtype}、形狀 {tuple(out.shape)}）" if isinstance(out, torch.Tensor) \
        else type(out).__name__
    grading.check_true(isinstance(out, torch.Tensor) and out.dim() == 0 and out.dtype == dtype,
                       name=f"{call} 回傳 acc_dtype 的 0 維張量",
                       detail=f"應回傳 dtype={dtype} 的 0 維張量，卻得到 {got}。",
                       hint="累加器與補償 c 都用 torch.zeros((), dtype=acc_dtype) 建立，相加前先把 values 轉成 acc_dtype"
                            "（fp16 張量加上 fp32 張量會被提升成 fp32）；不要回傳 .item()。")


def sums_in_own_loop(accumulate: Callable) -> None:
    """``accumulate`` reaches no torch.sum / cumsum: the exercise is the loop itself."""
    grading.check_own_code(accumulate, name="accumulate：自己逐項相加，不可用 torch.sum / cumsum",
                           forbid=(torch.sum, torch.Tensor.sum, torch.cumsum, torch.Tensor.cumsum))


def sums_leave_values_unchanged(accumulate: Callable) -> None:
    """fp16 values [16] into an fp16 accumulator (values.to(acc_dtype) is values itself), plain and compensated, and
    float32 values into a float32 one: the caller's values unchanged."""
    for values, dtype in ((torch.linspace(-1, 1, 16).half(), torch.float16), (torch.linspace(0, 3, 16), torch.float32)):
        for compensated in (False, True):
            contract.check_inputs_unchanged(accumulate, values, dtype, compensated=compensated,
                                            name=f"accumulate（{str(dtype)[6:]} 的 values 與累加器，compensated={compensated}："
                                                 "values.to(acc_dtype) 不複製）")


def _rounding_cases() -> list[tuple]:
    """(values, acc_dtype, compensated, call shown or None, expected, rel, name, hint) of the sums whose result the
    rounding rules fix; values are 1-D tensors of 2 to 10,000 elements."""
    x = torch.full((10_000,), 1e-4, dtype=torch.float16)
    exact = x.double().sum().item()
    idx = torch.arange(1000, dtype=torch.float64)
    mixed_signs = (((idx * 104729) % 2001 - 1000) * 2.0 ** ((idx % 9) - 6)).half()
    f16, bf16 = torch.float16, torch.bfloat16
    return [
        (x, f16, False, "accumulate(x, float16)", 0.25, 0.0, "fp16 累加器每一步都捨入成 fp16（停在 0.25）",
         "部分和到 0.25 之後，1e-4 小於它的半個 ulp，每次相加都被捨入掉；得到約 1.0 表示你的累加器"
         "其實是 fp32（torch.sum、Python float 或型別提升）。"),
        (x, torch.float32, False, "accumulate(x, float32)", exact, 1e-4, "fp32 累加器接近正確值", ""),
        (x, f16, True, "accumulate(x, float16, compensated=True)", exact, 1e-3, "Kahan 補償求和：fp16 累加器也接近正確值",
         "y = x - c; t = s + y; c = (t - s) - y; s = t，全部保持 acc_dtype；注意 c 的正負號。"),
        # Kahan returns s itself: 0.75 + 6 + 2048 in fp16 (spacing 2 at 2048) gives 2054 (exact 2054.75); s - c: 2056
        (torch.tensor([0.75, 6.0, 2048.0]), f16, True, None, 2054.0, 0.0, "Kahan 補償求和回傳累加器 s（0.75、6、2048，fp16）",
         "照上面的公式：迴圈結束後回傳 s，不要再加上或減去 c（c 是下一項要補的誤差，不是最後的修正）。"),
        # float32 values into a float16 accumulator: in fp16, 2048 + 1 rounds back to 2048 (the spacing there is 2)
        (torch.tensor([2048.0] + [1.0] * 8), f16, False, "accumulate(float32 的 values, float16)", 2048.0, 0.0,
         "先轉成 acc_dtype，再由左到右逐項相加",
         "fp16 中 2048 + 1 捨入回 2048，所以由左到右的答案是 2048；得到 2056 表示你從右邊加起（或先把小的數加在一起）。"),
        # a bf16 accumulator (float64 values): in bf16, 512 + 1 rounds back to 512 (the spacing there is 4)
        (torch.tensor([512.0] + [1.0] * 8, dtype=torch.float64), bf16, False, "accumulate(float64 的 values, bfloat16)",
         512.0, 0.0, "bf16 累加器：每一步都捨入成 bf16（512 與 8 個 1，由左到右）",
         "累加器用 acc_dtype 本身建立，任何浮點 dtype 都一樣（不只 fp16 與 fp32）：bf16 中 512 + 1 捨入回 512。"),
        # the same values with Kahan: the compensation c carries the 1s that s drops, and the fp16 result is exact (2056)
        (torch.tensor([2048.0] + [1.0] * 8), f16, True, "accumulate(float32 的 values, float16, compensated=True)", 2056.0,
         0.0, "Kahan 補償求和：float32 的 values 先轉成 fp16（2048 與 8 個 1）", _HALF_SUM_HINT),
        # a value fp16 cannot hold: 2^-11 + 2^-23 becomes 2^-11 when cast, and 1 + 2^-11 lies halfway between two fp16
        # numbers: it rounds to 1 (half to even). Added to the sum in float32 first, the sum is just above halfway.
        (torch.tensor([1.0, 2**-11 + 2**-23]), f16, False, "accumulate(float32 的 values, float16)", 1.0, 0.0,
         "每一項先轉成 acc_dtype 再相加（float32 的 1 與 2^-11 + 2^-23 加進 fp16 累加器）",
         "每一項先 v.to(acc_dtype)：2^-11 + 2^-23 轉成 fp16 是 2^-11，1 + 2^-11 落在兩個 fp16 的正中間，捨入成 1。"
         "得到 1.000977（1 + 2^-10）表示你把 float32 的 v 直接加到累加器上（和在 FP32 裡算），"
         "再把和轉回 fp16：那樣 v 沒有先捨入成 fp16。"),
        # fp16 values of mixed signs and sizes, Kahan with s and c rounded to fp16 at every step: exactly -2702. c kept
        # in fp32 (t rounded back to fp16) gives -2690, a float64 sum rounded at the end -2698, plain fp16 -2728.
        (mixed_signs, f16, True, "accumulate(fp16 的 values, float16, compensated=True)", -2702.0, 0.0,
         "Kahan：s 與 c 每一步都存成 fp16（1000 個正負、大小混合的 fp16 值；精確和約 -2697.6）",
         "照公式 y = x - c; t = s + y; c = (t - s) - y; s = t，四個量都是 acc_dtype 的 0 維張量。"
         "c 留在 FP32（只把 t 轉回 fp16）、或先用更寬的型別加總最後才轉型，結果都不是 -2702；一般的 fp16 累加得到 -2728。"),
    ]


def sums_round_every_step(accumulate: Callable) -> None:
    """``accumulate(values, acc_dtype, compensated)`` gives what rounding to ``acc_dtype`` at every step gives: values
    cast first, added left to right, Kahan's s and c kept in acc_dtype and s returned (0-d tensors of acc_dtype)."""
    for values, dtype, compensated, call, expected, rel, name, hint in _rounding_cases():
        out = accumulate(values, dtype, compensated=True) if compensated else accumulate(values, dtype)
        if call is not None:
            returns_0d_in(out, dtype, call)
        grading.check_scalar(out, expected, rel=rel, name=name, hint=hint)


def fp32_accumulator_within_2x(accumulate: Callable) -> None:
    """2,000 bf16 and fp16 values in [0, 0.01) into an fp32 accumulator: within 2x of torch.sum's error (fp32 inside,
    its result rounded to the input dtype) against the float64 sum."""
    g1 = torch.Generator().manual_seed(1)
    for low in (torch.bfloat16, torch.float16):
        vals = (torch.rand(2000, generator=g1) * 1e-2).to(low)
        grading.check_within_2x(accumulate(vals, torch.float32), vals.double().sum(), vals.sum(),
                                name=f"fp32 累加器：{low} 的 values 累加成 FP32",
                                rule="累加器（與補償 c）每一步都存成 acc_dtype，這裡是 FP32：低精度的 values 先轉成 FP32 再相加",
                                hint="累加器 s 以 torch.zeros((), dtype=acc_dtype) 建立，每一項 v.to(acc_dtype) 再相加；s += v 會把結果留在 s 原來的 dtype，"
                                     "累加器若建成 values 的 dtype（bf16），部分和到 2 左右就停止成長。")


def report_has_four_floats_by_the_formulas(error_report: Callable) -> None:
    """error_report([3, 5], [3, 4]) is a dict of four Python floats: max_abs 1, mean_abs 0.5, rel_l2 0.2, cosine."""
    rep = error_report(torch.tensor([3.0, 5.0]), torch.tensor([3.0, 4.0]))
    grading.check_true(isinstance(rep, dict) and {"max_abs", "mean_abs", "rel_l2", "cosine"} <= set(rep),
                       name="error_report 回傳含四個鍵的 dict", detail=f"應回傳含四個鍵的 dict，卻得到 {rep!r}")
    for key in ("max_abs", "mean_abs", "rel_l2", "cosine"):
        grading.check_true(isinstance(rep[key], float), name=f"error_report[{key!r}] 是 Python float",
                           detail=f"得到 {type(rep[key]).__name__}。", hint="對 0 維張量呼叫 .item()（或 float(...)）。")
    grading.check_scalar(rep["max_abs"], 1.0, name="max_abs")
    grading.check_scalar(rep["mean_abs"], 0.5, name="mean_abs")
    grading.check_scalar(rep["rel_l2"], 0.2, name="rel_l2", hint="||c - r|| / ||r||")
    grading.check_scalar(rep["cosine"], 29 / (5 * math.sqrt(34)), name="cosine", hint="<c, r> / (||c|| ||r||)")


def report_computes_in_float64(error_report: Callable) -> None:
    """Every measure in float64: two fp16 inputs [64, 300] whose norms pass 65504; fp16 and bf16 candidates against an
    fp32 reference (NumPy float64 expected values); inputs of different dtypes; float64 inputs 1e-9 apart."""
    # fp16 inputs, 2-D, norms > 65504: a norm taken in fp16 overflows
    g = torch.Generator().manual_seed(11)
    r = torch.randn(64, 300, generator=g) * 500
    c = r + 2 * torch.randn(64, 300, generator=g)
    rep = error_report(c.half(), r.half())
    rn, cn = r.half().double(), c.half().double()
    grading.check_scalar(rep["rel_l2"], float(torch.linalg.vector_norm(cn - rn) / torch.linalg.vector_norm(rn)), rel=1e-6,
                         name="先都轉成 float64 再算：rel_l2（兩個 fp16 輸入，範數超過 65504）",
                         hint="fp16 的範數超過 65504 會溢位成 inf（rel_l2 變成 0 或 NaN）；兩個輸入都先 .double() 再算。")
    grading.check_scalar(rep["cosine"], float(F.cosine_similarity(cn.flatten(), rn.flatten(), dim=0)), rel=1e-6,
                         name="先都轉成 float64 再算：cosine（兩個 fp16 輸入，範數超過 65504）",
                         hint="fp16 的範數超過 65504 會溢位成 inf；兩個輸入都先 .double() 再算。")
    # fp16 and bf16 candidates vs an fp32 reference
    for dtype in (torch.float16, torch.bfloat16):
        ref = torch.randn(64, 300, generator=g) * 500
        cand = (ref + 2 * torch.randn(64, 300, generator=g)).to(dtype)
        rep = error_report(cand, ref)
        cn, rn = cand.double().numpy().ravel(), ref.numpy().astype(np.float64).ravel()
        expected = {"max_abs": np.abs(cn - rn).max(), "mean_abs": np.abs(cn - rn).mean(),
                    "rel_l2": np.linalg.norm(cn - rn) / np.linalg.norm(rn),
                    "cosine": np.dot(cn, rn) / (np.linalg.norm(cn) * np.linalg.norm(rn))}
        for key, want in expected.items():
            grading.check_scalar(rep[key], float(want), rel=1e-6,
                                 name=f"先都轉成 float64 再算：error_report[{key!r}]（{str(dtype)[6:]} 對 fp32，形狀 [64, 300]）",
                                 hint="兩個輸入都先 .double()，並攤平成一維（輸入可以是任何形狀）；fp16 的範數超過 65504 會溢位成 inf，"
                                      "bf16 只有 8 位有效位元，在 bf16 裡算的範數與內積會失去 rel_l2、cosine 要量的那幾位。")
    # inputs of different dtypes: each goes straight to float64 (rounded once), not through the other's dtype
    rep = error_report(torch.tensor([1.0001, 2.0, 3.0]), torch.tensor([1.0, 2.0, 3.0]).half())
    grading.check_scalar(rep["max_abs"], float(torch.tensor(1.0001).double() - 1.0), rel=1e-6,
                         name="dtype 不同的輸入各自直接轉成 float64（fp32 的候選對 fp16 的參考）",
                         hint="c = candidate.double()、r = reference.double()：不要先把候選轉成參考的 dtype（fp16 裡 1.0001 捨入成 1，誤差就不見了）。")
    # two bf16 inputs that are far apart (not within a factor 2): c - r taken in bf16 rounds to 8 significant bits
    g2 = torch.Generator().manual_seed(12)
    rb = torch.randn(32, 50, generator=g2).bfloat16()
    cb = (rb.float() + 0.7 * torch.randn(32, 50, generator=g2)).bfloat16()
    rep = error_report(cb, rb)
    d = cb.double().flatten() - rb.double().flatten()
    for key, value in (("max_abs", d.abs().max()), ("mean_abs", d.abs().mean()), ("rel_l2", d.norm() / rb.double().norm())):
        grading.check_scalar(rep[key], float(value), rel=1e-6, name=f"差也在 float64 算：error_report[{key!r}]（兩個 bf16 輸入）",
                             hint="兩個輸入都先 .double() 再相減：(candidate - reference) 在 bf16 裡算，差會被捨入成 8 位有效位元"
                                  "（兩者相差不到 2 倍時才剛好精確，所以接近的輸入看不出來）。")
    # float64 inputs: a difference of 1e-9 around 1 vanishes if the inputs are rounded to float32
    base = torch.linspace(1, 2, 1000, dtype=torch.float64)
    grading.check_scalar(error_report(base + 1e-9, base)["max_abs"], 1e-9, rel=1e-4,
                         name="計算在 float64：float64 輸入的微小誤差不可被捨入掉",
                         hint="若轉成 float32，1 + 1e-9 會被捨入成 1，差變成 0；請用 .double()，不是 .float()。")


def report_sees_one_vector_of_any_layout(error_report: Callable) -> None:
    """A transposed (not contiguous) [3, 4] input is flattened; the cosine of a [4, 50] input whose first row has its
    sign flipped is that of the flattened tensors, not the mean of the rows' cosines."""
    xt = torch.arange(12.0).reshape(4, 3).T
    grading.check_scalar(error_report(xt, xt + 1)["max_abs"], 1.0, name="任何形狀與版面：轉置（不連續）的輸入",
                         hint="用 .flatten()（或 .reshape(-1)）攤平；.view(-1) 遇到不連續的張量會出錯。")
    r = torch.randn(4, 50, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    c = torch.cat([-r[:1], r[1:]])
    cos_all = float((c.flatten() @ r.flatten()) / (c.norm() * r.norm()))
    grading.check_scalar(error_report(c, r)["cosine"], cos_all, rel=1e-9,
                         name="cosine 是把整個張量當成一個向量（2-D 輸入，第一列錯、其他列完全正確）",
                         hint="先 .flatten() 再算 <c, r> / (||c|| ||r||)；逐列算 cosine 再平均，每一列的權重就一樣，"
                              f"得到的是 {float(F.cosine_similarity(c, r, dim=-1).mean()):.4f}，不是 {cos_all:.4f}。")


def _rel_l2_or_error(error_report: Callable, candidate: torch.Tensor, reference: torch.Tensor):
    """error_report's rel_l2, or the ValueError it raised instead."""
    try:
        return error_report(candidate, reference)["rel_l2"]
    except ValueError as err:
        return err


def report_refuses_only_an_all_zero_reference(error_report: Callable) -> None:
    """Tiny references are measured (float64 1e-20: cosine 1, rel_l2 0.01; float32 1e-30: rel_l2 0.5); one containing
    0 gives a small rel_l2 (no element-wise division); only an all-zero [2, 3] reference raises ValueError."""
    # F.cosine_similarity clamps each norm to at least 1e-8; a float32 norm of 1e-30 underflows to 0
    tiny = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 1e-20
    grading.check_scalar(error_report(1.01 * tiny, tiny)["cosine"], 1.0, rel=1e-9,
                         name="cosine：元素都很小（約 1e-20）的參考也照常計算",
                         hint="cosine = <c, r> / (||c|| ||r||)，在 float64 中照公式算；F.cosine_similarity 把每個範數至少當成 1e-8，"
                              "範數約 1e-18 時得到的是 1e-21 左右，不是 1。")
    grading.check_scalar(error_report(torch.full((16,), 1.5e-30), torch.full((16,), 1e-30))["rel_l2"], 0.5, rel=1e-6,
                         name="fp32 的參考約 1e-30：不是全為 0，rel_l2 = 0.5",
                         hint="先 .double() 再算範數、再判斷參考是不是全為 0：float32 裡 (1e-30)² 下溢成 0，範數就成了 0。")
    grading.check_raises(lambda: error_report(torch.ones(2, 3), torch.zeros(2, 3)), ValueError,
                         name="reference 全為 0 時拋出 ValueError",
                         hint="先算 ||reference||，為 0 就 raise ValueError(...)：此時 rel_l2 與 cosine 沒有定義。")
    ref = torch.arange(-1000, 1001) / 1000  # contains 0 and many values near 0
    near = _rel_l2_or_error(error_report, ref + 1e-3, ref)
    grading.check_true(isinstance(near, float) and near < 0.01, name="參考值含 0 時 rel_l2 不爆掉、也不拋錯",
                       detail=f"參考值含 0 與許多接近 0 的值，rel_l2 應約為 0.0017，卻得到 {near!r}。",
                       hint="不要逐元素相除；只有「全為 0」才拋出 ValueError。")
    # a tiny but nonzero reference (float64, about 1e-20, like small gradients): defined, so no ValueError
    tiny_ref = torch.randn(200, generator=torch.Generator().manual_seed(14), dtype=torch.float64) * 1e-20
    tiny_rel = _rel_l2_or_error(error_report, tiny_ref * 1.01, tiny_ref)
    grading.check_true(isinstance(tiny_rel, float) and abs(tiny_rel - 0.01) < 1e-9,
                       name="很小但不為 0 的參考值（float64，約 1e-20）照常計算，不拋錯",
                       detail=f"candidate = 1.01 × reference，rel_l2 應為 0.01，卻得到 {tiny_rel!r}。",
                       hint="只有 ||reference|| 恰好為 0 才拋出 ValueError：torch.allclose(reference, 0)（預設 atol=1e-8）、"
                            "「範數 < 1e-12」或「最大值 < 某個門檻」都會把很小但有意義的參考值（例如梯度）當成全為 0。")


def report_leaves_inputs_unchanged(error_report: Callable) -> None:
    """error_report on float64 [3, 20] inputs, where .double() and .flatten() return the same memory, changes neither."""
    c64 = torch.linspace(-1, 1, 60, dtype=torch.float64).reshape(3, 20)
    contract.check_inputs_unchanged(error_report, c64, 0.9 * c64 + 0.05,
                                    name="error_report（float64 輸入：.double() 與 .flatten() 不複製，不要 sub_、-=）")
