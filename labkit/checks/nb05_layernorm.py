"""Visible tests of 05_precision_analysis's exercise 3: ``layer_norm_fp32_stats(x, weight, bias, eps)``, a LayerNorm
whose statistics and affine run in fp32 and whose result is rounded once to x.dtype.

The expected values come from ``F.layer_norm`` on the inputs upcast to float64, and the 2x rule compares with
``F.layer_norm`` in the inputs' own dtype. The checks that take a generator ``g`` draw their inputs from it in the
order the test cell calls them, so that the cell's hidden tests continue the same stream.

Used in: 05_precision_analysis (test cells of ex3)
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.core import grading
from labkit.checks import contract

LN_RULE = "LayerNorm 的統計量（平均、變異數）與仿射（× weight + bias）都在 FP32 計算，最後只捨入一次成 x.dtype"
LN_HINT = ("x、weight、bias 都先 .float()，(x − μ) / sqrt(σ² + eps) * weight + bias 全在 FP32 算完，最後才 .to(x.dtype)。"
           "先把正規化的結果轉回半精度再乘 weight、加 bias（或統計量在半精度算），y·weight 的捨入誤差會被 weight 放大，"
           "而 bias 抵銷之後輸出本身很小。")
_TO_X_DTYPE = "最後一步 .to(x.dtype)"
EPS_HINT = ("eps 是 Python float，直接加在 FP32 的變異數上（var + eps）：torch.tensor(eps).to(x) 或 .to(x.dtype) 先把它捨入成 x 的"
            "半精度，fp16 裡 1e-8 變成 0（常數列得到 0 / 0 = NaN）、1e-7 變成 1.19e-7。")


def uses_no_ready_made_norm(fn: Callable) -> None:
    """``fn`` reaches no layer / group / RMS / instance / batch norm (functions, torch ops or nn modules)."""
    grading.check_own_code(fn, name="layer_norm_fp32_stats：自己寫，不可呼叫任何現成的正規化函式或層",
                           forbid=(F.layer_norm, torch.layer_norm, torch.native_layer_norm, nn.LayerNorm,
                                   F.group_norm, torch.group_norm, torch.native_group_norm, nn.GroupNorm,
                                   F.rms_norm, torch.rms_norm, nn.RMSNorm,
                                   F.instance_norm, torch.instance_norm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
                                   F.batch_norm, torch.batch_norm, torch.native_batch_norm, nn.BatchNorm1d, nn.BatchNorm2d,
                                   nn.BatchNorm3d, nn.LazyBatchNorm1d, nn.LazyInstanceNorm1d, nn.SyncBatchNorm))


def _output_in(y, dtype: torch.dtype, case: str, shown: str, hint: str = "") -> None:
    """``y`` is a tensor of ``dtype`` (x's); ``case`` names the inputs, ``shown`` the dtype expected, in the message."""
    grading.check_true(isinstance(y, torch.Tensor) and y.dtype == dtype,
                       name=f"layer_norm_fp32_stats 的輸出轉回 x.dtype（{case}）",
                       detail=f"輸出應為 {shown}，卻得到 {getattr(y, 'dtype', type(y).__name__)}。", hint=hint)


def normalizes_last_dim_with_affine(fn: Callable, g: torch.Generator) -> None:
    """fp16 x [4, 10, 64], weight and bias [64] from ``g``: an fp16 output equal to the float64 LayerNorm within fp16's
    output rounding (relative 2^-11)."""
    x = torch.randn(4, 10, 64, generator=g).half()
    wt = (1 + 0.5 * torch.randn(64, generator=g)).half()
    bs = (0.5 * torch.randn(64, generator=g)).half()
    y = fn(x, wt, bs)
    _output_in(y, torch.float16, "float16", "float16", _TO_X_DTYPE)
    grading.check_tensor(y, F.layer_norm(x.double(), (64,), wt.double(), bs.double()), atol=4e-3, rtol=2e-3,
                         name="對最後一維正規化，再乘上 weight、加上 bias",
                         hint="y = (x - μ) / sqrt(σ² + eps) * weight + bias；μ、σ² 沿最後一維（keepdim=True）。")


def fp32_two_pass_statistics(fn: Callable, g: torch.Generator) -> None:
    """A large mean and a small spread (outlier features of a residual stream), x [16, 128] from ``g``: fp16 with mean
    2000 and std 2, bf16 with mean 200 and std 4. Statistics taken in half precision, or E[x²] - E[x]², fail here."""
    for dtype, mean, std, tol in ((torch.float16, 2000.0, 2.0, (4e-3, 2e-3)), (torch.bfloat16, 200.0, 4.0, (3e-2, 3e-2))):
        xh = (torch.randn(16, 128, generator=g) * std + mean).to(dtype)
        y = fn(xh, torch.ones(128, dtype=dtype), torch.zeros(128, dtype=dtype))
        _output_in(y, dtype, f"{dtype}", f"{dtype}", _TO_X_DTYPE)
        grading.check_tensor(y, F.layer_norm(xh.double(), (128,)), atol=tol[0], rtol=tol[1],
                             name=f"統計量在 FP32、用 two-pass 計算（{dtype}，平均 {mean:g}、標準差 {std:g}）",
                             hint="先 x.float() 再算平均與變異數：在半精度算的平均會被捨入到 x 的間距（ulp），"
                                  "(x - μ)² 也一樣；E[x²] - E[x]² 即使在 FP32 也會相消，請先平均、再算 (x - μ)² 的平均。")


def cancelling_inputs(dtype: torch.dtype, seed: int, shape: tuple[int, ...] = (4, 8, 96)):
    """x of ``shape`` [..., C], weight and bias [C], all in ``dtype``: every row carries the same per-channel pattern
    (as a residual stream does), weight is large and bias cancels weight x pattern, so the output is small while
    y * weight is large; rounding y (or y * weight) to half before the end shows."""
    gen, C = torch.Generator().manual_seed(seed), shape[-1]
    z = torch.randn(C, generator=gen)
    z = (z - z.mean()) / z.std(unbiased=False)
    x_ = 40 + 8 * z + 0.3 * torch.randn(*shape, generator=gen)
    w_ = 16 * (1 + 0.25 * torch.randn(C, generator=gen))
    y_ = (x_ - x_.mean(-1, keepdim=True)) / x_.std(-1, unbiased=False, keepdim=True)
    return x_.to(dtype), w_.to(dtype), (-w_ * y_.reshape(-1, C).mean(0)).to(dtype)


def affine_in_fp32_within_2x(fn: Callable) -> None:
    """The 2x rule on cancelling inputs (:func:`cancelling_inputs`): bf16 and fp16 [4, 8, 96], bf16 [5, 40], and bf16 x
    with fp32 weight and bias [96] (the baseline: F.layer_norm on the same mix)."""
    for dtype, shape in ((torch.bfloat16, (4, 8, 96)), (torch.float16, (4, 8, 96)), (torch.bfloat16, (5, 40))):
        xh, wh, bh = cancelling_inputs(dtype, 3, shape)
        C = xh.shape[-1]
        grading.check_within_2x(fn(xh, wh, bh), F.layer_norm(xh.double(), (C,), wh.double(), bh.double()),
                                F.layer_norm(xh, (C,), wh, bh),
                                name=f"2 倍規則：{dtype} 輸入、形狀 {list(shape)}，weight 大、bias 抵銷 weight × 逐通道樣式",
                                rule=LN_RULE, hint=LN_HINT)
    # the affine uses the fp32 parameters as they are: rounding weight to bf16 first costs |y·weight|·2^-9
    xf, wf, bf = cancelling_inputs(torch.float32, 4)
    xh = xf.bfloat16()
    grading.check_within_2x(fn(xh, wf, bf), F.layer_norm(xh.double(), (96,), wf.double(), bf.double()),
                            F.layer_norm(xh, (96,), wf, bf), name="2 倍規則：bf16 的 x、fp32 的 weight 與 bias（weight 大、bias 抵銷）",
                            rule=LN_RULE,
                            hint="weight 與 bias 已經是 FP32：直接用 weight.float()、bias.float()，不要先轉成 x.dtype"
                                 "（weight.to(x.dtype) 會把 weight 捨入成 bf16，誤差再被 y·weight 放大）。")


def fp32_params_keep_x_dtype(fn: Callable, g: torch.Generator) -> None:
    """bf16 x [4, 64] with fp32 weight and bias [64] from ``g`` (a mixed-precision model keeps its LayerNorm
    parameters in fp32): a bf16 output, close to the float64 LayerNorm."""
    xm = torch.randn(4, 64, generator=g).bfloat16()
    wm, bm = 1 + 0.5 * torch.randn(64, generator=g), 0.5 * torch.randn(64, generator=g)
    y = fn(xm, wm, bm)
    _output_in(y, torch.bfloat16, "bf16 的 x、fp32 的 weight 與 bias", "bfloat16（x 的 dtype）",
               "最後一步 .to(x.dtype)：不是 weight 的 dtype（.to(weight.dtype)、.type_as(weight)），"
               "混合精度模型的 LayerNorm 參數常是 fp32，而 x 是 bf16。")
    grading.check_tensor(y, F.layer_norm(xm.double(), (64,), wm.double(), bm.double()), atol=3e-2, rtol=1e-2,
                         name="bf16 的 x、fp32 的 weight 與 bias：數值", hint=LN_HINT)


def eps_inside_the_sqrt(fn: Callable, g: torch.Generator) -> None:
    """float32 x [3, 7, 32] from ``g`` with variance about 1e-6, comparable to eps: sqrt(σ² + eps), with the default
    eps 1e-5 and with the caller's eps=1e-4."""
    xs = torch.randn(3, 7, 32, generator=g) * 1e-3
    y = fn(xs, torch.ones(32), torch.zeros(32))
    _output_in(y, torch.float32, "float32", "float32")
    grading.check_tensor(y, F.layer_norm(xs.double(), (32,), eps=1e-5), atol=1e-5, rtol=1e-4,
                         name="eps 加在變異數上：sqrt(σ² + eps)",
                         hint="變異數小到與 eps 相當時，sqrt(σ²) + eps 或忘了 eps 都會差很多。")
    grading.check_tensor(fn(xs, torch.ones(32), torch.zeros(32), eps=1e-4),
                         F.layer_norm(xs.double(), (32,), eps=1e-4), atol=1e-5, rtol=1e-4,
                         name="用呼叫者傳入的 eps（eps=1e-4，變異數約 1e-6）",
                         hint="sqrt(σ² + eps) 裡的 eps 是函式的參數，不要寫死成預設值 1e-5。")


def small_eps_kept_in_fp32(fn: Callable) -> None:
    """eps = 1e-8 and 1e-7, below fp16's smallest normal number (in fp16, 1e-8 rounds to 0 and 1e-7 to 1.19e-7): fp16
    and bf16 x [4, 64] whose first row is constant (variance 0) and whose other rows have a variance about 1e-7, as
    small as eps. Every output finite, and by the 2x rule as close to the float64 LayerNorm as F.layer_norm in x's
    dtype (which adds eps in fp32)."""
    gen = torch.Generator().manual_seed(8)
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.cat([torch.full((1, 64), 0.5), 3e-4 * torch.randn(3, 64, generator=gen)]).to(dtype)
        wt, bs = (1 + 0.25 * torch.randn(64, generator=gen)).to(dtype), (0.1 * torch.randn(64, generator=gen)).to(dtype)
        for eps in (1e-8, 1e-7):
            y = fn(x, wt, bs, eps=eps)
            case = f"{str(dtype)[6:]} 的 x、eps={eps:g}"
            bad = int((~torch.isfinite(y)).sum()) if isinstance(y, torch.Tensor) else -1
            grading.check_true(bad == 0, name=f"eps 很小時輸出仍是有限值（{case}，第一列是常數：變異數 0）",
                               detail=f"輸出有 {bad} 個非有限值（NaN/inf）：sqrt(σ² + eps) 變成 0，0 / 0 = NaN。",
                               hint=EPS_HINT)
            grading.check_within_2x(y, F.layer_norm(x.double(), (64,), wt.double(), bs.double(), eps),
                                    F.layer_norm(x, (64,), wt, bs, eps), name=f"2 倍規則：{case}（變異數約 1e-7，與 eps 相當）",
                                    rule="eps 與變異數一起在 FP32 相加：sqrt(σ² + eps)", hint=EPS_HINT)


def layernorm_keeps_the_contract(fn: Callable) -> None:
    """float32 x [3, 5, 32] (x.float() is x itself), weight and bias [32] (lk.checks.contract): none of them changed;
    the same output for x as a transposed or sliced view; and on the "meta" device an output on that device (every
    tensor the answer makes follows x's device)."""
    g5 = torch.Generator().manual_seed(5)
    x = torch.randn(3, 5, 32, generator=g5) * 2 + 1
    contract.check_contract(fn, x, 1 + torch.randn(32, generator=g5), torch.randn(32, generator=g5),
                            name="layer_norm_fp32_stats（float32 的 x：x.float() 不複製）", meta=True)
