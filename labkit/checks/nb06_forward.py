"""Visible tests of 06_triton_flashattention's forward kernel (ex2): _key_range and _fwd_tile alone (each through a
probe kernel that takes the helper as a constexpr argument), the padded query rows, the forward in stages against
float64, precision (Triton IR and the 2x rule), the grid, tiles skipped and 64-bit head offsets.

Used in: 06_triton_flashattention (test cells of ex2)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from labkit.checks import contract, nb06
from labkit.core import grading
from labkit.engine import attention
from labkit.tritonlab import bounds as tritonbounds, compile as tritoncompile, mode as tritonmode

RULE_FWD_IR = ("分數 s、m、l、acc、exp2 的引數與 lse 都以 fp32 計算；只有 tl.dot 的運算元（p.to(v.dtype)）與存回的 o "
               "轉成輸入的 dtype")
HINT_FWD_IR = ("tl.dot(q, kt) 的結果 s 已經是 fp32，不要轉成輸入的 dtype；m_max、m_new、alpha、p、tl.sum(p, 1) 與 lse 都留在 fp32。"
               "p.to(v.dtype) 只寫在 tl.dot 裡；acc / l 算完，存回時才 .to(o_ptr.dtype.element_ty)。")
RULE_FWD = "m、l、acc 以 fp32 保存與累加（p 只在 tl.dot 之前轉成 v 的 dtype），lse 以 fp32 計算與儲存"
KEY_RANGE_CASES = [(100, 100, 32, 16, False), (100, 100, 32, 16, True), (40, 100, 32, 16, True), (100, 40, 32, 16, True),
                   (63, 64, 16, 16, True), (64, 64, 16, 16, False), (65, 64, 16, 16, True)]   # (N, N_k, BM, BN, causal)
STAGES = [  # (what, leading dims, N, N_k, causal, the likely causes at this stage)
    ("whole tiles: N = N_k = 64, non-causal", (1, 2), 64, 64, False,
     "_key_range 與 _fwd_tile 都通過了，問題多半在讀取：K 要讀成轉置的 kt [d, B_N]（指標的第 1 維走 offs_d、第 2 維走 offs_n），"
     "V 是 [B_N, d]；第 bh 個 head 從 bh * N * d 開始；[0, mid) 與 [mid, hi) 兩段都要走過。"),
    ("a tail tile: N = N_k = 100, non-causal", (2, 3), 100, 100, False,
     "尾端區塊：超出 N_k 的鍵讀成 0 還不夠（分數 0 仍有權重），分數要遮成 -inf（keep = offs_n < N_K）；Q 與 O 的越界列也要遮罩。"),
    ("causal, N = N_k = 100", (2, 3), 100, 100, True,
     "對角線區塊 [mid, hi) 要遮罩：keep = (offs_n < N_K) & (offs_n[None, :] <= offs_m[:, None] + (N_K - N_Q))。"),
    ("causal, N = 40 < N_k = 100", (1, 2), 40, 100, True,
     "右下對齊：查詢 i 看得見 j <= i + (N_K - N_Q)；j <= i 是左上對齊（只在 N = N_k 時相同）。"),
    ("causal, N = 100 > N_k = 40", (1, 2), 100, 40, True,
     "前 60 列看不到任何鍵：O = 0、LSE = -inf（_fwd_store 在 l = 0 時除以 1）；右下對齊：j <= i + (N_K - N_Q)。"),
    ("causal, N = 63, N_k = 64", (1, 2), 63, 64, True,
     "N_k - N = 1：每個查詢區塊的最後一列看得見下一個 K 區塊的第一個鍵：hi = start_m + BLOCK_M + (N_K - N_Q)，不要 -1。"),
]


def key_range_rules(key_range, device, cases=KEY_RANGE_CASES) -> None:
    """(mid, hi) of key_range for every query tile of each (N, N_k, BLOCK_M, BLOCK_N, causal) against the rules of its
    docstring: first what makes the forward wrong (a mask left out, a needed tile dropped), then the work left undone."""
    for n, nk, bm, bn, causal in cases:
        sees = (lambda i: min(nk, max(0, i + nk - n + 1))) if causal else (lambda i: nk)   # query i sees keys [0, sees(i))
        tiles = []
        for tile, (mid, hi) in enumerate(nb06.tile_ranges(key_range, n, nk, bm, bn, causal, device)):
            first, last = tile * bm, min(tile * bm + bm, n) - 1
            tiles.append(dict(mid=mid, hi=hi, last=last, seen=sees(last),
                              whole=sees(first) // bn * bn,           # keys in whole tiles every row of this tile sees
                              need=-(-sees(last) // bn),              # key tiles the last row needs (ceil)
                              read=-(-max(mid, hi, 0) // bn),         # key tiles the two loops read
                              name=f"_key_range(N={n}, N_k={nk}, BLOCK_M={bm}, BLOCK_N={bn}, causal={causal}), "
                                   f"query rows {first}..{last}"))
        for t in tiles:
            grading.check_true(0 <= t["mid"] <= t["whole"] and t["mid"] % bn == 0, name=t["name"] + ": mid ends the whole tiles",
                               detail=f"得到 mid = {t['mid']}；[0, mid) 不遮罩，所以只能包含每一列都完整看得見、沒有越界的整塊："
                                      f"0 <= mid <= {t['whole']}，且是 BLOCK_N 的倍數。",
                               hint="因果：第一列看得見 start_m + (N_K - N_Q) + 1 個鍵，向下取到 BLOCK_N 的倍數（可能是負的：先 tl.maximum(x, 0)"
                                    " 再除，核心裡的 // 向零取整）；非因果：N_K // BLOCK_N * BLOCK_N（尾端區塊要遮罩）。")
            grading.check_true(t["read"] >= t["need"], name=t["name"] + ": no needed key tile dropped",
                               detail=f"得到 (mid, hi) = ({t['mid']}, {t['hi']})：只讀了 {t['read']} 個 K 區塊，但這個區塊的最後一列"
                                      f"（第 {t['last']} 列）看得見前 {t['seen']} 個鍵，要 {t['need']} 個區塊。",
                               hint="右下對齊：查詢 i 看得見 j <= i + (N_K - N_Q)（不是左上對齊的 j <= i）；"
                                    "hi = start_m + BLOCK_M + (N_K - N_Q)，不要再 -1（略過的條件用 >，不是 >=）。")
        for t in tiles:
            grading.check_true(t["read"] <= t["need"], name=t["name"] + ": causal tiles skipped",
                               detail=f"得到 (mid, hi) = ({t['mid']}, {t['hi']})：讀了 {t['read']} 個 K 區塊，但這個區塊的列只看得見前 "
                                      f"{t['seen']} 個鍵（{t['need']} 個區塊）。",
                               hint="hi = min(N_K, start_m + BLOCK_M + (N_K - N_Q))：之後的區塊整塊略過（只遮罩不略過，FLOP 一點都沒少）；"
                                    "沒有任何一列看得見鍵的區塊：mid = hi = 0。")
            grading.check_true(t["mid"] >= t["whole"], name=t["name"] + ": whole tiles left unmasked",
                               detail=f"得到 mid = {t['mid']}，每一列都看得見的整塊到 {t['whole']}：[mid, {t['whole']}) 這些看得見的整塊也被遮罩了。",
                               hint="[0, mid) 的整塊不需要 tl.where；只有對角線與尾端區塊放進 [mid, hi)。")


@triton.jit
def _fwd_tile_probe(q_ptr, kt_ptr, v_ptr, keep_ptr, acc_ptr, m_ptr, l_ptr, qk_scale, FWD_TILE: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, MASKED: tl.constexpr):
    rm, rn, rd = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, D)
    acc_ptrs = acc_ptr + rm[:, None] * D + rd[None, :]
    acc, m_i, l_i = FWD_TILE(tl.load(acc_ptrs), tl.load(m_ptr + rm), tl.load(l_ptr + rm),
                             tl.load(q_ptr + rm[:, None] * D + rd[None, :]), tl.load(kt_ptr + rd[:, None] * BN + rn[None, :]),
                             tl.load(v_ptr + rn[:, None] * D + rd[None, :]),
                             tl.load(keep_ptr + rm[:, None] * BN + rn[None, :]) != 0, qk_scale, MASKED, "ieee")
    tl.store(acc_ptrs, acc)
    tl.store(m_ptr + rm, m_i)
    tl.store(l_ptr + rm, l_i)


def fwd_tile_rules(fwd_tile, device, cases=((False, False), (True, False), (False, True), (True, True))) -> None:
    """One fwd_tile step (16 x 16 tiles, d = 16) from a state (acc, m, l) against float64, compared as acc / l and
    m + log2(l), per (masked, big) case. Rows 0-7 carry a state from earlier tiles, rows 8-15 have seen nothing; when
    masked, rows 3 and 12 see no key of this tile. big: scores near 1e4 (log2 units), integers fp32 holds exactly."""
    for masked, big in cases:
        what = f"_fwd_tile (MASKED={masked}, {'scores near 1e4' if big else 'scores ~1'})"
        if big:
            q, kt = (torch.randint(-3, 4, shape, device=device).float() * 64 for shape in ((16, 16), (16, 16)))
            qk_scale = 0.5
        else:
            q, kt = torch.randn(16, 16, device=device), torch.randn(16, 16, device=device)
            qk_scale = 0.7
        v = torch.randn(16, 16, device=device)
        keep = torch.rand(16, 16, device=device) < 0.7 if masked else torch.ones(16, 16, dtype=torch.bool, device=device)
        keep[[3, 12]] = not masked
        s = ((q.double() @ kt.double()) * qk_scale).masked_fill(~keep, float("-inf"))     # log2 units
        m0 = torch.full((16,), float("-inf"), device=device)
        m0[:8] = s[:8].amax(1).clamp(min=-50).float().round() + torch.randint(-3, 3, (8,), device=device)
        m0[3] = 5.0
        l0 = torch.zeros(16, device=device)
        l0[:8] = 2.0
        o0 = torch.randn(16, 16, device=device)
        acc0 = o0 * l0[:, None]
        acc, m, l = acc0.clone(), m0.clone(), l0.clone()
        _fwd_tile_probe[(1,)](q, kt, v, keep.to(torch.int8), acc, m, l, qk_scale, FWD_TILE=fwd_tile, BM=16, BN=16, D=16,
                              MASKED=masked)
        lse0 = m0.double() + torch.log2(l0.double())                                       # -inf: nothing seen
        lse_new = torch.logaddexp2(lse0, torch.logsumexp(s * math.log(2), 1) / math.log(2))
        seen = torch.isfinite(lse_new)
        w0 = torch.exp2(lse0 - lse_new).nan_to_num(0.0)
        o_ref = w0[:, None] * o0.double() + torch.exp2(s - lse_new[:, None]).nan_to_num(0.0) @ v.double()
        bad = (acc.isnan() | acc.isinf()).any(1) | m.isnan() | l.isnan() | l.isinf()
        grading.check_true(not bad.any(), name=what + ": no NaN or inf",
                           detail=f"acc、m_i 或 l_i 出現 NaN 或 inf（列 {bad.nonzero().flatten().tolist()}）。",
                           hint="整列被遮住（還沒看過任何鍵）時 m_new = -inf，2^(-inf - (-inf)) = NaN：把這種列的 m_new 換成 0 再算 p 與 alpha；"
                                "分數很大時不減 m_new 就取 exp2 會溢位成 inf。")
        grading.check_true(bool((l[~seen] == 0).all() and (acc[~seen] == 0).all()), name=what + ": rows that saw no key stay empty",
                           detail=f"還沒看過任何鍵的列應維持 l = 0、acc = 0，得到 l = {l[~seen].tolist()}。",
                           hint="被遮住的分數是 -inf，p = 2^(-inf) = 0：l 與 acc 都不變。")
        grading.check_true(bool(torch.isneginf(m[~seen]).all()), name=what + ": rows that saw no key keep m = -inf",
                           detail=f"還沒看過任何鍵的列，回傳的 m 應仍是 -inf（還沒有最大值），得到 {m[~seen].tolist()}。",
                           hint="平移量可以換成 0（算 p 與 alpha 用），但回傳的是真正的最大值：m_max = max(m, rowmax(s))，"
                                "shift = tl.where(m_max == -inf, 0, m_max)，回傳 m_max。回傳 0 的話，練習 5 的視窗裡先遇到整塊都在視窗外的列，"
                                "之後每個分數都很負時 exp2(s - 0) 全部下溢成 0。")
        grading.check_tensor((m.double() + torch.log2(l.double()))[seen], lse_new[seen], name=what + ": m + log2(l)",
                             atol=1e-5, rtol=1e-6,
                             hint="m_new = max(m, rowmax(s) * qk_scale)；l = l * 2^(m - m_new) + rowsum(2^(s * qk_scale - m_new))："
                                  "分數先乘 qk_scale（log2 單位）、減的是 m_new；遮罩：tl.where(keep, s, -inf)。")
        grading.check_tensor((acc.double() / l.double()[:, None])[seen], o_ref[seen], name=what + ": acc / l", atol=1e-5,
                             hint="先前累積的 acc 也要 rescale：acc = acc * 2^(m - m_new)[:, None]，再加上 p @ v（p 轉成 v 的 dtype）。")


def padded_query_rows_not_stored(fwd_kernel, device) -> None:
    """One head, N = N_k = 20 (part of one query tile): fwd_kernel launched by hand into o [1, 20, 16] and lse [1, 20]
    followed by spare rows, before any other forward: an unmasked store of the padded rows would corrupt memory."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 20, 16, device=device) for _ in range(3))
    o_room, o = grading.with_spare_rows(torch.empty(20, 16, device=device), spare=128)
    lse_room, lse = grading.with_spare_rows(torch.empty(20, device=device), spare=128)
    fwd_kernel[lambda meta: (triton.cdiv(20, meta["BLOCK_M"]), 1)](
        q, k, v, o.view(1, 20, 16), lse.view(1, 20), 16 ** -0.5 * nb06.LOG2E, 20, 20, HEAD_DIM=16, CAUSAL=False, PREC="ieee")
    hint = ("_fwd_store 的兩個 tl.store 都要遮罩：o 用 mask=offs_m[:, None] < N_Q，lse 用 mask=offs_m < N_Q。"
            "最後一個查詢區塊補出來的列（offs_m >= N_Q）不屬於任何查詢，寫出去會蓋掉別的資料（在直譯器裡會弄壞記憶體，讓 notebook 的核心當掉）。")
    for room, what in ((o_room, "o"), (lse_room, "lse")):
        grading.check_spare_rows(room, 20, name=f"_fwd_kernel（N = 20，不滿一個查詢區塊）：補出來的列沒有寫到 {what} 之外",
                                 hint=hint)


def forward_stages(forward, device) -> None:
    """forward(q, k, v, is_causal) -> (o, lse), d = 16, fp32, in the order of STAGES: loads and stores inside the
    tensors, _fwd_kernel launched, shapes, no NaN, o and lse vs float64 (atol 1e-5), no tensor as large as the
    [..., N, N_k] scores built; the first stage once more on q, k, v as transposed views (same o and lse, views left
    unchanged)."""
    torch.manual_seed(5)
    for what, lead, n, nk, causal, hint in STAGES:
        q = torch.randn(*lead, n, 16, device=device)
        k, v = (torch.randn(*lead, nk, 16, device=device) for _ in range(2))
        with tritonmode.launches() as launched, nb06.LargestNewTensor() as created, tritonbounds.outside_accesses() as outside:
            o, lse = forward(q, k, v, is_causal=causal)
        name = f"flash_attention_forward ({what})"
        tritonbounds.check_inside(outside, name=name + ": loads and stores inside the tensors",
                                  hint="尾端的區塊：K、V 的載入用 mask=offs_n < N_K（other=0），Q 的載入與 O、LSE 的儲存用 offs_m < N_Q。")
        grading.check_true(launched["_fwd_kernel"] >= 1, name=name + ": _fwd_kernel launched",
                           detail=f"沒有啟動 _fwd_kernel（啟動紀錄：{dict(launched)}）；這個練習要用 Triton 核心計算。")
        grading.check_true(tuple(o.shape) == tuple(q.shape) and tuple(lse.shape) == tuple(q.shape[:-1]),
                           name=name + ": shapes", detail=f"o 應為 {tuple(q.shape)}、lse 應為 {tuple(q.shape[:-1])}；"
                                                          f"得到 {tuple(o.shape)}、{tuple(lse.shape)}。")
        grading.check_true(not (o.isnan().any() or lse.isnan().any()), name=name + ": no NaN",
                           detail=f"o 或 lse 有 NaN（列：{o.isnan().any(-1).nonzero()[:, -1].unique().tolist()[:8]}）。",
                           hint="看不到任何鍵的列：l = 0，O = acc / 1 = 0，LSE = -inf（_fwd_store 的 l_safe）。" + hint)
        o_ref, lse_ref = nb06.attention64(q, k, v, causal)
        grading.check_tensor(o.double(), o_ref, name=name + ": o", atol=1e-5, hint=hint)
        grading.check_tensor(lse.double(), lse_ref, name=name + ": lse", atol=1e-5,
                             hint="lse = (m + log2(l)) * ln(2)：m 以 log2 為單位，存自然對數；看不到任何鍵的列是 -inf。" + hint)
        scores = q.numel() // 16 * nk
        grading.check_true(created.largest < scores, name=name + ": no [..., N, N_k] tensor built",
                           detail=f"建立了 {created.largest} 個元素的張量；[..., N, N_k] 的分數是 {scores} 個。",
                           hint="FlashAttention 不建立 N x N_k 的分數矩陣：lse 也在核心裡算（_fwd_store 存 (m + log2 l) * ln 2），"
                                "不要在主機端用 q @ k^T 與 torch.logsumexp 補算。")
        if what == STAGES[0][0]:   # once, on the smallest stage: q, k, v as transposed views (left unchanged), then
            contract.check_views_once(forward, q, k, v, name="flash_attention_forward", want=(o, lse), is_causal=causal)
            contract.check_no_state(lambda: forward(q, k, v, is_causal=False), lambda: forward(q, k, v, is_causal=True),
                                    name="flash_attention_forward")   # causal and not, in turns: fresh outputs each call


def forward_ir_fp32(forward, device, shape=(1, 1, 40, 16), causal=True, dtypes=(torch.bfloat16, torch.float16),
                    name="flash_attention_forward: bf16 and fp16 inputs in the compiled Triton IR") -> None:
    """The Triton IR of forward's launches on q, k, v ``shape`` of ``dtypes`` (the compiler's front end, no GPU): s, m, l,
    the exp2 argument and lse in fp32; a value converted to the input dtype only a tl.dot operand (p) or stored (o)."""
    tritoncompile.check_fp32_statistics(
        lambda: [forward(*(torch.randn(*shape, device=device).to(dtype) for _ in range(3)), is_causal=causal)
                 for dtype in dtypes], name=name, rule=RULE_FWD_IR, hint=HINT_FWD_IR)


def forward_precision(forward, device) -> None:
    """bf16 in -> o bf16, lse fp32 [..., N]; the Triton IR in fp32 (forward_ir_fp32); the 2x rule vs plain attention in
    that dtype for bf16 and fp16: N = 70, N_k = 90, d = 32 (o and lse, causal and not) and N_k = 1000 (o, 63 key tiles);
    fp32 scores all near -250 (o and lse, atol 1e-3)."""
    qb, kb, vb = (torch.randn(1, 2, 40, 16, device=device).to(torch.bfloat16) for _ in range(3))
    ob, lseb = forward(qb, kb, vb, is_causal=True)
    grading.check_true(ob.dtype == torch.bfloat16 and lseb.dtype == torch.float32 and lseb.shape == qb.shape[:-1],
                       name="flash_attention_forward: bf16 in -> o bf16, lse fp32 [..., N]",
                       detail=f"o 應為 bf16、lse 應為 fp32 {tuple(qb.shape[:-1])}；得到 {ob.dtype}、{lseb.dtype} {tuple(lseb.shape)}。",
                       hint="o = torch.empty_like(q3)（q 的 dtype）；lse 用 dtype=torch.float32；存 o 前 .to(o_ptr.dtype.element_ty)。")
    forward_ir_fp32(forward, device)
    torch.manual_seed(13)
    for dtype in grading.LOW_PRECISION:
        for causal in (False, True):
            ql = torch.randn(1, 2, 70, 32, device=device).to(dtype)
            kl, vl = (torch.randn(1, 2, 90, 32, device=device).to(dtype) for _ in range(2))
            ol, lsel = forward(ql, kl, vl, is_causal=causal)
            o64, lse64 = nb06.attention64(ql, kl, vl, causal)
            o_plain, lse_plain = attention.reference_attention(ql, kl, vl, causal=causal)
            name = f"flash_attention_forward: {str(dtype)[6:]} inputs, N = 70, N_k = 90, d = 32, causal={causal}"
            grading.check_within_2x(lsel, lse64, lse_plain, name=name + ": lse", rule=RULE_FWD,
                                    hint="l 要用 fp32 的 p 加總：tl.sum(p, 1) 在轉型之前（p.to(v.dtype) 只給 tl.dot 用）；"
                                         "m_i、l_i、acc 用 tl.full／tl.zeros(..., tl.float32) 建立。")
            grading.check_within_2x(ol, o64, o_plain, name=name + ": o", rule=RULE_FWD,
                                    hint="acc 是 fp32 累加器：tl.dot(p.to(v.dtype), v, acc)；acc / l 在 fp32 中算完，存回時才轉成 o 的 dtype。")
    gen = torch.Generator().manual_seed(21)   # N_k = 1000: an acc rounded per tile is 5-7x off, an fp32 one near 1x
    for dtype in grading.LOW_PRECISION:
        ql = torch.randn(1, 1, 20, 32, generator=gen).to(dtype).to(device)
        kl = torch.randn(1, 1, 1000, 32, generator=gen).to(dtype).to(device)
        vl = (torch.randn(1, 1, 1000, 32, generator=gen) + 1.0).to(dtype).to(device)
        ol, _ = forward(ql, kl, vl)
        grading.check_within_2x(ol, nb06.attention64(ql, kl, vl, False)[0], attention.reference_attention(ql, kl, vl)[0],
                                name=f"flash_attention_forward: {str(dtype)[6:]} inputs, N_k = 1000 (63 key tiles): o",
                                rule=RULE_FWD,
                                hint="acc 在整個 K/V 迴圈裡都是 fp32：每塊 tl.dot(p.to(v.dtype), v, acc) 直接累加進 fp32 的 acc，"
                                     "不要在迴圈裡把 acc（或 _fwd_tile 回傳的 acc）轉成輸入的 dtype：每塊捨入一次，誤差隨區塊數累積。")
    qn = (torch.randn(1, 2, 37, 16, generator=gen) * 0.5 + 8.0).to(device)   # every score near -250
    kn = (torch.randn(1, 2, 45, 16, generator=gen) * 0.5 - 8.0).to(device)
    vn = torch.randn(1, 2, 45, 16, generator=gen).to(device)
    for causal in (False, True):
        o, lse = forward(qn, kn, vn, is_causal=causal)
        o_ref, lse_ref = nb06.attention64(qn, kn, vn, causal)
        name = f"flash_attention_forward: every score near -250 (N = 37, N_k = 45, causal={causal})"
        hint = ("m_i 從 -inf 開始（tl.full([BLOCK_M], float(\"-inf\"), tl.float32)），不是 0；rowmax 在 tl.where(keep, s, -inf) 之後取"
                "（遮罩外的鍵讀成 0，分數 0 比每個真的分數都大）。否則所有分數都很負時 exp2(s - m) 全部下溢成 0，l = 0。")
        grading.check_tensor(o.double(), o_ref, name=name + ": o", atol=1e-3, hint=hint)
        grading.check_tensor(lse.double(), lse_ref, name=name + ": lse", atol=1e-3, hint=hint)


def forward_grid_and_reads(forward, fwd_kernel, device, offsets_hint: str = "") -> None:
    """The grid follows the tuned BLOCK_M (one forward, N = 40, with fwd_kernel's only config swapped for 16 x 32); in
    the interpreter: causal tiles skipped at N = 256 (<= 85% of the non-causal loads), the padded query rows of
    N = 40 not read, and 64-bit head offsets (fwd_kernel launched by hand with the head's program id past 2^23)."""
    gen = torch.Generator().manual_seed(22)
    saved_configs = fwd_kernel.configs
    try:
        fwd_kernel.configs = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32})]
        qg, kg, vg = (torch.randn(1, 1, 40, 16, generator=gen).to(device) for _ in range(3))
        with contract.new_memory_reads_nan():                               # rows left unwritten read NaN
            og, _ = forward(qg, kg, vg)
    finally:
        fwd_kernel.configs = saved_configs
    grading.check_tensor(og.double(), nb06.attention64(qg, kg, vg, False)[0], name="flash_attention_forward: tuned BLOCK_M = 16, BLOCK_N = 32 (N = 40): o",
                         atol=1e-5, hint="網格跟著自動調校選的區塊走：grid = lambda meta: (triton.cdiv(N, meta[\"BLOCK_M\"]), BH)；"
                                         "不要把直譯器的 32 寫死（GPU 上選的是 64 或 128）。")
    qs, ks, vs = (torch.randn(1, 1, 256, 16, device=device) for _ in range(3))
    nb06.causal_tiles_skipped(lambda causal: forward(qs, ks, vs, is_causal=causal), ratio=0.85,
                              name="flash_attention_forward: causal tiles skipped",
                              detail="因果時讀了 {causal} 個元素，非因果 {plain} 個（比例 {share:.2f}）。",
                              hint="對角線右上方完全看不見的 K/V 區塊不要讀：迴圈的上界是 _key_range 的 hi，不是 N_K。")
    q, k, v = (torch.randn(1, 1, 40, 16, device=device) for _ in range(3))
    if tritonmode.current() == "interpreter":   # N = N_k = 40 (not a multiple of BLOCK_M): padded query rows not read
        bm = fwd_kernel.configs[0].kwargs["BLOCK_M"]                           # the interpreter's only config
        with tritonmode.loaded_elements() as count:
            forward(q, k, v)
        need = 40 * 16 + triton.cdiv(40, bm) * 2 * 40 * 16                    # q once; K and V once per query tile
        grading.check_true(count["elements"] <= need, name="flash_attention_forward (N = 40): padded query rows not read",
                           detail=f"讀了 {count['elements']} 個元素；q 只讀 N 以內的列、每個查詢區塊讀 K 與 V 各一次是 {need} 個。",
                           hint="最後一個查詢區塊補出來的列（offs_m >= N_Q）不要讀：q 的 tl.load 要 mask=offs_m[:, None] < N_Q, other=0.0"
                                "（最後一個 head 的這些列在張量之外；GPU 上是越界讀取）。")
    q, k, v = (torch.randn(1, 20, 16, device=device) for _ in range(3))
    o, lse = torch.empty_like(q), torch.empty(1, 20, device=device)
    nb06.head_offsets_64bit(
        lambda: fwd_kernel[lambda meta: (triton.cdiv(20, meta["BLOCK_M"]), 1)](q, k, v, o, lse, 0.25 * nb06.LOG2E, 20, 20,
                                                                               HEAD_DIM=16, CAUSAL=True, PREC="ieee"),
        (q, k, v, o, lse), name="_fwd_kernel: 64-bit head offsets (bh past 2^23, N = 20, d = 16)",
        detail="head 編號 2^23 起（bh * N * d 超過 2^31），核心裡有 {overflows} 個 int32 加減乘的結果溢位。",
        hint=offsets_hint)


def forward_own_code_compiles(forward, device) -> None:
    """forward calls no SDPA / softmax / labkit; its kernels compile for sm80 and sm90 with no TF32 for fp32 inputs."""
    grading.check_own_code(forward, name="flash_attention_forward: your own kernel",
                           forbid=(F.scaled_dot_product_attention, torch.softmax, torch.Tensor.softmax, F.softmax))
    q, k, v = (torch.randn(1, 1, 40, 16, device=device) for _ in range(3))
    nb06.compiles_without_tf32(lambda: forward(q, k, v, is_causal=True), name="flash_attention_forward",
                               hint='fp32 輸入時啟動核心要傳 PREC="ieee"，而且每個 tl.dot 都要寫 input_precision=PREC（不寫時 GPU 對 fp32 的預設就是 TF32）。'
                                    "直譯器用 numpy 精確相乘，看不出差別，所以這一關檢查編譯出的 GPU 程式碼。")
