"""Visible tests of 11_determinism's exercise 2: the deterministic backward (``deterministic_backward``).

The rules: the same bits for dQ, dK and dV whatever order the programs run in (the interpreter's programs shuffled,
:func:`labkit.determinism.reduce.distinct_over_orders`; on a GPU, repeated runs); correct against float64 autograd
(fp32 inputs within 1e-4; bf16 and fp16 by the course's 2x rule); the student's own kernel (not the given atomic one,
not SDPA or autograd); views and inputs left as they were; no load or store outside the tensors. Shapes vary: head size
!= block size, N and N_K not multiples of the blocks, N != N_K, block_m != block_n, causal with rows that see no key.

Used in: 11_determinism (test cell of ex2)
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from labkit.checks import contract, nb06_backward
from labkit.core import codereach, grading
from labkit.determinism import backward as detbackward, reduce as detreduce
from labkit.engine import attention
from labkit.tritonlab import bounds as tritonbounds, mode as tritonmode

NAME = "deterministic_backward"
RULE = ("每個 dQ 的部分和（第 j 個鍵區塊對第 i 個查詢區塊的 dS_ij K_j）寫進只屬於它的固定格子，全部寫完後再依固定順序相加；"
        "tl.atomic_add 的相加順序由程式執行的先後決定，每次執行都可能不同")
FORBID = (F.scaled_dot_product_attention, torch.autograd.grad, detbackward.atomic_backward)
CASES = [  # (what, B, H, N, N_K, D, causal, block_m, block_n)
    ("N = 40, N_k = 56, d = 32, non-causal", 1, 2, 40, 56, 32, False, 16, 16),
    ("causal N = 70 > N_k = 45, d = 16, block_m 16, block_n 32", 2, 1, 70, 45, 16, True, 16, 32),
    ("causal N = 33 < N_k = 80, d = 64", 1, 1, 33, 80, 64, True, 16, 16),
]
HINT_MATH = ("P_ij = exp(S_ij * scale - lse_i)（看不到的位置用 tl.where 設 0）；dV_j += P^T dO_i；dS = P ∘ (dO_i V_j^T - D_i)，"
             "D = rowsum(dO ∘ O)；dK_j += scale * dS^T Q_i；dQ_i 的份額 = scale * dS K_j。因果是右下對齊：j <= i + N_k - N。")


def _inputs(B, H, N, n_k, D, causal, dtype=torch.float32, seed=0):
    """q, k, v, do of the case, and o, lse from float64 attention; plus the float64 gradients (dq, dk, dv)."""
    gen = torch.Generator().manual_seed(seed)
    dev = tritonmode.device()
    q, do = (torch.randn(B, H, N, D, generator=gen).to(dtype).to(dev) for _ in range(2))
    k, v = (torch.randn(B, H, n_k, D, generator=gen).to(dtype).to(dev) for _ in range(2))
    o, lse, grads = nb06_backward.gradients64(q, k, v, do, causal)
    return (q, k, v, o.to(dtype), lse, do), grads


def own_code(backward) -> None:
    """backward is the student's: no SDPA, no autograd, not the given atomic backward; it launches a Triton kernel
    defined in the notebook with the grid and block sizes the prose states and fp32 dQ slots (bf16 inputs), and no kernel
    it launches adds by ``tl.atomic_add``."""
    name = f"{NAME}：自己的 Triton 核心"
    reached = codereach.first_reached(backward, lambda obj: any(obj is f for f in FORBID),
                                       attributes={"atomic_backward", "scaled_dot_product_attention"})
    grading.check_true(not reached, name=name, detail=f"{NAME} 用到了 {reached}。",
                       hint="這個練習要你寫自己的核心：不要呼叫 lk.detbackward.atomic_backward、SDPA 或 torch.autograd.grad。")
    args, _ = _inputs(1, 2, 20, 40, 16, False, torch.bfloat16)
    launched: list = []   # (kernel function, grid, its arguments by name) of the notebook's launches
    with tritonmode.watched_launches(lambda fn, a, kw: launched.append(
            (fn, kw.get("grid"), {**dict(zip(inspect.signature(fn).parameters, a)), **kw}))), tritonbounds.outside_accesses():
        backward(*args, False, block_m=32, block_n=32)   # a stray store is dropped, not run
    grading.check_true(len(launched) >= 1, name=name, detail="沒有啟動任何在 notebook 裡定義的 Triton 核心。",
                       hint="deterministic_backward 要以 _bwd_slots_kernel[grid](...) 啟動你自己的核心。")
    shapes = [(tuple(grid) if isinstance(grid, (tuple, list)) else grid, named.get("BLOCK_M"), named.get("BLOCK_N"))
              for _, grid, named in launched]
    grading.check_true(((2, 2), 32, 32) in shapes, name=f"{NAME}：網格 (cdiv(N_k, block_n), B * H)，區塊大小用引數",
                       detail=f"N_k = 40、B * H = 2、block_m = block_n = 32 應有一次網格 (2, 2)、BLOCK_M = BLOCK_N = 32 的啟動，"
                              f"得到（網格, BLOCK_M, BLOCK_N）：{shapes}。",
                       hint="一個程式負責一個鍵區塊：_bwd_slots_kernel[(triton.cdiv(N_k, block_n), B * H)](..., BLOCK_M=block_m, "
                            "BLOCK_N=block_n)；block_m、block_n 是引數，不要寫死。")
    slots = [named["dq_slots_ptr"] for _, _, named in launched if isinstance(named.get("dq_slots_ptr"), torch.Tensor)]
    grading.check_true(bool(slots) and all(t.dtype == torch.float32 and t.numel() == 2 * 2 * 20 * 16 for t in slots),
                       name=f"{NAME}：dQ 的格子是 fp32 的 [B, H, cdiv(N_k, block_n), N, d]",
                       detail=f"bf16 輸入、N = 20、N_k = 40、block_n = 32、d = 16：格子應為 float32、{2 * 2 * 20 * 16} 個元素，得到 "
                              f"{[(t.dtype, t.numel()) for t in slots]}。",
                       hint="dq_slots = torch.zeros(B, H, cdiv(N_k, block_n), N, d, dtype=torch.float32)：份額以 fp32 存、以 fp32 相加，"
                            "最後才轉回輸入的 dtype。")
    atomic = sorted({fn.__name__ for fn, _, _ in launched if "atomic_add" in codereach.attributes_read(fn)})
    grading.check_true(not atomic, name=f"{NAME}：dQ 的份額存進格子，不用 atomic", detail=f"核心 {atomic} 用了 tl.atomic_add。",
                       hint=f"違反的規則：{RULE}。每個格子只有一個寫入者：用 tl.store。")


def matches_float64(backward, cases=CASES) -> None:
    """fp32 inputs: dq, dk, dv within 1e-4 of float64 autograd; no NaN; shapes and dtypes of the inputs; no load or
    store outside the tensors."""
    for what, B, H, N, n_k, D, causal, bm, bn in cases:
        args, want = _inputs(B, H, N, n_k, D, causal)
        name = f"{NAME}（{what}）"
        with tritonbounds.outside_accesses() as outside:
            got = backward(*args, causal, block_m=bm, block_n=bn)
        tritonbounds.check_inside(outside, name=name, hint="越界的列與鍵要遮罩：讀 Q、dO、lse、D 用 rows < N，讀 K、V 用 keys < N_k；"
                                  "寫 dQ 的格子、dK、dV 時也要同樣的遮罩。")
        for g, x, w, t in zip(("dq", "dk", "dv"), got, want, args[:3]):
            grading.check_true(isinstance(x, torch.Tensor) and x.shape == t.shape and x.dtype == t.dtype,
                               name=f"{name}: {g}", detail=f"{g} 應為 {t.dtype} {tuple(t.shape)}，得到 "
                               f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}。")
            grading.check_tensor(x.double(), w, name=f"{name}: {g}", atol=1e-4, hint=HINT_MATH)


def within_2x(backward) -> None:
    """bf16 and fp16 inputs (N = 70, N_k = 90, d = 32, causal): each gradient's error against float64 at most 2x that
    of autograd through plain attention in the same dtype, plus the rounding of the exact gradient to that dtype."""
    for dtype in grading.LOW_PRECISION:
        args, want = _inputs(1, 2, 70, 90, 32, True, dtype, seed=3)
        q, k, v, _, _, do = args
        qp, kp, vp = (t.clone().requires_grad_() for t in (q, k, v))
        plain = torch.autograd.grad(attention.reference_attention(qp, kp, vp, causal=True)[0], (qp, kp, vp), do)
        with tritonbounds.outside_accesses():
            got = backward(*args, True)
        for g, x, w, base in zip(("dq", "dk", "dv"), got, want, plain):
            grading.check_true(isinstance(x, torch.Tensor) and x.dtype == dtype, name=f"{NAME}（{str(dtype)[6:]}）: {g} 的 dtype",
                               detail=f"輸入是 {dtype}，{g} 應為 {dtype}，得到 {getattr(x, 'dtype', type(x).__name__)}。",
                               hint="梯度和輸入同 dtype：dQ 的格子相加（fp32）之後 .to(q.dtype)。")
            grading.check_within_2x(x, w, base, name=f"{NAME}（{str(dtype)[6:]}，N = 70，N_k = 90，因果）: {g}",
                                    rule="P、dS 與 dQ、dK、dV 的累加都以 fp32 計算，dQ 的格子也是 fp32，相加後才轉回輸入的 dtype",
                                    floor=(w.to(dtype).double() - w).abs().max().item(),
                                    hint="格子（slots）用 torch.float32；不要先把 dQ 的份額轉成 bf16 再相加。")


def same_bits_over_orders(backward, orders: int = 5) -> None:
    """dq, dk and dv hold the same bits over ``orders`` program orders (the interpreter's programs shuffled, or
    repeated runs on a GPU), at two shapes with three or more key blocks per head."""
    for what, B, H, N, n_k, D, causal, bm, bn in (CASES[0], CASES[2]):
        args, _ = _inputs(B, H, N, n_k, D, causal, seed=5)
        with tritonbounds.outside_accesses():
            results = detreduce.outputs_over_orders(lambda: backward(*args, causal, block_m=bm, block_n=bn), orders)
        for i, g in enumerate(("dq", "dk", "dv")):
            kinds = len(detreduce.distinct([r[i] for r in results]))
            grading.check_true(kinds == 1, name=f"{NAME}（{what}）: {g} 在 {orders} 種程式順序下位元相同",
                               detail=f"{g} 在 {orders} 種程式執行順序下得到 {kinds} 種不同的位元。",
                               hint=f"違反的規則：{RULE}。")


def keeps_the_contract(backward) -> None:
    """Every tensor argument, contiguous (lse holding -inf: N > N_k, causal) and as a transposed view, is left
    unchanged; the views give the same gradients."""
    args, _ = _inputs(1, 2, 40, 24, 16, True, seed=7)
    with tritonbounds.outside_accesses():
        want = contract.check_inputs_unchanged(backward, *args, True, name=NAME)
        contract.check_views_once(backward, *args, True, name=NAME, want=want)
