"""Visible tests of exercise 5b of 01_setup_and_comparison: the autograd Function ``FlashAttention2``.

``FlashAttention2.apply(q, k, v, is_causal)`` takes q [..., N, d], k, v [..., Nk, d] and returns o [..., N, d];
it saves q, k, v, o and one lse [..., N]. o and the gradients are compared with autograd through labkit's
reference attention (atol 1e-5 for o, 1e-4 for gradients in fp32, 1e-10 in float64).

Used in: 01_setup_and_comparison (test cells of ex5b)
"""
from __future__ import annotations

import torch

from labkit.checks import contract
from labkit.core import grading
from labkit.engine import attention

GRADS = ("dq", "dk", "dv")


def _saved_lse(o, q):
    """The tensors o's Function saved that have lse's shape q.shape[:-1]."""
    return [t for t in o.grad_fn.saved_tensors if tuple(t.shape) == tuple(q.shape[:-1])]


def writes_its_own_code(FlashAttention2) -> None:
    """forward and backward reach no SDPA or softmax (nor labkit); backward runs no autograd (exercise 5a's code)."""
    for method in (FlashAttention2.forward, FlashAttention2.backward):
        grading.check_own_code(method, name=f"FlashAttention2.{method.__name__}: 自己寫",
                               forbid=(torch.nn.functional.scaled_dot_product_attention, torch.softmax,
                                       torch.Tensor.softmax, torch.nn.functional.softmax))
    grading.check_own_code(FlashAttention2.backward, name="FlashAttention2.backward: flash_attention_backward, not autograd",
                           forbid=(torch.autograd.grad, torch.Tensor.backward))


def matches_autograd_and_saves_lse(FlashAttention2) -> None:
    """fp32 [2, 3, 100, 16], causal or not: forward returns o only; it saves exactly q, k, v, o and one lse [2, 3, 100]
    (the reference's values); o and the gradients match autograd through the reference."""
    torch.manual_seed(9)
    q, k, v = (torch.randn(2, 3, 100, 16, requires_grad=True) for _ in range(3))
    do = torch.randn(2, 3, 100, 16)
    for causal in (False, True):
        o = FlashAttention2.apply(q, k, v, causal)
        grading.check_true(isinstance(o, torch.Tensor), name="FlashAttention2.forward: returns o only",
                           detail=f"forward 應只回傳 o（一個張量），卻回傳 {type(o).__name__}。")
        o_ref, lse_ref = attention.reference_attention(q, k, v, causal=causal)
        grading.check_tensor(o, o_ref, name=f"FlashAttention2: o (causal={causal})", atol=1e-5)
        saved, lse_like = o.grad_fn.saved_tensors, _saved_lse(o, q)
        grading.check_true(len(lse_like) == 1, name="FlashAttention2: saved log-sum-exp",
                           detail=f"save_for_backward 應恰好存一個形狀 {tuple(q.shape[:-1])} 的 lse，"
                                  f"實際存了：{[tuple(t.shape) for t in saved]}。",
                           hint="ctx.save_for_backward 存 q、k、v、o、lse；不要另外存 m 與 l。")
        grading.check_tensor(lse_like[0], lse_ref, name="FlashAttention2: saved lse values", atol=1e-5)
        grading.check_true(len(saved) == 5 and any(t.shape == o.shape and torch.equal(t, o.detach()) for t in saved),
                           name="FlashAttention2: saves q, k, v, o and lse",
                           detail=f"save_for_backward 應恰好存 5 個張量（q、k、v、o、lse），實際存了 {len(saved)} 個："
                                  f"{[tuple(t.shape) for t in saved]}。",
                           hint="ctx.save_for_backward 存 q、k、v、o、lse：o 要存下來給反向的 D = rowsum(dO * O)，不要在 backward 重算前向；"
                                "is_causal 不是張量，存成 ctx.is_causal。")
        grads, expected = torch.autograd.grad(o, (q, k, v), do), torch.autograd.grad(o_ref, (q, k, v), do)
        for name, g, e in zip(GRADS, grads, expected):
            grading.check_tensor(g, e, name=f"FlashAttention2: {name} (causal={causal})", atol=1e-4,
                                 hint="backward 回傳 (dq, dk, dv, None)；is_causal 要存在 ctx 上並傳給 backward。")


def keeps_is_causal_per_call(FlashAttention2) -> None:
    """fp32 [1, 2, 16, 8]: a causal forward, then a non-causal one, then the backward of the first (and the other
    order): the gradients are those of the first call's own is_causal (kept on ctx, not on the class or a global)."""
    torch.manual_seed(38)
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    do = torch.randn(1, 2, 16, 8)
    for first in (True, False):
        o_first = FlashAttention2.apply(q, k, v, first)
        FlashAttention2.apply(q, k, v, not first)
        grads = torch.autograd.grad(o_first, (q, k, v), do)
        expected = torch.autograd.grad(attention.reference_attention(q, k, v, causal=first)[0], (q, k, v), do)
        for name, g, e in zip(GRADS, grads, expected):
            grading.check_tensor(g, e, atol=1e-4, name=f"FlashAttention2：每次呼叫的 is_causal 留在自己的 ctx 上（is_causal={first} "
                                                       f"的前向、再一次 is_causal={not first} 的前向，之後反向第一個）：{name}",
                                 hint="forward 用 ctx.is_causal = is_causal 存，backward 讀 ctx.is_causal；存在 class 屬性"
                                      "（FlashAttention2.is_causal）或全域變數時，第二次前向會蓋掉第一次的設定。")


def works_on_views(FlashAttention2) -> None:
    """Causal fp32 q, do [2, 2, 20, 8], k, v [2, 2, 24, 8] as views (transposed storage, rows of a wider buffer): o and
    the gradients through the Function equal those on contiguous copies, with no error (a q.view(-1, N, d) of a
    transposed q raises); q, k, v and do are left unchanged."""
    torch.manual_seed(39)
    name = "FlashAttention2 (o, dq, dk, dv)"

    def o_and_grads(q, k, v, do):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        try:
            out = FlashAttention2.apply(q, k, v, True)
            return (out, *torch.autograd.grad(out, (q, k, v), do))
        except RuntimeError as error:
            grading.check_true(False, name=f"{name}：輸入可以是 view", detail=(
                f"q、k、v 的 stride {[t.stride() for t in (q, k, v)]} 時出錯：{str(error)[:200]}"),
                hint="模型傳入的 q、k、v 常是 transpose 後的 view：不要用 .view() 攤平前導維度（它要求連續的記憶體），"
                     "改用 .reshape()，或直接讓 flash_attention_forward 處理任意前導維度。")

    q, k, v, do = torch.randn(2, 2, 20, 8), torch.randn(2, 2, 24, 8), torch.randn(2, 2, 24, 8), torch.randn(2, 2, 20, 8)
    contract.check_contract(o_and_grads, q, k, v, do, name=name)


def causal_bottom_right(FlashAttention2) -> None:
    """float64, default blocks: N=24 after 46 cached keys, and N=70 > Nk=24 (the first 46 queries see no key: o = 0,
    gradients 0); o in float64, o and gradients to rounding (atol=1e-10)."""
    torch.manual_seed(12)
    for n, nk in ((24, 70), (70, 24)):
        q = torch.randn(1, 2, n, 8, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(1, 2, nk, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
        o_fn = FlashAttention2.apply(q, k, v, True)   # is_causal: apply takes its arguments by position
        o_ref, _ = attention.reference_attention(q, k, v, causal=True)
        grading.check_true(o_fn.dtype == torch.float64, name=f"FlashAttention2: float64 o, N={n}, Nk={nk}",
                           detail=f"float64 輸入時 o 應為 float64，卻是 {o_fn.dtype}。")
        grading.check_tensor(o_fn, o_ref, name=f"FlashAttention2: causal N={n}, Nk={nk}, o", atol=1e-10,
                             hint="因果規則對齊右下角：query i 看得到 key j 的條件是 j <= i + (Nk - N)；Nk < N 時前 N - Nk 個 query 看不到任何 key（o = 0）。")
        grad_o = torch.randn_like(o_fn)
        for name, g, e in zip(GRADS, torch.autograd.grad(o_fn, (q, k, v), grad_o), torch.autograd.grad(o_ref, (q, k, v), grad_o)):
            grading.check_tensor(g, e, name=f"FlashAttention2: causal N={n}, Nk={nk}, {name} (float64)", atol=1e-10,
                                 hint="前向與反向都要用同一個 is_causal；float64 輸入不要轉成 fp32。")


def bf16_o_and_fp32_lse(FlashAttention2) -> None:
    """bf16 [1, 2, 40, 16], causal: o comes back in bf16 (exercise 4's rule), the saved lse stays fp32."""
    qb, kb, vb = (torch.randn(1, 2, 40, 16).to(torch.bfloat16).requires_grad_() for _ in range(3))
    o = FlashAttention2.apply(qb, kb, vb, True)
    lse_like = _saved_lse(o, qb)
    grading.check_true(o.dtype == torch.bfloat16 and len(lse_like) == 1 and lse_like[0].dtype == torch.float32,
                       name="FlashAttention2: bf16 inputs give bf16 o and save an fp32 lse",
                       detail=f"bf16 輸入時 o 應為 bf16、存下的 lse 應為 fp32，卻得到 o {o.dtype}、"
                              f"lse {[t.dtype for t in lse_like]}。",
                       hint="直接呼叫 flash_attention_forward(q, k, v, is_causal)：不要先把 q、k、v 轉成 fp32，"
                            "也不要把 lse 轉成 q.dtype 再存（統計量留在 fp32）。")


def no_n_by_n_tensor(FlashAttention2) -> None:
    """N = Nk = 512 ([1, 2, 512, 16]), causal or not: neither the forward nor the backward creates a tensor larger
    than an input or a 128 x 128 tile per head (the scores would be 16 times an input)."""
    q, k, v = (torch.randn(1, 2, 512, 16, requires_grad=True) for _ in range(3))
    limit = max(q.numel(), 2 * 128 * 128)
    for causal in (False, True):
        out = []
        size, op = grading.largest_new_tensor(lambda: out.append(FlashAttention2.apply(q, k, v, causal)))
        grading.check_true(size <= limit, name=f"FlashAttention2.forward: no N x N tensor (causal={causal})",
                           detail=f"N = Nk = 512 的前向建立了 {size} 個元素的張量（{op}），超過輸入或單一區塊的大小 {limit}。",
                           hint="forward 要呼叫練習 4 的 flash_attention_forward（分塊、不建立分數矩陣），不是 standard_attention。")
        size, op = grading.largest_new_tensor(lambda: torch.autograd.grad(out[0], (q, k, v), torch.ones_like(out[0])))
        grading.check_true(size <= limit, name=f"FlashAttention2.backward: no N x N tensor (causal={causal})",
                           detail=f"N = Nk = 512 的反向建立了 {size} 個元素的張量（{op}），超過輸入或單一區塊的大小 {limit}。",
                           hint="backward 要呼叫練習 5a 的 flash_attention_backward（從 lse 逐塊重算 P），"
                                "不是用 autograd 對標準注意力求導：那樣會把 N x N 的 P 建出來、存下來。")
