"""Visible tests of 10_fp8_attention's exercise 3: the FP8 forward kernel (``fp8_attention``, ``_fp8_fwd_kernel``).

The inputs are FP8 values and descales drawn at random (no quantizer: exercise 1's answer is not in labkit), so the
reference is float64 attention of the DEQUANTIZED inputs (x8 * descale, per tile): the kernel's only rounding left is
P's cast to e4m3 (and fp32 arithmetic, and o's to bf16). :func:`o_bound` turns that into a per-element tolerance.
Tiles: 16 x 16 in the interpreter; on a GPU 64 x 32 (an FP8 ``tl.dot`` compiles only with K >= 32: D and BLOCK_N,
and becomes wgmma only with BLOCK_M >= 64; see :func:`fp8_mma_in_ptx`).

Used in: 10_fp8_attention (test cell of ex3)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from labkit.checks import contract, nb06
from labkit.core import grading
from labkit.fp8 import cast
from labkit.tritonlab import bounds as tritonbounds, compile as tritoncompile, mode as tritonmode

E4M3 = torch.float8_e4m3fn
HALF_SPACING = 2.0 ** -4      # e4m3 normals: 3 mantissa bits, rounding moves x by at most 2^-4 |x|
HALF_SUBNORMAL = 2.0 ** -10   # below 2^-6 the spacing is 2^-9: rounding (or flushing to 0) moves x by <= 2^-10
KERNEL = "_fp8_fwd_kernel"
FORBID = (F.scaled_dot_product_attention, torch.softmax, F.softmax, torch.Tensor.softmax)
CASES = [  # (what, B, Hq, Hkv, N, Nk, D, causal, per_block, p_scale, reverse)
    ("N = 40, Nk = 56, per-block descales, p_scale 256", 1, 4, 2, 40, 56, 32, False, True, 256.0, False),
    ("causal N = 40, Nk = 56, per-tensor descales, p_scale 1, reverse", 1, 4, 2, 40, 56, 32, True, False, 1.0, True),
    ("causal N = 56 > Nk = 40, per-block descales, p_scale 256, reverse", 1, 4, 2, 56, 40, 32, True, True, 256.0, True),
    ("causal N = Nk = 40, B = 2, per-block descales, p_scale 1", 2, 2, 2, 40, 40, 32, True, True, 1.0, False),
]
# run with block_n = 2 block_m (the interpreter's 16 x 16 tiles are square): q's tiles are not k's
WIDE_N_CASE = ("causal N = 40, Nk = 56, block_n = 2 block_m, per-block descales, p_scale 256, reverse",
               1, 4, 2, 40, 56, 32, True, True, 256.0, True)
HINT_MATCH = ("S = tl.dot(q8, k8^T) * (D^-0.5 * log2(e) * q_descale[該查詢區塊] * k_descale[該鍵區塊])；"
              "acc = acc * alpha + tl.dot(P8, v8) * v_descale[該鍵區塊]（先前的 acc 也要乘 alpha）；最後 o = acc / (l * p_scale)。"
              "GQA：查詢 head h 讀 kv head h // (Hq // Hkv)；因果是右下對齊：j <= i + Nk - N。")


def lse_atol() -> float:
    """lse's tolerance: 1e-4 in the interpreter (S in fp32: measured 7e-7); 2e-3 compiled, where the FP8 wgmma adds
    its products with ~14-bit precision (|S| sums ~4 here: ~5e-4; an estimate, not measured on a GPU). lse in log2
    units (x1.44) or without the max is far outside both."""
    return 1e-4 if tritonmode.current() == "interpreter" else 2e-3


def blocks() -> tuple[int, int]:
    """(block_m, block_n) of the checks: 16 x 16 in the interpreter, 64 x 32 compiled (FP8 wgmma: M >= 64, K >= 32)."""
    return (16, 16) if tritonmode.current() == "interpreter" else (64, 32)


def fp8_inputs(B, Hq, Hkv, N, Nk, D, per_block, block_m, block_n, seed=0):
    """Random e4m3 q8 [B, Hq, N, D], k8, v8 [B, Hkv, Nk, D] (|x8| up to 448) and fp32 descales that make the
    dequantized values ~N(0, 1): 0-dim, or per tile [B, H, ceil(n / block)] varying 4x between tiles."""
    gen = torch.Generator().manual_seed(seed)
    dev = tritonmode.device()

    def one(H, n, block):
        x8 = (torch.randn(B, H, n, D, generator=gen) * 100).clamp(-448, 448).to(E4M3)
        shape = (B, H, -(-n // block)) if per_block else ()
        descale = (2.0 ** (torch.rand(shape, generator=gen) * 2 - 1)) / 100
        return x8.to(dev), descale.to(dev)
    (q8, qd), (k8, kd), (v8, vd) = one(Hq, N, block_m), one(Hkv, Nk, block_n), one(Hkv, Nk, block_n)
    return q8, k8, v8, qd, kd, vd


def dequantized(x8, descale, block):
    """x8 * descale in float64, per tile of ``block`` rows when descale is [B, H, tiles]: [B, H, n, D]."""
    d = descale.double().cpu()
    if d.dim():
        d = d.repeat_interleave(block, -1)[..., :x8.shape[2], None]
    return x8.cpu().double() * d


def attention64(q8, k8, v8, qd, kd, vd, causal, block_m, block_n):
    """float64 attention of the dequantized inputs (GQA: kv head h // (Hq // Hkv); bottom-right causal). Returns
    (o, lse, w, v, visible): the weights w [B, Hq, N, Nk], v per query head and the visible keys (bool), for
    :func:`o_bound`."""
    q, k, v = dequantized(q8, qd, block_m), dequantized(k8, kd, block_n), dequantized(v8, vd, block_n)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    n, nk = q.shape[2], k.shape[2]
    visible = torch.ones(n, nk, dtype=torch.bool)
    if causal:
        visible = torch.arange(nk)[None, :] <= torch.arange(n)[:, None] + (nk - n)
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    w = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return w @ v, lse, w, v, visible.expand_as(w)


def o_bound(o64, w, v, visible, p_scale):
    """How far o may be from the float64 answer (per element) when only P's cast rounds.

    The kernel casts P * p_scale (P = exp(s - m) <= 1, m the running max) to e4m3: a normal value moves by at most
    half its spacing, 2^-4 relative; below 2^-6 (subnormal) by at most half of 2^-9, and below 2^-10 it becomes 0:
    2^-10 absolute. Divided by p_scale that is 2^-4 P + 2^-10 / p_scale per key, in units of the running max, and
    at most that after rescaling to the final max (alpha <= 1). o = sum_j P8_j v_j / (l p_scale) with l the exact
    fp32 sum of P (in units of the final max l = 1 / max_j w_j >= 1): |o - o64| <= sum_j (2^-4 w_j
    + 2^-10 / (p_scale l) [j visible]) |v_j|, plus o's rounding to bf16 (2^-9 |o|, taken as 2^-8) and 1% of the
    first term for fp32 arithmetic. So a missing descale (x ~100), p_scale not divided (x 256), a wrong kv head,
    or acc not rescaled by alpha are far outside it; an o whose P was rounded to bf16 instead is inside it
    (:func:`p_cast_in_fp8` tells those apart)."""
    vis = visible.double() * w.amax(-1, keepdim=True) / p_scale   # [j visible] / (p_scale l)
    return (HALF_SPACING * 1.05 * w + HALF_SUBNORMAL * vis) @ v.abs() + 2.0 ** -8 * o64.abs() + 1e-6


def _kept_inside(fp8_attention):
    """``fp8_attention`` whose kernels' loads and stores leave no tensor: the lanes that would are skipped (a wrong
    answer's stray store, e.g. rows past N_Q, would otherwise write into the grader's own memory)."""
    def guarded(*args, **kwargs):
        with tritonbounds.outside_accesses():
            return fp8_attention(*args, **kwargs)
    return guarded


def _run(fp8_attention, what, B, Hq, Hkv, N, Nk, D, causal, per_block, p_scale, reverse, seed=0, tiles=None):
    """One case: (inputs, o, lse) with loads and stores checked inside the tensors; ``tiles`` (block_m, block_n),
    :func:`blocks` by default."""
    bm, bn = tiles or blocks()
    inputs = fp8_inputs(B, Hq, Hkv, N, Nk, D, per_block, bm, bn, seed)
    with tritonbounds.outside_accesses() as outside, contract.new_memory_reads_nan():
        o, lse = fp8_attention(*inputs, causal, p_scale=p_scale, reverse=reverse, block_m=bm, block_n=bn)
    tritonbounds.check_inside(outside, name=f"fp8_attention（{what}）：只讀寫傳入的張量",
                              hint="尾端區塊（N 不是 block 的倍數）：K、V 的載入用 mask=offs_n < N_K，Q 的載入與 O、LSE 的儲存用 offs_m < N_Q。")
    return inputs, o, lse


def own_code(fp8_attention) -> None:
    """fp8_attention is the student's own: no SDPA, softmax of torch or flex_attention, no labkit but lk.fp8cast (the
    cast the exercise gives; :func:`labkit.core.grading.check_own_code` with ``allow``), and it launches
    _fp8_fwd_kernel."""
    from torch.nn.attention.flex_attention import flex_attention

    name = "fp8_attention：自己的 Triton 核心"
    grading.check_own_code(fp8_attention, name=name, forbid=FORBID + (flex_attention,), allow=(cast,))
    with tritonmode.launches() as launched:
        _run(fp8_attention, "一個小例子", 1, 2, 1, 20, 20, 32, False, False, 256.0, False)
    grading.check_true(launched[KERNEL] >= 1, name=name, detail=f"沒有啟動 {KERNEL}（啟動紀錄：{dict(launched)}）。",
                       hint=f"fp8_attention 要以 {KERNEL}[grid](...) 啟動核心。")


def matches_dequantized(fp8_attention, cases=CASES) -> None:
    """Each case of ``cases`` (N not a multiple of the block, Nk != N, D = 32, GQA Hq = 4 over Hkv = 2, causal and
    not, per-tensor and per-block descales, p_scale 1 and 256, both orders) with :func:`blocks`' tiles, then
    :data:`WIDE_N_CASE` with block_n = 2 block_m: shapes and dtypes, o within :func:`o_bound` of float64 attention
    of the dequantized inputs, lse within :func:`lse_atol`."""
    square = blocks()
    wide = (square[0], 2 * square[1])
    for case, (bm, bn) in [(case, square) for case in cases] + [(WIDE_N_CASE, wide)]:
        what, B, Hq, Hkv, N, Nk, D, causal, per_block, p_scale, reverse = case
        inputs, o, lse = _run(fp8_attention, what, B, Hq, Hkv, N, Nk, D, causal, per_block, p_scale, reverse,
                              tiles=(bm, bn))
        name = f"fp8_attention（{what}）"
        grading.check_true(tuple(o.shape) == (B, Hq, N, D) and o.dtype == torch.bfloat16 and lse.dtype == torch.float32
                           and tuple(lse.shape) == (B, Hq, N), name=name + "：形狀與 dtype",
                           detail=f"o 應為 bf16 {(B, Hq, N, D)}、lse 應為 fp32 {(B, Hq, N)}；得到 {o.dtype} {tuple(o.shape)}、"
                                  f"{lse.dtype} {tuple(lse.shape)}。")
        o64, lse64, w, v, visible = attention64(*inputs, causal, bm, bn)
        bound = o_bound(o64, w, v, visible, p_scale)
        err = (o.cpu().double() - o64).abs().nan_to_num(math.inf)
        worst = int((err / bound).flatten().argmax())
        grading.check_true(bool((err <= bound).all()), name=name + "：o 與反量化輸入的 float64 注意力相符", hint=HINT_MATCH,
                           detail=f"最大誤差 {float(err.max()):.3g}；誤差 / 容許值最大 {float(err.flatten()[worst] / bound.flatten()[worst]):.3g}"
                                  "（容許值：P 轉成 e4m3 的捨入，每個鍵 2^-4 P + 2^-10 / p_scale，加上 o 轉 bf16）。")
        grading.check_tensor(lse.cpu(), lse64, name=name + "：lse", atol=lse_atol(),
                             hint="lse = (m + log2(l)) * ln(2)（m 以 log2 為單位，l 是 fp32 的 P 總和，不含 p_scale）；看不到任何鍵的列是 -inf。")


def empty_rows(fp8_attention) -> None:
    """Causal N = 24 > Nk = 16: rows 0..7 see no key, in a query tile whose other rows do (the masked tile is
    visited): o = 0, lse = -inf, no NaN anywhere."""
    _, o, lse = _run(fp8_attention, "因果 N = 24 > Nk = 16", 1, 2, 1, 24, 16, 32, True, False, 256.0, True)
    hint = ("看不到任何鍵的列：m 一直是 -inf，shift 用 0（tl.where(m == -inf, 0, m)）避免 -inf - (-inf) = NaN；"
            "l = 0 時除以 1（o = 0），lse = -inf。")
    grading.check_true(not (o.isnan().any() or lse.isnan().any()), name="fp8_attention：看不到鍵的列沒有 NaN",
                       detail=f"o 或 lse 有 NaN（列：{o.isnan().any(-1).nonzero()[:, -1].unique().tolist()[:8]}）。", hint=hint)
    grading.check_true(bool((o[:, :, :8] == 0).all() and torch.isneginf(lse[:, :, :8]).all()),
                       name="fp8_attention：看不到鍵的列 o = 0、lse = -inf",
                       detail=f"因果 N = 24、Nk = 16：前 8 列看不到任何鍵，得到 lse = {lse[0, 0, :8].tolist()}。", hint=hint)


def causal_tiles_skipped(fp8_attention) -> None:
    """In the interpreter: causal N = Nk = 64 (16 x 16 tiles: 10 of 16 key tiles visible) loads at most 3/4 of the
    elements a non-causal run loads (skipping gives 2/3; masking only, 1)."""
    nb06.causal_tiles_skipped(
        lambda causal: _run(fp8_attention, "N = Nk = 64", 1, 1, 1, 64, 64, 32, causal, False, 256.0, False),
        ratio=0.75, name="fp8_attention：因果時略過對角線之後的區塊",
        detail="因果時載入了 {causal} 個元素，非因果 {plain} 個（{share:.2f}）；略過的話約 2/3。",
        hint="鍵的區塊只走到 hi = min(Nk, start_m + BLOCK_M + Nk - N)：之後的區塊整塊不載入（只遮罩不略過，讀取一點都沒少）。")


def sink_inputs():
    """A sink: 16 equal queries, key 0 scores 8 (v = 0), 127 keys score 0.5 (v = 1), e^-7.5 = 5.5e-4 below the sink:
    each of those P below 2^-10 (rounds to 0 in e4m3) when the running max is the sink's, their sum 7% of the row.
    Exact e4m3 values, descales 1, D = 16 or 32 (compiled)."""
    D = 16 if tritonmode.current() == "interpreter" else 32
    one = torch.tensor(1.0)
    q8 = torch.full((1, 1, 16, D), 16 / D).to(E4M3)            # s_j = D^-0.5 * sum_d q k_j = 4 k_j (D = 16)
    k = torch.full((1, 1, 128, D), 0.125 * math.sqrt(D) / 4)
    k[:, :, 0] = 2.0 * math.sqrt(D) / 4
    v = torch.ones(1, 1, 128, D)
    v[:, :, 0] = 0.0
    dev = tritonmode.device()
    return tuple(t.to(dev) for t in (q8, k.to(E4M3), v.to(E4M3), one, one, one))


def _sink_error(fp8_attention, p_scale, reverse) -> float:
    bm, bn = blocks()
    inputs = sink_inputs()
    o, _ = _kept_inside(fp8_attention)(*inputs, False, p_scale=p_scale, reverse=reverse, block_m=bm, block_n=bn)
    o64 = attention64(*inputs, False, bm, bn)[0]
    return float((o.cpu().double() - o64).abs().max())


def reverse_and_p_scale(fp8_attention) -> None:
    """The sink input (:func:`sink_inputs`): forward with p_scale 1 loses the 127 keys (error ~0.07); reverse=True
    walks them before the sink, with their own running max, so its error is under a quarter of that; so does
    forward with p_scale 256 (P * 256 ~ 0.14, a normal e4m3 value)."""
    lost = _sink_error(fp8_attention, 1.0, False)
    for what, err, hint in (
            ("reverse=True 真的倒著走", _sink_error(fp8_attention, 1.0, True),
             "reverse=True：j = n_tiles - 1 - t，從最後一個看得見的鍵區塊走回第 0 塊，讓 sink 最後才進來。"),
            ("p_scale 真的放大了 P", _sink_error(fp8_attention, 256.0, False),
             "P8 = to_e4m3(p * p_scale)：先乘 p_scale 再轉型，最後 o = acc / (l * p_scale)。")):
        grading.check_true(lost > 0.03 and err <= lost / 4, name=f"fp8_attention：{what}（sink 輸入）", hint=hint,
                           detail=f"sink 之外的 127 個鍵各自的 P ~ 5.5e-4（低於 e4m3 的 2^-10，轉型後成為 0），合起來占 7%；"
                                  f"順向、p_scale = 1 的誤差 {lost:.3g}，這次 {err:.3g}（應在其 1/4 以內）。")


def p_cast_in_fp8(fp8_attention) -> None:
    """One 16 x 16 tile (random scores, p_scale 256): o equals a model of the kernel with P * p_scale cast to e4m3
    (fp32 scores, exp2, sum; o to bf16) within o's bf16 rounding; a model with P rounded to bf16 differs from it by
    more than that on this input (an FP8 kernel must round P to e4m3, not keep it more precise)."""
    bm, bn = blocks()
    q8, k8, v8, qd, kd, vd = fp8_inputs(1, 1, 1, bm, bn, 32, False, bm, bn, seed=3)
    o, _ = _kept_inside(fp8_attention)(q8, k8, v8, qd, kd, vd, False, p_scale=256.0, block_m=bm, block_n=bn)
    s = (q8.cpu().float() @ k8.cpu().float().transpose(-1, -2)) * (32 ** -0.5 * math.log2(math.e) * float(qd * kd))
    p = torch.exp2(s - s.amax(-1, keepdim=True))

    def model(rounded):
        return ((rounded.float() @ v8.cpu().float()) * float(vd) / (p.sum(-1, keepdim=True) * 256.0)).double()
    fp8_model, bf16_model = model((p * 256).to(E4M3)), model((p * 256).to(torch.bfloat16))
    tol = 2.0 ** -8 * fp8_model.abs() + 1e-5
    grading.check_true(bool(((bf16_model - fp8_model).abs() > tol).any()), name="fp8_attention：P 的 FP8 檢查（輸入）",
                       detail="這組輸入分不出 e4m3 與 bf16 的 P（檢查本身的問題，請回報）。")
    err = (o.cpu().double() - fp8_model).abs()
    grading.check_true(bool((err <= tol).all()), name="fp8_attention：P 轉成 e4m3（FP8）再乘 V",
                       detail=f"一個 16 x 16 區塊：o 與「P * p_scale 轉成 e4m3」的模型最多差 {float(err.max()):.3g}"
                              f"（容許 bf16 捨入 {float(tol.max()):.3g}）；與 P 留在 bf16 的模型差 {float((o.cpu().double() - bf16_model).abs().max()):.3g}。",
                       hint="P8 = lk.fp8cast.to_e4m3(p * p_scale, EXACT)，tl.dot(P8, v8)：P 要轉成 FP8（e4m3），不要轉成 bf16 或 v 以外的型別。")


def fp8_mma_in_ptx(run) -> None:
    """``run()`` launches _fp8_fwd_kernel; compiled for sm90 with BLOCK_M = 128, BLOCK_N = 128, D = 64, 8 warps,
    2 stages, its PTX has wgmma ... .e4m3.e4m3 for both dots (QK^T: n = BLOCK_N = 128, PV: n = D = 64) and no
    bf16/f16 MMA."""
    name = f"{KERNEL}：兩個 tl.dot 在 sm90 都是 FP8 wgmma"
    try:
        reports = tritoncompile.check_compiles(_kept_inside(run), name=name, archs=(90,), config={
            "BLOCK_M": 128, "BLOCK_N": 128, "HEAD_DIM": 64, "num_warps": 8, "num_stages": 2, "EXACT": False})
    except AssertionError as err:
        raise AssertionError(f"{err}\n提示（hint）：sm90 的 FP8 tl.dot 需要 K >= 32（D 與 BLOCK_N）；kernel 只能讀 tl.constexpr 全域常數。") from None
    ops = [op for r in reports if r.kernel == KERNEL for op in r.mma_ops]
    fp8 = {op.split(".")[4].split("k")[0] for op in ops if op.startswith("wgmma") and op.endswith(".e4m3.e4m3")}
    other = [op for op in ops if not op.endswith(".e4m3.e4m3")]
    grading.check_true(fp8 == {"m64n128", "m64n64"} and not other, name=name,
                       detail=f"PTX 的 MMA 指令：{ops or '沒有'}；應只有 wgmma ....f32.e4m3.e4m3（QK^T 的 n128 與 PV 的 n64）。",
                       hint="q8、k8、v8 以 FP8 載入，不要 .to(tl.bfloat16)；P 以 lk.fp8cast.to_e4m3 轉成 e4m3 再 tl.dot(P8, v8)。")


def bad_input_raises(fp8_attention) -> None:
    """ValueError for: v in bf16, q in e5m2, a q_descale shaped for another block_m, Hq = 3 over Hkv = 2, D = 24."""
    bm, bn = blocks()
    q8, k8, v8, qd, kd, vd = fp8_inputs(1, 2, 1, 40, 40, 32, True, bm, bn)
    q3, k2 = fp8_inputs(1, 3, 2, 40, 40, 32, False, bm, bn)[:2]
    q24, k24, v24 = (t[..., :24] for t in (q8, k8, v8))
    bad = {"v 是 bf16（不是 float8_e4m3fn）": (q8, k8, v8.to(torch.bfloat16), qd, kd, vd),
           "q 是 float8_e5m2（不是 float8_e4m3fn）": (q8.to(torch.float8_e5m2), k8, v8, qd, kd, vd),
           "q_descale 的形狀對應 block_m 的兩倍": (q8, k8, v8, qd[..., ::2], kd, vd),
           "Hq = 3 不是 Hkv = 2 的倍數": (q3, k2, k2, qd.new_tensor(1.0), kd.new_tensor(1.0), vd.new_tensor(1.0)),
           "D = 24 不是 2 的次方": (q24, k24, v24, qd, kd, vd)}
    for what, args in bad.items():
        grading.check_raises(lambda: _kept_inside(fp8_attention)(*args, block_m=bm, block_n=bn), ValueError,
                             name=f"fp8_attention：不合法的輸入（{what}）拋出 ValueError",
                             hint="在啟動核心前檢查 dtype、descale 的形狀（() 或 [B, H, ceil(N / block)]）、Hq % Hkv 與 D，"
                                  "raise ValueError 說明哪裡錯、允許什麼。")


def contract_kept(fp8_attention) -> None:
    """Per-block descales, causal, GQA: q8, k8, v8 and the descales as transposed views give the same (o, lse) and
    stay unchanged."""
    bm, bn = blocks()
    inputs = fp8_inputs(1, 4, 2, 40, 40, 32, True, bm, bn, seed=7)
    contract.check_views_once(_kept_inside(fp8_attention), *inputs, True, name="fp8_attention", block_m=bm, block_n=bn)
