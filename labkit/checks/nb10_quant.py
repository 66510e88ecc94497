"""Visible tests of 10_fp8_attention's exercises 1 (quantizers), 2 (rotation) and 4 (the pipeline).

The references compute another way than the answers: scales from a float64 loop over the tiles, the Hadamard
matrix from its closed form H[i, j] = (-1)^popcount(i & j), the round-trip bound from e4m3's spacing.
:func:`casts_to_fp8` watches the answer at work: it sees every value handed to a float8 cast (torch 2.11 on a GPU
turns values past max into NaN while torch 2.13 on a CPU saturates, so the output alone cannot show a missing clamp).
Exercise 4's checks are in :mod:`labkit.checks.nb10_pipeline`.

Used in: 10_fp8_attention (test cells of ex1, ex2, ex4)
"""
from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.checks import contract
from labkit.core import grading

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = (E4M3, E5M2)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# an amax (exact in bf16, fp16, fp32) whose x / (amax / fmax) is just above fmax in fp32, for 448 and for 57344:
# only a clamp keeps it in range (~1 in 12 fp32 amax values do this; the bf16 ones near 1: 1.0234375, 1.078125, ...)
OVERSHOOT = 4 * 1.0234375
_SCALE_HINT = "descale = amax / fmax：amax = x.abs().amax() 先轉成 float32 再除，fmax = torch.finfo(dtype).max；amax 為 0 時 descale = 1。"


def _inputs(seed: int, *shape: int, dtype=torch.float32, amax: float | None = None) -> torch.Tensor:
    """Seeded randn of ``shape`` in ``dtype`` (its first element set to -amax when given)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    if amax is not None:
        x = x.clamp(-amax / 2, amax / 2)
        x.view(-1)[0] = -amax
    return x.to(dtype)


def _half_spacing(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the gap between the values of ``dtype`` around |y| (y float64 within +-max): rounding to nearest moves
    y by at most this. In [2^e, 2^(e+1)) the gap is eps * 2^e; below smallest_normal the subnormals' eps * tiny."""
    f = torch.finfo(dtype)
    e = torch.floor(torch.log2(y.abs().clamp_min(f.smallest_normal)))
    return f.eps * torch.exp2(e) / 2


def _round_trip(x: torch.Tensor, x8: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """|x8 * descale - x| <= descale * (half e4m3's spacing at |x / descale|) + fp32's rounding of x / descale."""
    x64, d64 = x.double(), descale.double()
    y = (x64 / d64).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
    bound = d64 * (_half_spacing(y, dtype) + y.abs() * 2.0**-23)
    err = (x8.double() * d64 - x64).abs()
    grading.check_true(bool((err <= bound).all()), name=f"{what}：x8 · descale 與 x 相差不超過半個 FP8 間距", detail=(
        f"{int((err > bound).sum())} 個元素超出界限，最大超出 {float((err - bound).max()):.3g}（x8 · descale 還原 x 的誤差"
        f"應 ≤ descale × {dtype} 在 |x / descale| 處間距的一半）。"),
        hint="x8 = (x.float() / descale).clamp(-fmax, fmax).to(dtype)：除以（不是乘以）descale，在 FP32 裡算，最後才轉型。")


class _CastWatch(TorchDispatchMode):
    """Records the largest |value| handed to a float8 cast (``.to``, ``copy_``) of a wider float tensor, per dtype."""

    def __init__(self):
        super().__init__()
        self.largest: dict[torch.dtype, float] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype in FP8:
            for src in args:
                if isinstance(src, torch.Tensor) and src.is_floating_point() and src.dtype not in FP8 and src.numel():
                    self.largest[out.dtype] = max(self.largest.get(out.dtype, 0.0), float(src.abs().max()))
        return out


def casts_to_fp8(call, what: str):
    """``call()``'s result (a quantizer's (x8, descale)); fails when a value past the float8 dtype's max reached a
    cast, or the result holds NaN."""
    with _CastWatch() as watch:
        result = call()
    for dtype, largest in watch.largest.items():
        grading.check_true(largest <= torch.finfo(dtype).max, name=f"{what}：轉型前先 clamp 到 ±fmax", detail=(
            f"轉成 {dtype} 的值最大到 {largest:.8g}，超過 fmax = {torch.finfo(dtype).max:g}：GPU 上的 torch 2.11 把超出的值"
            "轉成 NaN（這台 CPU 的 torch 2.13 則飽和成 fmax，所以看輸出看不出來）。"),
            hint="x / descale 在 FP32 裡可能比 fmax 多一點點（amax / (amax / fmax) 不一定剛好是 fmax）："
                 "轉型前 .clamp(-fmax, fmax)，fmax = torch.finfo(dtype).max（FP8 的，不是 x 的 dtype 的）。")
    nan = sum(int(torch.isnan(t.double()).sum()) for t in result if isinstance(t, torch.Tensor))
    grading.check_true(nan == 0, name=f"{what}：輸出沒有 NaN", detail=f"輸出有 {nan} 個 NaN。", hint=_SCALE_HINT)
    return result


# ----------------------------------------------------------------------------- ex1: quantizers

def per_tensor_scale_and_round_trip(quantize_per_tensor) -> None:
    """fp32, bf16 and fp16 x of several shapes (0-d to 4-d): x8 e4m3 of x's shape, descale an fp32 0-dim tensor equal
    to amax / 448 (amax in fp32), the round trip within half a spacing; an amax whose x / descale overshoots 448 in
    fp32 reaches the cast clamped (no NaN)."""
    cases = [((3, 40), torch.float32, None), ((2, 3, 17, 16), torch.bfloat16, None), ((257,), torch.float16, None),
             ((), torch.float32, None), ((4, 33), torch.float32, OVERSHOOT), ((2, 5, 8), torch.bfloat16, OVERSHOOT)]
    for seed, (shape, dtype, amax) in enumerate(cases):
        x = _inputs(seed, *shape, dtype=dtype, amax=amax) * (30 if amax is None else 1)
        what = f"quantize_per_tensor（{str(dtype)[6:]}、形狀 {tuple(shape)}）"
        x8, descale = casts_to_fp8(lambda: quantize_per_tensor(x), what)
        grading.check_true(x8.dtype == E4M3 and x8.shape == x.shape, name=f"{what}：x8 是 x 形狀的 float8_e4m3fn",
                           detail=f"得到 dtype={x8.dtype}、形狀 {tuple(x8.shape)}。", hint="預設 dtype=torch.float8_e4m3fn。")
        grading.check_true(isinstance(descale, torch.Tensor) and descale.dtype == torch.float32 and descale.dim() == 0,
                           name=f"{what}：descale 是 fp32 的 0 維張量", hint=_SCALE_HINT + "回傳張量，不要 .item()。",
                           detail=f"得到 {getattr(descale, 'dtype', type(descale).__name__)}、形狀 {tuple(getattr(descale, 'shape', ()))}。")
        want = x.float().abs().max().double() / 448
        grading.check_scalar(descale, float(want), rel=1e-6, name=f"{what}：descale = amax / 448", hint=_SCALE_HINT)
        _round_trip(x, x8, descale, E4M3, what)


def zero_gives_descale_one(quantize_per_tensor, quantize_per_block) -> None:
    """An all-zero x (fp32, bf16): descale 1, x8 all zero, no NaN; per block, a zero tile among others gets 1."""
    for dtype in (torch.float32, torch.bfloat16):
        x8, descale = casts_to_fp8(lambda: quantize_per_tensor(torch.zeros(3, 8, dtype=dtype)), "quantize_per_tensor（全 0）")
        grading.check_true(float(descale) == 1.0 and not x8.float().any(), name="quantize_per_tensor（全 0 的 x）：descale = 1",
                           detail=f"descale = {float(descale)}，x8 有 {int(x8.float().ne(0).sum())} 個非 0。", hint=_SCALE_HINT)
    x = _inputs(0, 1, 2, 40, 16)
    x[0, 1, 16:32] = 0                       # tile 1 of head 1 (block 16) is zero
    x8, descale = casts_to_fp8(lambda: quantize_per_block(x, 16), "quantize_per_block（有一塊全 0）")
    grading.check_true(float(descale[0, 1, 1]) == 1.0 and not x8[0, 1, 16:32].float().any(),
                       name="quantize_per_block：全 0 的一塊 descale = 1", detail=f"那一塊的 descale = {float(descale[0, 1, 1])}。",
                       hint="每一塊各自判斷：torch.where(amax > 0, amax / fmax, 1)。")


def per_block_tiles_along_n(quantize_per_block) -> None:
    """x [B, H, N, D] with B, H > 1, N not a multiple of block, block != D (fp32, bf16, fp16): descale fp32
    [B, H, ceil(N / block)], each entry the amax of its `block` rows (the last tile short) / 448, from a float64 loop;
    x8 of x's shape; the round trip within half a spacing per tile."""
    for seed, (shape, block, dtype) in enumerate([((2, 3, 37, 16), 8, torch.float32), ((2, 2, 50, 32), 16, torch.bfloat16),
                                                  ((1, 2, 16, 8), 32, torch.float16), ((3, 1, 24, 16), 1, torch.float32)]):
        x = _inputs(seed, *shape, dtype=dtype) * torch.linspace(0.5, 40, shape[2]).view(-1, 1).to(dtype)
        what = f"quantize_per_block（{str(dtype)[6:]}、x {tuple(shape)}、block={block}）"
        x8, descale = casts_to_fp8(lambda: quantize_per_block(x, block), what)
        B, H, N, D = shape
        tiles = -(-N // block)
        want = torch.stack([x[:, :, t * block:(t + 1) * block].double().abs().amax(dim=(-2, -1)) for t in range(tiles)], -1) / 448
        grading.check_true(x8.dtype == E4M3 and x8.shape == x.shape, name=f"{what}：x8 是 x 形狀的 float8_e4m3fn",
                           detail=f"得到 dtype={x8.dtype}、形狀 {tuple(x8.shape)}。")
        grading.check_true(descale.dtype == torch.float32 and tuple(descale.shape) == (B, H, tiles),
                           name=f"{what}：descale 是 fp32 [B, H, ceil(N / block)]", detail=(
                               f"應為 float32 {(B, H, tiles)}，得到 {descale.dtype} {tuple(descale.shape)}。"),
                           hint="沿 N 每 block 列一塊（最後一塊可以比較短）：塊數 = -(-N // block)；每個 (b, h) 各自一組。")
        grading.check_tensor(descale, want, name=f"{what}：每塊的 descale = 該塊的 amax / 448", atol=0, rtol=1e-6,
                             hint="一塊是同一個 (b, h) 沿 N 連續 block 列的全部 D 個通道，不是沿 D 切，也不跨 head。")
        _round_trip(x, x8, descale.repeat_interleave(block, -1)[..., :N, None], E4M3, what)


def e5m2_supported(quantize_per_tensor, quantize_per_block) -> None:
    """dtype=float8_e5m2: x8 in e5m2, descale amax / 57344, the round trip within e5m2's half spacing, clamped."""
    x = _inputs(7, 2, 2, 24, 16, amax=OVERSHOOT)
    for name, call, want in (("quantize_per_tensor", lambda: quantize_per_tensor(x, E5M2), x.abs().max().double() / 57344),
                             ("quantize_per_block", lambda: quantize_per_block(x, 8, E5M2),
                              x.double().reshape(2, 2, 3, -1).abs().amax(-1) / 57344)):
        what = f"{name}（dtype=torch.float8_e5m2）"
        x8, descale = casts_to_fp8(call, what)
        grading.check_true(x8.dtype == E5M2, name=f"{what}：x8 的 dtype 是 e5m2", detail=f"得到 {x8.dtype}。",
                           hint="用傳入的 dtype 轉型，fmax = torch.finfo(dtype).max（e5m2 是 57344），不要寫死 448。")
        grading.check_tensor(descale, want, name=f"{what}：descale = amax / 57344", atol=0, rtol=1e-6, hint=_SCALE_HINT)
        _round_trip(x, x8, descale if descale.dim() == 0 else descale.repeat_interleave(8, -1)[..., None], E5M2, what)


def bad_arguments_refused(quantize_per_tensor, quantize_per_block) -> None:
    """dtype bf16, fp16 or int8 -> ValueError (both); block 0 or an x that is not 4-d -> ValueError (per block)."""
    x = _inputs(0, 1, 1, 8, 16)
    hint = "dtype 只能是 torch.float8_e4m3fn 或 torch.float8_e5m2，其他的 raise ValueError（說明允許哪些）。"
    for dtype in (torch.bfloat16, torch.float16, torch.int8):
        grading.check_raises(lambda: quantize_per_tensor(x, dtype), ValueError, name=f"quantize_per_tensor(x, {dtype})",
                             hint=hint)
        grading.check_raises(lambda: quantize_per_block(x, 4, dtype), ValueError, name=f"quantize_per_block(x, 4, {dtype})",
                             hint=hint)
    grading.check_raises(lambda: quantize_per_block(x, 0), ValueError, name="quantize_per_block(x, block=0)",
                         hint="block < 1 raise ValueError。")
    grading.check_raises(lambda: quantize_per_block(x[0], 4), ValueError, name="quantize_per_block（3 維的 x）",
                         hint="x 要是 [B, H, N, D]：x.dim() != 4 raise ValueError。")


def quantizers_keep_the_contract(quantize_per_tensor, quantize_per_block) -> None:
    """fp32 and bf16 x: x unchanged, views (transposed, sliced) give the same answer, every tensor on x's device
    (meta; and no tensor returned that was made without device=, e.g. from float(amax))."""
    for dtype in (torch.float32, torch.bfloat16):            # x.float() of an fp32 x is x itself: in place shows
        x = _inputs(3, 2, 2, 20, 16, dtype=dtype)
        contract.check_contract(quantize_per_tensor, x, name=f"quantize_per_tensor（{str(dtype)[6:]}）", meta=True,
                                factories=True)
        contract.check_contract(quantize_per_block, x, 8, name=f"quantize_per_block（{str(dtype)[6:]}）", meta=True,
                                factories=True)


# ----------------------------------------------------------------------------- ex2: rotation

def sylvester(d: int) -> torch.Tensor:
    """H[i, j] = (-1)^popcount(i & j): Sylvester's Hadamard matrix from its closed form, fp32 [d, d]."""
    i = torch.arange(d)
    bits = i.view(-1, 1) & i.view(1, -1)
    parity = sum((bits >> b) & 1 for b in range(max(d.bit_length(), 1)))
    return (1 - 2 * (parity % 2)).float()


def hadamard_is_sylvester(hadamard) -> None:
    """d = 1, 2, 4, 16, 64: fp32 [d, d] equal to (-1)^popcount(i & j) (entries +-1, H H^T = d I); d = 0, 3, 6, 12, 48
    -> ValueError."""
    for d in (1, 2, 4, 16, 64):
        h = hadamard(d)
        grading.check_true(isinstance(h, torch.Tensor) and h.dtype == torch.float32 and tuple(h.shape) == (d, d),
                           name=f"hadamard({d}) 是 fp32 [d, d]", detail=f"得到 {getattr(h, 'dtype', type(h))} "
                           f"{tuple(getattr(h, 'shape', ()))}。", hint="從 torch.ones(1, 1) 開始，每次 cat 成 [[H, H], [H, -H]]。")
        grading.check_tensor(h @ h.T, d * torch.eye(d), name=f"hadamard({d}) @ hadamard({d}).T = d·I", atol=0)
        grading.check_tensor(h, sylvester(d), name=f"hadamard({d}) 是 Sylvester 構造（H_2d = [[H, H], [H, -H]]）", atol=0,
                             hint="右下角那一塊是 -H；不要除以 √d（正規化在 random_rotation 裡做）。")
    for d in (0, 3, 6, 12, 48):
        grading.check_raises(lambda: hadamard(d), ValueError, name=f"hadamard({d}) raise ValueError",
                             hint="d 必須是 2 的冪次（d >= 1 且 d & (d - 1) == 0）。")


def rotation_is_random_and_orthogonal(random_rotation) -> None:
    """d = 16, 64, 128: fp32 [d, d], |R R^T - I| <= 2 d 2^-24 (each entry of R R^T sums d products of size 1/d, each
    partial sum at most 1, so each add rounds by at most 2^-24: (d + 2) 2^-24 with R's own rounding); R = diag(s) H /
    sqrt(d) with s = torch.randint(0, 2, (d,), generator=generator) * 2 - 1: the same seed gives the same R, seeds
    0-5 give different ones (not the plain H / sqrt(d)); generator=None draws from torch's global generator."""
    hint = "R = diag(s) @ hadamard(d) / √d，s = torch.randint(0, 2, (d,), generator=generator) * 2 - 1（乘在列上：s[:, None] * H）。"
    for d in (16, 64, 128):
        r = random_rotation(d, torch.Generator().manual_seed(1))
        grading.check_true(r.dtype == torch.float32 and tuple(r.shape) == (d, d), name=f"random_rotation({d}) 是 fp32 [d, d]",
                           detail=f"得到 {r.dtype} {tuple(r.shape)}。", hint=hint)
        grading.check_tensor(r @ r.T, torch.eye(d), name=f"random_rotation({d})：R Rᵀ = I（容許 2·d·2⁻²⁴）",
                             atol=2 * d * 2.0**-24, hint="記得除以 √d。")
        draws = []
        for seed in range(6):
            s = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
            got = random_rotation(d, torch.Generator().manual_seed(seed))
            grading.check_tensor(got, s[:, None].double() * sylvester(d).double() / math.sqrt(d), atol=1e-6,
                                 name=f"random_rotation({d}, generator=manual_seed({seed})) 的正負號來自 generator", hint=hint)
            draws.append(got)
        grading.check_true(len({tuple(t.flatten().tolist()) for t in draws}) > 1, name=f"random_rotation({d})：generator 起始值不同，R 不同",
                           detail="6 個不同的 generator 起始值給出同一個 R。", hint=hint)
    with torch.random.fork_rng():                             # generator=None: torch's global generator
        torch.manual_seed(7)
        s = torch.randint(0, 2, (16,)) * 2 - 1
        torch.manual_seed(7)
        got = random_rotation(16)
    grading.check_tensor(got, s[:, None].double() * sylvester(16).double() / math.sqrt(16), atol=1e-6, hint=hint + (
        "generator=None 時就用 torch 的全域亂數（torch.randint(..., generator=None)），不要自己建一個固定起始值（manual_seed）的 generator。"),
                         name="random_rotation(16)（generator=None，torch.manual_seed(7) 之後）的正負號來自全域亂數")


def rotate_qk_keeps_scores_and_dtypes(rotate_qk, random_rotation) -> None:
    """q [2, 3, 20, D], k [2, 3, 28, D] (D = 32, 64) in fp32, bf16, fp16: outputs in q's / k's dtype, each entry within
    fp32's rounding of its D products (2 D 2^-24 |x_row|) plus half a step of the dtype (one cast back, to nearest)
    of x @ R in float64; for fp32, (q R)(k R)^T = q k^T within 8 D 2^-24 |q_i| |k_j| (D roundings in each of q R, k R and R R^T);
    q, k unchanged, views."""
    for d, dtype in ((32, torch.float32), (64, torch.float32), (32, torch.bfloat16), (64, torch.float16)):
        q, k = _inputs(d, 2, 3, 20, d, dtype=dtype), _inputs(d + 1, 2, 3, 28, d, dtype=dtype)
        r = random_rotation(d, torch.Generator().manual_seed(d))
        what = f"rotate_qk（{str(dtype)[6:]}、D={d}）"
        contract.check_contract(rotate_qk, q, k, r, name=what)       # first: an answer that changes q shows as such
        qr, kr = rotate_qk(q, k, r)
        grading.check_true(qr.dtype == dtype and kr.dtype == dtype and qr.shape == q.shape and kr.shape == k.shape,
                           name=f"{what}：輸出保留 q、k 的 dtype 與形狀", detail=f"得到 {qr.dtype} {tuple(qr.shape)}、{kr.dtype} "
                           f"{tuple(kr.shape)}。", hint="在 FP32 裡算 q.float() @ R.float()，最後 .to(q.dtype)。")
        for got, x in ((qr, q), (kr, k)):
            want = x.double() @ r.double()
            step = 2 * d * 2.0**-24 * x.double().norm(dim=-1, keepdim=True)   # fp32's rounding of the d products
            step = step + (_half_spacing(want, dtype) if dtype != torch.float32 else 0)   # one cast back, to nearest
            bad = int(((got.double() - want).abs() > step).sum())
            grading.check_true(bad == 0, name=f"{what}：x @ R 在 FP32 裡算、只捨入一次", detail=(
                f"{bad} 個元素與 x @ R（float64）相差超過 FP32 的累加誤差加上一個 {dtype} 間距。"),
                hint="先 .float() 再相乘（R 不要轉成 x 的 dtype），最後才轉回原 dtype。")
        if dtype == torch.float32:
            norms = q.double().norm(dim=-1, keepdim=True) * k.double().norm(dim=-1).unsqueeze(-2)
            err = (qr.double() @ kr.double().transpose(-1, -2) - q.double() @ k.double().transpose(-1, -2)).abs()
            grading.check_true(bool((err <= 8 * d * 2.0**-24 * norms).all()), name=f"{what}：(q R)(k R)ᵀ = q kᵀ", detail=(
                f"最大誤差 {float(err.max()):.3g}，超過 8·D·2⁻²⁴·|q_i||k_j|。"), hint="q 與 k 都乘同一個 R（右乘：q @ R，不是 R @ q 或 R.T）。")
