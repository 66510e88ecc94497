"""Visible tests of 08_decode_attention's exercise 2: ``decode_attention(q, k, v)`` (q [B, H_q, d]; k, v [B, N, H_kv, d]
-> o [B, H_q, d], lse [B, H_q] fp32) through the student's ``_decode_kernel``, ``_attend_tile`` and ``_finish``.

Used in: 08_decode_attention (test cells of ex2)
"""
from __future__ import annotations

from typing import Callable

import torch

from labkit.checks import contract
from labkit.core import grading
from labkit.tritonlab import bounds as tritonbounds, compile as tritoncompile, mode as tritonmode
from labkit.checks import nb08_kernels
from labkit.checks.nb08_kernels import QK_SCALE_16, Helpers

SIZES_HINT = ("三個大小各管各的：HEAD_DIM 是 q、K、V 的欄（offs_d），BLOCK_N 是一塊的鍵數（offs_n 與迴圈的步長），BLOCK_G 是 q 區塊的列數"
              "（offs_g、acc 的列）；前面幾個例子三者都是 16，拿一個代替另一個看不出來，這裡才會錯。")


def matches_reference(decode_attention: Callable, H: Helpers, b, hq, hkv, n, d, what: str, hint: str, seed=0, scale=1.0,
                      dtype=torch.float32, atol=1e-5):
    """decode_attention on seeded q [b, hq, d], k, v [b, n, hkv, d]: one launch of _decode_kernel, nothing read or written
    outside the tensors, no NaN, o and lse (natural log) against the float64 reference (atol; lse also rtol 1e-6)."""
    q, k, v = H.inputs(b, hq, hkv, n, d, dtype=dtype, seed=seed, scale=scale)
    name = f"decode_attention（B={b}, H_q={hq}, H_kv={hkv}, N={n}, d={d}）：{what}"
    with tritonmode.launches() as launched, nb08_kernels.shapes_named(name, hint), tritonbounds.outside_accesses() as outside:
        o, lse = decode_attention(q, k, v)
    tritonbounds.check_inside(outside, name=name + "：只讀寫傳入的張量",
                              hint="最後一個鍵區塊只有一部分在快取裡：K、V 的載入都要 mask=鍵 < N（other=0）。" + hint)
    nb08_kernels.launched_once(launched, "_decode_kernel", name, hint="decode_attention 已寫好；請完成 _decode_kernel 的內容。")
    o_ref, lse_ref = H.reference(q, k, v)
    grading.check_true(not o.isnan().any() and not lse.isnan().any(), name=name + "：沒有 NaN",
                       detail=f"o 有 {int(o.isnan().sum())} 個 NaN，lse 有 {int(lse.isnan().sum())} 個。", hint=hint)
    grading.check_tensor(o.double(), o_ref, name=name + "：o", atol=atol, hint=hint)
    grading.check_tensor(lse.double(), lse_ref, name=name + "：lse（自然對數）", atol=atol, rtol=1e-6,
                         hint="lse = (m + log2(l)) × ln 2：m 以 log2 為單位，存之前換回自然對數。" + hint)
    return o, lse


def padded_rows_not_written(kernel, H: Helpers) -> None:
    """_decode_kernel launched by hand with g = 3 (B_G = 16), grid (1, 2): o [6, 16] and lse [6] written, not past them."""
    nb08_kernels.padded_rows_not_written(
        lambda q, k, v, o, lse: kernel[(1, 2)](q, k, v, o, lse, QK_SCALE_16, 24, H_KV=2, G=3, HEAD_DIM=16, BLOCK_G=16,
                                               BLOCK_N=H.block_n, PREC="ieee"),
        H, n=24, rows=6, spare=16, name="_decode_kernel（g = 3，B_G = 16）：多出來的 13 列沒有寫到 o、lse 之外",
        hint="tl.store 的 o 與 lse 都要加上 mask=row_ok（offs_g < G）：多出來的列屬於別的 head 或根本在張量之外。")


def staged_cases(decode_attention: Callable, H: Helpers) -> None:
    """From the easiest case to the hardest: MHA, a tail tile, GQA g = 4, g = 3 padded, scores near 1e3, d = 32 and
    g = 32 (head size, key block and query rows of different sizes)."""
    for args, what, hint, extra in [
            ((2, 2, 2, 32, 16), "MHA，N 是區塊倍數",
             "線上 softmax：m_new = max(m, rowmax(s))，alpha = exp2(m - m_new)，l = l·alpha + rowsum(p)，acc = acc·alpha + p @ v；"
             "分數乘上 qk_scale（已含 log2 e），用 exp2 而不是 exp。", {}),
            ((2, 2, 2, 37, 16), "N 不是區塊倍數（尾端區塊）", "尾端區塊：offs_n < N 以外的鍵讀成 0、分數設成 -inf（keep），不能算進 softmax。", {}),
            ((2, 8, 2, 40, 16), "GQA g = 4（KV head j 服務查詢 head j·g .. j·g+g-1）",
             "查詢 head h 用 KV head h // g：程式實例 j 的列是 heads = j * G + offs_g（不是 offs_g * H_KV + j）；"
             "K/V 的位址用 j * HEAD_DIM（KV head），q/o 的位址用 heads。", {}),
            ((1, 6, 2, 24, 16), "g = 3（B_G 補到 16：多的列遮罩）",
             "列數 BLOCK_G 是 g 補到 2 的次方（至少 16）：讀 q 與寫 o、lse 都要用 row_ok = offs_g < G 遮罩，否則寫到別的 head。", {}),
            ((1, 4, 2, 40, 16), "分數約 1e3（要減最大值）",
             "先減去目前的最大值再 exp2（exp2(1e3) 在 fp32 是 inf）；每塊更新 m 之後用 alpha 把舊的 acc、l 縮放。", dict(seed=3, scale=150.0)),
            ((2, 4, 2, 45, 32), "d = 32（不等於 B_N = 16）、N = 45 不是區塊倍數", SIZES_HINT, dict(seed=8)),
            ((1, 32, 1, 21, 32), "g = 32（B_G = 32，不等於 B_N = 16）", SIZES_HINT, dict(seed=9))]:
        matches_reference(decode_attention, H, *args, what, hint, **extra)


def other_key_block(kernel, H: Helpers) -> None:
    """_decode_kernel launched by hand with a key block of 32 (64 where the notebook's B_N is 32; d = 16, B_G = 16):
    GQA g = 4, N = 40 not a multiple of it; o and lse against the float64 reference."""
    block = nb08_kernels.other_block(H)
    q, k, v = H.inputs(2, 8, 2, 40, 16, seed=12)
    o, lse = torch.empty_like(q), torch.empty(2, 8, device=H.device)
    name = f"_decode_kernel（BLOCK_N = {block}，不是 notebook 的 {H.block_n}；N = 40，d = 16）"
    with nb08_kernels.shapes_named(name, SIZES_HINT):
        kernel[(2, 2)](q, k, v, o, lse, QK_SCALE_16, 40, H_KV=2, G=4, HEAD_DIM=16, BLOCK_G=16, BLOCK_N=block, PREC="ieee")
    o_ref, lse_ref = H.reference(q, k, v)
    hint = ("BLOCK_N 是核心的參數：offs_n 的長度（tl.arange 的上限）用 BLOCK_N、迴圈 range(0, N, BLOCK_N)；不要寫死直譯器的 16"
            "（GPU 上是 64）。" + SIZES_HINT)
    grading.check_tensor(o.double(), o_ref, name=name + "：o", atol=1e-5, hint=hint)
    grading.check_tensor(lse.double(), lse_ref, name=name + "：lse", atol=1e-5, rtol=1e-6, hint=hint)


def keeps_the_contract(decode_attention: Callable, H: Helpers) -> None:
    """q [2, 2, 16], k, v [2, 16, 1, 16] (one key tile: each call is a launch of 2 short programs): the inputs unchanged
    after the call; transposed and sliced views of q, k and v give the o and lse their contiguous copies give."""
    q, k, v = H.inputs(2, 2, 1, 16, 16, seed=13)
    contract.check_inputs_unchanged(decode_attention, q, k, v, name="decode_attention")
    contract.check_views(decode_attention, q, k, v, name="decode_attention")


def empty_rows(probe, H: Helpers) -> None:
    """``probe[(1,)](o [16, 16], lse [16], PREC=)`` (the notebook's probe: the student's _attend_tile on a tile whose every
    score is masked, then _finish): no NaN; o = 0 and lse = -inf where no key was seen."""
    o_empty = torch.full((16, 16), 7.0, device=H.device)
    lse_empty = torch.zeros(16, device=H.device)
    probe[(1,)](o_empty, lse_empty, PREC="ieee")
    grading.check_true(not o_empty.isnan().any() and not lse_empty.isnan().any(),
                       name="_attend_tile + _finish：整塊都被遮住的列沒有 NaN",
                       detail=f"o 有 {int(o_empty.isnan().sum())} 個 NaN，lse 有 {int(lse_empty.isnan().sum())} 個。",
                       hint="整列都是 -inf 時 m_new = -inf，s - m_new 是 -inf - (-inf) = NaN：平移量改用 0"
                            "（shift = tl.where(m_new == -inf, 0, m_new)）；_finish 裡 l = 0 的列不要算 acc / l（0/0）。")
    grading.check_true(bool((o_empty == 0).all()) and bool(torch.isneginf(lse_empty).all()),
                       name="_finish：沒看到任何鍵的列（l = 0）回傳 o = 0、lse = -inf",
                       detail=f"o 的值 {sorted(set(o_empty.flatten().tolist()))[:4]}，lse 的值 {sorted(set(lse_empty.tolist()))[:4]}。",
                       hint="empty = l_i == 0：o = tl.where(empty, 0, acc / l)（或先把 l 換成 1），lse = tl.where(empty, -inf, (m + log2 l) · ln 2)。")


def bf16_in_bf16_out(decode_attention: Callable, H: Helpers) -> None:
    """bf16 q [1, 4, 16], k, v [1, 40, 2, 16]: o bf16 of q's shape, lse fp32; o near the float64 reference (atol 2e-2)."""
    qb, kb, vb = H.inputs(1, 4, 2, 40, 16, dtype=torch.bfloat16, seed=4)
    ob, lseb = decode_attention(qb, kb, vb)
    grading.check_true(ob.dtype == torch.bfloat16 and lseb.dtype == torch.float32 and ob.shape == qb.shape,
                       name="decode_attention：bf16 輸入得到 bf16 的 o、fp32 的 lse",
                       detail=f"o: {ob.dtype} {tuple(ob.shape)}，lse: {lseb.dtype}。",
                       hint="tl.store(o_ptr + ..., o.to(o_ptr.dtype.element_ty))：fp32 的累加器存進 bf16 輸出之前要轉型。")
    grading.check_tensor(ob.double(), H.reference(qb, kb, vb)[0], name="decode_attention：bf16 的 o", atol=2e-2,
                         hint="以 fp32 累加（acc、m、l 都是 fp32），只在存回時轉成 bf16。")


def precision(decode_attention: Callable, H: Helpers) -> None:
    """acc, m and l in fp32: the 2x rule at N = 1000 (63 tiles of the interpreter's 16) in bf16 and fp16; the same rule
    read from the Triton IR of bf16 and fp16 launches (a tile's P.V rounded before it joins acc, or an lse rounded before
    its fp32 store, costs too little here for the 2x rule); every score near -240 (fp32, N = 37)."""
    nb08_kernels.acc_stays_fp32(lambda q, k, v: decode_attention(q, k, v)[0], H, seed=30,
                                name="decode_attention：{dtype} 輸入，N = 1000（63 個區塊）的 o")
    tritoncompile.check_fp32_statistics(
        lambda: [decode_attention(*H.inputs(1, 4, 2, 20, 16, dtype=dtype)) for dtype in (torch.bfloat16, torch.float16)],
        name="decode_attention：bf16 與 fp16 輸入編譯出的 Triton IR",
        rule="s、m、l、acc、exp2 的引數與 lse 都以 fp32 計算；只有 tl.dot 的運算元（p.to(v.dtype)）與存回的 o 轉成輸入的 dtype",
        hint="tl.dot(p.to(v.dtype), v) 的結果已經是 fp32：直接加進 acc，不要先轉成輸入的 dtype；m、l、alpha、tl.sum(p, 1) 與 lse "
             "都留在 fp32，lse 原樣存進 fp32 的 lse（不要 .to(o_ptr.dtype.element_ty)）；o 存回時才轉型。")
    nb08_kernels.very_negative_scores(decode_attention, H, name="decode_attention（N = 37）", n=37, seed=10)


def kv_read_once(decode_attention: Callable, H: Helpers) -> None:
    """Interpreter only: q [2, 8, 16], k, v [2, 48, 2, 16]: no more elements loaded than q, K and V once each."""
    if not nb08_kernels.interpreted():
        return
    q, k, v = H.inputs(2, 8, 2, 48, 16, seed=5)
    with tritonmode.loaded_elements() as count:
        decode_attention(q, k, v)
    once = k.numel() + v.numel() + q.numel()
    grading.check_true(count["elements"] <= once, name="decode_attention：K/V 每個元素只讀一次（g 個查詢 head 共用）",
                       detail=f"讀了 {count['elements']:,} 個元素；q、K、V 各讀一次是 {once:,} 個。",
                       hint="網格是 (B, H_kv)：一個程式實例讀一個 KV head 的 K/V 一次，服務它的 g 個查詢 head（疊成 tl.dot 的列）；"
                            "讀 q 時多出來的列（offs_g >= G）也要用 row_ok 遮罩，不要讀。")


def offsets_64bit(kernel, H: Helpers) -> None:
    """Interpreter only: _decode_kernel as if on sequences 2^22 and 2^22 + 1 of a batch (b·N·H_kv·d passes 2^31; no memory
    behind them): no int32 overflow in an address."""
    if not nb08_kernels.interpreted():
        return
    q, k, v = H.inputs(2, 4, 2, 40, 16, seed=6)
    o, lse = torch.empty_like(q), torch.empty(2, 4, device=H.device)
    nb08_kernels.no_int32_overflow(
        lambda: kernel[(2, 2)](q, k, v, o, lse, QK_SCALE_16, 40, H_KV=2, G=2, HEAD_DIM=16, BLOCK_G=16, BLOCK_N=H.block_n,
                               PREC="ieee"),
        (q, k, v, o, lse), pid_offset=(2**22, 0, 0), where="讀寫到別條序列或張量之外",
        name="_decode_kernel：位址以 64 位元計算（第 2^22 條序列起，b·N·H_kv·d 超過 2^31）",
        hint="b 取 tl.program_id(0).to(tl.int64)：b 一開始就是 int64，b * N * H_KV * HEAD_DIM 才以 64 位元相乘"
             "（先以 int32 乘完再 .to(tl.int64) 已經太遲）。")


def own_code_compiles_no_tf32(decode_attention: Callable, H: Helpers) -> None:
    """No SDPA, softmax or the reference; _decode_kernel compiles for sm80 and sm90, its fp32 tl.dot without TF32."""
    nb08_kernels.own_kernel(decode_attention, H, "decode_attention：你自己的核心，不呼叫 SDPA、softmax 或參考答案")
    q, k, v = H.inputs(1, 4, 2, 20, 16)
    reports = nb08_kernels.compiles(lambda: decode_attention(q, k, v), "_decode_kernel",
                                    why="最常見的原因：核心或它呼叫的 @triton.jit 函式讀了一般的 Python 全域變數（例如 LOG2E）：直接寫數字或當參數傳入。")
    tritoncompile.check_no_tf32(reports, name="_attend_tile：fp32 輸入時 tl.dot 用 input_precision=PREC（ieee），不用 TF32",
                                hint="兩個 tl.dot 都要傳 input_precision=PREC（包裝函式依 dtype 選：fp32 是 \"ieee\"）。直譯器不理會 "
                                     "input_precision，CPU 上的數值看不出差別，只有編譯出來的程式碼看得出。")
