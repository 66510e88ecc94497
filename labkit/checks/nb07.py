"""Visible tests of 07_context_parallel's exercises: merging partial attention results, the zig-zag layout and the
causal work per device.

merge_partials is checked by splitting the keys in two, attending to each part (:func:`labkit.cp.ring.block_attention`,
o in q's dtype, lse fp32 or float64) and merging: the result equals attention over all keys (float64: errors ~1e-15).

Used in: 07_context_parallel (test cells of ex1_merge, ex2_zigzag, ex3_causal_work)
"""
from __future__ import annotations

import torch

from labkit.checks import contract
from labkit.core import grading
from labkit.cp import ring as ringproc


def _qkv(dtype=torch.float64, seed: int = 1):
    """q, k, v [2, 3, 10, 8] of ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, 10, 8, generator=gen, dtype=torch.float64).to(dtype) for _ in range(3)]


def _halves(q, k, v, cut: int, *, k_start: int = 0, causal: bool = False):
    """The partial results (o, lse) of q over the keys before ``cut`` and over those from ``cut`` on."""
    a = ringproc.block_attention(q, k[..., :cut, :], v[..., :cut, :], q_start=0, k_start=k_start, causal=causal)
    b = ringproc.block_attention(q, k[..., cut:, :], v[..., cut:, :], q_start=0, k_start=k_start + cut, causal=causal)
    return a, b


def merge_equals_full_attention(merge) -> None:
    """float64 q, k, v [2, 3, 10, 8], the keys cut at 5 and at 3: o and lse equal attention over all keys (atol 1e-12),
    in float64; every lse shifted by +-1e4 (a constant added to every score of a row adds it to lse and leaves o
    unchanged): no overflow or underflow."""
    q, k, v = _qkv()
    full_o, full_lse = ringproc.block_attention(q, k, v, q_start=0, k_start=0, causal=False)
    for cut in (5, 3):
        a, b = _halves(q, k, v, cut)
        o, lse = merge(*a, *b)
        grading.check_tensor(lse, full_lse, name=f"merge_partials：lse = log(e^lse1 + e^lse2)（在第 {cut} 個鍵切開）",
                             atol=1e-12, hint="lse 是兩邊的 log-sum-exp，用 torch.logaddexp；只取兩者的最大值會漏掉較小那邊的貢獻。")
        grading.check_tensor(o, full_o, name=f"merge_partials：合併的 o 等於對全部鍵的注意力（在第 {cut} 個鍵切開）",
                             atol=1e-12, hint="o = exp(lse1 - lse) * o1 + exp(lse2 - lse) * o2：兩邊各乘上自己的權重，"
                                              "不是直接平均，也不要把權重對調。")
    grading.check_true(o.dtype == torch.float64 and lse.dtype == torch.float64, name="merge_partials：float64 輸入回傳 float64",
                       detail=f"o、lse 應為 float64，卻是 {o.dtype}、{lse.dtype}。", hint="float64 輸入就以 float64 計算，不要降成 fp32。")
    for shift in (1e4, -1e4):
        o, lse = merge(a[0], a[1] + shift, b[0], b[1] + shift)
        overflow = ("不可直接算 exp(lse)：exp(1e4) 溢位成 inf，exp(-1e4) 下溢成 0（float64 也一樣）。"
                    "用 torch.logaddexp 求 lse，再只對差 lse1 - lse、lse2 - lse 取 exp。")
        grading.check_tensor(lse, full_lse + shift, name=f"merge_partials：lse 約 {shift:+.0e} 時不可溢位", atol=1e-8,
                             hint=overflow)
        grading.check_tensor(o, full_o, name=f"merge_partials：lse 約 {shift:+.0e} 時的 o", atol=1e-9, hint=overflow)


def merge_keeps_the_contract(merge) -> None:
    """float64 partials (keys cut at 5): o1, lse1, o2, lse2 left unchanged (no lse1.sub_ on a caller's float64 lse, where
    .to(float64) does not copy); each as a view (transposed storage, rows of a wider buffer) gives the contiguous
    answer; a merge of other partials (cut at 3) in between changes nothing; on meta inputs every tensor it makes
    follows the inputs' device (no torch.zeros without device=)."""
    q, k, v = _qkv()
    a, b = _halves(q, k, v, 5)
    other_a, other_b = _halves(q, k, v, 3, k_start=0, causal=True)
    contract.check_contract(merge, *a, *b, name="merge_partials", other=lambda: merge(*other_a, *other_b), meta=True)


def merge_handles_empty_rows(merge) -> None:
    """Causal, queries at positions 0..9: part a holds the keys at 4..9, part b the keys at 10..13 (after every query).
    Rows 0..3 see no key on either side (lse = -inf on both: o = 0, lse = -inf, no NaN); rows 4..9 see keys of part
    a only (a's o and lse)."""
    q, k, v = _qkv()
    a, b = _halves(q, k, v, 6, k_start=4, causal=True)
    ref_o, ref_lse = ringproc.block_attention(q, k, v, q_start=0, k_start=4, causal=True)
    o, lse = merge(*a, *b)
    empty = ("兩邊都是 -inf 時 lse = -inf，lse1 - lse 是 -inf - (-inf) = NaN：這些列的平移量改用 0"
             "（torch.where(torch.isneginf(lse), 0, lse)），權重 exp(-inf) = 0，o = 0。")
    grading.check_true(not (o.isnan().any() or lse.isnan().any()),
                       name="merge_partials：兩邊都沒有可見的鍵時不可出現 NaN",
                       detail=f"o 有 {int(o.isnan().sum())} 個 NaN，lse 有 {int(lse.isnan().sum())} 個。", hint=empty)
    grading.check_tensor(o, ref_o, name="merge_partials：沒有可見鍵的列 o = 0，只有一邊有鍵的列 o = 那一邊的 o",
                         atol=1e-12, hint=empty)
    grading.check_tensor(lse, ref_lse, name="merge_partials：沒有可見鍵的列 lse = -inf", atol=1e-12, hint=empty)


def merge_keeps_dtypes(merge) -> None:
    """fp32 partials (keys cut at 5) with their o in bf16 and lse fp32: o comes back bf16 (atol 2e-2 against fp32
    attention over all keys), lse fp32; a running fp32 result merged with a new bf16 partial, and the other way
    round: o takes o1's dtype."""
    q, k, v = _qkv(torch.float32)
    a32, b32 = _halves(q, k, v, 5)
    o, lse = merge(a32[0].bfloat16(), a32[1], b32[0].bfloat16(), b32[1])
    grading.check_true(o.dtype == torch.bfloat16 and lse.dtype == torch.float32,
                       name="merge_partials：o 與 o1 同 dtype（bf16），lse 是 fp32",
                       detail=f"o 應為 bfloat16、lse 應為 float32，卻是 {o.dtype}、{lse.dtype}。",
                       hint="以 fp32 計算（acc 至少 fp32），最後只把 o 轉回 o1.dtype；lse 不可轉成 bf16（只有約 3 位有效數字）。")
    ref_o = ringproc.block_attention(q, k, v, q_start=0, k_start=0, causal=False)[0]
    grading.check_tensor(o, ref_o, name="merge_partials：bf16 的 o 合併後的值", atol=2e-2)
    for o1_dt, o2_dt in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        o, lse = merge(a32[0].to(o1_dt), a32[1], b32[0].to(o2_dt), b32[1])
        grading.check_true(o.dtype == o1_dt and lse.dtype == torch.float32,
                           name=f"merge_partials：o1 是 {o1_dt}、o2 是 {o2_dt} 時，o 與 o1 同 dtype、lse 是 fp32",
                           detail=f"o 應為 {o1_dt}、lse 應為 float32，卻是 {o.dtype}、{lse.dtype}。",
                           hint="最後回傳 o.to(o1.dtype)：不是 o2 的 dtype，也不是兩者提升後的 dtype。")


def merge_rounds_once(merge) -> None:
    """bf16 and fp16 q [2, 3, 12, 16], k, v [2, 3, 40, 16], keys cut at 17, partials as a flash kernel returns them
    (o in the input dtype, lse fp32). lse: the course's 2x rule against PyTorch's CPU flash kernel run once over all
    the keys (its lse is fp32); o: your own merge in float64 on the same partials (checked above), rounded once."""
    flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # (o, lse, ...): o in q's dtype, lse fp32
    precision_rule = "合併以 fp32 計算：lse 與累加的 o 保持 fp32，只在最後把 o 轉回 o1 的 dtype"
    for dt, seed in ((torch.bfloat16, 7), (torch.float16, 8)):
        gen = torch.Generator().manual_seed(seed)
        ql, kl, vl = (torch.randn(2, 3, n, 16, generator=gen).to(dt) for n in (12, 40, 40))
        a, b = _halves(ql, kl, vl, 17)
        o, lse = merge(*a, *b)
        ref_lse = ringproc.block_attention(ql.double(), kl.double(), vl.double(), q_start=0, k_start=0, causal=False)[1]
        grading.check_within_2x(lse, ref_lse, flash_cpu(ql, kl, vl)[1], name=f"merge_partials：{dt} 的部分結果，合併後的 lse",
                                rule=precision_rule,
                                hint="lse 不可經過 o 的 dtype：bf16 只有約 3 位有效數字，lse ≈ 3 時誤差約 0.01，"
                                     "權重 exp(lse1 - lse) 也跟著錯約 1%。acc 至少 fp32，lse1、lse2 轉成 acc 再算。")
        exact_o, _ = merge(*(t.double() for t in (*a, *b)))
        grading.check_tensor(o.double(), exact_o, name=f"merge_partials：{dt} 的 o 只在最後捨入一次", atol=1e-6,
                             rtol=torch.finfo(dt).eps,
                             hint=f"規則：{precision_rule}。w1·o1 + w2·o2 在 {dt} 裡算，每個乘積與加總都各捨入一次，"
                                  "誤差是捨入一次的好幾倍：先把 o1、o2 與權重轉成 fp32 再相乘相加，最後才 .to(o1.dtype)。")


def zigzag_layouts(zigzag) -> None:
    """P = 1, 2, 3, 4: a list of P lists of two Python ints, chunks 0..2P-1 each on exactly one device, device i
    holding chunks i and 2P-1-i."""
    for p in (1, 2, 3, 4):
        expected = [[i, 2 * p - 1 - i] for i in range(p)]
        z = zigzag(p)
        grading.check_true(isinstance(z, list) and len(z) == p and all(isinstance(d, list) and len(d) == 2 for d in z),
                           name=f"zigzag_chunks({p})：長度 {p} 的 list，每張裝置一個兩段的 list", detail=f"得到 {z!r}。",
                           hint="回傳 list 的 list（不是 tuple 或 generator）：第 i 個是裝置 i 的 [第一段, 第二段]。")
        grading.check_true(all(type(c) is int for d in z for c in d),
                           name=f"zigzag_chunks({p})：區塊編號是 Python int",
                           detail=f"得到的元素型別：{sorted({type(c).__name__ for d in z for c in d})}。",
                           hint="區塊編號用 Python 的 range 算出的 int；torch.arange 或 numpy 的元素是 0 維 tensor 或 numpy 整數，"
                                "後面的 causal_work 會因此回傳 tensor。")
        grading.check_true(sorted(c for d in z for c in d) == list(range(2 * p)),
                           name=f"zigzag_chunks({p})：第 0..{2 * p - 1} 段每段恰好分給一張裝置", detail=f"得到 {z}。",
                           hint="共 2P 段，編號 0..2P-1；第二段是 2P-1-i（差一就會漏掉或重複一段），不要寫只對某個 P 成立的常數。")
        grading.check_true(z == expected, name=f"zigzag_chunks({p})：裝置 i 拿第 i 段與第 2P-1-i 段",
                           detail=f"應為 {expected}，卻得到 {z}。",
                           hint="head-tail：前面輕的第 i 段配後面重的第 2P-1-i 段；[i, i+P] 是輪流分配，工作量不平衡。")


def count_pairs(chunks, m: int) -> int:
    """(query, key) pairs with key position <= query position, queries in ``chunks`` (of ``m`` positions each), by
    enumeration."""
    pos = torch.cat([torch.arange(c * m, (c + 1) * m) for c in chunks])
    return int((torch.arange(int(pos.max()) + 1)[None, :] <= pos[:, None]).sum())


def causal_work_counts(causal_work) -> None:
    """All chunks together give the whole causal triangle N(N+1)/2 (4 chunks of 8, 2 of 3); one device's chunks, not
    necessarily adjacent, match a count by enumeration (:func:`count_pairs`); the result is a Python int."""
    for n_chunks, m in ((4, 8), (2, 3)):
        n = n_chunks * m
        grading.check_scalar(causal_work(list(range(n_chunks)), m), n * (n + 1) // 2,
                             name=f"causal_work：全部 {n_chunks} 段合起來是整個因果三角形 N(N+1)/2（m = {m}）", rel=0,
                             hint="第 c 段：c*m*m（前面各段全部可見）+ m(m+1)/2（對角區塊的下三角，含對角線）。")
    for chunks, m in (([1, 6], 3), ([2], 5), ([3, 4], 2)):
        grading.check_scalar(causal_work(chunks, m), count_pairs(chunks, m),
                             name=f"causal_work({chunks}, {m})：只算這張裝置持有的區塊，第 c 段依它的編號 c", rel=0,
                             hint="第 c 段的查詢看得到前面 c 段的全部 c*m*m 個鍵，加上自己這段的 m(m+1)/2；"
                                  "c 是區塊編號，不是它在 chunks 裡的位置，而且每一段都要算。")
    work = causal_work([1, 6], 3)
    grading.check_true(type(work) is int, name="causal_work：回傳 Python int",
                       detail=f"應回傳 int，卻得到 {type(work).__name__}（{work!r}）。", hint="回傳 Python int：用整數除法 //（/ 會得到 float）；以 tensor 或 numpy 計數時，最後用 int(...) 轉回。")
