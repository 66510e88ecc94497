"""Visible tests of 11_determinism's exercise 1: a sum over programs with fixed slots (``fixed_order_sum``).

The rules: each program's fp32 partial is stored in its own slot and the slots are added in one fixed order, so the
total holds the same bits over shuffled program orders (repeated runs on a GPU); the total is the sum (against float64,
n not a multiple of the block, a single element, one block, bf16 input); the student's own kernel (not the given
atomic_sum); a strided view of x gives the contiguous copy's bits and stays unchanged; no load or store outside.

Used in: 11_determinism (test cell of ex1)
"""
from __future__ import annotations

import torch

from labkit.core import codereach, grading
from labkit.determinism import reduce as detreduce
from labkit.tritonlab import bounds as tritonbounds, mode as tritonmode

NAME = "fixed_order_sum"
RULE = "每個程式的部分和存進只屬於它的格子（第 pid 格），全部寫完後依索引順序相加；不用 tl.atomic_add"
CASES = [(1, 64), (63, 64), (64, 64), (1000, 64), (1000, 16), (4097, 128), (4097, 16)]   # (n, block): 257 slots last


def _x(n: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """n values over six orders of magnitude (fp32 additions round differently in every order), on the kernels' device."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen) * torch.logspace(0, 6, n)).to(dtype).to(tritonmode.device())


def own_code(fixed_order_sum) -> None:
    """Not the given atomic_sum; a Triton kernel defined in the notebook runs one program per block (grid
    (cdiv(n, block),)), and no notebook kernel it launches adds by ``tl.atomic_add``."""
    reached = codereach.first_reached(fixed_order_sum, lambda obj: obj is detreduce.atomic_sum, attributes={"atomic_sum"})
    grading.check_true(not reached, name=f"{NAME}：自己的核心", detail=f"{NAME} 用到了 {reached}。",
                       hint="lk.detreduce.atomic_sum 正是要換掉的做法：寫你自己的核心。")
    launched: list = []   # (kernel function, grid) of every notebook kernel launch
    with tritonmode.watched_launches(lambda fn, args, kwargs: launched.append((fn, kwargs.get("grid")))), \
            tritonbounds.outside_accesses():   # a stray store is dropped, not run
        fixed_order_sum(_x(100), 32)
    grading.check_true(len(launched) >= 1, name=f"{NAME}：自己的核心", detail="沒有啟動任何在 notebook 裡定義的 Triton 核心。",
                       hint="每個程式把自己那一段的部分和存進格子：_partials_kernel[(cdiv(n, block),)](...)。")
    grids = [tuple(grid) if isinstance(grid, (tuple, list)) else grid for _, grid in launched]
    grading.check_true((4,) in grids, name=f"{NAME}：一個程式一段（網格 (cdiv(n, block),)）",
                       detail=f"n = 100、block = 32 應有一次 4 個程式的啟動，得到的網格：{grids}。",
                       hint="部分和的核心用網格 (triton.cdiv(n, block),)，BLOCK=block：block 是引數，不要寫死，"
                            "也不要在 PyTorch 裡算部分和。")
    atomic = sorted({fn.__name__ for fn, _ in launched if "atomic_add" in codereach.attributes_read(fn)})
    grading.check_true(not atomic, name=f"{NAME}：存進格子，不用 atomic", detail=f"核心 {atomic} 用了 tl.atomic_add。",
                       hint=f"違反的規則：{RULE}（每格只有一個寫入者，用 tl.store）。")


def matches_float64(fixed_order_sum, cases=CASES) -> None:
    """fp32 0-dim total within 1e-6 of sum |x| of the float64 sum, for n and block of :data:`CASES`, and for bf16 x;
    no load or store outside the tensors."""
    for n, block in cases:
        x = _x(n, seed=n)
        name = f"{NAME}（n = {n}，block = {block}）"
        with tritonbounds.outside_accesses() as outside:
            total = fixed_order_sum(x, block)
        tritonbounds.check_inside(outside, name=name, hint="最後一段不滿 block：載入時用 mask=offs < n、other=0.0；格子要有 cdiv(n, block) 個，不要寫死。")
        grading.check_true(isinstance(total, torch.Tensor) and total.dtype == torch.float32 and total.dim() == 0,
                           name=name, detail=f"應回傳 fp32 的 0 維張量，得到 {getattr(total, 'dtype', type(total).__name__)} "
                           f"{tuple(getattr(total, 'shape', ()))}。", hint="回傳 total[0] 或 slots.sum()（0 維）。")
        grading.check_tensor(total.double(), x.double().sum(), name=name, atol=1e-6 * float(x.double().abs().sum()),
                             hint="每個程式載入第 pid 段（pid * block + arange(block)），以 fp32 加總後存進 slots[pid]；"
                                  "格子數是 cdiv(n, block)，最後一段也要算。")
    x = _x(300, seed=3, dtype=torch.bfloat16)
    before = x.clone()
    with tritonbounds.outside_accesses():
        total = fixed_order_sum(x, 64)
    grading.check_true(x.dtype == torch.bfloat16 and torch.equal(x, before), name=f"{NAME}（bf16）：x 不被修改",
                       detail=f"呼叫後 x 變成 {x.dtype}{'' if x.dtype != torch.bfloat16 else '，內容也變了'}。",
                       hint="要 fp32 就在核心裡 .to(tl.float32)，或用 x.float() 得到新張量；不要改 x.data 或原地轉換。")
    grading.check_tensor(total.double(), x.double().sum(), name=f"{NAME}（bf16，n = 300）",
                         atol=1e-6 * float(x.double().abs().sum()), hint="部分和以 fp32 計算：載入後先 .to(tl.float32)。")


def same_bits_over_orders(fixed_order_sum, orders: int = 8) -> None:
    """The same bits over ``orders`` program orders (shuffled in the interpreter, repeated runs on a GPU)."""
    x = _x(2000, seed=9)
    with tritonbounds.outside_accesses():
        kinds = detreduce.distinct_over_orders(lambda: fixed_order_sum(x, 32), orders)
    grading.check_true(len(kinds) == 1, name=f"{NAME}：{orders} 種程式順序下位元相同",
                       detail=f"在 {orders} 種程式執行順序下得到 {len(kinds)} 種不同的結果：{[float(t) for t in kinds]}。",
                       hint=f"違反的規則：{RULE}。")


def keeps_the_contract(fixed_order_sum) -> None:
    """x as a strided view (every other element of a buffer) gives the contiguous copy's bits and is left unchanged."""
    buffer = _x(1400, seed=5)
    view = buffer[::2]
    before = buffer.clone()
    with tritonbounds.outside_accesses():
        got, want = fixed_order_sum(view, 64), fixed_order_sum(view.contiguous(), 64)
    grading.check_true(detreduce.same_bits(got, want), name=f"{NAME}：x 是跨步的視圖（x[::2]）",
                       detail=f"視圖得到 {float(got)}，連續的副本得到 {float(want)}。",
                       hint="核心假設 x 連續：先 x = x.contiguous()（或把 stride 傳進核心）。")
    grading.check_true(torch.equal(buffer, before), name=f"{NAME}：x 不被修改", detail="呼叫後 x 的內容變了。",
                       hint="不要把部分和寫回 x；格子用另一個張量。")
