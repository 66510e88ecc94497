"""Visible tests of 11_determinism's exercise 3: batch-invariant split-KV decode (``invariant_decode``).

The rules: a fixed split size (not derived from the batch's size or its longest request) and a combine of one fixed
order, so that every request's output holds the same bits alone and in batches of 3, 8 and 17 (requests of different
lengths, not multiples of the split, shuffled neighbours), and over shuffled program orders; correct against float64
(fp32 within 1e-5, large scores too; bf16 by the 2x rule); the combine written by the student; views and inputs left as
they were.

Used in: 11_determinism (test cell of ex3)
"""
from __future__ import annotations

import inspect

import torch

from labkit.checks import contract
from labkit.core import codereach, grading
from labkit.determinism import decode as detdecode, invariance, reduce as detreduce
from labkit.engine import attention
from labkit.tritonlab import mode as tritonmode

NAME = "invariant_decode"
RULE = ("每個 split 的大小固定（不由批次大小、也不由批次裡最長的請求決定），合併依 split 的固定順序：一個請求的鍵怎麼切、"
        "怎麼加，只由它自己的長度決定")
GIVEN = (detdecode.combine, detdecode.dynamic_decode, detdecode.unsplit_decode)
LENGTHS = [37, 1, 130, 61, 95, 7, 150, 49, 23, 111, 77, 3, 140, 66, 58, 102, 15]   # 17 requests, few multiples of 16


def requests(lens=LENGTHS, heads: int = 2, dim: int = 16, dtype=torch.float32, seed: int = 0, scale: float = 1.0):
    """Decode requests (q [H, D], k, v [H, L, D]) on the kernels' device; q multiplied by ``scale``."""
    reqs = detdecode.make_requests(lens, heads, dim, dtype=dtype, generator=torch.Generator().manual_seed(seed),
                                   device=tritonmode.device())
    return [((q.float() * scale).to(dtype), k, v) for q, k, v in reqs]


def _float64(req) -> torch.Tensor:
    """A request's output [H, D] by float64 attention over its own keys."""
    q, k, v = (t.double() for t in req)
    return attention.reference_attention(q[:, None], k, v)[0][:, 0]


def own_combine(decode) -> None:
    """decode combines the splits itself: it reaches none of the given combine, dynamic_decode or unsplit_decode."""
    reached = codereach.first_reached(decode, lambda obj: any(obj is f for f in GIVEN), attributes={f.__name__ for f in GIVEN})
    grading.check_true(not reached, name=f"{NAME}：自己的合併", detail=f"{NAME} 用到了 {reached}。",
                       hint="split_partials 是給定的；合併（依 lse 加權）要自己寫，不要呼叫 lk.detdecode.combine、dynamic_decode 或 unsplit_decode。")


def matches_float64(decode) -> None:
    """fp32 requests (lengths 1-150, d = 16 and 64): each row within 1e-5 of float64 attention; q x 100 (scores in the
    hundreds: the combine must subtract the largest lse); bf16 requests by the 2x rule against attention in bf16."""
    for what, dim, scale in (("d = 16", 16, 1.0), ("d = 64", 64, 1.0), ("q x 100（分數上百）", 16, 100.0)):
        reqs = requests(LENGTHS[:6], dim=dim, seed=1, scale=scale)
        out = decode(*detdecode.pad_batch(reqs))
        grading.check_true(isinstance(out, torch.Tensor) and out.shape == (6, 2, dim) and out.dtype == torch.float32,
                           name=f"{NAME}（{what}）: o", detail=f"o 應為 float32 (6, 2, {dim})，得到 "
                           f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}。")
        grading.check_tensor(out.double(), torch.stack([_float64(r) for r in reqs]), name=f"{NAME}（{what}，長度 "
                             f"{LENGTHS[:6]}）", atol=1e-5, hint="合併：m = max_s lse_s，w_s = exp(lse_s - m)，o = Σ w_s o_s / Σ w_s；"
                             "超出請求長度的 split（lse = -inf）權重為 0。")
    reqs = requests(LENGTHS[:6], dtype=torch.bfloat16, seed=2)
    out = decode(*detdecode.pad_batch(reqs))
    grading.check_true(isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16, name=f"{NAME}（bf16）: o 的 dtype",
                       detail=f"q 是 bfloat16，o 應為 bfloat16，得到 {getattr(out, 'dtype', type(out).__name__)}。",
                       hint="合併以 fp32 計算，回傳前 .to(q.dtype)。")
    _rounded_once(decode, detdecode.pad_batch(reqs))
    for i, req in enumerate(reqs):
        plain = attention.reference_attention(req[0][:, None], req[1], req[2])[0][:, 0]
        grading.check_within_2x(out[i], _float64(req), plain, name=f"{NAME}（bf16，第 {i} 個請求，長度 {LENGTHS[i]}）",
                                rule="split 的部分結果與合併都以 fp32 計算，最後才轉回 q 的 dtype",
                                floor=float((_float64(req).to(torch.bfloat16).double() - _float64(req)).abs().max()),
                                hint="合併的權重與加總用 fp32（o_part、lse_part 已是 fp32），回傳前才 .to(q.dtype)。")


def _rounded_once(decode, batch, split_size: int = 16) -> None:
    """bf16 ``batch``: decode's o is the fp32 combine of the same partials rounded once to bf16 (at most 2% of the
    entries one rounding away: another fixed order of the fp32 sums may round the other way)."""
    o_part, lse_part = detdecode.split_partials(*batch, split_size, -(-int(batch[3].max()) // split_size))
    want = detdecode.combine(o_part, lse_part, torch.float32).to(torch.bfloat16)
    differ = float((decode(*batch, split_size).float() != want.float()).float().mean())
    grading.check_true(differ <= 0.02, name=f"{NAME}（bf16，split_size = {split_size}）：只在最後轉回 q 的 dtype",
                       detail=f"{differ:.0%} 的元素和「fp32 合併、最後轉一次 bf16」的結果不同（容許 2%）。",
                       hint="o_part、lse_part 是 fp32：權重、加總與除法都用 fp32，不要先把 o_part 或分子、分母轉成 q 的 dtype；"
                            "回傳前才 .to(q.dtype)。")


def _split_sizes(decode, batch, split_size: int) -> list:
    """The split size of every launch of the given partials kernel during ``decode(*batch, split_size)``."""
    sizes: list = []

    def seen(fn, args, kwargs):
        sizes.append(kwargs.get("SPLIT", dict(zip(inspect.signature(fn).parameters, args)).get("SPLIT")))
    with tritonmode.watched_launches(seen, module=detdecode.__name__):
        decode(*batch, split_size)
    return sizes


def batch_invariant(decode, lens=LENGTHS, dim: int = 16, seed: int = 0) -> None:
    """Requests of ``lens`` (17 of 1-150 keys): each request's row alone equals (torch.equal) its row in batches of 3,
    8 and 17 (neighbours and positions shuffled); decode(..., split_size) cuts every request into splits of
    ``split_size`` keys (the argument, whatever the batch)."""
    reqs = requests(lens, dim=dim, seed=seed)
    found = invariance.mismatches(decode, reqs, (3, 8, len(lens)), seed=seed)
    bad = {size: [f"#{i}（長度 {lens[i]}）" for i in which] for size, which in found.items() if which}
    grading.check_true(not bad, name=f"{NAME}：批次不變（batch invariance）",
                       detail=f"這些請求在不同大小的批次裡得到和單獨執行時不同的位元：{bad}。", hint=f"違反的規則：{RULE}。")
    for size, batch in ((32, requests(lens[:6], dim=dim, seed=seed)), (16, requests(lens[:2], dim=dim, seed=seed))):
        sizes = _split_sizes(decode, detdecode.pad_batch(batch), size)
        grading.check_true(bool(sizes) and all(s == size for s in sizes), name=f"{NAME}：split 的大小是 split_size",
                           detail=f"split_size = {size} 時 split_partials 收到的 split 大小：{sizes}。",
                           hint=f"違反的規則：{RULE}；用傳入的 split_size，不要寫死，也不要由 lens 或 B 推出。")


def same_bits_over_orders(decode, orders: int = 4) -> None:
    """A batch of 8 gives the same bits over ``orders`` program orders (shuffled in the interpreter, repeated on a
    GPU)."""
    batch = detdecode.pad_batch(requests(LENGTHS[:8], seed=3))
    kinds = len(detreduce.distinct_over_orders(lambda: decode(*batch), orders))
    grading.check_true(kinds == 1, name=f"{NAME}：{orders} 種程式順序下位元相同",
                       detail=f"同一批次在 {orders} 種程式執行順序下得到 {kinds} 種不同的結果。",
                       hint="合併要依 split 的索引順序相加，不要用 atomic 或依完成順序累加。")


def keeps_the_contract(decode) -> None:
    """q, the caches and lens as views give the same o and are left unchanged."""
    q, k, v, lens = detdecode.pad_batch(requests(LENGTHS[:3], seed=4))
    contract.check_views_once(decode, q, k, v, lens, name=NAME)
