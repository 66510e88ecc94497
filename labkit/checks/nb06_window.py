"""Visible tests of 06_triton_flashattention's GQA with a sliding window (ex5): values against a float64 reference
that repeats K/V per group and masks the window, K/V not repeated in memory, scores near -250, 64-bit head offsets,
PREC for fp32, bf16 and fp16 by the 2x rule, and only the key tiles inside the window read.

Used in: 06_triton_flashattention (test cells of ex5)
"""
from __future__ import annotations

import torch

from labkit.checks import contract, nb06
from labkit.core import grading
from labkit.engine import attention
from labkit.tritonlab import bounds as tritonbounds, compile as tritoncompile, mode as tritonmode

RULE_GQA = "m、l、acc 以 fp32 累加（_fwd_tile），o 存成 q 的 dtype、lse 存成 fp32"
CASES = [(4, 2, 50, 100, False, None), (4, 1, 60, 120, True, 10), (4, 2, 40, 72, False, 9), (2, 1, 36, 20, True, 4),
         (4, 2, 40, 20, False, None),    # no window, N - 1 > N_k: a query sees keys up to N - 1 after it
         (2, 1, 64, 65, True, 8),        # the last row's own key starts a key tile (hi)
         (2, 1, 64, 72, True, 25)]       # the first row's leftmost key ends a key tile (lo)
CONTRACT_CASE = 3   # the case also run on transposed views and with block_m = 64, block_n = 32 (a small one, N < 64)


def window_mask(n: int, nk: int, causal: bool, window, device=None) -> torch.Tensor:
    """keep [N, N_k]: query i (at position i + N_k - N) sees key j when |pos - j| <= window and, causal, j <= pos."""
    pos = torch.arange(n, device=device)[:, None] + (nk - n)
    j = torch.arange(nk, device=device)[None, :]
    keep = torch.ones(n, nk, dtype=torch.bool, device=device)
    if window is not None:
        keep &= (pos - j).abs() <= window
    if causal:
        keep &= j <= pos
    return keep


def gqa_window_reference(q, k, v, causal, window, dtype=torch.float64):
    """Attention in ``dtype`` with K/V [B, Hkv, N_k, d] repeated per group of q [B, Hq, N, d] and the window mask."""
    group = q.shape[1] // k.shape[1]
    k, v = k.to(dtype).repeat_interleave(group, dim=1), v.to(dtype).repeat_interleave(group, dim=1)
    keep = window_mask(q.shape[-2], k.shape[-2], causal, window, q.device)
    return attention.reference_attention(q.to(dtype), k, v, mask=keep)


def _views_and_block_sizes(gqa, q, k, v, causal, window, want) -> None:
    """gqa on transposed views of q, k, v (views left unchanged), on k and v as the first d columns of a wider buffer
    (a fused KV tensor's slices: a reshape keeps them views), then with block_m = 64, block_n = 32 and block_m = 16,
    block_n = 64, new tensors starting as NaN (rows a hard-coded BLOCK_M or grid leaves unwritten show): all give
    ``want`` (o, lse)."""
    contract.check_views_once(gqa, q, k, v, name="attention_gqa_window", want=want, is_causal=causal, window=window)
    sliced = gqa(q, contract.padded_rows(k), contract.padded_rows(v), is_causal=causal, window=window)
    for what, got, right in zip(("o", "lse"), sliced, want):
        grading.check_tensor(got, right, atol=1e-5, hint=contract.VIEW_HINT,
                             name=f"attention_gqa_window：k、v 是較寬緩衝區的切片（kv[..., :d]，不連續）: {what}")
    for block_m, block_n in ((64, 32), (16, 64)):
        with contract.new_memory_reads_nan():                             # rows left unwritten read NaN
            o_b, lse_b = gqa(q, k, v, is_causal=causal, window=window, block_m=block_m, block_n=block_n)
        for what, got, right in zip(("o", "lse"), (o_b, lse_b), want):
            grading.check_tensor(got, right, atol=1e-5,
                                 name=f"attention_gqa_window: block_m = {block_m}, block_n = {block_n} (N = {q.shape[-2]}): {what}",
                                 hint="block_m、block_n 是參數：網格 triton.cdiv(N, block_m) 與核心的 BLOCK_M=block_m、BLOCK_N=block_n "
                                      "都用它們，不要寫死 32、16（BLOCK_M 寫死 32、網格用 block_m = 64 時，每個查詢區塊的後半列沒有寫；"
                                      "網格寫死 cdiv(N, 32)、block_m = 16 時也是）。")


def gqa_window_values(gqa, device) -> None:
    """gqa(q, k, v, is_causal, window) -> (o, lse) for each of CASES (Hq, Hkv, N, N_k, causal, window; B = 2, d = 16):
    accesses inside the tensors, the kernel launched, K/V not repeated, no NaN, o and lse vs float64 (atol 1e-5); case
    CONTRACT_CASE also on transposed views of q, k, v (same answer, views unchanged) and with block_m = 64, block_n = 32
    (freed memory filled with NaN first: rows left unwritten show)."""
    torch.manual_seed(11)
    for hq, hkv, n, nk, causal, window in CASES:
        q = torch.randn(2, hq, n, 16, device=device)
        k, v = (torch.randn(2, hkv, nk, 16, device=device) for _ in range(2))
        with tritonmode.launches() as launched, nb06.LargestNewTensor() as created, tritonbounds.outside_accesses() as outside:
            o, lse = gqa(q, k, v, is_causal=causal, window=window)
        name = f"attention_gqa_window: Hq={hq}, Hkv={hkv}, N={n}, Nk={nk}, causal={causal}, window={window}"
        tritonbounds.check_inside(outside, name=name + ": loads and stores inside the tensors",
                                  hint="視窗邊緣與尾端的區塊：K、V 的載入用 mask=offs_n < N_K，Q 與 O、LSE 用 offs_m < N_Q。")
        grading.check_true(launched["_fwd_gqa_window_kernel"] >= 1, name=name + ": kernel launched",
                           detail=f"啟動紀錄：{dict(launched)}。")
        grading.check_true(n > nk or created.largest < 2 * hq * nk * 16, name=name + ": K/V not repeated",
                           detail=f"建立了 {created.largest} 個元素的張量；複製後的 K 是 {2 * hq * nk * 16}。",
                           hint="不要 repeat_interleave / expand().contiguous()：核心裡用 bh // GROUP 找 K/V head。")
        o_ref, lse_ref = gqa_window_reference(q, k, v, causal, window)
        grading.check_true(not o.isnan().any(), name=name + ": no NaN", detail="o 有 NaN。",
                           hint="看不到任何鍵的列：_fwd_tile 的 m_new 換成 0，_fwd_store 在 l = 0 時寫 O = 0、LSE = -inf。")
        grading.check_tensor(o.double(), o_ref, name=name + ": o", atol=1e-5,
                             hint="K/V head = bh // GROUP；視窗：|pos - j| <= window，pos = i + (Nk - N)；"
                                  "非因果時右側也有 window 個鍵，因果時右側到 pos 為止。window=None 是看得見全部的鍵：非因果時查詢 i "
                                  "與鍵 j 的距離最多是 max(N, Nk) - 1（pos 可以是負的），所以不能用 Nk 當成「沒有視窗」（預設用 N + Nk）。")
        grading.check_tensor(lse.double(), lse_ref, name=name + ": lse", atol=1e-5)
        if (hq, hkv, n, nk, causal, window) == CASES[CONTRACT_CASE]:
            _views_and_block_sizes(gqa, q, k, v, causal, window, want=(o, lse))


def gqa_window_precision(gqa, kernel, device, offsets_hint: str = "") -> None:
    """fp32 scores near -250 (GQA, causal window 20: o and lse, atol 1e-3); 64-bit head offsets (kernel launched by
    hand with the query head's program id past 2^24, interpreter); fp32 inputs launch with PREC="ieee"; bf16 and fp16
    inputs (Hq = 4, Hkv = 2, causal window 16, N = 70, N_k = 90, d = 32): o in q's dtype, lse fp32, both by the 2x rule."""
    gen = torch.Generator().manual_seed(25)
    qn = (torch.randn(1, 4, 37, 16, generator=gen) * 0.5 + 8.0).to(device)
    kn = (torch.randn(1, 2, 45, 16, generator=gen) * 0.5 - 8.0).to(device)
    vn = torch.randn(1, 2, 45, 16, generator=gen).to(device)
    o, lse = gqa(qn, kn, vn, is_causal=True, window=20)
    o_ref, lse_ref = gqa_window_reference(qn, kn, vn, True, 20)
    for what, got, want in (("o", o, o_ref), ("lse", lse, lse_ref)):
        grading.check_tensor(got.double(), want, name=f"attention_gqa_window: every score near -250 (causal, window 20): {what}",
                             atol=1e-3, hint="m_i 從 -inf 開始（tl.full([BLOCK_M], float(\"-inf\"), tl.float32)），不是 0；_fwd_tile 遇到這一列還沒看過任何鍵的區塊"
                                             "（視窗左邊的區塊）時，平移量用 0，但回傳的 m 仍是 -inf，不是 0：否則所有分數都很負時 "
                                             "exp2(s - 0) 全部下溢成 0，l = 0。")
    qs, ks, vs = (torch.randn(1, 20, 16, device=device) for _ in range(3))
    os_, lses = torch.empty_like(qs), torch.empty(1, 20, device=device)
    nb06.head_offsets_64bit(
        lambda: kernel[(1, 1)](qs, ks, vs, os_, lses, 0.25 * nb06.LOG2E, 20, 20, 2, 4, HEAD_DIM=16, CAUSAL=True,
                               PREC="ieee", BLOCK_M=32, BLOCK_N=16), (qs, ks, vs, os_, lses), pid=2**24,
        name="_fwd_gqa_window_kernel: 64-bit head offsets (bh past 2^24)",
        detail="查詢 head 編號 2^24 起（bh * N * d 與 kv * N_k * d 都超過 2^31），核心裡有 {overflows} 個 int32 加減乘的結果溢位。",
        hint=offsets_hint)
    q, k, v = (torch.randn(1, 2, 20, 16, device=device) for _ in range(3))
    with tritoncompile.recorded() as launches:
        gqa(q, k[:, :1].contiguous(), v[:, :1].contiguous(), is_causal=True, window=4)
    precs = sorted({str(launch.args.get("PREC")) for launch in launches if launch.kernel == "_fwd_gqa_window_kernel"})
    grading.check_true(precs == ["ieee"], name="attention_gqa_window: fp32 inputs launch with PREC=\"ieee\"",
                       detail=f"fp32 輸入時 _fwd_gqa_window_kernel 以 PREC = {precs} 啟動；GPU 上 \"tf32\" 讓 tl.dot 只用 10 位元尾數相乘。",
                       hint='PREC="ieee" if q.dtype == torch.float32 else "tf32"（同練習 2）。')
    torch.manual_seed(16)
    for dtype in grading.LOW_PRECISION:
        ql = torch.randn(1, 4, 70, 32, device=device).to(dtype)
        kl, vl = (torch.randn(1, 2, 90, 32, device=device).to(dtype) for _ in range(2))
        ol, lsel = gqa(ql, kl, vl, is_causal=True, window=16)
        name = f"attention_gqa_window: {str(dtype)[6:]} inputs, Hq=4, Hkv=2, causal window 16"
        grading.check_true(isinstance(ol, torch.Tensor) and ol.dtype == dtype and lsel.dtype == torch.float32,
                           name=name + ": o in q's dtype, lse fp32",
                           detail=f"o 應為 {dtype}、lse 應為 fp32；得到 {getattr(ol, 'dtype', type(ol))}、{getattr(lsel, 'dtype', type(lsel))}。",
                           hint="o = torch.empty_like(q3)（q 的 dtype）；lse 用 dtype=torch.float32；_fwd_store 存 o 前 .to(o_ptr.dtype.element_ty)。")
        o64, lse64 = gqa_window_reference(ql, kl, vl, True, 16)
        o_plain, lse_plain = gqa_window_reference(ql, kl, vl, True, 16, dtype=dtype)
        grading.check_within_2x(ol, o64, o_plain, name=name + ": o", rule=RULE_GQA)
        grading.check_within_2x(lsel, lse64, lse_plain, name=name + ": lse", rule=RULE_GQA)


def window_loads(n, nk, bm, bn, causal, window, d):
    """Load lanes of a kernel that reads, per query tile, only the key tiles its rows can see: q once
    (bm x d) and K, V tiles (bn x d each) from the tile holding start_m + shift - window to the one holding
    start_m + bm - 1 + shift (+ window when not causal), keys clipped to [0, nk)."""
    shift, lanes = nk - n, 0
    for start_m in range(0, n, bm):
        first = max(start_m + shift - window, 0)
        last = min(start_m + bm - 1 + shift + (0 if causal else window), nk - 1)
        lanes += bm * d + (2 * bn * d * (last // bn - first // bn + 1) if last >= first else 0)
    return lanes


def window_tiles_read(kernel, device, range_hint: str = "") -> None:
    """In the interpreter: kernel launched by hand (BLOCK_M = 32, BLOCK_N = 16, d = 16, one head) reads only the key
    tiles inside the window (three shapes, lanes counted), and at N = 40 the last query tile's padded rows are not read."""
    if tritonmode.current() != "interpreter":
        return
    for n, nk, causal, window in ((256, 256, True, 8), (96, 160, False, 20), (64, 100, True, 5)):
        qs, ks, vs = (torch.randn(1, length, 16, device=device) for length in (n, nk, nk))
        os_, lses = torch.empty_like(qs), torch.empty(1, n, device=device)
        with tritonmode.loaded_elements() as count:
            kernel[((n + 31) // 32, 1)](qs, ks, vs, os_, lses, 0.25 * nb06.LOG2E, n, nk, 1, window, HEAD_DIM=16,
                                        CAUSAL=causal, PREC="ieee", BLOCK_M=32, BLOCK_N=16)
        need = window_loads(n, nk, 32, 16, causal, window, 16)
        grading.check_true(count["lanes"] <= need,
                           name=f"_fwd_gqa_window_kernel (N={n}, N_k={nk}, causal={causal}, window={window}): "
                                "only the key tiles inside the window read",
                           detail=f"讀取了 {count['lanes']} 個位置（含遮罩掉的）；只讀視窗內的 K/V 區塊時是 {need} 個。",
                           hint=range_hint)
    n, nk, window = 40, 56, 12   # N = 40 (not a multiple of BLOCK_M = 32): padded query rows neither read nor written
    qs, ks, vs = (torch.randn(1, length, 16, device=device) for length in (n, nk, nk))
    with tritonmode.loaded_elements() as count:
        kernel[(2, 1)](qs, ks, vs, torch.empty_like(qs), torch.empty(1, n, device=device), 0.25 * nb06.LOG2E, n, nk,
                       1, window, HEAD_DIM=16, CAUSAL=True, PREC="ieee", BLOCK_M=32, BLOCK_N=16)
    need = 0
    for start_m in (0, 32):          # q's rows inside N, and the key tiles [lo, hi) rounded out to whole tiles, within N_k
        first = max(start_m + nk - n - window, 0) // 16 * 16
        last = min(-(-min(start_m + 32 + nk - n, nk) // 16) * 16, nk)
        need += min(32, n - start_m) * 16 + 2 * 16 * max(0, last - first)
    grading.check_true(count["elements"] <= need,
                       name=f"_fwd_gqa_window_kernel (N={n}, N_k={nk}, causal, window={window}): padded query rows not read",
                       detail=f"讀了 {count['elements']} 個元素；q 只讀 N 以內的列、K/V 只讀視窗內的區塊是 {need} 個。",
                       hint="最後一個查詢區塊補出來的列（offs_m >= N_Q）不要讀：q 的 tl.load 要 mask=offs_m[:, None] < N_Q"
                            "（同練習 2；最後一個 head 的這些列在張量之外）。")
