"""Visible tests of exercise 5a of 01_setup_and_comparison: ``flash_attention_backward(q, k, v, o, lse, do, ...)``.

o and lse come from labkit's reference (so the checks do not depend on exercise 4); the expected gradients
are autograd's through it. fp32 gradients sum N products in another order (atol=1e-4), float64 to rounding
(1e-10); bf16/fp16 by the 2x rule against float64 autograd, the baseline autograd through plain attention in
the input dtype. Shapes: q, o, do [..., N, d]; k, v [..., Nk, d]; lse [..., N].

Used in: 01_setup_and_comparison (test cells of ex5a)
"""
from __future__ import annotations

import torch

from labkit.core import grading
from labkit.checks import contract, nb01

GRADS = ("dq", "dk", "dv")
ACCUMULATOR_RULE = "dQ、dK、dV 的累加器（以及重算的 P、dS）以 fp32 保存，bf16/fp16 輸入也一樣"


def _low_precision(flash_attention_backward, q, k, v, do, causal, blocks, o_dtype=torch.float32):
    """The answer's gradients on bf16/fp16 inputs with o (in ``o_dtype``) and fp32 lse from the float64 reference,
    the float64 autograd gradients and the plain baseline's: (grads, expected, baseline)."""
    o64, lse64, expected = nb01.reference_grads(q.double(), k.double(), v.double(), do.double(), causal)
    grads = flash_attention_backward(q, k, v, o64.to(o_dtype), lse64.float(), do, is_causal=causal,
                                     block_m=blocks[0], block_n=blocks[1])
    return grads, expected, nb01.plain_grads(q, k, v, do, nb01.causal_keep(q.shape[-2], k.shape[-2], causal))


def writes_its_own_code(flash_attention_backward) -> None:
    """No autograd, softmax or SDPA (nor labkit) anywhere the function reaches."""
    grading.check_own_code(flash_attention_backward, name="flash_attention_backward: 自己寫",
                           forbid=(torch.autograd.grad, torch.Tensor.backward, torch.softmax, torch.Tensor.softmax,
                                   torch.nn.functional.softmax, torch.nn.functional.scaled_dot_product_attention))


def matches_autograd(flash_attention_backward) -> None:
    """fp32 [2, 3, 100, 16], blocks 32 x 16, causal or not: dq, dk, dv match autograd (atol=1e-4), in fp32."""
    torch.manual_seed(7)
    q, k, v, do = (torch.randn(2, 3, 100, 16) for _ in range(4))
    for causal in (False, True):
        o_ref, lse_ref, expected = nb01.reference_grads(q, k, v, do, causal)
        grads = flash_attention_backward(q, k, v, o_ref, lse_ref, do, is_causal=causal, block_m=32, block_n=16)
        for name, g, e in zip(GRADS, grads, expected):
            grading.check_tensor(g, e, name=f"flash_attention_backward: {name} (causal={causal})", atol=1e-4,
                                 hint="P = exp(S - L)；dS = P * (dP - D)，D = rowsum(dO * O)；dq 與 dk 都要乘 scale。")
            grading.check_true(g.dtype == torch.float32, name=f"flash_attention_backward: {name} dtype",
                               detail=f"{name} 應為 torch.float32，卻是 {g.dtype}。")


def keeps_the_contract(flash_attention_backward) -> None:
    """Causal fp32 q, o, do [1, 2, 16, 8], k, v [1, 2, 12, 8] (the first 4 queries see no key: lse = -inf), blocks 8:
    every input left unchanged (lse too: no in-place lse[lse == -inf] = inf), views (transposed storage, rows of a
    wider buffer) give the same gradients, and on meta inputs every tensor it makes follows q's device."""
    torch.manual_seed(37)
    q, k, v, do = torch.randn(1, 2, 16, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 16, 8)
    o, lse, _ = nb01.reference_grads(q, k, v, do, True)
    contract.check_contract(flash_attention_backward, q, k, v, o, lse, do, name="flash_attention_backward", meta=True,
                            is_causal=True, block_m=8, block_n=8)


def causal_bottom_right(flash_attention_backward) -> None:
    """Causal with Nk != N both ways, float64 3-D, blocks 16: N=24 after 33 cached keys, and N=57 > Nk=24 (the first
    33 queries see no key: lse = -inf, gradients 0, no NaN); then fp32 N=63, Nk=64: the Q loop of K block [16, 32)
    starts at Q block [0, 16), whose query 15 sees key 16."""
    torch.manual_seed(26)
    for n, nk in ((24, 57), (57, 24)):
        q, k, v = torch.randn(2, n, 8, dtype=torch.float64), *(torch.randn(2, nk, 8, dtype=torch.float64) for _ in range(2))
        do = torch.randn(2, n, 8, dtype=torch.float64)
        o_ref, lse_ref, expected = nb01.reference_grads(q, k, v, do, True)
        grads = flash_attention_backward(q, k, v, o_ref, lse_ref, do, is_causal=True, block_m=16, block_n=16)
        for name, g, e in zip(GRADS, grads, expected):
            grading.check_true(g.dtype == torch.float64, name=f"flash_attention_backward: float64 {name} dtype",
                               detail=f"float64 輸入時 {name} 應為 float64，卻是 {g.dtype}。",
                               hint="累加器 dtype = torch.promote_types(q.dtype, torch.float32)。")
            grading.check_true(not g.isnan().any(), name=f"flash_attention_backward: no NaN in {name}, causal N={n}, Nk={nk}",
                               detail=f"{name} 含有 NaN。",
                               hint="lse = -inf 的列（看不到任何 key）：exp(S - L) = exp(-inf - (-inf)) = NaN；"
                                    "把這些列的 L 換成 +inf，P 就是 0（用 torch.where 產生新的張量，不要原地改呼叫端的 lse）。")
            grading.check_tensor(g, e, name=f"flash_attention_backward: {name}, causal N={n}, Nk={nk}", atol=1e-10,
                                 hint="右下對齊：區塊內遮罩 j > i + (Nk - N)，K 區塊 j0 從 query j0 - (Nk - N) 所在的 "
                                      "Q 區塊開始；float64 輸入以 float64 累加。")
    q, k, v, do = torch.randn(1, 2, 63, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 63, 16)
    o_ref, lse_ref, expected = nb01.reference_grads(q, k, v, do, True)
    grads = flash_attention_backward(q, k, v, o_ref, lse_ref, do, is_causal=True, block_m=16, block_n=16)
    for name, g, e in zip(GRADS, grads, expected):
        grading.check_tensor(g, e, name=f"flash_attention_backward: {name}, causal N=63, Nk=64, blocks 16 (skip bound)",
                             atol=1e-4, hint="K 區塊 j0 的第一個 query 是 j0 - (Nk - N)：從 (j0 - (Nk - N)) // block_m 這個 Q 區塊開始，"
                                             "不要多加 1。")


SKIP_CASES = (  # (N, Nk, block size, dk/dv rows checked from, check name, hint); dO of queries 0..31 is NaN
    (96, 96, 32, 32, "flash_attention_backward: causal tile skipping",
     "因果時，K 區塊 j 只和看得到它的 Q 區塊相乘：對角線右上方的區塊要略過，不是讀進來再遮罩。"),
    (64, 32, 16, 0, "flash_attention_backward: causal tile skipping, N=64 > Nk=32",
     "K 區塊 [j0, j1) 的 Q 迴圈從 query j0 - (Nk - N) 所在的 Q 區塊開始；Nk - N 可以是負的（這裡是 -32）："
     "不要取絕對值，也不要先 max(0, ·)。看不到這個 K 區塊的 Q 區塊要略過，不是讀進來再遮罩。"),
)


def skips_tiles_above_the_diagonal(flash_attention_backward) -> None:
    """dO of queries 0..31 is NaN. N = Nk = 96, blocks 32: those queries see no key of K blocks [32, 96), so dk, dv
    there stay finite and exact if the tiles above the diagonal are skipped. N=64 > Nk=32, blocks 16: queries 0..31
    see no key at all; every K block's Q loop starts at query j0 - (Nk - N) = j0 + 32 (the signed offset)."""
    torch.manual_seed(27)
    for n, nk, block, first, name, hint in SKIP_CASES:
        q, k, v, do = torch.randn(1, 2, n, 8), torch.randn(1, 2, nk, 8), torch.randn(1, 2, nk, 8), torch.randn(1, 2, n, 8)
        o_ref, lse_ref, expected = nb01.reference_grads(q, k, v, do, True)
        do_nan = do.clone()
        do_nan[..., :32, :] = float("nan")
        _, dk, dv = flash_attention_backward(q, k, v, o_ref, lse_ref, do_nan, is_causal=True, block_m=block, block_n=block)
        for label, g, e in (("dk", dk, expected[1]), ("dv", dv, expected[2])):
            grading.check_tensor(g[..., first:, :], e[..., first:, :], name=f"{name} ({label})", atol=1e-4, hint=hint)


def accumulates_in_fp32(flash_attention_backward) -> None:
    """bf16 causal N=128, Nk=160 and fp16 N=96, Nk=128 in 4 x 4 blocks (every gradient row sums dozens of tiles;
    V and dO with mean 1): gradients in the input dtype, within the 2x rule (an accumulator rounded each tile drifts)."""
    torch.manual_seed(22)
    for dtype, n, nk, causal in ((torch.bfloat16, 128, 160, True), (torch.float16, 96, 128, False)):
        q, k = torch.randn(1, 2, n, 16).to(dtype), torch.randn(1, 2, nk, 16).to(dtype)
        v, do = (1 + torch.randn(1, 2, nk, 16)).to(dtype), (1 + torch.randn(1, 2, n, 16)).to(dtype)
        grads, expected, baseline = _low_precision(flash_attention_backward, q, k, v, do, causal, (4, 4))
        grading.check_true([g.dtype for g in grads] == [dtype] * 3, name=f"flash_attention_backward: {dtype} dtype",
                           detail=f"{dtype} 輸入時 dq、dk、dv 應為 {dtype}，卻是 {[g.dtype for g in grads]}。",
                           hint="以 fp32 累加，回傳前轉回 q、k、v 的 dtype。")
        for name, g, e, b in zip(GRADS, grads, expected, baseline):
            grading.check_within_2x(g, e, b, name=f"flash_attention_backward: {dtype} {name}, N={n}, Nk={nk}, blocks 4 (2x rule)",
                                    rule=ACCUMULATOR_RULE,
                                    hint="acc 用 torch.promote_types(q.dtype, torch.float32)：dq、dk、dv 用 acc 建立、每個區塊先 .to(acc)，"
                                         "全部累加完才轉回輸入的 dtype；在 bf16 的 dq 上 += 每一次都會捨入。")


def d_term_in_fp32(flash_attention_backward, dtype, shape, n, nk, d, causal, blocks, gen) -> None:
    """D = rowsum(dO * O) stays fp32 with o in the input dtype (as the forward returns it), by the 2x rule on dq, dk.

    V's first d/2 columns are +-1.75 on every key (every O row holds them exactly) and dO is offset by 3 there: D sums
    products of about +-5 that mostly cancel (D ~ 1), so a product rounded to bf16 or a D stored in it errs by a few
    percent of D, while the plain backward's roundings average out over 300+ keys of mean 1.

    Args: dtype bf16/fp16; shape the leading dims; q [*shape, n, d], k, v [*shape, nk, d]; blocks (block_m,
    block_n); gen a torch.Generator the inputs are drawn from.
    """
    q, k = torch.randn(*shape, n, d, generator=gen), 1 + torch.randn(*shape, nk, d, generator=gen)
    v, do = 0.25 * torch.randn(*shape, nk, d, generator=gen), 0.25 * torch.randn(*shape, n, d, generator=gen)
    v[..., : d // 2] = torch.tensor([1.75, -1.75]).repeat(d // 4)
    do[..., : d // 2] += 3.0
    q, k, v, do = (t.to(dtype) for t in (q, k, v, do))
    grads, expected, baseline = _low_precision(flash_attention_backward, q, k, v, do, causal, blocks, o_dtype=dtype)
    for name, g, e, b in zip(("dq", "dk"), grads, expected, baseline):
        grading.check_within_2x(g, e, b, name=f"flash_attention_backward: D from {str(dtype)[6:]} o and do, {name}, "
                                              f"N={n}, Nk={nk}, causal={causal} (2x rule)",
                                rule="D = rowsum(dO ∘ O) 是統計量，以 fp32 計算與保存：dO 與 O 先轉成 fp32 再相乘、加總",
                                hint="delta = (do.to(acc) * o.to(acc)).sum(dim=-1, keepdim=True)：o 是前向傳回的 bf16/fp16，"
                                     "do * o 在 bf16 相乘，每個乘積先捨入一次（先乘再 .to(acc) 也一樣）；這裡的乘積約 ±5、"
                                     "大多彼此抵消（D 約 1），捨入誤差合起來是 D 的百分之幾。D 也不要轉回 q.dtype 存。")


def statistics_in_fp32(flash_attention_backward) -> None:
    """D in fp32 (:func:`d_term_in_fp32`: bf16 N=32, Nk=384; fp16 causal N=44, Nk=300); lse read in fp32 (bf16 scores
    near 100, exact: an lse rounded to bf16 scales a row's P by up to 28%); dQ's accumulator alone in fp32 over 128 K
    tiles of 4 keys (K's column 0 is 8 + N(0, 1): dQ[:, 0] sums partial sums of ~8 x dS that cancel)."""
    gen = torch.Generator().manual_seed(31)
    d_term_in_fp32(flash_attention_backward, torch.bfloat16, (1, 2), 32, 384, 16, False, (16, 64), gen)
    d_term_in_fp32(flash_attention_backward, torch.float16, (1, 2), 44, 300, 24, True, (16, 64), gen)
    for n, nk, causal in ((40, 64, False), (24, 80, True)):
        q = 2 * torch.randint(-1, 2, (1, 2, n, 16), generator=gen).float()         # d = 16, scale 1/4: score = 100 + j/2
        k = torch.randint(-1, 2, (1, 2, nk, 16), generator=gen).float()
        q[..., 0], k[..., 0] = 4.0, 100.0
        v, do = torch.randn(1, 2, nk, 16, generator=gen), torch.randn(1, 2, n, 16, generator=gen)
        q, k, v, do = (t.to(torch.bfloat16) for t in (q, k, v, do))
        grads, expected, baseline = _low_precision(flash_attention_backward, q, k, v, do, causal, (16, 16))
        for name, g, e, b in zip(GRADS, grads, expected, baseline):
            grading.check_within_2x(g, e, b, name=f"flash_attention_backward: bf16, scores near 100, {name}, N={n}, Nk={nk} (2x rule)",
                                    rule="lse 是統計量：以 fp32 讀入、重算 P = exp(S - lse) 全在 fp32，不可捨入成 bf16/fp16",
                                    hint="lse = lse.to(acc)（不是 lse.to(q.dtype)）：100 附近 bf16 的間距是 0.5，"
                                         "捨入後的 lse 讓一整列的 P 差到 28%。")
    for dtype, causal in ((torch.bfloat16, False), (torch.float16, True)):
        q, k = torch.randn(1, 2, 24, 16, generator=gen), torch.randn(1, 2, 512, 16, generator=gen)
        q[..., 0], k[..., 0] = 0.0, k[..., 0] + 8
        v, do = torch.randn(1, 2, 512, 16, generator=gen), torch.randn(1, 2, 24, 16, generator=gen)
        q, k, v, do = (t.to(dtype) for t in (q, k, v, do))
        grads, expected, baseline = _low_precision(flash_attention_backward, q, k, v, do, causal, (16, 4))
        grading.check_within_2x(grads[0], expected[0], baseline[0],
                                name=f"flash_attention_backward: {str(dtype)[6:]} dq over 128 K tiles (2x rule)",
                                rule="dQ 的累加器以 fp32 保存，bf16/fp16 輸入也一樣（dK、dV 亦同）",
                                hint="dq = torch.zeros(q.shape, dtype=acc)（不是 torch.zeros_like(q)，那是 q 的 bf16/fp16）；"
                                     "每個區塊的 dS @ K_j 以 fp32 加進去，全部累加完才轉回 q.dtype。")
