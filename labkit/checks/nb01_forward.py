"""Visible tests of exercise 4 of 01_setup_and_comparison: ``flash_attention_forward(q, k, v, is_causal, block_m, block_n)``.

Each check runs the tiled forward on small inputs (q [..., N, d], k, v [..., Nk, d]) and compares
(o [..., N, d], lse [..., N]) with labkit's reference attention: fp32 to ~1e-7 (blocked sums reorder the
additions; atol=1e-5), float64 to rounding (1e-10), bf16/fp16 by the 2x rule. Probes watch how it reads:
tiles above the causal diagonal hold NaN, q's row blocks are recorded, and so is the largest tensor it builds.

Used in: 01_setup_and_comparison (test cells of ex4)
"""
from __future__ import annotations

import torch

from labkit.checks import contract, nb01
from labkit.core import grading
from labkit.engine import attention

ACCUMULATOR_RULE = "累加器 m、l 與輸出累加器 O 跨區塊都以 fp32 保存，bf16/fp16 輸入也一樣"


def _compare(flash_attention_forward, q, k, v, *, causal, blocks, label, **check):
    """Run the answer with ``blocks`` = (block_m, block_n) and check o and lse against the reference, named by
    ``label`` (o's, lse's); ``check``: tolerances and hints of nb01.check_against_reference.

    Returns (o, lse, o_ref, lse_ref).
    """
    o, lse = flash_attention_forward(q, k, v, is_causal=causal, block_m=blocks[0], block_n=blocks[1])
    return (o, lse, *nb01.check_against_reference(o, lse, q, k, v, names=tuple(f"flash_attention_forward: {x}" for x in label),
                                             causal=causal, **check))


def writes_its_own_code(flash_attention_forward) -> None:
    """No SDPA or softmax (nor labkit) anywhere the function reaches."""
    grading.check_own_code(flash_attention_forward, name="flash_attention_forward: 自己寫",
                           forbid=(torch.nn.functional.scaled_dot_product_attention, torch.softmax, torch.Tensor.softmax,
                                   torch.nn.functional.softmax))


def matches_reference(flash_attention_forward) -> None:
    """fp32 [2, 3, 100, 16] (N not a multiple of the blocks), causal or not, blocks 32 x 16 and 64 x 64;
    o in q's dtype, lse fp32."""
    torch.manual_seed(5)
    q, k, v = (torch.randn(2, 3, 100, 16) for _ in range(3))
    for causal in (False, True):
        for bm, bn in ((32, 16), (64, 64)):
            o, lse, _, _ = _compare(flash_attention_forward, q, k, v, causal=causal, blocks=(bm, bn),
                                    label=(f"o (causal={causal}, blocks={bm},{bn})", f"lse (causal={causal})"),
                                    hint="每讀一個 K/V 區塊，先以 exp(m - m_new) 縮放舊的 l 與 O，再加上新的。",
                                    lse_hint="lse = m + log(l)，在所有 K/V 區塊之後計算；形狀 [..., N]。")
            grading.check_true(o.dtype == q.dtype and lse.dtype == torch.float32, name="flash_attention_forward: dtype",
                               detail=f"o 應為 {q.dtype}、lse 應為 torch.float32，卻得到 {o.dtype} 與 {lse.dtype}。")


def causal_bottom_right(flash_attention_forward) -> None:
    """Causal with Nk != N, blocks 16 that divide neither: N=24 after 33 cached keys, decode N=1, and N=57 > Nk=24
    (the first 33 queries see no key: o = 0, lse = -inf, no NaN); N=63, Nk=64: the skip bound keeps the tile the
    diagonal crosses (query 15 sees key 16)."""
    torch.manual_seed(24)
    for n, nk in ((24, 57), (1, 50), (57, 24)):
        q = torch.randn(2, 3, n, 16)
        k, v = torch.randn(2, 3, nk, 16), torch.randn(2, 3, nk, 16)
        o, lse = flash_attention_forward(q, k, v, is_causal=True, block_m=16, block_n=16)
        grading.check_true(not o.isnan().any() and not lse.isnan().any(),
                           name=f"flash_attention_forward: no NaN, causal N={n}, Nk={nk}",
                           detail="結果含有 NaN（看不到任何 key 的列應為 o = 0、lse = -inf）。",
                           hint="整個區塊都被遮住的列 m_new = -inf：平移量改用 0；最後除以 l 時把 l = 0 換成 1。")
        _, lse, _, lse_ref = _compare(flash_attention_forward, q, k, v, causal=True, blocks=(16, 16),
                                      label=(f"causal N={n}, Nk={nk}", f"lse, causal N={n}, Nk={nk}"),
                                      hint="因果規則對齊右下角：j <= i + (Nk - N)；K/V 區塊的範圍與區塊內遮罩都要含 Nk - N。")
        grading.check_true(bool((torch.isneginf(lse) == torch.isneginf(lse_ref)).all()),
                           name=f"flash_attention_forward: lse = -inf exactly on rows that see no key (N={n}, Nk={nk})",
                           detail="看不到任何 key 的列 lse 應為 -inf，其他列為有限值。")
    q, k, v = torch.randn(1, 2, 63, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    o, _ = flash_attention_forward(q, k, v, is_causal=True, block_m=16, block_n=16)
    grading.check_tensor(o, attention.reference_attention(q, k, v, causal=True)[0],
                         name="flash_attention_forward: causal N=63, Nk=64, blocks 16 (skip bound)", atol=1e-5,
                         hint="Q 區塊 [i0, i1) 需要讀到 key i1 - 1 + (Nk - N)（含）：K 區塊的迴圈上界是 i1 + Nk - N（不含），"
                              "略過條件是 j0 > i1 - 1 + Nk - N，不是 >=。")


SKIP_CASES = (  # (N, Nk, first NaN row of V, block size, rows of o that see no NaN row, check name, hint)
    (96, 96, 32, 32, 32, "flash_attention_forward: causal block skipping",
     "因果時，整塊位於對角線右上方的 K/V 區塊要略過（不讀取、不相乘），不是讀進來再遮罩。"),
    (64, 32, 16, 16, 48, "flash_attention_forward: causal block skipping, N=64 > Nk=32",
     "K/V 區塊的上界是 min(Nk, i1 + (Nk - N))，Nk - N 可以是負的（這裡是 -32）：不要取絕對值，也不要先 max(0, ·)；"
     "看不到的區塊要略過，不是讀進來再遮罩。"),
)


def skips_tiles_above_the_diagonal(flash_attention_forward) -> None:
    """Causal tiles that no query of a Q block can see are skipped, not read and masked: V rows past some key are
    NaN, and o's rows whose queries see none of them must match the reference. N = Nk = 96 in blocks of 32; and
    N=64 > Nk=32 in blocks of 16 (query i sees keys j <= i - 32): rows 0..47 stay finite only if the tile range
    keeps the signed offset Nk - N (not |Nk - N| or 0)."""
    torch.manual_seed(25)
    for n, nk, nan_from, block, rows, name, hint in SKIP_CASES:
        q, k, v = torch.randn(1, 2, n, 8), torch.randn(1, 2, nk, 8), torch.randn(1, 2, nk, 8)
        o_ref, _ = attention.reference_attention(q, k, v, causal=True)
        v_nan = v.clone()
        v_nan[..., nan_from:, :] = float("nan")
        o, _ = flash_attention_forward(q, k, v_nan, is_causal=True, block_m=block, block_n=block)
        grading.check_tensor(o[..., :rows, :], o_ref[..., :rows, :], name=name, atol=1e-5, hint=hint)


def keeps_a_running_max(flash_attention_forward) -> None:
    """Scores near +-1e4 (d=4: scale 1/2 exact; one-hot keys: exact scores), causal or not: every tile subtracts
    the running max; then the tile's max is taken AFTER the causal mask (scores 10 j and 8 j grow along the keys,
    so a diagonal tile's largest score sits on a hidden key up to 150 above the visible ones)."""
    torch.manual_seed(15)
    base = torch.tensor([20000.0, -20000.0, 16000.0, -6000.0, 0.0])[torch.randint(0, 5, (40,))]
    q = (base[:, None] + torch.randint(-8, 9, (1, 2, 40, 4))).float()
    k = torch.eye(4)[torch.randint(0, 4, (1, 2, 70))]
    v = torch.randn(1, 2, 70, 4)
    for causal in (False, True):
        _compare(flash_attention_forward, q, k, v, causal=causal, blocks=(16, 16), float64_reference=True, rtol=1e-6,
                 label=(f"scores near 1e4 (causal={causal})", f"lse, scores near 1e4 (causal={causal})"),
                 hint="每個區塊都減去目前的最大值 m_new 再取 exp；不要用 0 或固定常數平移。")
    hint = "先套用區塊內的因果遮罩，再取區塊的最大值：被遮住的 key 不可參與 m_new，否則看得見的 key 的 exp 會下溢成 0。"
    for n, nk in ((40, 40), (24, 40)):
        k_up = (torch.arange(float(nk))[:, None] * torch.eye(4)[0]).expand(1, 2, nk, 4)
        q_up = torch.zeros(1, 2, n, 4)
        q_up[..., 0] = torch.tensor([20.0, 16.0])[:, None]                        # score = 10 j and 8 j
        _compare(flash_attention_forward, q_up, k_up, torch.randn(1, 2, nk, 4), causal=True, blocks=(16, 16),
                 float64_reference=True, lse_atol=1e-4, rtol=1e-6, hint=hint, lse_hint=hint,
                 label=(f"hidden keys with the largest scores (N={n}, Nk={nk})",
                        f"lse, hidden keys with the largest scores (N={n}, Nk={nk})"))


def float64_in_float64(flash_attention_forward) -> None:
    """float64 [3, 45, 8], causal, blocks 16: float64 accumulators and outputs (rounding only, atol=1e-10)."""
    q, k, v = (torch.randn(3, 45, 8, dtype=torch.float64) for _ in range(3))
    o, lse = flash_attention_forward(q, k, v, is_causal=True, block_m=16, block_n=16)
    grading.check_true(o.dtype == torch.float64 and lse.dtype == torch.float64, name="flash_attention_forward: float64 dtype",
                       detail=f"float64 輸入時 o 與 lse 都應為 float64，卻得到 {o.dtype} 與 {lse.dtype}。")
    _compare(flash_attention_forward, q, k, v, causal=True, blocks=(16, 16), atol=1e-10,
             label=("float64 accuracy", "float64 lse"),
             hint="累加器 dtype = torch.promote_types(q.dtype, torch.float32)：float64 輸入不要轉成 fp32。")


def accumulators_in_fp32(flash_attention_forward) -> None:
    """bf16 causal N=48, Nk=777, d=24 and fp16 N=32, Nk=1024, d=40, many K/V tiles (block_n=8), V ~ 2 + N(0, 1):
    o in the input dtype, lse fp32; o and lse by the 2x rule (an O or l rounded to bf16 each tile drifts); lse
    within 1e-4 of float64 (tile scores and exp in fp32; the scale 1/sqrt(d) is no power of two)."""
    torch.manual_seed(20)
    for dtype, n, nk, d, causal, bm in ((torch.bfloat16, 48, 777, 24, True, 16), (torch.float16, 32, 1024, 40, False, 32)):
        q = torch.randn(1, 2, n, d).to(dtype)
        k, v = torch.randn(1, 2, nk, d).to(dtype), (2 + torch.randn(1, 2, nk, d)).to(dtype)
        o, lse = flash_attention_forward(q, k, v, is_causal=causal, block_m=bm, block_n=8)
        grading.check_true(o.dtype == dtype and lse.dtype == torch.float32, name=f"flash_attention_forward: {dtype} dtype",
                           detail=f"{dtype} 輸入時 o 應為 {dtype}、lse 應為 fp32，卻得到 {o.dtype} 與 {lse.dtype}。",
                           hint="m、l、O 的累加器用 fp32：torch.promote_types(q.dtype, torch.float32)。")
        o_ref, lse_ref = attention.reference_attention(q.double(), k.double(), v.double(), causal=causal)
        o_base, lse_base = nb01.plain_attention(q, k, v, nb01.causal_keep(n, nk, causal))
        hint = ("acc 用 torch.promote_types(q.dtype, torch.float32)：每個區塊先 .to(acc)，m、l、O 用 acc 建立、"
                "跨區塊一直留在 acc（不要每個區塊轉回 q.dtype）；只有最後寫入 o 時才轉回 q.dtype。")
        grading.check_within_2x(lse, lse_ref, lse_base, rule=ACCUMULATOR_RULE, hint=hint,
                                name=f"flash_attention_forward: {dtype} lse, N={n}, Nk={nk}, block_n=8 (2x rule)")
        grading.check_within_2x(o, o_ref, o_base, rule=ACCUMULATOR_RULE, hint=hint,
                                name=f"flash_attention_forward: {dtype} o, N={n}, Nk={nk}, block_n=8 (2x rule)")
        grading.check_tensor(lse, lse_ref, name=f"flash_attention_forward: {dtype} lse to fp32 precision, N={n}, Nk={nk}",
                             atol=1e-4, hint="每個區塊的 S = q_i k_j^T、exp(S - m) 與 l 的加總都在 fp32（P 只在乘 V 時可轉成 q.dtype）；"
                                             "先把 q 轉成 fp32 再乘 scale（在 bf16 裡乘 scale 會把 q 捨入）；"
                                             "lse 與 float64 的差應在 1e-4 以內。")


class _RowReads(torch.overrides.TorchFunctionMode):
    """Records the blocks of rows sliced from ``src`` [..., N, d], as (first row, rows), in the order read."""

    def __init__(self, src):
        super().__init__()
        self.src, self.reads = src, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if args and args[0] is self.src and getattr(func, "__name__", "") in ("__getitem__", "narrow", "split", "chunk"):
            for piece in (out if isinstance(out, (tuple, list)) else [out]):
                if piece.dim() == self.src.dim() and piece.shape[-1] == self.src.shape[-1] and piece.shape[-2] < self.src.shape[-2]:
                    start = (piece.storage_offset() - self.src.storage_offset()) // self.src.stride(-2) % self.src.shape[-2]
                    self.reads.append((start, piece.shape[-2]))
        return out


def outer_loop_over_q_blocks(flash_attention_forward) -> None:
    """FA2's loop order on [1, 2, 96, 8], blocks 32: each Q block is read once (a block sliced again right after
    itself counts once), in any order (on a GPU the Q blocks run in parallel); K/V blocks outside, FlashAttention
    v1's order, read every Q block again for every K/V block."""
    q, k, v = (torch.randn(1, 2, 96, 8) for _ in range(3))
    with _RowReads(q) as rows:
        flash_attention_forward(q, k, v, block_m=32, block_n=32)
    counts = nb01.reads_per_index(rows.reads, q.shape[-2])
    grading.check_true(max(counts) <= 1, name="flash_attention_forward: outer loop over Q blocks (FA2's order)",
                       detail=f"q 的每一列應只讀一次，卻有列被讀了 {max(counts)} 次"
                              f"（讀取的 Q 區塊依序為 (起始列, 列數)：{rows.reads[:12]}…）。",
                       hint="外層迴圈跑 Q 區塊、內層跑 K/V 區塊：一個 Q 區塊讀進來，跑完所有 K/V 區塊、寫出它的 o 與 lse，"
                            "再換下一個 Q 區塊（Q 區塊的順序不限；K/V 在外層是 FlashAttention v1 的順序）。")


def keeps_the_contract(flash_attention_forward) -> None:
    """Causal fp32 q [1, 2, 12, 8], k, v [1, 2, 16, 8], blocks 8: inputs left unchanged (no in-place qi *= scale on a
    block of q), views (transposed storage, rows of a wider buffer) give the same o and lse, and on meta inputs every
    tensor it makes follows q's device (torch.arange / full / zeros with device=q.device)."""
    torch.manual_seed(35)
    q, k, v = torch.randn(1, 2, 12, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    contract.check_contract(flash_attention_forward, q, k, v, name="flash_attention_forward", meta=True,
                            is_causal=True, block_m=8, block_n=8)


def no_n_by_n_tensor(flash_attention_forward) -> None:
    """Causal [2, 3, 128, 16], blocks 32: no operation inside the call creates a tensor larger than an input or
    one [..., 32, 32] tile (an N x N one would be 98304 elements)."""
    q, k, v = (torch.randn(2, 3, 128, 16) for _ in range(3))
    limit = max(q.numel(), 2 * 3 * 32 * 32)
    size, op = grading.largest_new_tensor(lambda: flash_attention_forward(q, k, v, is_causal=True, block_m=32, block_n=32))
    grading.check_true(size <= limit, name="flash_attention_forward: no N x N tensor",
                       detail=f"呼叫中建立了 {size} 個元素的張量（{op}），超過輸入或單一區塊的大小 {limit}。",
                       hint="不要建立完整的分數矩陣或 N x N 因果遮罩；遮罩在區塊內用 arange 建立。")
