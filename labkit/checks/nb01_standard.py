"""Visible tests of exercise 1 of 01_setup_and_comparison: ``standard_attention(q, k, v, mask, is_causal, scale)``.

Each check calls the student's function on small inputs (q [..., N, d], k, v [..., Nk, d]) and compares
(o [..., N, d], lse [..., N]) with labkit's reference attention: fp32 inputs agree to ~1e-6 (the same terms
summed in another order), so atol=1e-5; float64 to rounding (1e-12); bf16/fp16 by the 2x rule.

Used in: 01_setup_and_comparison (test cells of ex1)
"""
from __future__ import annotations

import math

import torch

from labkit.core import grading
from labkit.engine import attention
from labkit.checks import contract, nb01

NAME = "standard_attention"
STATISTICS_RULE = "softmax 的統計量（每列最大值 m、總和 l、lse）以 fp32 計算，bf16/fp16 輸入也一樣"


def _compare(standard_attention, q, k, v, *, label, is_causal=False, mask=None, scale=None, **check):
    """Run the answer on (q, k, v, mask, is_causal, scale) and check o and lse against the reference, named by
    ``label`` (o's, lse's); ``check``: tolerances and hints of nb01.check_against_reference.

    Returns (o, lse, o_ref, lse_ref).
    """
    o, lse = standard_attention(q, k, v, mask=mask, is_causal=is_causal, scale=scale)
    return (o, lse, *nb01.check_against_reference(o, lse, q, k, v, names=tuple(f"{NAME}: {x}" for x in label),
                                             causal=is_causal, mask=mask, scale=scale, **check))


def writes_its_own_softmax(standard_attention) -> None:
    """No SDPA, softmax, log_softmax or logsumexp (nor labkit) anywhere the function reaches."""
    grading.check_own_code(standard_attention, name="standard_attention: 自己寫 softmax 與 LSE",
                           forbid=(torch.nn.functional.scaled_dot_product_attention, torch.softmax, torch.Tensor.softmax,
                                   torch.nn.functional.softmax, torch.logsumexp, torch.Tensor.logsumexp,
                                   torch.log_softmax, torch.Tensor.log_softmax, torch.nn.functional.log_softmax))


def matches_reference(standard_attention) -> None:
    """fp32 [2, 3, 50, 16] inputs, causal or not: o in q's dtype, lse fp32; the mask argument ([B, 1, N, Nk],
    [N, Nk], AND-ed with is_causal); the scale argument; causal with Nk != N (N=20 and N=1 after Nk=50 keys)."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 3, 50, 16) for _ in range(3))
    for causal in (False, True):
        o, lse, _, _ = _compare(standard_attention, q, k, v, is_causal=causal,
                                label=(f"o (is_causal={causal})", f"lse (is_causal={causal})"),
                                hint="scores = q @ k.transpose(-2, -1) * scale；因果遮罩用 tril。",
                                lse_hint="lse = m + log(sum(exp(s - m)))，形狀 [..., N]（不要 keepdim）。")
        grading.check_true(o.dtype == q.dtype and lse.dtype == torch.float32, name="standard_attention: dtype",
                           detail=f"o 應為 {q.dtype}、lse 應為 torch.float32，卻得到 {o.dtype} 與 {lse.dtype}。")
    mask = torch.rand(2, 1, 50, 50) > 0.5
    mask[..., 0] = True                        # every query sees at least key 0
    mask_2d = torch.rand(50, 50) > 0.3
    mask_2d[:, 0] = True
    for m_, causal, label in ((mask, False, "mask [B, 1, N, Nk]"), (mask_2d, False, "mask [N, Nk]"),
                              (mask, True, "mask + is_causal")):
        _compare(standard_attention, q, k, v, mask=m_, is_causal=causal, label=(f"o with {label}", f"lse with {label}"),
                 hint="mask 為 True 的位置保留；False 的位置把分數設為 -inf；與因果遮罩同時使用時兩者取 AND。")
    o, lse = standard_attention(q, k, v, scale=0.3)
    o_ref, _ = attention.reference_attention(q, k, v, scale=0.3)
    grading.check_tensor(o, o_ref, name="standard_attention: scale=0.3", atol=1e-5,
                         hint="scale 參數給定時用它，只有 scale=None 才用 1/sqrt(d)。")
    # Query i sits at position i + (Nk - N), so it sees keys j <= i + (Nk - N): bottom-right aligned.
    for n in (20, 1):
        _compare(standard_attention, torch.randn(2, 3, n, 16), k, v, is_causal=True,
                 label=(f"causal, N={n} queries, Nk=50 keys", f"lse, causal N={n}, Nk=50"),
                 hint="因果遮罩對齊右下角：query i 可看 key j <= i + (Nk - N)，即 tril(diagonal=Nk - N)；"
                      "N=1 時唯一的 query 看見全部的 key。")


def keeps_the_contract(standard_attention) -> None:
    """fp32 q [1, 2, 12, 8], k, v [1, 2, 16, 8] with a [12, 16] mask and is_causal=True: q, k, v and the caller's
    mask left unchanged (no mask &= causal), views (transposed storage, rows of a wider buffer) give the same o and
    lse, and on meta inputs every tensor it makes follows q's device (the causal mask built with device=q.device)."""
    torch.manual_seed(36)
    q, k, v = torch.randn(1, 2, 12, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    mask = torch.rand(12, 16) > 0.3
    contract.check_contract(standard_attention, q, k, v, name=NAME, meta=True, mask=mask, is_causal=True)


def scale_zero_is_used(standard_attention) -> None:
    """scale=0.0 is used as given (only None means 1/sqrt(d)): every score 0, o = mean of v, lse = log(Nk)."""
    qs, ks, vs = (torch.randn(1, 2, 8, 16) for _ in range(3))
    o, lse = standard_attention(qs, ks, vs, scale=0.0)
    grading.check_tensor(o, vs.mean(-2, keepdim=True).expand_as(o), name="standard_attention: scale=0.0 is used (o = mean of v)",
                         atol=1e-6, hint="只有 scale is None 時才用預設的 1/sqrt(d)：`scale = scale or ...` 會把 0.0 當成沒給。")
    grading.check_tensor(lse, torch.full_like(lse, math.log(8)), name="standard_attention: scale=0.0, lse = log(Nk)", atol=1e-6)


def empty_rows_give_zero(standard_attention) -> None:
    """Rows that see no key give o = 0 and lse = -inf, never NaN: causal N=12 > Nk=5 (7 blind queries), and a
    [50, 50] mask that hides every key from query 3."""
    torch.manual_seed(12)
    q, k, v = (torch.randn(2, 3, 50, 16) for _ in range(3))
    mask_row = torch.ones(50, 50, dtype=torch.bool)
    mask_row[3] = False
    q_many, k_few, v_few = torch.randn(2, 3, 12, 16), torch.randn(2, 3, 5, 16), torch.randn(2, 3, 5, 16)
    for args, kwargs, label in (((q_many, k_few, v_few), dict(is_causal=True), "causal N=12, Nk=5"),
                                ((q, k, v), dict(mask=mask_row), "mask hides every key from query 3")):
        o, lse = standard_attention(*args, **kwargs)
        o_ref, lse_ref = attention.reference_attention(*args, causal=kwargs.get("is_causal", False), mask=kwargs.get("mask"))
        grading.check_true(not o.isnan().any() and not lse.isnan().any(), name=f"standard_attention: no NaN ({label})",
                           detail="看不到任何 key 的列出現了 NaN。",
                           hint="該列的最大值是 -inf，(-inf) - (-inf) = NaN：最大值為 -inf 時改用 0 平移，除以 l 前把 l = 0 換成 1。")
        grading.check_tensor(o, o_ref, name=f"standard_attention: o ({label})", atol=1e-5, hint="完全被遮住的一列：o 應為 0。")
        grading.check_true(bool((torch.isneginf(lse) == torch.isneginf(lse_ref)).all()),
                           name=f"standard_attention: lse = -inf ({label})",
                           detail="完全被遮住的列 lse 應為 -inf（其他列為有限值）。", hint="lse = m + log(l)，l = 0 時是 -inf。")
        grading.check_tensor(lse, lse_ref, name=f"standard_attention: lse ({label})", atol=1e-5)


def subtracts_row_max(standard_attention) -> None:
    """Scores near +-1e4 (one-hot keys, scale=1: exact in fp32): exp overflows unless each ROW subtracts its max."""
    torch.manual_seed(11)
    base = torch.tensor([10000.0, -10000.0, 12000.0, -3000.0, 0.0, 8000.0])
    q_big = base[:, None] + torch.randint(-3, 4, (2, 6, 4)).float()
    k_big = torch.eye(4)[torch.arange(12) % 4].expand(2, 12, 4)
    _compare(standard_attention, q_big, k_big, torch.randn(2, 12, 4), scale=1.0, float64_reference=True, rtol=1e-6,
             label=("scores near 1e4", "lse, scores near 1e4"),
             hint="每一列先減去該列自己的最大值 m（s.amax(dim=-1, keepdim=True)）再取 exp（不是整個張量的最大值）。")


def float64_in_float64(standard_attention) -> None:
    """float64 [3, 30, 8] in, causal: o and lse in float64, computed in float64 (error ~1e-16, atol=1e-12)."""
    q64, k64, v64 = (torch.randn(3, 30, 8, dtype=torch.float64) for _ in range(3))
    o, lse = standard_attention(q64, k64, v64, is_causal=True)
    grading.check_true(o.dtype == torch.float64 and lse.dtype == torch.float64, name="standard_attention: float64 dtype",
                       detail=f"float64 輸入時 o 與 lse 都應為 float64，卻得到 {o.dtype} 與 {lse.dtype}。",
                       hint="計算用的 dtype = torch.promote_types(q.dtype, torch.float32)。")
    _compare(standard_attention, q64, k64, v64, is_causal=True, atol=1e-12,
             label=("float64 accuracy", "float64 lse"), hint="float64 輸入要以 float64 計算（不要先轉成 fp32）。")


def row_max_after_mask(standard_attention) -> None:
    """The row max is taken AFTER masking. Exact scores c * j (scale=1, key j = (j, 0, 0, 0)): a row's largest score
    sits on a hidden key up to 150 above the keys it sees; exp(-150) underflows in fp32, so a max taken before
    masking leaves l = 0 (o = 0, lse = -inf) on a row that sees keys. Causal N=12, Nk=16, and a [N, Nk] mask."""
    k_up = (torch.arange(16.0)[:, None] * torch.eye(4)[0]).expand(2, 3, 16, 4)    # key j = (j, 0, 0, 0)
    q_up = torch.zeros(2, 3, 12, 4)
    q_up[..., 0] = torch.tensor([10.0, 8.0, 12.0])[:, None]                       # score = c * j, c per head
    v_up = torch.randn(2, 3, 16, 4)
    mask_up = torch.rand(12, 16) > 0.4
    mask_up[:, 0] = True
    for kwargs, label in ((dict(is_causal=True), "is_causal, N=12, Nk=16"), (dict(mask=mask_up), "mask [N, Nk]")):
        hint = "先遮罩、再取每列最大值：被遮住的 key 的分數不可參與 m，否則看得見的 key 的 exp(s - m) 會全部下溢成 0。"
        _compare(standard_attention, q_up, k_up, v_up, scale=1.0, float64_reference=True, lse_atol=1e-4, rtol=1e-6,
                 label=(f"hidden keys with the largest scores ({label})", f"lse, hidden keys with the largest scores ({label})"),
                 hint=hint, lse_hint=hint, **kwargs)


def low_precision_statistics_in_fp32(standard_attention) -> None:
    """bf16 [2, 3, 48, 64] causal with Nk=96, fp16 [1, 4, 40, 32] with Nk=72: o in the input dtype, lse fp32;
    o and lse within the 2x rule against float64; lse within 1e-4 of float64 (scores, exp and sums in fp32:
    a bf16/fp16 matmul or s - m rounded before exp is off by ~1e-2, which lse shows)."""
    torch.manual_seed(16)
    for dtype, shape, nk, causal in ((torch.bfloat16, (2, 3, 48, 64), 96, True), (torch.float16, (1, 4, 40, 32), 72, False)):
        kv_shape = (*shape[:-2], nk, shape[-1])
        q = torch.randn(*shape).to(dtype)
        k, v = (torch.randn(kv_shape).to(dtype) for _ in range(2))
        o, lse = standard_attention(q, k, v, is_causal=causal)
        grading.check_true(o.dtype == dtype and lse.dtype == torch.float32, name=f"standard_attention: {dtype} dtype",
                           detail=f"{dtype} 輸入時 o 應為 {dtype}、lse 應為 fp32，卻得到 {o.dtype} 與 {lse.dtype}。",
                           hint="softmax 與 LSE 至少用 fp32 計算：torch.promote_types(q.dtype, torch.float32)。")
        o_ref, lse_ref = attention.reference_attention(q.double(), k.double(), v.double(), causal=causal)
        o_base, lse_base = nb01.plain_attention(q, k, v, nb01.causal_keep(shape[-2], nk, causal))
        grading.check_within_2x(lse, lse_ref, lse_base, name=f"standard_attention: {dtype} lse (2x rule)", rule=STATISTICS_RULE,
                                hint="先把 q、k、v 轉成 fp32（torch.promote_types(q.dtype, torch.float32)）再算分數、最大值、"
                                     "exp 與加總；在 bf16 裡算完再 .float() 只是把已經捨入的值換個型別。")
        grading.check_within_2x(o, o_ref, o_base, name=f"standard_attention: {dtype} o (2x rule)", rule=STATISTICS_RULE)
        grading.check_tensor(lse, lse_ref, name=f"standard_attention: {dtype} lse to fp32 precision", atol=1e-4,
                             hint="至少用 fp32 計算：q、k 先轉成 fp32 再相乘（bf16 的 q @ k.T 已經捨入），"
                                  "s - m、exp 與加總也留在 fp32；lse 與 float64 的差應在 1e-4 以內。")
