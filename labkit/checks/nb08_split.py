"""Visible tests of 08_decode_attention's exercise 3: ``choose_num_splits(batch, n_kv_heads, max_len, n_sms, block_n)``
and ``split_kv_partials(q, k, v, seqlens, S)`` (q [B, H_q, d]; k, v [B, N, H_kv, d]; seqlens [B] int32 -> o_part
[B, H_q, S, d] fp32, lse_part [B, H_q, S] fp32, chunk) through the student's ``_split_kernel``.

Used in: 08_decode_attention (test cells of ex3)
"""
from __future__ import annotations

from typing import Callable

import torch

from labkit.checks import contract
from labkit.core import grading
from labkit.tritonlab import bounds as tritonbounds, mode as tritonmode
from labkit.checks import nb08_kernels
from labkit.checks.nb08_kernels import QK_SCALE_16, Helpers

SPLIT_CASES = [
    ((1, 8, 4096, 132, 64), 17, "batch 1：把程式實例數補到至少一輪 SM（ceil(132 / 8) = 17）",
     "S = ceil(SM 數 / (batch × H_kv))：向上取整（132 // 8 = 16 只有 128 個程式實例，還差 4 個 SM）。"),
    ((1, 8, 4096, 128, 64), 16, "SM 數剛好整除 batch × H_kv：ceil(128 / 8) = 16，不多切一段",
     "向上取整寫成 -(-a // b)：a // b + 1 在整除時多一段（128 // 8 + 1 = 17）。"),
    ((16, 8, 4096, 132, 64), 2, "batch 16：128 個程式實例差一點，S = 2", "程式實例數是 batch × H_kv × S：batch 與 H_kv 都要算。"),
    ((4, 8, 4096, 132, 64), 5, "batch 4：ceil(132 / 32) = 5", "程式實例數是 batch × H_kv × S：batch 與 H_kv 都要算。"),
    ((32, 8, 4096, 132, 64), 1, "batch × H_kv 已超過 SM 數：不切分（S = 1）", "程式實例已經填滿 SM 時不要切：S 至少 1，不是 0。"),
    ((1, 8, 100, 132, 64), 2, "短的上下文：每段至少一個區塊（ceil(100 / 64) = 2）",
     "S 不超過 ceil(max_len / block_n)：切得比一個區塊還短，只是多寫部分結果。"),
    ((1, 8, 1024, 132, 64), 16, "上下文剛好是區塊的整數倍：ceil(1024 / 64) = 16，不多切一段",
     "S 不超過 ceil(max_len / block_n)：向上取整寫成 -(-a // b)；a // b + 1 在整除時多一段（1024 // 64 + 1 = 17）。"),
    ((1, 8, 0, 132, 64), 1, "最長的序列是 0：S = 1", "S = max(1, ...)：沒有鍵時也要有一個程式實例寫出 o = 0、lse = -inf。"),
    ((2, 4, 4096, 132, 64), 17, "H_kv = 4、batch 2：ceil(132 / 8) = 17", "程式實例數是 batch × H_kv × S：用傳入的 n_kv_heads，不要寫死 8。"),
    ((1, 8, 300, 132, 128), 3, "區塊 128：ceil(300 / 128) = 3", "每段至少一個區塊：用傳入的 block_n，不要寫死 64。")]


def split_count(choose_num_splits: Callable) -> None:
    """choose_num_splits -> int: ceil(SMs / (batch x H_kv)), capped at ceil(max_len / block), at least 1."""
    for args, expected, what, hint in SPLIT_CASES:
        got = choose_num_splits(*args)
        grading.check_scalar(got, expected, name=f"choose_num_splits{args}：{what}", rel=0, hint=hint)
        grading.check_true(type(got) is int, name=f"choose_num_splits{args}：回傳 int",
                           detail=f"得到 {type(got).__name__}。", hint="用整數運算：向上取整寫成 -(-a // b)；回傳 int，不是 float。")


def partials_match_reference(split_kv_partials: Callable, H: Helpers, b, hq, hkv, n, d, lens, splits, what: str, hint: str,
                             seed=0):
    """split_kv_partials on seeded q [b, hq, d], k, v [b, n, hkv, d] with lengths ``lens``: one launch of _split_kernel, nothing
    read or written outside the tensors; per split s, no NaN and (o_s, lse_s) against the float64 reference over keys
    [s * chunk, min((s + 1) * chunk, length)) (atol 1e-5). Returns (q, k, v, seqlens)."""
    q, k, v = H.inputs(b, hq, hkv, n, d, seed=seed)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=H.device)
    name = f"split_kv_partials（B={b}, H_q={hq}, H_kv={hkv}, lens={lens}, S={splits}）：{what}"
    with tritonmode.launches() as launched, nb08_kernels.shapes_named(name, hint), tritonbounds.outside_accesses() as outside:
        o_part, lse_part, chunk = split_kv_partials(q, k, v, seqlens, splits)
    tritonbounds.check_inside(outside, name=name + "：只讀寫傳入的張量",
                              hint="每段最後一個鍵區塊：K、V 的載入都要 mask=鍵 < 這段的終點與序列長度（other=0）。" + hint)
    nb08_kernels.launched_once(launched, "_split_kernel", name)
    lens_t = torch.tensor(lens)
    for s in range(splits):
        lo = torch.full((b,), s * chunk)
        hi = torch.minimum(torch.full((b,), (s + 1) * chunk), lens_t)
        o_ref, lse_ref = H.reference(q, k, v, lo, hi)
        part = f"{name}：第 {s} 段（鍵 [{s * chunk}, min({(s + 1) * chunk}, 長度))）"
        grading.check_true(not o_part[:, :, s].isnan().any() and not lse_part[:, :, s].isnan().any(), name=part + "：沒有 NaN",
                           detail="部分結果有 NaN。",
                           hint="沒有鍵的段：迴圈一次都不跑，l = 0；_finish 要把 l = 0 的列寫成 o = 0、lse = -inf（不要 0/0）。"
                                "_attend_tile 裡整列都是 -inf 時，平移量用 0（-inf - (-inf) 是 NaN）。")
        grading.check_tensor(lse_part[:, :, s].double(), lse_ref, name=part + "：lse_s", atol=1e-5, hint=hint)
        grading.check_tensor(o_part[:, :, s].double(), o_ref, name=part + "：o_s（只在這段鍵上正規化）", atol=1e-5, hint=hint)
    return q, k, v, seqlens


def padded_rows_not_written(kernel, H: Helpers) -> None:
    """_split_kernel launched by hand with g = 3 (B_G = 16), S = 2, grid (1, 2, 2): partials [12, 16] and [12] written,
    not past them."""
    lens = torch.tensor([24], dtype=torch.int32, device=H.device)
    nb08_kernels.padded_rows_not_written(
        lambda q, k, v, o, lse: kernel[(1, 2, 2)](q, k, v, lens, o, lse, QK_SCALE_16, 24, H.block_n, 2, H_KV=2, G=3,
                                                  HEAD_DIM=16, BLOCK_G=16, BLOCK_N=H.block_n, PREC="ieee"),
        H, n=24, rows=12, spare=32, name="_split_kernel（g = 3，B_G = 16）：多出來的列沒有寫到 o_part、lse_part 之外",
        hint="部分結果的 tl.store 也要 mask=row_ok（offs_g < G），和練習 2 一樣。")


def staged_cases(split_kv_partials: Callable, H: Helpers) -> None:
    """S = 1; S = 3 with a tail; GQA g = 4; d = 32 (not the key block); lengths 80, 0, 23, 5 in one batch."""
    for args, what, hint, seed in [
            ((2, 2, 2, 40, 16, [40, 40], 1), "S = 1（等於不切分）",
             "S = 1 時唯一的一段是 [0, 長度)：lo = s * CHUNK、hi = min(lo + CHUNK, seqlens[b])。", 0),
            ((1, 2, 2, 90, 16, [90], 3), "S = 3，長度 90 不是區塊倍數",
             "第 s 段是 [s·CHUNK, min((s+1)·CHUNK, 長度))：迴圈 range(lo, hi, BLOCK_N)，遮罩用 offs_n < hi（不是 < N），"
             "o_part 的位置是 ((b·H_q + head)·S + s)·d。", 0),
            ((2, 8, 2, 64, 16, [64, 64], 2), "GQA g = 4", "與練習 2 相同：程式實例 j 的列是查詢 head j·G .. j·G+G-1，K/V 用 KV head j。", 0),
            ((2, 4, 2, 70, 32, [70, 45], 3), "d = 32（不等於 B_N = 16）",
             "HEAD_DIM 是 q、K、V 的欄（offs_d），BLOCK_N 是一塊的鍵數（offs_n 與迴圈的步長）：前面的例子兩者都是 16，"
             "拿一個代替另一個看不出來，這裡才會錯。", 3),
            ((4, 4, 2, 80, 16, [80, 0, 23, 5], 3), "每條序列不同長度（80、0、23、5）",
             "每條序列讀自己的長度 n_b = tl.load(lens_ptr + b)；不是快取的容量 N。長度 0、或短到這段沒有鍵：o_s = 0、lse_s = -inf。", 0),
            ((1, 32, 1, 40, 16, [37], 2), "g = 32（B_G = 32：查詢的列數不是 16）",
             "BLOCK_G 是核心的參數：offs_g 的長度用 BLOCK_G，acc、m、l 的列數都是 BLOCK_G；前面的例子 B_G 都是 16。", 4)]:
        partials_match_reference(split_kv_partials, H, *args, what, hint, seed=seed)


def other_key_block(kernel, H: Helpers) -> None:
    """_split_kernel launched by hand with a key block of 32 (64 where the notebook's B_N is 32), CHUNK = 2 blocks, S = 2,
    lengths 90 and 50 (not multiples of the block): partials against the float64 reference."""
    block, lens = nb08_kernels.other_block(H), [90, 50]
    chunk = 2 * block
    q, k, v = H.inputs(2, 4, 2, 90, 16, seed=14)
    o_part, lse_part = torch.empty(2, 4, 2, 16, device=H.device), torch.empty(2, 4, 2, device=H.device)
    name = f"_split_kernel（BLOCK_N = {block}，不是 notebook 的 {H.block_n}；CHUNK = {chunk}，S = 2，長度 {lens}）"
    with nb08_kernels.shapes_named(name, "BLOCK_N 是核心的參數：offs_n 與迴圈的步長都用它，不要寫死直譯器的 16。"):
        kernel[(2, 2, 2)](q, k, v, torch.tensor(lens, dtype=torch.int32, device=H.device), o_part, lse_part, QK_SCALE_16,
                          90, chunk, 2, H_KV=2, G=2, HEAD_DIM=16, BLOCK_G=16, BLOCK_N=block, PREC="ieee")
    for s in range(2):
        lo = torch.full((2,), s * chunk)
        o_ref, lse_ref = H.reference(q, k, v, lo, torch.minimum(lo + chunk, torch.tensor(lens)))
        hint = "BLOCK_N 是核心的參數：offs_n 的長度（tl.arange 的上限）用 BLOCK_N、迴圈 range(lo, hi, BLOCK_N)；不要寫死直譯器的 16（GPU 上是 64）。"
        grading.check_tensor(o_part[:, :, s].double(), o_ref, name=f"{name}：第 {s} 段的 o_s", atol=1e-5, hint=hint)
        grading.check_tensor(lse_part[:, :, s].double(), lse_ref, name=f"{name}：第 {s} 段的 lse_s", atol=1e-5, hint=hint)


def keeps_the_contract(split_kv_partials: Callable, H: Helpers) -> None:
    """q [2, 2, 16], k, v [2, 16, 1, 16], lengths [13, 7], S = 1 (each call is a launch of 2 short programs): the inputs
    unchanged after the call; transposed and sliced views of q, k, v and lengths cut as ``lens[::2]`` give the partials
    their contiguous copies give."""
    q, k, v = H.inputs(2, 2, 1, 16, 16, seed=15)
    lens = torch.tensor([13, 7], dtype=torch.int32, device=H.device)
    contract.check_inputs_unchanged(split_kv_partials, q, k, v, lens, 1, name="split_kv_partials")
    contract.check_views(split_kv_partials, q, k, v, lens, 1, name="split_kv_partials", vectors=True)


def splits_read_own_keys(split_kv_partials: Callable, H: Helpers) -> None:
    """Interpreter only (load elements and lanes counted, masked-off lanes too): with S = 3 over 96 keys, each split reads
    and loops over its own blocks only; with lengths 96 and 20, each split's loop stops at its sequence's length."""
    if not nb08_kernels.interpreted():
        return
    q, k, v = H.inputs(1, 2, 2, 96, 16, seed=7)
    with tritonmode.loaded_elements() as count:
        _, _, chunk = split_kv_partials(q, k, v, torch.tensor([96], dtype=torch.int32, device=H.device), 3)
    once = k.numel() + v.numel() + 3 * q.numel() + 2 * 3                    # q and its length once per program (2 x 3)
    hint = "迴圈從 lo = s·CHUNK 開始，到 hi 停：不要從 0 讀到 N 再用遮罩丟掉別段的鍵。"
    grading.check_true(count["elements"] <= once, name="split_kv_partials：每段只讀自己的鍵（K/V 合計讀一次）",
                       detail=f"讀了 {count['elements']:,} 個元素；K/V 各一次、每個程式實例讀 q 與長度一次，是 {once:,} 個。", hint=hint)
    lanes = 2 * 3 * (2 * chunk * 16 + 16 * 16 + 1)      # per program (2 KV heads x 3 splits): K and V of its chunk, q's tile, its length
    grading.check_true(count["lanes"] <= lanes, name="split_kv_partials：每段的迴圈只走自己的區塊（遮罩掉的讀取也算）",
                       detail=f"發出了 {count['lanes']:,} 個讀取位置（含遮罩掉的）；每個程式實例走自己 {chunk} 個鍵的區塊，"
                              f"加上 q 與長度，是 {lanes:,} 個。", hint=hint)
    q, k, v = H.inputs(2, 2, 2, 96, 16, seed=9)      # S = 3: the second sequence's splits 1 and 2 hold no key
    lens = [96, 20]
    with tritonmode.loaded_elements() as count:
        _, _, chunk = split_kv_partials(q, k, v, torch.tensor(lens, dtype=torch.int32, device=H.device), 3)
    keys = sum(-(-max(0, min((s + 1) * chunk, n) - s * chunk) // H.block_n) * H.block_n for n in lens for s in range(3))
    lanes = 2 * (2 * keys * 16) + 2 * 2 * 3 * (16 * 16 + 1)      # K and V of 2 KV heads; q and length per program
    grading.check_true(count["lanes"] <= lanes, name="split_kv_partials：每段的迴圈在這條序列的長度停（長度 96 與 20）",
                       detail=f"發出了 {count['lanes']:,} 個讀取位置（含遮罩掉的）；只走長度以內的區塊是 {lanes:,} 個。",
                       hint="hi = min(lo + CHUNK, n_b)，迴圈 range(lo, hi, BLOCK_N)：長度 20 的序列第 1、2 段一個區塊都不走；"
                            "迴圈走到 lo + CHUNK 再用 offs_n < n_b 遮掉，GPU 上這些區塊的 tl.dot 照樣要算。")


def offsets_64bit(kernel, H: Helpers) -> None:
    """Interpreter only: _split_kernel with a capacity of 2^26 tokens per sequence (b·N·H_kv·d passes 2^31 from b = 2; no
    memory behind it): no int32 overflow in an address."""
    if not nb08_kernels.interpreted():
        return
    q, k, v = H.inputs(3, 4, 2, 16, 16, seed=8)
    lens = torch.tensor([20, 5, 30], dtype=torch.int32, device=H.device)
    o_part, lse_part = torch.empty(3, 4, 2, 16, device=H.device), torch.empty(3, 4, 2, device=H.device)
    nb08_kernels.no_int32_overflow(
        lambda: kernel[(3, 2, 2)](q, k, v, lens, o_part, lse_part, QK_SCALE_16, 2**26, H.block_n, 2, H_KV=2, G=2, HEAD_DIM=16,
                                  BLOCK_G=16, BLOCK_N=H.block_n, PREC="ieee"),
        (q, k, v, lens, o_part, lse_part), where="讀到別條序列或張量之外",
        name="_split_kernel：位址以 64 位元計算（容量 N = 2^26，b·N·H_kv·d 超過 2^31）",
        hint="和練習 2 一樣：b 取 tl.program_id(0).to(tl.int64)，b * N * H_KV * HEAD_DIM 才以 64 位元相乘。")


def precision(split_kv_partials: Callable, H: Helpers) -> None:
    """Exercise 2's precision rule for the partials (o_s stays fp32): one split over N = 1000 in bf16 and fp16 by the 2x
    rule; the Triton IR of bf16 and fp16 launches (a partial rounded once costs too little here for the 2x rule; merged,
    o is rounded twice); every score near -240 (fp32)."""
    def one_split(q, k, v):
        lens = torch.tensor([k.shape[1]], dtype=torch.int32, device=H.device)
        o_part, lse_part, _ = split_kv_partials(q, k, v, lens, 1)
        return o_part[:, :, 0], lse_part[:, :, 0]

    nb08_kernels.acc_stays_fp32(lambda q, k, v: one_split(q, k, v)[0], H, seed=32,
                                name="split_kv_partials：{dtype} 輸入，S = 1、N = 1000（63 個區塊）的 o_s")
    lens = torch.tensor([40, 3], dtype=torch.int32, device=H.device)
    nb08_kernels.partials_fp32_in_ir(
        lambda: [split_kv_partials(*H.inputs(2, 4, 2, 40, 16, dtype=dtype), lens, 2) for dtype in (torch.bfloat16, torch.float16)],
        "split_kv_partials：bf16 與 fp16 輸入編譯出的 Triton IR")
    nb08_kernels.very_negative_scores(one_split, H, name="split_kv_partials（N = 37，S = 1）", n=37, seed=11, out="o_s")


def own_code_compiles(split_kv_partials: Callable, H: Helpers) -> None:
    """No SDPA, softmax or the reference; _split_kernel compiles for sm80 and sm90."""
    nb08_kernels.own_kernel(split_kv_partials, H, "split_kv_partials：你自己的核心")
    q, k, v = H.inputs(2, 4, 2, 40, 16)
    lens = torch.tensor([40, 3], dtype=torch.int32, device=H.device)
    nb08_kernels.compiles(lambda: split_kv_partials(q, k, v, lens, 2), "_split_kernel")
