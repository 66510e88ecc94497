"""Visible tests of 03_long_sequence_training's exercises 3 and 4: positions past the trained length (a learned table
tiled longer, rotary embeddings).

rope's references are float64 and computed another way (:func:`rope_complex`, complex rotations). Tolerances: fp32
angles m*theta <= 64 rad carry ~1e-5 relative error at most, so outputs of size ~1 agree to ~1e-5 with float64 values
(atol=1e-4); float64 inputs agree to ~1e-13 (atol=1e-10); bf16 outputs are rounded to 8 significant bits (~0.4%), so
values of size <= 5 agree to ~0.02 (atol=0.05).

Used in: 03_long_sequence_training (test cells of ex3_extend_positions, ex4_rope)
"""
from __future__ import annotations

import torch

from labkit.checks import contract
from labkit.core import grading
from labkit.models import gpt2

# What two hints ask for, said in words (labkit ships to students: no line of the answer stands in it)
KEEP_GRAD = "用 requires_grad_ 讓 table.weight 的 requires_grad 與 old 的相同"
SET_CONFIG = "把 model.config.n_positions 設成 n_positions"


def extend_tiles_the_table(extend) -> None:
    """``extend(model, 80)`` on a tiny GPT-2 with a 32-position table [32, h]: a new nn.Embedding [80, h] whose row i
    is old row i mod 32, trainable, on the old device and dtype; a 32-token input's logits unchanged, 80 tokens run
    and config.n_positions = 80."""
    model = gpt2.build_model("tiny", n_positions=32, seed=1)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    old_wpe = model.transformer.wpe.weight.detach().clone()
    wpe_module_before, model_wpe_before = model.transformer.wpe, model.transformer.wpe.weight
    extend(model, 80)
    wpe = model.transformer.wpe
    grading.check_true(isinstance(wpe, torch.nn.Embedding) and tuple(wpe.weight.shape) == (80, old_wpe.shape[1]),
                       name="extend: a new nn.Embedding of shape (80, h)",
                       detail=f"wpe 應為 (80, {old_wpe.shape[1]}) 的 nn.Embedding，得到 {type(wpe).__name__} "
                              f"{tuple(getattr(getattr(wpe, 'weight', None), 'shape', ()))}。",
                       hint="列數是 ceil(n_positions / P) 份舊表再截到 n_positions 列；用 floor 會少最後不滿一份的那一段。")
    grading.check_tensor(wpe.weight, old_wpe[torch.arange(80) % 32], name="extend: row i = old row i mod 32 (tile)", atol=0,
                         hint="平鋪（tile）是整張表接著整張表（repeat），不是每一列重複幾次（repeat_interleave）。")
    grading.check_true(wpe.num_embeddings == 80 and wpe.weight is not model_wpe_before,
                       name="extend: a new nn.Embedding module (num_embeddings = 80)",
                       detail=f"wpe.num_embeddings = {getattr(wpe, 'num_embeddings', None)}，應為 80；"
                              f"{'wpe 還是原來的模組，只換了它的權重' if wpe is wpe_module_before else ''}。",
                       hint="建一個新的 torch.nn.Embedding(n_positions, h, ...)，再 model.transformer.wpe = 新表；"
                            "只換 wpe.weight（或 wpe.weight.data）的話，模組的 num_embeddings 還是舊的 32，和它的權重對不上。")
    grading.check_true(wpe.weight.requires_grad, name="extend: a trainable table stays trainable",
                       detail="舊表 requires_grad=True，新表也應是 True。",
                       hint=f"複製用 torch.no_grad()，之後 {KEEP_GRAD}。")
    grading.check_true(wpe.weight.device == old_wpe.device and wpe.weight.dtype == old_wpe.dtype,
                       name="extend: same device and dtype as the old table",
                       detail=f"得到 {wpe.weight.device} {wpe.weight.dtype}，舊表是 {old_wpe.device} {old_wpe.dtype}。")
    with torch.no_grad():
        after = model(input_ids=ids).logits
        longer = model(input_ids=torch.randint(0, 256, (1, 80))).logits
    grading.check_tensor(after, before, name="extend: logits of a 32-token input unchanged", atol=1e-6)
    grading.check_true(longer.shape[1] == 80 and model.config.n_positions == 80, name="extend: 80 tokens run, config updated",
                       detail=f"80 個 token 的輸入應能前向傳播，config.n_positions 應為 80（得到 {model.config.n_positions}）。",
                       hint=f"最後{SET_CONFIG}。")


def extend_keeps_grad_dtype_and_device(extend) -> None:
    """A frozen table stays frozen (32 -> 64), a bf16 table stays bf16 (32 -> 40), and a model on the "meta" device
    (shapes only, no data: it shows on a CPU where the new table is created) gets its new table there (32 -> 48)."""
    frozen = gpt2.build_model("tiny", n_positions=32)
    frozen.transformer.wpe.requires_grad_(False)  # its one parameter, the table
    extend(frozen, 64)
    grading.check_true(not frozen.transformer.wpe.weight.requires_grad, name="extend: a frozen table stays frozen",
                       detail="舊表 requires_grad=False 時，新表也應是 False（新建的 nn.Embedding 預設 requires_grad=True）。",
                       hint=f"{KEEP_GRAD}。")
    half = gpt2.build_model("tiny", n_positions=32).to(torch.bfloat16)
    extend(half, 40)
    grading.check_true(half.transformer.wpe.weight.dtype == torch.bfloat16, name="extend: the old table's dtype (bf16)",
                       detail=f"新表的 dtype 應與舊表相同（bf16），得到 {half.transformer.wpe.weight.dtype}。",
                       hint="torch.nn.Embedding(n, h, device=old.device, dtype=old.dtype)：預設 dtype 是 float32。")
    on_meta = gpt2.build_model("tiny", n_positions=32).to("meta")
    try:
        extend(on_meta, 48)
        made_on = on_meta.transformer.wpe.weight.device
    except (RuntimeError, NotImplementedError) as err:  # e.g. copying the meta table into a CPU one
        made_on = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    grading.check_true(made_on == torch.device("meta"), name="extend: the new table on the old table's device",
                       detail=f"模型在 meta 裝置上時，新表應在 meta 上，得到 {made_on}。",
                       hint="torch.nn.Embedding(n, h, device=old.device, dtype=old.dtype)：不給 device 的話新表建在 CPU，"
                            "模型在 GPU 上時，前向傳播會因為裝置不同而失敗。複製舊表時也不必經過 CPU（不要 .cpu()）："
                            "meta 裝置上的張量只有形狀、沒有資料，搬不到 CPU。")


def extend_refuses_no_growth(extend) -> None:
    """A 32-position table asked for 32 or 16 positions: ValueError, and the model unchanged (config.n_positions and
    wpe.num_embeddings still 32)."""
    for n_new in (32, 16):
        kept = gpt2.build_model("tiny", n_positions=32)
        grading.check_raises(lambda: extend(kept, n_new), ValueError,
                             name=f"extend a 32-position table to {n_new}: ValueError",
                             hint="n_positions 不大於目前的列數時（等於也算）拋出 ValueError。")
        grading.check_true(kept.config.n_positions == 32 and kept.transformer.wpe.num_embeddings == 32,
                           name=f"extend a 32-position table to {n_new}: the refused call changes nothing",
                           detail=f"拋出 ValueError 之後 config.n_positions = {kept.config.n_positions}、"
                                  f"wpe.num_embeddings = {kept.transformer.wpe.num_embeddings}，都應該還是 32。",
                           hint="先檢查 n_positions，再建新表、換模組、改 config：錯誤的呼叫不可以留下改了一半的模型。")


def rope_complex(x: torch.Tensor, base: float) -> torch.Tensor:
    """A float64 reference written another way: pair (i, i + D/2) of x [..., N, D] is the complex number
    x_i + j x_{i+D/2}, rotated by e^{j m theta_i} at position m; float64 [..., N, D]."""
    n, d = x.shape[-2:]
    theta = base ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    turn = torch.polar(torch.ones(n, d // 2, dtype=torch.float64), torch.arange(n, dtype=torch.float64)[:, None] * theta)
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double()) * turn
    return torch.cat([z.real, z.imag], -1)


def rope_rotates_pairs(rope) -> None:
    """x [2, 3, 64, 16] fp32: same shape and dtype back, position 0 not rotated, norms kept; D = 2 (one pair,
    theta_0 = 1: [1, 0] at position m is [cos m, sin m]); D = 4 with base 100 (pairs (0, 2) and (1, 3), theta = 1 and
    0.1: [1, 1, 0, 0] -> [cos m, cos 0.1m, sin m, sin 0.1m])."""
    x = torch.randn(2, 3, 64, 16, generator=torch.Generator().manual_seed(0))
    out = rope(x)
    grading.check_true(isinstance(out, torch.Tensor) and out.shape == x.shape and out.dtype == x.dtype,
                       name="rope: same shape and dtype as x",
                       detail=f"應回傳 {tuple(x.shape)} {x.dtype}，得到 {tuple(getattr(out, 'shape', ()))} {getattr(out, 'dtype', type(out).__name__)}。")
    grading.check_tensor(out[..., 0, :], x[..., 0, :], name="rope: position 0 is not rotated", atol=1e-6,
                         hint="第 m 列用位置 m：位置從 0 開始（torch.arange(N)）。")
    grading.check_tensor(out.norm(dim=-1), x.norm(dim=-1), name="rope: norms unchanged (a rotation)", atol=1e-4)
    m = torch.arange(64, dtype=torch.float64)
    unit = torch.tensor([1.0, 0.0]).expand(1, 1, 64, 2)
    grading.check_tensor(rope(unit)[0, 0], torch.stack([m.cos(), m.sin()], -1), name="rope: D = 2", atol=1e-4,
                         hint="x' = x * cos(m theta) + rotate_half(x) * sin(m theta)；rotate_half([x1, x2]) = [-x2, x1]。")
    ones_then_zeros = torch.tensor([1.0, 1.0, 0.0, 0.0]).expand(1, 1, 64, 4)
    expected = torch.stack([m.cos(), (0.1 * m).cos(), m.sin(), (0.1 * m).sin()], -1)
    grading.check_tensor(rope(ones_then_zeros, base=100.0)[0, 0], expected, name="rope: D = 4, base = 100", atol=1e-4,
                         hint="通道 i 與 i + D/2 一對（不是 2i 與 2i+1）；theta_i = base ** (-2i / D)，用參數 base。")


def rope_float64_any_shape(rope) -> None:
    """float64 in, float64 out: [1, 2, 50, 8] with base 500 and [N, D] = [40, 6] (no batch or head dimension) with
    base 1000, against :func:`rope_complex` (atol 1e-10)."""
    gen = torch.Generator().manual_seed(1)
    x64 = torch.randn(1, 2, 50, 8, generator=gen, dtype=torch.float64)
    out64 = rope(x64, base=500.0)
    grading.check_true(out64.dtype == torch.float64, name="rope: float64 in, float64 out", detail=f"得到 {out64.dtype}。")
    grading.check_tensor(out64, rope_complex(x64, 500.0), name="rope(base=500): float64 accuracy", atol=1e-10,
                         hint="float64 輸入時角度也用 float64：torch.promote_types(x.dtype, torch.float32)。")
    x2d = torch.randn(40, 6, generator=gen, dtype=torch.float64)
    grading.check_tensor(rope(x2d, base=1000.0), rope_complex(x2d, 1000.0), name="rope: x of shape [N, D] = [40, 6]", atol=1e-10,
                         hint="x 是 [..., N, D]：N 與 D 取最後兩維（x.shape[-2], x.shape[-1]），不要假設有 4 維 [B, H, N, D]。")


def rope_scores_depend_on_distance(rope, offsets=(0, 7), seed: int = 2) -> None:
    """The same float64 q and k [32] at all 100 positions give scores [100, 100] equal along each diagonal in
    ``offsets``: they depend only on the distance n - m."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(32, generator=gen, dtype=torch.float64), torch.randn(32, generator=gen, dtype=torch.float64)
    scores = rope(q.expand(1, 1, 100, 32))[0, 0] @ rope(k.expand(1, 1, 100, 32))[0, 0].T  # [100, 100]
    for offset in offsets:
        diag = torch.diagonal(scores, offset=-offset)
        grading.check_tensor(diag, diag[:1].expand_as(diag), name=f"rope: scores at distance {offset} all equal", atol=1e-9,
                             hint="<R_m q, R_n k> 只應取決於 n - m。")


def rope_angles_in_fp32(rope) -> None:
    """Half-precision inputs at long positions: bf16 [1, 2, 4096, 8] (atol 0.05) and fp16 [1, 2500, 8] (atol 0.02)
    against float64, their dtype kept; bf16 [1, 2, 4096, 64] rotated in fp32 and rounded once: in units of a bf16
    spacing at max(|value|, 1/16), one rounding is at most 0.5 and the fp32 angles add at most about 1 more
    (measured: <= 1.0 over four seeds); cos and sin or the products rounded to bf16 first give 20-30. Allowed: 4."""
    gen = torch.Generator().manual_seed(3)
    xb = torch.randn(1, 2, 4096, 8, generator=gen).to(torch.bfloat16)
    outb = rope(xb)
    grading.check_true(outb.dtype == torch.bfloat16 and outb.shape == xb.shape, name="rope: bf16 in, bf16 out",
                       detail=f"bf16 輸入應回傳 bf16，得到 {outb.dtype}。", hint="算完之後 .to(x.dtype)。")
    grading.check_tensor(outb, rope_complex(xb, 10000.0), name="rope: bf16 input, positions up to 4095 (angles in fp32)",
                         atol=0.05, hint="角度不可在 bf16 裡算：bf16 裡 4095 附近的間隔是 32，角度 m*theta 會差好幾個弧度。"
                                          "arange、theta 與乘積都用 torch.promote_types(x.dtype, torch.float32)，最後才轉回 x.dtype。")
    xr = torch.randn(1, 2, 4096, 64, generator=gen).to(torch.bfloat16)
    ref = rope_complex(xr, 10000.0)
    err = ((rope(xr).double() - ref).abs() / (torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(1 / 16))).max().item()
    grading.check_true(err <= 4, name="rope: bf16 input, the rotation in fp32 and rounded once [1, 2, 4096, 64]",
                       detail=f"最大誤差是 {err:.1f} 個 bf16 間距（以 max(|值|, 1/16) 計），最多 4；只在最後捨入一次時約 1。",
                       hint="x 先轉成 fp32（xf = x.to(acc)），cos、sin 與乘加都在 fp32 中做，最後才 .to(x.dtype)："
                            "不要把 cos、sin 或 x * cos 先轉成 bf16（每一步各捨入一次）。")
    xh16 = torch.randn(1, 2500, 8, generator=gen).to(torch.float16)
    outh16 = rope(xh16)
    grading.check_true(isinstance(outh16, torch.Tensor) and outh16.dtype == torch.float16 and outh16.shape == xh16.shape,
                       name="rope: fp16 [1, 2500, 8] in, same shape and fp16 out",
                       detail=f"得到 {getattr(outh16, 'dtype', type(outh16).__name__)} {tuple(getattr(outh16, 'shape', ()))}。",
                       hint="算完之後 .to(x.dtype)。")
    grading.check_tensor(outh16, rope_complex(xh16, 10000.0), name="rope: fp16 input, positions up to 2499 (angles in fp32)",
                         atol=0.02, hint="fp16 的角度也不可在 fp16 裡算：2048 以上 fp16 的間隔是 2，位置本身就不準。"
                                         "不只 bf16 要升精度：用 torch.promote_types(x.dtype, torch.float32)。")


def rope_keeps_the_contract(rope) -> None:
    """fp32 x [2, 3, 12, 8] (lk.checks.contract): x left unchanged; the same answer for x as a transposed or sliced
    view; no state between calls (base 10000 and base 500 on the same N and D, each right after the other: a cache
    keyed by (N, D) alone fails); and on the "meta" device (shapes only: it shows on a CPU where the tables are made)
    the position and frequency tables made on x's device."""
    x = torch.randn(2, 3, 12, 8, generator=torch.Generator().manual_seed(6))
    contract.check_contract(rope, x, name="rope", other=lambda: rope(x, base=500.0), meta=True)
