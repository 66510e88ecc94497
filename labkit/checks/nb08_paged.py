"""Visible tests of 08_decode_attention's exercise 6: ``paged_split_partials(q, k_pages, v_pages, table, seqlens, S)``
(q [B, H_q, d]; pages [num_pages, page_size, H_kv, d]; table [B, max_pages] int32; seqlens [B] int32 -> o_part
[B, H_q, S, d] fp32, lse_part [B, H_q, S] fp32, chunk) and ``paged_decode`` through the student's
``_paged_split_kernel``. A contiguous cache is copied into pages (in order or shuffled) and the results are compared
with the float64 reference on the contiguous cache.

Used in: 08_decode_attention (test cells of ex6)
"""
from __future__ import annotations

from typing import Callable

import torch

from labkit.checks import contract
from labkit.core import grading
from labkit.tritonlab import mode as tritonmode
from labkit.decoding import decode
from labkit.checks import nb08_kernels
from labkit.checks.nb08_kernels import QK_SCALE_16, Helpers

PAGE_HINT = ("第 t 個 token 在頁 table[b, t // PAGE_SIZE] 的第 t % PAGE_SIZE 列：位址 ((page·PAGE_SIZE + t % PAGE_SIZE)·H_kv + j)·d；"
             "頁表第 b 列從 table_ptr + b·MAX_PAGES 開始。")


def paged_inputs(H: Helpers, b, hq, hkv, lens, d, page_size, shuffle, seed=0):
    """q [B, H_q, d] and a contiguous cache k, v [B, N, H_kv, d], the same cache in pages (plus 2 spare pages),
    the page table [B, max pages] (padded with 0) and seqlens [B] int32."""
    need = [-(-n // page_size) for n in lens]
    q, k, v = H.inputs(b, hq, hkv, max(1, max(need)) * page_size, d, seed=seed)
    num_pages = sum(need) + 2
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)) if shuffle else torch.arange(num_pages)
    k_pages, v_pages = (torch.zeros(num_pages, page_size, hkv, d, device=H.device) for _ in range(2))
    lists, used = [], 0
    for row, count in enumerate(need):
        pages = order[used:used + count].tolist()
        used += count
        for i, page in enumerate(pages):
            k_pages[page] = k[row, i * page_size:(i + 1) * page_size]
            v_pages[page] = v[row, i * page_size:(i + 1) * page_size]
        lists.append(pages)
    table = decode.page_table(lists, device=H.device)
    return q, k, v, k_pages, v_pages, table, torch.tensor(lens, dtype=torch.int32, device=H.device)


def matches_contiguous(paged_split_partials: Callable, paged_decode: Callable, H: Helpers, b, hq, hkv, lens, d, page_size,
                       shuffle, splits, what: str, hint: str, seed=0):
    """One launch of _paged_split_kernel; per split s, no NaN and (o_s, lse_s) against the float64 reference on the contiguous
    cache over keys [s * chunk, min((s + 1) * chunk, length)); paged_decode's merged o too (atol 1e-5).
    Returns (q, k_pages, v_pages, table, seqlens)."""
    q, k, v, k_pages, v_pages, table, seqlens = paged_inputs(H, b, hq, hkv, lens, d, page_size, shuffle, seed)
    name = f"paged（B={b}, H_q={hq}, H_kv={hkv}, lens={lens}, page={page_size}, {'亂序' if shuffle else '依序'}, S={splits}）：{what}"
    with tritonmode.launches() as launched, nb08_kernels.shapes_named(name, hint):
        o_part, lse_part, chunk = paged_split_partials(q, k_pages, v_pages, table, seqlens, splits)
    nb08_kernels.launched_once(launched, "_paged_split_kernel", name)
    lens_t = torch.tensor(lens)
    for s in range(splits):
        lo = torch.full((b,), s * chunk)
        o_ref, lse_ref = H.reference(q, k, v, lo, torch.minimum(lo + chunk, lens_t))
        part = f"{name}：第 {s} 段"
        grading.check_true(not o_part[:, :, s].isnan().any() and not lse_part[:, :, s].isnan().any(), name=part + "：沒有 NaN",
                           detail="部分結果有 NaN。", hint="沒有鍵的段：o = 0、lse = -inf（練習 2 的 _finish）。")
        grading.check_tensor(lse_part[:, :, s].double(), lse_ref, name=part + "：lse_s", atol=1e-5, hint=hint)
        grading.check_tensor(o_part[:, :, s].double(), o_ref, name=part + "：o_s", atol=1e-5, hint=hint)
    o, lse = paged_decode(q, k_pages, v_pages, table, seqlens, splits)
    grading.check_tensor(o.double(), H.reference(q, k, v, hi=lens_t)[0], name=name + "：合併後的 o", atol=1e-5, hint=hint)
    return q, k_pages, v_pages, table, seqlens


def padded_rows_not_written(kernel, H: Helpers) -> None:
    """_paged_split_kernel launched by hand with g = 3 (B_G = 16), S = 2, two pages of 16: partials [12, 16] and [12]
    written, not past them."""
    table, lens = torch.tensor([[0, 1]], dtype=torch.int32, device=H.device), torch.tensor([24], dtype=torch.int32, device=H.device)
    nb08_kernels.padded_rows_not_written(
        lambda q, k, v, o, lse: kernel[(1, 2, 2)](q, k.reshape(2, 16, 2, 16), v.reshape(2, 16, 2, 16), table, lens, o, lse,
                                                  QK_SCALE_16, 16, 2, 2, H_KV=2, G=3, HEAD_DIM=16, BLOCK_G=16, PAGE_SIZE=16,
                                                  PREC="ieee"),
        H, n=32, rows=12, spare=32, name="_paged_split_kernel（g = 3，B_G = 16）：多出來的列沒有寫到 o_part、lse_part 之外",
        hint="部分結果的 tl.store 也要 mask=row_ok（offs_g < G），和練習 2、3 一樣。")


def staged_cases(paged_split_partials: Callable, paged_decode: Callable, H: Helpers) -> None:
    """Pages in order, S = 1; shuffled, lengths not multiples of the page, d = 32, S = 3; GQA g = 4, pages of 32 (not d),
    a length 0; g = 32 (B_G = 32)."""
    for args, what, hint in [
            ((2, 2, 2, [32, 32], 16, 16, False, 1), "頁依序、S = 1", PAGE_HINT),
            ((2, 2, 2, [37, 50], 32, 16, True, 3), "頁亂序、長度不是頁大小的倍數、d = 32、S = 3",
             "頁不照順序：一定要透過頁表找實體頁（不能假設第 i 頁就是實體頁 i）。最後一頁只讀 start + offs < hi 的列。" + PAGE_HINT),
            ((4, 8, 2, [0, 33, 16, 70], 16, 32, True, 2), "GQA g = 4、頁大小 32（不等於 d = 16）、長度 0",
             "程式實例 j 的列是查詢 head j·G .. j·G+G-1，K/V 的位址加上 j·d（KV head j）；長度 0 的序列不讀任何頁。" + PAGE_HINT),
            ((1, 32, 1, [37], 16, 16, True, 2), "g = 32（B_G = 32：查詢的列數不是 16）",
             "BLOCK_G 是核心的參數：offs_g 的長度用 BLOCK_G，acc、m、l 的列數都是 BLOCK_G；前面的例子 B_G 都是 16。")]:
        matches_contiguous(paged_split_partials, paged_decode, H, *args, what, hint)


def keeps_the_contract(paged_split_partials: Callable, paged_decode: Callable, H: Helpers) -> None:
    """q [2, 2, 16], shuffled pages of 16 [5, 16, 1, 16], lengths [20, 9], S = 1 (launches of 2 programs):
    paged_split_partials and paged_decode leave their inputs (the cache, the page table, the lengths) unchanged; transposed
    and sliced views of q and the pages, a page table cut from a wider one and lengths cut as ``lens[::2]`` give the
    partials their contiguous copies give."""
    q, _, _, k_pages, v_pages, table, seqlens = paged_inputs(H, 2, 2, 1, [20, 9], 16, 16, True, seed=14)
    for fn in (paged_split_partials, paged_decode):
        contract.check_inputs_unchanged(fn, q, k_pages, v_pages, table, seqlens, 1, name=fn.__name__)
    contract.check_views(paged_split_partials, q, k_pages, v_pages, table, seqlens, 1, name="paged_split_partials", vectors=True)


def _page_lanes(lens, chunk, splits, width) -> int:
    """Load lanes of 2 KV heads walking only their own pages within the length (pages of 16, d = 16): per program its
    length, q's tile and the table row; per page its K and V."""
    pages = 2 * sum(-(-max(0, min((s + 1) * chunk, n) - s * chunk) // 16) for n in lens for s in range(splits))
    return 2 * 2 * splits * (1 + 16 * 16 + width) + pages * 2 * 16 * 16


def reads_within_lengths(paged_split_partials: Callable, H: Helpers) -> None:
    """Interpreter only (load elements and lanes counted, masked-off lanes too): page-table padding (a page id past the pool)
    not read, the loop stops at the length; with S = 3 and lengths 96 and 20 each split walks its own pages only."""
    if not nb08_kernels.interpreted():
        return
    lens = [20, 3]
    q, _, _, k_pages, v_pages, table, seqlens = paged_inputs(H, 2, 2, 2, lens, 16, 16, True, seed=5)
    wide = torch.cat([table, torch.zeros(2, 3, dtype=torch.int32, device=H.device)], 1)    # 3 more padding columns
    wide[1, 1:] = k_pages.shape[0] + 100                                                  # sequence 1 holds one page
    with tritonmode.loaded_elements() as count:
        _, _, chunk = paged_split_partials(q, k_pages, v_pages, wide, seqlens, 1)
    most = 2 * 2 * (1 + 2) + q.numel() + 2 * sum(lens) * 2 * 16          # lens and pages per program, q, K/V
    lanes = _page_lanes(lens, chunk, 1, wide.shape[1])
    hint = ("迴圈到 hi = min((s+1)·CHUNK, n_b) 為止（不是到這段的 CHUNK 結束），最後一頁用 start + offs < hi 遮罩："
            "長度以外的頁表欄位（這裡放了不存在的頁碼）與頁表之外的記憶體都不要讀。")
    grading.check_true(count["elements"] <= most, name="paged：只讀序列長度以內的 token，頁表補的欄位不讀",
                       detail=f"讀了 {count['elements']:,} 個元素；最多應為 {most:,}。", hint=hint)
    grading.check_true(count["lanes"] <= lanes, name="paged：迴圈只走序列長度以內的頁（遮罩掉的讀取也算）",
                       detail=f"發出了 {count['lanes']:,} 個讀取位置（含遮罩掉的）；長度 {lens}、CHUNK = {chunk} 時最多 {lanes:,} 個。",
                       hint=hint)
    lens = [96, 20]                                                       # S = 3 (pages of 16, CHUNK = 32)
    q, _, _, k_pages, v_pages, table, seqlens = paged_inputs(H, 2, 2, 2, lens, 16, 16, True, seed=11)
    with tritonmode.loaded_elements() as count:
        _, _, chunk = paged_split_partials(q, k_pages, v_pages, table, seqlens, 3)
    lanes = _page_lanes(lens, chunk, 3, table.shape[1])
    grading.check_true(count["lanes"] <= lanes, name="paged：每段的迴圈只走自己的頁（S = 3，長度 96 與 20；遮罩掉的讀取也算）",
                       detail=f"發出了 {count['lanes']:,} 個讀取位置（含遮罩掉的）；每段只走 [s·CHUNK, min((s+1)·CHUNK, n_b)) "
                              f"的頁（CHUNK = {chunk}）時最多 {lanes:,} 個。",
                       hint="第 s 段的迴圈是 range(lo, hi, PAGE_SIZE)，lo = s·CHUNK、hi = min(lo + CHUNK, n_b)：不要從第 0 頁開始、"
                            "也不要走到序列長度 n_b，再用遮罩丟掉別段的鍵；GPU 上那些頁照樣要讀、tl.dot 照樣要算，切分就白做了。")


def offsets_64bit(kernel, H: Helpers) -> None:
    """Interpreter only: page ids from 2^22 (page · PAGE_SIZE · H_kv · d passes 2^31; no memory behind them): no int32
    overflow in an address."""
    if not nb08_kernels.interpreted():
        return
    q, k, v = H.inputs(2, 4, 2, 16, 16, seed=6)
    big = (2**22 + torch.arange(6, dtype=torch.int32, device=H.device)).view(2, 3)
    lens32 = torch.tensor([40, 17], dtype=torch.int32, device=H.device)
    o_part, lse_part = torch.empty(2, 4, 2, 16, device=H.device), torch.empty(2, 4, 2, device=H.device)
    k_pool, v_pool = k.reshape(2, 16, 2, 16), v.reshape(2, 16, 2, 16)
    nb08_kernels.no_int32_overflow(
        lambda: kernel[(2, 2, 2)](q, k_pool, v_pool, big, lens32, o_part, lse_part, QK_SCALE_16, 32, 2, 3, H_KV=2, G=2,
                                  HEAD_DIM=16, BLOCK_G=16, PAGE_SIZE=16, PREC="ieee"),
        (q, k_pool, v_pool, big, lens32, o_part, lse_part), where="讀到別的頁或頁面池之外",
        name="_paged_split_kernel：位址以 64 位元計算（頁碼 2^22 起，頁 · PAGE_SIZE · H_kv · d 超過 2^31）",
        hint="從頁表讀出的頁碼是 int32：先 .to(tl.int64) 再乘 PAGE_SIZE 與 H_KV * HEAD_DIM。")


def precision(paged_split_partials: Callable, H: Helpers) -> None:
    """Exercise 2's precision rule through pages (o_s stays fp32): 63 pages of 16 in order, length 1000, bf16 and fp16 by
    the 2x rule; the Triton IR of bf16 and fp16 launches; every score near -240 (fp32, length 37 in 3 pages)."""
    def one_split(q, k, v, length):
        pages = k.shape[1] // 16
        table = torch.arange(pages, dtype=torch.int32, device=H.device)[None]
        o_part, lse_part, _ = paged_split_partials(q, k.view(pages, 16, 2, k.shape[-1]), v.view(pages, 16, 2, k.shape[-1]), table,
                                                   torch.tensor([length], dtype=torch.int32, device=H.device), 1)
        return o_part[:, :, 0], lse_part[:, :, 0]

    nb08_kernels.acc_stays_fp32(lambda q, k, v: one_split(q, k, v, 1000)[0], H, seed=34, n=1008,
                                name="paged_split_partials：{dtype} 輸入，S = 1、長度 1000（63 頁）的 o_s")

    def low(dtype):
        ql, kl, vl = H.inputs(1, 4, 2, 32, 16, dtype=dtype, seed=36)
        return paged_split_partials(ql, kl.view(2, 16, 2, 16), vl.view(2, 16, 2, 16),
                                    torch.tensor([[1, 0]], dtype=torch.int32, device=H.device),
                                    torch.tensor([20], dtype=torch.int32, device=H.device), 2)

    nb08_kernels.partials_fp32_in_ir(lambda: [low(dtype) for dtype in (torch.bfloat16, torch.float16)],
                                     "paged_split_partials：bf16 與 fp16 輸入編譯出的 Triton IR")
    nb08_kernels.very_negative_scores(lambda q, k, v: one_split(q, k, v, 37), H, name="paged_split_partials（長度 37，S = 1）",
                                      n=48, seed=12, out="o_s")


def own_code_compiles(paged_split_partials: Callable, paged_decode: Callable, H: Helpers) -> None:
    """No SDPA, softmax or the reference; _paged_split_kernel compiles for sm80 and sm90."""
    nb08_kernels.own_kernel(paged_decode, H, "paged_decode：你自己的核心")
    q, k_pages, v_pages, table, seqlens = matches_contiguous(paged_split_partials, paged_decode, H, 2, 4, 2, [17, 40], 16, 16,
                                                             True, 2, "（編譯用）", PAGE_HINT, seed=9)
    nb08_kernels.compiles(lambda: paged_split_partials(q, k_pages, v_pages, table, seqlens, 2), "_paged_split_kernel")
