"""Visible tests of 10_fp8_attention's exercise 4: ``fp8_pipeline`` (rotate q and k, quantize, ``fp8_attention``).

:func:`_recording` watches the pipeline at work: the ``fp8_attention`` it finds in the notebook's namespace is
wrapped for the duration of a check, so the check sees the FP8 tensors, scales and options it was handed and
dequantizes them against q R, k R (R drawn from the same seed, in closed form) and v. The goals run the reader's
pipeline, with the reader's kernel, over :mod:`labkit.fp8.study`'s cases at its CPU shapes.

Used in: 10_fp8_attention (test cell of ex4)
"""
from __future__ import annotations

import contextlib
import inspect
import math

import torch

from labkit.checks import nb10_quant
from labkit.core import grading
from labkit.fp8 import study
from labkit.tritonlab import mode as tritonmode

SHAPE = (2, 2, 40, 32)   # B, H, N, D of the hand-over checks: 40 rows = 2.5 tiles of 16, 1.25 of 32
_ORDER = ("q", "k", "v")


@contextlib.contextmanager
def _recording(fp8_pipeline, name: str = "fp8_attention"):
    """Inside, the ``fp8_attention`` that ``fp8_pipeline`` finds in its namespace records each call's arguments (a dict
    by parameter name, defaults filled in) in the yielded list, then runs."""
    scope = fp8_pipeline.__globals__
    original = scope.get(name)
    grading.check_true(callable(original), name="fp8_pipeline 呼叫 fp8_attention",
                       detail="在 fp8_pipeline 所在的命名空間找不到 fp8_attention。", hint="先執行練習 3 的格子。")
    calls = []

    def spy(*args, **kwargs):
        bound = inspect.signature(original).bind(*args, **kwargs)
        bound.apply_defaults()
        calls.append(dict(bound.arguments))
        return original(*args, **kwargs)

    scope[name] = spy
    try:
        yield calls
    finally:
        scope[name] = original


def _rotation(d: int, seed: int) -> torch.Tensor:
    """float64 R = diag(s) H / sqrt(d), s the +-1 that torch.randint(0, 2, (d,)) draws from manual_seed(seed)."""
    s = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return s[:, None].double() * nb10_quant.sylvester(d).double() / math.sqrt(d)


def _handed_over(fp8_pipeline, q, k, v, what: str, **options) -> dict:
    """The arguments of the one fp8_attention call that ``fp8_pipeline(q, k, v, **options)`` makes; checks o too."""
    with _recording(fp8_pipeline) as calls:
        try:
            o = fp8_pipeline(q, k, v, **options)
        except Exception as error:  # noqa: BLE001 - e.g. descales that do not match the kernel's tiles: name the rule
            grading.check_true(False, name=f"{what}：執行", detail=f"出錯 {type(error).__name__}: {str(error)[:300]}",
                               hint="q 以 block_m、k 與 v 以 block_n 分塊量化，並把 block_m、block_n 也傳給 fp8_attention。")
    grading.check_true(len(calls) == 1, name=f"{what}：呼叫 fp8_attention 一次", detail=f"呼叫了 {len(calls)} 次。",
                       hint="量化 q、k、v 之後呼叫一次 fp8_attention(q8, k8, v8, q_descale, k_descale, v_descale, causal, ...)。")
    grading.check_true(isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and o.shape == q.shape,
                       name=f"{what}：回傳 bf16 的 o [B, H, N, D]", detail=f"得到 {getattr(o, 'dtype', type(o))} "
                       f"{tuple(getattr(o, 'shape', ()))}。", hint="fp8_attention 回傳 (o, lse)：只回傳 o。")
    return calls[0]


def _dequantized(args: dict, which: str) -> torch.Tensor:
    """float64 x8 * descale of ``which`` ("q", "k", "v") in the recorded arguments (descale 0-dim or per block)."""
    x8, descale = args[f"{which}8"], args[f"{which}_descale"].double()
    if descale.dim() == 0:
        return x8.double() * descale
    block = args["block_m"] if which == "q" else args["block_n"]
    return x8.double() * descale.repeat_interleave(block, dim=-1)[..., :x8.shape[2], None]


def _near(args: dict, wants: dict, what: str, hint: str, rotated: bool = False) -> None:
    """Each of q8, k8, v8 dequantized is ``wants[name]`` within e4m3's rounding (relative RMS error <= 0.1)."""
    for which in _ORDER:
        got, want = _dequantized(args, which), wants[which]
        rel = float((got - want).norm() / want.norm())
        grading.check_true(rel <= 0.1, name=f"{what}：{which}8 · {which}_descale ≈ {which}{' R' if rotated and which != 'v' else ''}",
                           detail=f"相對 RMS 誤差 {rel:.3g}（e4m3 的捨入約 0.03）。", hint=hint)


def pipeline_hands_over(fp8_pipeline) -> None:
    """q, k, v bf16 [2, 2, 40, 32] (where Triton kernels run here). Block scaling with rotation (seed 3, block_m 16, block_n 32, causal, p_scale 64,
    reverse): one fp8_attention call with e4m3 operands, q_descale [2, 2, 3], k and v [2, 2, 2], the options passed
    through, q8 and k8 dequantized ~ q R and k R with the SAME R (the generator's first draw), v8 ~ v (not rotated);
    per-tensor scaling without rotation: 0-dim descales, q8 ~ q; with rotation (seed 3): q8 ~ q R, k8 ~ k R, v8 ~ v;
    quant="bad" -> ValueError; o bf16 [2, 2, 40, 32]."""
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(*SHAPE, generator=g).bfloat16().to(tritonmode.device()) for _ in range(3))
    options = dict(quant="block", rotate=True, causal=True, p_scale=64.0, reverse=True, block_m=16, block_n=32)
    what = "fp8_pipeline(quant='block', rotate=True, block_m=16, block_n=32)"
    args = _handed_over(fp8_pipeline, q, k, v, what, generator=torch.Generator().manual_seed(3), **options)
    grading.check_true(all(args[f"{t}8"].dtype == torch.float8_e4m3fn for t in _ORDER), name=f"{what}：q8、k8、v8 是 e4m3",
                       detail=f"得到 {[str(args[f'{t}8'].dtype) for t in _ORDER]}。", hint="量化函式的預設 dtype 就是 e4m3。")
    shapes = {t: tuple(args[f"{t}_descale"].shape) for t in _ORDER}
    grading.check_true(shapes == {"q": (2, 2, 3), "k": (2, 2, 2), "v": (2, 2, 2)}, name=f"{what}：每塊的 descale 對上核心的 tile",
                       detail=f"descale 形狀 {shapes}，應為 q (2, 2, 3)、k 與 v (2, 2, 2)。",
                       hint="q 用 quantize_per_block(q, block_m)，k 與 v 用 quantize_per_block(·, block_n)。")
    passed = {key: args.get(key) for key in options if key not in ("quant", "rotate")}
    grading.check_true(passed == {key: options[key] for key in passed}, name=f"{what}：選項原樣傳給 fp8_attention",
                       detail=f"fp8_attention 收到 {passed}。", hint="causal、p_scale、reverse、block_m、block_n 都要傳下去。")
    r = _rotation(SHAPE[-1], 3).to(q.device)
    _near(args, {"q": q.double() @ r, "k": k.double() @ r, "v": v.double()}, what, rotated=True,
          hint="旋轉在量化之前：q, k = rotate_qk(q, k, random_rotation(D, generator))，q 與 k 用同一個 R（只抽一次），v 不旋轉。")
    what = "fp8_pipeline(quant='tensor', rotate=False)"
    args = _handed_over(fp8_pipeline, q, k, v, what, quant="tensor")
    grading.check_true(all(args[f"{t}_descale"].dim() == 0 for t in _ORDER), name=f"{what}：每個張量一個 descale（0 維）",
                       detail=f"descale 形狀 {[tuple(args[f'{t}_descale'].shape) for t in _ORDER]}。",
                       hint="quant='tensor' 用 quantize_per_tensor。")
    _near(args, {"q": q.double(), "k": k.double(), "v": v.double()}, what, hint="rotate=False 時不旋轉。")
    what = "fp8_pipeline(quant='tensor', rotate=True)"
    args = _handed_over(fp8_pipeline, q, k, v, what, quant="tensor", rotate=True, generator=torch.Generator().manual_seed(3))
    _near(args, {"q": q.double() @ r, "k": k.double() @ r, "v": v.double()}, what, rotated=True,
          hint="rotate=True 不論 quant 是哪一種：先旋轉 q 與 k，再量化。")
    grading.check_raises(lambda: fp8_pipeline(q, k, v, quant="row"), ValueError, name="fp8_pipeline(quant='row')",
                         hint="quant 只能是 'tensor' 或 'block'，其他的 raise ValueError。")


def pipeline_meets_goals(fp8_pipeline) -> None:
    """The two goals of :data:`labkit.fp8.study.GOAL_RUNS` at :data:`labkit.fp8.study.GOAL_AT`'s CPU shapes, with the
    reader's kernel: outliers, per-tensor RMSE >= 2 x per-block + rotation RMSE (reference 2.95); sink, forward
    p_scale 1 RMSE >= 3 x reverse p_scale 256 RMSE (reference 4.43)."""
    got = study.goals(fp8_pipeline)
    hints = {"outliers": "rotate=True 要在量化前把 q 與 k 乘上同一個 R；quant='block' 每塊一個 scale。",
             "sink": "p_scale 與 reverse 要傳給 fp8_attention：P 先乘上 p_scale 再轉 e4m3，否則 exp(s - m) 小於 2⁻⁹ 的值變成 0。"}
    reference = {"outliers": 2.95, "sink": 4.43}
    for goal, (case, top, bottom, least) in study.GOAL_RUNS.items():
        grading.check_true(got[goal] >= least, name=f"精度目標（{case}）：{top} 的 RMSE ≥ {least:g} × {bottom} 的 RMSE",
                           detail=f"比值只有 {got[goal]:.3g}（參考答案 {reference[goal]:.2f}）。", hint=hints[goal])
