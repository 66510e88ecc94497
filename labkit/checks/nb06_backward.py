"""Visible tests of 06_triton_flashattention's backward kernels (ex3): _query_range alone (through a probe kernel
that takes it as a constexpr argument), padded rows neither read nor stored, dV, dK, dQ in stages against float64
autograd, precision (Triton IR, the 2x rule, D in fp32), the grids, tiles skipped and 64-bit head offsets.

Used in: 06_triton_flashattention (test cells of ex3)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from labkit.checks import contract, nb06
from labkit.core import grading
from labkit.engine import attention
from labkit.tritonlab import bounds as tritonbounds, compile as tritoncompile, mode as tritonmode

RULE_BWD = "D = rowsum(dO ∘ O)、dK、dV、dQ 以 fp32 計算與累加（只在 tl.dot 之前把 P、dS 轉成輸入的 dtype），存回時才轉型"
QUERY_RANGE_CASES = [(100, 100, 16, 32, False), (100, 100, 16, 32, True), (40, 100, 16, 32, True), (100, 40, 16, 32, True),
                     (63, 64, 16, 32, True), (63, 64, 16, 16, True), (65, 64, 16, 16, True)]   # (N, N_k, BM, BN, causal)
CAUSES = {  # gradient -> where it comes from
    "dv": "dV = Σ P^T dO（_bwd_dkdv_kernel）：P^T = 2^(K Q^T * qk_scale - lse2)，lse2 = lse * log2(e)（前處理）；遮罩用 tl.where。",
    "dk": "dV 已經對了，看 dS：dK = sm_scale * Σ dS^T Q，dS = P ∘ (dP - D)，dP = dO V^T，D = rowsum(dO ∘ O)（前處理）。",
    "dq": "dK、dV 已經對了，看 _bwd_dq_kernel：鍵的範圍用 _key_range，dQ = sm_scale * Σ dS K，對角線與尾端區塊要遮罩。",
}
STAGES = [  # (what, leading dims, N, N_k, causal, the likely causes at this stage)
    ("whole tiles: N = N_k = 64, non-causal", (1, 2), 64, 64, False,
     "讀取：Q^T、K^T 的指標（第 bh 個 head 從 bh * N * d 開始），迴圈走過所有查詢（或鍵）區塊。"),
    ("a tail tile: N = N_k = 100, non-causal", (1, 2), 100, 100, False,
     "尾端：越界的列與鍵用 mask 讀成 0（Q、dO、lse2、D 的越界列，K、V 的越界鍵），存回時也要遮罩；dQ 核心的尾端區塊分數要設成 0。"),
    ("causal, N = N_k = 100", (1, 2), 100, 100, True,
     "對角線區塊要遮罩：P 在 j > i + (N_K - N_Q) 的位置設成 0（dK/dV 核心的 [lo, mid)、dQ 核心的 [mid, hi)）。"),
    ("causal, N = 40 < N_k = 100", (1, 2), 40, 100, True,
     "右下對齊：查詢 i 看得見 j <= i + (N_K - N_Q)；j <= i 是左上對齊（只在 N = N_k 時相同）。兩個核心的遮罩都要檢查。"),
    ("causal, N = 100 > N_k = 40", (1, 2), 100, 40, True,
     "前 60 列看不到任何鍵（lse = -inf）：P = 2^(S * qk_scale - lse2) 是 +inf，要用 tl.where 設成 0（乘以遮罩會得到 inf * 0 = NaN），"
     "而且在乘上 dO 之前；右下對齊。"),
    ("causal, N = 63, N_k = 64", (1, 2), 63, 64, True,
     "N_k - N = 1：每個查詢區塊的最後一列看得見下一個 K 區塊的第一個鍵；_query_range 的 lo 不要 +1，_key_range 的 hi 不要 -1。"),
]


def _query_tiles(got: list, n: int, nk: int, bm: int, bn: int, causal: bool) -> list[dict]:
    """Per key tile: what (lo, mid) it got and the bounds its rules allow."""
    tiles = []
    for tile, (lo, mid) in enumerate(got):
        first_key, last_key = tile * bn, min(tile * bn + bn, nk) - 1
        first_row = max(0, first_key - (nk - n))          # the first query that sees key first_key
        tiles.append(dict(lo=lo, mid=mid, first_key=first_key, last_key=last_key, first_row=first_row,
                          start=first_row // bm * bm,                         # the query tile holding it
                          all_row=max(0, last_key - (nk - n)),                # from here on every key is seen
                          upper=min(-(-max(0, first_key + bn - 1 - (nk - n)) // bm) * bm, n),
                          name=f"_query_range(N={n}, N_k={nk}, BLOCK_M={bm}, BLOCK_N={bn}, causal={causal}), "
                               f"keys {first_key}..{last_key}"))
    return tiles


def query_range_rules(query_range, device, cases=QUERY_RANGE_CASES) -> None:
    """(lo, mid) of query_range for every key tile of each (N, N_k, BLOCK_M, BLOCK_N, causal) against the rules of its
    docstring: first what makes the gradients wrong (a needed query tile dropped, a mask left out), then the work left
    undone."""
    align = ("右下對齊：查詢 i 看得見 j <= i + (N_K - N_Q)，所以 lo = max(start_n - (N_K - N_Q), 0) 向下取到 BLOCK_M 的倍數"
             "（不要 +1；核心裡的 // 向零取整：先 tl.maximum(x, 0) 再除）。")
    for n, nk, bm, bn, causal in cases:
        tiles = _query_tiles(nb06.tile_ranges(query_range, n, nk, bm, bn, causal, device, per_key_tile=True), n, nk, bm, bn, causal)
        for t in tiles if not causal else ():
            grading.check_true((t["lo"], t["mid"]) == (0, 0), name=t["name"] + ": non-causal",
                               detail=f"得到 (lo, mid) = ({t['lo']}, {t['mid']})。",
                               hint="非因果：每個查詢區塊都看得見每個鍵，不遮罩：(lo, mid) = (0, 0)。")
        for t in tiles if causal else ():
            grading.check_true(t["lo"] <= t["start"], name=t["name"] + ": no needed query tile dropped",
                               detail=f"得到 lo = {t['lo']}；第一個看得見鍵 {t['first_key']} 的查詢是第 {t['first_row']} 列，"
                                      f"它所在的查詢區塊從 {t['start']} 開始。", hint="lo 太大：漏掉了看得見這些鍵的查詢區塊。" + align)
            grading.check_true(t["mid"] >= max(t["lo"], t["all_row"]) and (t["mid"] % bm == 0 or t["mid"] >= n),
                               name=t["name"] + ": mid", detail=f"得到 mid = {t['mid']}；從 mid 起不遮罩，所以每一列都要看得見鍵 "
                               f"{t['first_key']}..{t['last_key']}：mid >= {t['all_row']}，且是 BLOCK_M 的倍數（或 N_Q）。",
                               hint="mid = start_n + BLOCK_N - 1 - (N_K - N_Q)（先 tl.maximum(x, 0)），向上取到 BLOCK_M 的倍數："
                                    "(x + BLOCK_M - 1) // BLOCK_M * BLOCK_M，不超過 N_Q。右下對齊：j <= i + (N_K - N_Q)。")
        for t in tiles if causal else ():
            grading.check_true(t["lo"] >= t["start"], name=t["name"] + ": causal tiles skipped",
                               detail=f"得到 lo = {t['lo']}；第 {t['start']} 列之前的查詢一個鍵都看不到。",
                               hint="lo 之前的查詢區塊要整塊略過（只遮罩不略過，FLOP 一點都沒少）。" + align)
            grading.check_true(t["mid"] <= max(t["upper"], t["lo"]), name=t["name"] + ": whole tiles left unmasked",
                               detail=f"得到 mid = {t['mid']}；從 {t['upper']} 起的查詢區塊已經看得見整個鍵區塊，不需要遮罩。",
                               hint="[lo, mid) 只放對角線的查詢區塊。" + align)


def gradients64(q, k, v, do, causal):
    """o and lse (fp32, from a float64 reference) and the float64 gradients (dq, dk, dv) by autograd."""
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    o64, lse64 = attention.reference_attention(q64, k64, v64, causal=causal)
    return o64.float().detach(), lse64.float().detach(), torch.autograd.grad(o64, (q64, k64, v64), do.double())


def _in_room(t):
    """t [1, R, ...] copied into a buffer with spare rows after it (the view): a read past its rows stays in the buffer."""
    return grading.with_spare_rows(t[0], spare=128)[1][None]


def _launchers(kernels: tuple, q, k, v, o, do, lse, delta, lse2, dq, dk, dv) -> dict:
    """kernel name -> a launch by hand (N = N_k = 20, d = 16, one head) of (preprocess, dkdv, dq) ``kernels``."""
    preprocess, dkdv, dq_kernel = kernels
    args = dict(qk_scale=16 ** -0.5 * nb06.LOG2E, sm_scale=16 ** -0.5, N_Q=20, N_K=20, HEAD_DIM=16, CAUSAL=False, PREC="ieee")
    return {"_bwd_preprocess": lambda: preprocess[(1, 1)](o, do, lse, delta, lse2, 20, HEAD_DIM=16, BLOCK_M=64),
            "_bwd_dkdv_kernel": lambda causal=False: dkdv[lambda meta: (triton.cdiv(20, meta["BLOCK_N"]), 1)](
                q, k, v, do, lse2, delta, dk, dv, **{**args, "CAUSAL": causal}),
            "_bwd_dq_kernel": lambda causal=False: dq_kernel[lambda meta: (triton.cdiv(20, meta["BLOCK_M"]), 1)](
                q, k, v, do, lse2, delta, dq, **{**args, "CAUSAL": causal})}


def padded_rows_backward(kernels: tuple, device) -> None:
    """kernels = (_bwd_preprocess, _bwd_dkdv_kernel, _bwd_dq_kernel) launched by hand on one head, N = N_k = 20 (part
    of one tile), before any other backward: inputs and outputs in buffers with spare rows; the padded rows of Q, dO,
    lse2, D and the padded keys of K, V are neither read nor stored (an unmasked store would corrupt memory)."""
    torch.manual_seed(6)
    q, k, v, do = (_in_room(torch.randn(1, 20, 16, device=device)) for _ in range(4))
    o, lse = (_in_room(t) for t in gradients64(q, k, v, do, False)[:2])
    rooms, outs = {}, {}
    for what, shape in (("delta", (1, 20)), ("lse2", (1, 20)), ("dk", (1, 20, 16)), ("dv", (1, 20, 16)), ("dq", (1, 20, 16))):
        rooms[what], out = grading.with_spare_rows(torch.empty(20, *shape[2:], device=device), spare=128)
        outs[what] = out.view(shape)
    launch = _launchers(kernels, q, k, v, o, do, lse, outs["delta"], outs["lse2"], outs["dq"], outs["dk"], outs["dv"])
    for kernel, run in launch.items():   # the interpreter: every load and store (the ones past the end are skipped)
        with tritonbounds.outside_accesses() as seen:
            run()
        tritonbounds.check_inside(seen, name=f"{kernel}（N = N_k = 20，不滿一個區塊）：補出來的列與鍵不讀也不寫",
                                  hint="tl.load 與 tl.store 都要遮罩：Q、dO、lse2、D、dQ 的列用 offs_m < N_Q，K、V、dK、dV 的鍵用 "
                                       "offs_n < N_K（讀用 other=0.0）。補出來的列不屬於任何查詢（或鍵）：讀進來數值上看不出來，"
                                       "寫出去會蓋掉別的資料；在 GPU 上，最後一個 head 的這些位址在張量之外（非法記憶體存取）。")
    where = {"delta": ("_bwd_preprocess", "mask=rows（offs_m < N_Q）"), "lse2": ("_bwd_preprocess", "mask=rows（offs_m < N_Q）"),
             "dk": ("_bwd_dkdv_kernel", "mask=keys（offs_n[:, None] < N_K）"), "dv": ("_bwd_dkdv_kernel", "mask=keys（offs_n[:, None] < N_K）"),
             "dq": ("_bwd_dq_kernel", "mask=rows[:, None]（offs_m < N_Q）")}
    for what, (kernel, mask) in where.items():   # on a GPU: the spare rows after each output stay untouched
        grading.check_spare_rows(rooms[what], 20, name=f"{kernel}（N = N_k = 20，不滿一個區塊）：補出來的列沒有寫到 {what} 之外",
                                 hint=f"{kernel} 存 {what} 的 tl.store 要 {mask}：最後一個區塊補出來的列不屬於任何查詢（或鍵），"
                                      "寫出去會蓋掉別的資料（在直譯器裡會弄壞記憶體，讓 notebook 的核心當掉）。")


def backward_stages(backward, device) -> None:
    """backward(q, k, v, o, lse, do, is_causal) -> (dq, dk, dv), d = 16, fp32, in the order of STAGES: accesses inside
    the tensors, both kernels launched, then dV, dK, dQ (shape, no NaN, vs float64 autograd, atol 1e-4), no tensor as
    large as [..., N, N_k] built; the first stage once more on transposed views of every input (same gradients, views
    left unchanged)."""
    torch.manual_seed(7)
    for what, lead, n, nk, causal, hint in STAGES:
        q = torch.randn(*lead, n, 16, device=device)
        k, v = (torch.randn(*lead, nk, 16, device=device) for _ in range(2))
        do = torch.randn_like(q)
        o, lse, expected = gradients64(q, k, v, do, causal)
        with tritonmode.launches() as launched, nb06.LargestNewTensor() as created, tritonbounds.outside_accesses() as outside:
            grads = backward(q, k, v, o, lse, do, is_causal=causal)
        name = f"flash_attention_backward ({what})"
        tritonbounds.check_inside(outside, name=name + ": loads and stores inside the tensors",
                                  hint="查詢列（Q、dO、lse2、D、dQ）用 mask=offs_m < N_Q，鍵（K、V、dK、dV）用 offs_n < N_K："
                                       "N 與 N_k 不同時別用錯；越界的儲存在 GPU 上會寫壞別的 head。")
        grading.check_true(launched["_bwd_dkdv_kernel"] >= 1 and launched["_bwd_dq_kernel"] >= 1,
                           name=name + ": _bwd_dkdv_kernel and _bwd_dq_kernel launched",
                           detail=f"啟動紀錄：{dict(launched)}；兩個核心都要啟動。")
        got, want = dict(zip(("dq", "dk", "dv"), grads)), dict(zip(("dq", "dk", "dv"), expected))
        for g in ("dv", "dk", "dq"):
            grading.check_true(isinstance(got[g], torch.Tensor) and got[g].shape == want[g].shape, name=f"{name}: {g} shape",
                               detail=f"{g} 應為 {tuple(want[g].shape)}，得到 {tuple(getattr(got[g], 'shape', ()))}。")
            grading.check_true(not got[g].isnan().any(), name=f"{name}: {g} has no NaN", detail=f"{g} 有 NaN。", hint=hint)
            grading.check_tensor(got[g].double(), want[g], name=f"{name}: {g}", atol=1e-4, hint=CAUSES[g] + " " + hint)
        scores = q.numel() // 16 * nk
        grading.check_true(created.largest < scores, name=name + ": no [..., N, N_k] tensor built",
                           detail=f"建立了 {created.largest} 個元素的張量；[..., N, N_k] 的 P 或 dP 是 {scores} 個。",
                           hint="反向也不建立 N x N_k 的矩陣：D = rowsum(dO ∘ O) 由 _bwd_preprocess 逐列算（不要在主機端用 P ∘ dP 求和），"
                                "P、dP、dS 只在核心裡逐塊重算。")
        if what == STAGES[0][0]:   # once, on the smallest stage: every input as a transposed view, left unchanged
            contract.check_views_once(backward, q, k, v, o, lse, do, name="flash_attention_backward", want=grads,
                                      is_causal=causal)


def _within_2x(backward, q, k, v, do, causal, name, hint) -> None:
    """Each gradient of backward (o and lse from float64) vs float64 autograd: at most 2x that of autograd through
    plain attention in the inputs' dtype, plus the rounding of the exact gradient to that dtype."""
    o64, lse64, expected = gradients64(q, k, v, do, causal)
    qp, kp, vp = (t.clone().requires_grad_() for t in (q, k, v))
    plain = torch.autograd.grad(attention.reference_attention(qp, kp, vp, causal=causal)[0], (qp, kp, vp), do)
    grads = backward(q, k, v, o64.to(q.dtype), lse64, do, is_causal=causal)
    for g, got, want, base in zip(("dv", "dk", "dq"), grads[::-1], expected[::-1], plain[::-1]):
        grading.check_within_2x(got, want, base, name=f"{name}: {g}", rule=RULE_BWD, hint=hint,
                                floor=(want.to(q.dtype).double() - want).abs().max().item())   # rounding the answer itself


def backward_precision(backward, preprocess, device) -> None:
    """bf16 in -> bf16 gradients; the three kernels' Triton IR in fp32 for bf16 and fp16; the 2x rule for bf16 and
    fp16 at N = 70, N_k = 90, d = 32 (causal) and at N = 1024 (64 query tiles), N_k = 32; D from bf16 O and dO in
    fp32 (preprocess launched by hand); the D and lse2 buffers fp32, and the D the dK/dV and dQ kernels read equal to
    fp64 row sums of the bf16 O and dO (not a sum rounded in bf16 on the host); dO not contiguous."""
    qb, kb, vb, dob = (torch.randn(1, 2, 40, 16, device=device).to(torch.bfloat16) for _ in range(4))
    ob, lseb, _ = gradients64(qb, kb, vb, dob, True)
    grads = backward(qb, kb, vb, ob.to(torch.bfloat16), lseb, dob, is_causal=True)
    grading.check_true(all(g.dtype == torch.bfloat16 and g.shape == qb.shape and torch.isfinite(g).all() for g in grads),
                       name="flash_attention_backward: bf16 in, bf16 gradients",
                       detail=f"dq、dk、dv 應為 bf16 {tuple(qb.shape)}；得到 {[(g.dtype, tuple(g.shape)) for g in grads]}。",
                       hint="dq、dk、dv 用 torch.empty_like(輸入)；核心裡 fp32 累加，存回前 .to(dk_ptr.dtype.element_ty)。")
    t16 = lambda dtype: torch.randn(1, 1, 40, 16, device=device).to(dtype)   # noqa: E731 - a tiny input of that dtype
    tritoncompile.check_fp32_statistics(
        lambda: [backward(t16(dtype), t16(dtype), t16(dtype), t16(dtype), t16(torch.float32)[..., 0], t16(dtype),
                          is_causal=True) for dtype in (torch.bfloat16, torch.float16)],
        name="flash_attention_backward: bf16 and fp16 inputs in the compiled Triton IR",
        rule="D、P、dP、dS 與 dK、dV、dQ 的累加器都以 fp32 計算；只有 tl.dot 的運算元（P^T、dS）與存回的梯度轉成輸入的 dtype",
        hint="tl.math.exp2(...) 算出的 P 與 tl.dot 算出的 dP 都是 fp32：先算 dS = P * (dP - D)，再把 P、dS 分別在 tl.dot 裡 .to(輸入的 dtype)；"
             "不要先把 P 或 dP 轉成輸入的 dtype 再拿去計算。")
    torch.manual_seed(14)
    for dtype in grading.LOW_PRECISION:
        ql, dol = (torch.randn(1, 2, 70, 32, device=device).to(dtype) for _ in range(2))
        kl, vl = (torch.randn(1, 2, 90, 32, device=device).to(dtype) for _ in range(2))
        _within_2x(backward, ql, kl, vl, dol, True, f"flash_attention_backward: {str(dtype)[6:]} inputs, N = 70, N_k = 90, "
                   "d = 32, causal", hint="_bwd_preprocess 讀進 O、dO 後先 .to(tl.float32) 再算 D；dk、dv、dq 用 tl.zeros(..., tl.float32)，"
                                          "以 tl.dot(a, b, acc) 累加，存回時才 .to(dk_ptr.dtype.element_ty)。")
    gen = torch.Generator().manual_seed(26)   # D from bf16 O and dO: fp32 sums agree to ~1e-6, bf16 ones are ~1e-2 off
    op, dop = (torch.randn(1, 70, 32, generator=gen).to(torch.bfloat16).to(device) for _ in range(2))
    delta_p, lse2_p = torch.empty(1, 70, device=device), torch.empty(1, 70, device=device)
    preprocess[(triton.cdiv(70, 64), 1)](op, dop, torch.zeros(1, 70, device=device), delta_p, lse2_p, 70, HEAD_DIM=32, BLOCK_M=64)
    grading.check_tensor(delta_p.double(), (op.double() * dop.double()).sum(-1), name="_bwd_preprocess: D from bf16 O and dO (fp32)",
                         atol=1e-4, hint="D 以 fp32 計算與儲存：讀進 O、dO 後先 .to(tl.float32)，tl.sum 在 fp32 中做，"
                                         "存進 fp32 的 delta 之前不要轉成輸入的 dtype。")
    with tritoncompile.recorded() as launched:
        qb = torch.randn(1, 2, 40, 16, device=device).to(torch.bfloat16)
        backward(qb, qb, qb, qb, torch.zeros(1, 2, 40, device=device), qb, is_causal=True)
    rowsum = (qb.double() * qb.double()).sum(-1).reshape(2, 40)   # D = rowsum(dO * O), O = dO = qb here
    for launch in launched:
        for arg in ("delta_ptr", "lse2_ptr"):
            buffer = launch.args.get(arg)
            if isinstance(buffer, torch.Tensor):
                grading.check_true(buffer.dtype == torch.float32,
                                   name=f"flash_attention_backward: {launch.kernel} 的 {arg[:-4]} 緩衝是 fp32（bf16 輸入）",
                                   detail=f"{arg[:-4]} 是 {buffer.dtype}。",
                                   hint="delta 與 lse2 用 torch.empty(bh, n, dtype=torch.float32, device=...) 配置，不是 q 的 dtype"
                                        "（torch.empty_like(q3[..., 0]) 會跟著輸入變成 bf16）：D 與 lse·log2(e) 以 fp32 儲存。")
        delta = launch.args.get("delta_ptr")
        if launch.kernel != "_bwd_preprocess" and isinstance(delta, torch.Tensor) and delta.numel() >= rowsum.numel():
            grading.check_tensor(delta.reshape(2, -1)[:, :40].double(), rowsum, atol=1e-3,
                                 name=f"flash_attention_backward: {launch.kernel} 讀的 D 是 fp32 的列和（bf16 O、dO）",
                                 hint="D = rowsum(dO ∘ O) 由 _bwd_preprocess 以 fp32 算好就直接交給 dK/dV 與 dQ 核心；不要在主機端"
                                      "用 bf16 的 (do3 * o3).sum(-1) 重算或覆寫它（bf16 的和在 16 附近差到 0.06，fp32 差不到 1e-5）。")
    q, k, v = (torch.randn(1, 2, 40, 16, device=device) for _ in range(3))
    do_t = torch.randn(1, 2, 16, 40, device=device).transpose(-1, -2)   # dO not contiguous, as autograd may hand it over
    o_ref, lse_ref, expected = gradients64(q, k, v, do_t.contiguous(), True)
    for g, got, want in zip(("dQ", "dK", "dV"), backward(q, k, v, o_ref, lse_ref, do_t, is_causal=True), expected):
        grading.check_tensor(got.double(), want, name=f"flash_attention_backward: {g}，dO 不連續（轉置的視圖）", atol=1e-5,
                             hint="核心以連續的 [BH, N, d] 定位：dO 也要經過 _as_heads（reshape 之後 .contiguous()），和 q、k、v、o 一樣；"
                                  "autograd 給的 dO 不一定連續（例如 .sum().backward() 給的是 stride 0 的展開）。")
    gen = torch.Generator().manual_seed(24)   # 64 query tiles: fp16 dK, dV accumulated in fp16 are about 4x the allowance
    for dtype in grading.LOW_PRECISION:
        ql, dol = (torch.randn(1, 1, 1024, 32, generator=gen).to(dtype).to(device) for _ in range(2))
        dol = (dol.float() + 1.0).to(dtype)
        kl = torch.randn(1, 1, 32, 32, generator=gen).to(dtype).to(device)
        vl = (torch.randn(1, 1, 32, 32, generator=gen) + 1.0).to(dtype).to(device)
        _within_2x(backward, ql, kl, vl, dol, False, f"flash_attention_backward: {str(dtype)[6:]} inputs, N = 1024 "
                   "(64 query tiles), N_k = 32, d = 32", hint="dk、dv 在整個查詢迴圈裡都是 fp32：tl.dot(a, b, dk) 直接累加進 fp32 的 dk、dv，不要在迴圈裡"
                                                            "（或 _dkdv_stage 回傳時）把它們轉成輸入的 dtype：每塊捨入一次，誤差隨區塊數累積。")


def backward_grids_and_reads(backward, kernels: tuple, device, offsets_hint: str = "") -> None:
    """The grids follow the tuned tiles (one backward, N = 40, with each kernel's BLOCK_M and BLOCK_N swapped); in the
    interpreter: both kernels skip causal tiles at N = 256 (<= 72% of the non-causal loads) and the three kernels use
    64-bit head offsets (launched by hand with the head's program id past 2^23). kernels: (preprocess, dkdv, dq)."""
    _, dkdv, dq_kernel = kernels
    gen = torch.Generator().manual_seed(23)
    qg, kg, vg, dog = (torch.randn(1, 1, 40, 16, generator=gen).to(device) for _ in range(4))
    og, lseg, want = gradients64(qg, kg, vg, dog, False)
    saved_configs = dkdv.configs, dq_kernel.configs
    try:
        dkdv.configs = [triton.Config({"BLOCK_M": 32, "BLOCK_N": 16})]    # each kernel's interpreter tiles swapped
        dq_kernel.configs = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32})]
        with contract.new_memory_reads_nan():                               # rows left unwritten read NaN
            got = backward(qg, kg, vg, og, lseg, dog)
    finally:
        dkdv.configs, dq_kernel.configs = saved_configs
    for g, got_g, want_g in zip(("dq", "dk", "dv"), got, want):
        grading.check_tensor(got_g.double(), want_g, name=f"flash_attention_backward: tuned tiles swapped (dK/dV 32 x 16, dQ 16 x 32; N = 40): {g}", atol=1e-4,
                             hint="網格跟著自動調校選的區塊走：dK/dV 核心 lambda meta: (triton.cdiv(N_k, meta[\"BLOCK_N\"]), BH)，"
                                  "dQ 核心 lambda meta: (triton.cdiv(N, meta[\"BLOCK_M\"]), BH)；不要把直譯器的區塊大小寫死。")
    backward_skips_causal_tiles(backward, device, n=256, d=16, name="flash_attention_backward: causal tiles skipped",
                                detail="因果 {causal} vs 非因果 {plain} 個元素（比例 {share:.2f}）。",
                                hint="dK/dV 核心：查詢迴圈從 _query_range 的 lo 開始（之前的查詢區塊看不到這些鍵）；"
                                     "dQ 核心：鍵迴圈到 _key_range 的 hi 為止。兩個核心都要略過，不是只遮罩。")
    q, k, v, o, do = (torch.randn(1, 20, 16, device=device) for _ in range(5))
    lse, delta, lse2 = (torch.zeros(1, 20, device=device) for _ in range(3))
    dq, dk, dv = (torch.empty_like(q) for _ in range(3))
    launch = _launchers(kernels, q, k, v, o, do, lse, delta, lse2, dq, dk, dv)
    for kernel, run in launch.items():
        nb06.head_offsets_64bit(run if kernel == "_bwd_preprocess" else lambda run=run: run(True),
                                (q, k, v, o, do, lse, delta, lse2, dq, dk, dv),
                                name=f"{kernel}: 64-bit head offsets (bh past 2^23, N = 20, d = 16)",
                                detail=f"head 編號 2^23 起（bh * N * d 超過 2^31），{kernel} 裡有 {{overflows}} 個 int32 加減乘的結果溢位。",
                                hint=offsets_hint)


def backward_skips_causal_tiles(backward, device, *, n: int, d: int, name: str, detail: str, hint: str = "",
                                ratio: float = 0.72) -> None:
    """In the interpreter: a causal backward at N = N_k = n loads at most ``ratio`` of a non-causal one's elements."""
    qs, ks, vs, dos = (torch.randn(1, 1, n, d, device=device) for _ in range(4))

    def run(causal):
        os_, lses, _ = gradients64(qs, ks, vs, dos, causal)
        backward(qs, ks, vs, os_, lses, dos, is_causal=causal)

    nb06.causal_tiles_skipped(run, ratio=ratio, name=name, detail=detail, hint=hint)


def backward_own_code_compiles(backward, device) -> None:
    """backward calls no autograd / SDPA / softmax / labkit; its kernels compile for sm80 and sm90 with no TF32 (fp32)."""
    grading.check_own_code(backward, name="flash_attention_backward: your own kernels",
                           forbid=(torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward,
                                   F.scaled_dot_product_attention, torch.softmax, torch.Tensor.softmax))
    q, k, v, do = (torch.randn(1, 1, 40, 16, device=device) for _ in range(4))
    o, lse, _ = gradients64(q, k, v, do, True)
    nb06.compiles_without_tf32(lambda: backward(q, k, v, o, lse, do, is_causal=True), name="flash_attention_backward",
                               hint='fp32 輸入時兩個反向核心都要以 PREC="ieee" 啟動，而且 _dkdv_stage、_dq_stage 裡每個 tl.dot 都要寫 '
                                    "input_precision=PREC（不寫時 GPU 對 fp32 的預設就是 TF32）。直譯器用 numpy 精確相乘，看不出差別，"
                                    "所以這一關檢查編譯出的 GPU 程式碼。")
