"""Visible tests of exercise 1 of 02_gpt2_integration: the attention function GPT-2 calls.

``my_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs)`` takes
query ``[B, H, N, D]``, key and value ``[B, H, Nk, D]`` and returns ``(out [B, N, H, D], None)``. The
references are labkit's standard attention (scores materialized, softmax in fp32) on float64 inputs, or
PyTorch's SDPA in the inputs' dtype as the 2x rule's baseline.

Used in: 02_gpt2_integration (test cells of ex1)
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from labkit.checks import contract
from labkit.core import grading
from labkit.engine import attention

CAUSAL = types.SimpleNamespace(is_causal=True)           # module stand-ins: what the function reads of `module`
BIDIRECTIONAL = types.SimpleNamespace(is_causal=False)


def reference_bnhd(q, k, v, **kwargs):
    """Standard attention (scores materialized, softmax in fp32), in transformers' [B, N, H, D] layout."""
    return attention.reference_attention(q, k, v, **kwargs)[0].transpose(1, 2)


def own_formula(my_attention) -> None:
    """The answer writes the formula: it calls neither SDPA nor labkit."""
    grading.check_own_code(my_attention, name="自己寫出公式：不呼叫 SDPA 或 labkit", forbid=(F.scaled_dot_product_attention,))


def _qkv(gen):
    """q, k, v [B=2, H=3, N=Nk=6, D=8] in fp32."""
    return tuple(torch.randn(2, 3, 6, 8, generator=gen) for _ in range(3))


def returns_output_and_none(my_attention) -> None:
    """``(out, None)`` with out [B, N, H, D] = (2, 6, 3, 8) for q, k, v [2, 3, 6, 8]."""
    q, k, v = _qkv(torch.Generator().manual_seed(0))
    result = my_attention(CAUSAL, q, k, v, None, scaling=0.5)
    grading.check_true(isinstance(result, tuple) and len(result) == 2 and result[1] is None,
                       name="my_attention 回傳值", detail="應回傳 (輸出, None) 兩個元素的 tuple。")
    grading.check_true(isinstance(result[0], torch.Tensor) and tuple(result[0].shape) == (2, 6, 3, 8),
                       name="輸出排列 [B, N, H, D]",
                       detail=f"query 是 [B, H, N, D] = (2, 3, 6, 8)，輸出應為 (2, 6, 3, 8)，"
                              f"卻得到 {tuple(getattr(result[0], 'shape', ()))}。",
                       hint="transformers 要的是 [B, N, H, D]：最後把 [B, H, N, D] 的結果 transpose(1, 2)。")


def keeps_the_contract(my_attention) -> None:
    """q, k, v [2, 3, 6, 8] with a boolean mask [2, 1, 6, 6] and dropout=0.0, as transformers passes them: q, k, v and
    the caller's mask left unchanged; each as a view (the transposed storage of [B, N, H, D], rows of a wider buffer)
    gives the contiguous answer; a causal call with Nk = 9 in between changes nothing (no mask cached by shape); on
    meta inputs every tensor it makes follows query's device; scaling=0.0 is used as given (o = mean of v)."""
    g = torch.Generator().manual_seed(58)
    q, k, v = _qkv(g)
    keep = torch.rand(2, 1, 6, 6, generator=g) > 0.3
    contract.check_contract(my_attention, CAUSAL, q, k, v, keep, name="my_attention", meta=True, atol=1e-6,
                            scaling=0.5, dropout=0.0)
    k9, v9 = (torch.randn(2, 3, 9, 8, generator=g) for _ in range(2))
    contract.check_no_state(lambda: my_attention(CAUSAL, q, k, v, None, scaling=0.5),
                            lambda: my_attention(CAUSAL, q, k9, v9, None, scaling=0.5), name="my_attention", atol=1e-6)
    contract.check_follows_device(my_attention, CAUSAL, q, k9, v9, None, name="my_attention", scaling=0.5)  # its own mask
    grading.check_tensor(my_attention(BIDIRECTIONAL, q, k, v, None, scaling=0.0)[0], v.mean(-2, keepdim=True).expand_as(v).transpose(1, 2),
                         name="my_attention：scaling=0.0 照用（每個分數都是 0，輸出 = value 的平均）", atol=1e-6,
                         hint="只有 scaling is None 時才用 1/sqrt(D)：`scaling or D ** -0.5` 會把 0.0 當成沒給。")


def follows_scaling_and_masks(my_attention) -> None:
    """Against :func:`reference_bnhd` (atol 1e-5): the scaling passed or 1/sqrt(D), no mask for a non-causal module,
    the bottom-right causal rule for N < Nk and N > Nk, a boolean mask used as given (fully masked rows give 0,
    no causal rule added on top, also for N=3 < Nk=7), and integer scores up to ~5000 without overflow."""
    g = torch.Generator().manual_seed(0)
    q, k, v = _qkv(g)
    grading.check_tensor(my_attention(CAUSAL, q, k, v, None, scaling=0.5)[0], reference_bnhd(q, k, v, causal=True, scale=0.5),
                         name="使用傳進來的 scaling（0.5），因果，N = Nk", atol=1e-5,
                         hint="分數乘上傳進來的 scaling，不是自己算的 1/sqrt(D)；遮罩為 None 且 module.is_causal 時套用因果規則。")
    grading.check_tensor(my_attention(CAUSAL, q, k, v, None)[0], reference_bnhd(q, k, v, causal=True),
                         name="scaling=None 時用 1/sqrt(D)", atol=1e-5, hint="scaling 為 None 時用 D ** -0.5。")
    grading.check_tensor(my_attention(BIDIRECTIONAL, q, k, v, None, scaling=0.5)[0], reference_bnhd(q, k, v, scale=0.5),
                         name="module.is_causal 為 False、遮罩為 None：不遮", atol=1e-5,
                         hint="只有 module.is_causal 為真時才套用因果規則。")
    for n, nk in ((1, 7), (3, 7), (6, 4)):  # N < Nk: decoding with a KV cache; N > Nk: the first N - Nk rows see nothing
        qn = torch.randn(2, 3, n, 8, generator=g)
        kn, vn = (torch.randn(2, 3, nk, 8, generator=g) for _ in range(2))
        grading.check_tensor(my_attention(CAUSAL, qn, kn, vn, None, scaling=0.5)[0],
                             reference_bnhd(qn, kn, vn, causal=True, scale=0.5),
                             name=f"因果規則對齊右下角（N={n}, Nk={nk}）", atol=1e-5,
                             hint="query i 可以看 key j <= i + (Nk - N)；j <= i（左上角）在解碼時只讓 query 看到第一個 key。"
                                  "N > Nk 時前 N - Nk 列看不到任何 key：輸出 0，不是 NaN。")
    pad = torch.ones(2, 6, dtype=torch.bool)
    pad[1, :2] = False  # row 1: two pads on the left
    keep = torch.ones(6, 6, dtype=torch.bool).tril() & pad[:, None, None, :]  # [B, 1, N, Nk]: causal and padding
    keep[0, 0, 4, 1] = False  # a hole the causal rule alone would not make
    grading.check_tensor(my_attention(CAUSAL, q, k, v, keep, scaling=0.5)[0], reference_bnhd(q, k, v, scale=0.5, mask=keep),
                         name="使用 attention_mask（布林，True = 可以看；左側補齊有整列被遮住）", atol=1e-5,
                         hint="attention_mask 不是 None 時直接用它（它已含因果規則）：torch.where(mask, scores, -inf)；"
                              "整列被遮住時 softmax 是 NaN，要換成 0（例如 .nan_to_num(0.0)）。")
    # A boolean mask with N < Nk (3 new tokens after 4 cached ones; row 1 left-padded by 2) on a causal module: the mask
    # already holds the bottom-right causal rule, so a causal rule applied again (top-left j <= i) hides cached keys.
    g_dec = torch.Generator().manual_seed(7)
    q3, k7, v7 = (torch.randn(2, 3, length, 8, generator=g_dec) for length in (3, 7, 7))
    pad7 = torch.ones(2, 7, dtype=torch.bool)
    pad7[1, :2] = False
    keep_dec = (torch.arange(7)[None, :] <= torch.arange(3)[:, None] + 4) & pad7[:, None, None, :]  # [B, 1, 3, 7]
    grading.check_tensor(my_attention(CAUSAL, q3, k7, v7, keep_dec, scaling=0.5)[0],
                         reference_bnhd(q3, k7, v7, scale=0.5, mask=keep_dec),
                         name="attention_mask 不是 None 時只用它（N=3 < Nk=7，因果模組，有補齊）", atol=1e-5,
                         hint="遮罩已含右下角對齊的因果規則：不要再套一次因果規則（左上角的 j <= i 會遮掉快取裡的 key）。")
    qi, ki = (torch.randint(-50, 51, (1, 2, 5, 8), generator=g).float() for _ in range(2))  # integer scores: exact in fp32
    vi = torch.randn(1, 2, 5, 8, generator=g)
    grading.check_tensor(my_attention(CAUSAL, qi, ki, vi, None, scaling=1.0)[0],
                         reference_bnhd(qi.double(), ki.double(), vi.double(), causal=True, scale=1.0),
                         name=f"大分數（最大 {float((qi @ ki.transpose(-2, -1)).max()):.0f}）不溢位", atol=1e-5,
                         hint="exp(x) 在 fp32 於 x > 88 時變成 inf：先減去每列的最大值再取 exp（torch.softmax 會替你做）。")


def output_dtype_follows_value(my_attention) -> None:
    """bf16 q, k, v [2, 3, 6, 8] give a bf16 output (atol 2e-2); fp64 ones are computed in fp64 (atol 1e-12)."""
    q, k, v = _qkv(torch.Generator().manual_seed(0))
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    out = my_attention(CAUSAL, qb, kb, vb, None, scaling=0.5)[0]
    grading.check_true(isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16, name="輸出 dtype 和 value 相同",
                       detail=f"bf16 的 query/key/value 應得到 bf16 的輸出，卻得到 {getattr(out, 'dtype', type(out))}。",
                       hint="softmax 在 fp32 算完後，用 .to(value.dtype) 轉回來再乘 V。")
    grading.check_tensor(out, reference_bnhd(qb, kb, vb, causal=True, scale=0.5), name="bf16 的輸出數值", atol=2e-2)
    # fp64 in: scores and softmax in fp64 (rounding ~1e-16; fp32 arithmetic would leave ~1e-7).
    qd, kd, vd = q.double(), k.double(), v.double()
    out = my_attention(CAUSAL, qd, kd, vd, None, scaling=0.5)[0]
    grading.check_true(isinstance(out, torch.Tensor) and out.dtype == torch.float64, name="fp64 進、fp64 出",
                       detail=f"fp64 的 query/key/value 應得到 fp64 的輸出，卻得到 {getattr(out, 'dtype', type(out))}。")
    grading.check_tensor(out, reference_bnhd(qd, kd, vd, causal=True, scale=0.5), name="fp64 輸入以 fp64 計算", atol=1e-12,
                         hint="計算用的 dtype = torch.promote_types(query.dtype, torch.float32)：fp64 輸入就留在 fp64，不要一律轉成 fp32。")


def precision_large_scores(my_attention) -> None:
    """The 2x rule against float64, bf16 and fp16 inputs with large scores (std ~25), N < Nk, N = Nk, N > Nk.

    Baseline: PyTorch's own attention in that dtype (SDPA keeps scores and softmax in fp32). Floor: half a spacing
    of the output dtype at the largest output (probabilities cast to value.dtype before @ V, as FlashAttention does).
    """
    g = torch.Generator().manual_seed(1)
    for low in (torch.bfloat16, torch.float16):
        for n, nk, d in ((21, 50, 24), (40, 40, 40), (64, 33, 16)):  # D not a power of 2
            ql, kl = ((5 * torch.randn(2, 2, length, d, generator=g)).to(low) for length in (n, nk))
            vl = torch.randn(2, 2, nk, d, generator=g).to(low)
            exact = reference_bnhd(ql.double(), kl.double(), vl.double(), causal=True)
            plain = F.scaled_dot_product_attention(ql, kl, vl, attn_mask=torch.ones(n, nk, dtype=torch.bool).tril(nk - n))
            grading.check_within_2x(my_attention(CAUSAL, ql, kl, vl, None)[0], exact, plain.nan_to_num(0.0).transpose(1, 2),
                                    name=f"精度規則：{str(low)[6:]} 輸入、分數很大（N={n}, Nk={nk}, D={d}）",
                                    rule="分數 QK^T 與 softmax 在 fp32 計算，機率算完才轉回 value.dtype",
                                    hint="先把 query、key 轉成 fp32 再相乘（query.to(acc) @ key.to(acc).transpose(-2, -1)，acc = torch.promote_types(query.dtype, torch.float32)）："
                                         "bf16 的矩陣乘法結果已經捨入成 bf16，分數 32 附近的間距是 0.25，機率就差了一成以上；"
                                         "scaling 乘在 fp32 的分數上（不要先把 bf16 的 query 乘上 scaling）；"
                                         "softmax 也要吃 fp32 的分數，不要先轉回 value.dtype。",
                                    floor=0.5 * torch.finfo(low).eps * float(exact.abs().max()))


def constant_v_case(low, n, nk, d, gen):
    """(query, key, value, exact output [B, N, H, D], SDPA's output) in dtype `low`, value the same on every key.

    Every output row IS that row of V (values with few mantissa bits, exact in bf16 and fp16), so PyTorch's and
    the fp32 softmax's outputs are exact.
    """
    ql, kl = (torch.randn(2, 2, length, d, generator=gen).to(low) for length in (n, nk))
    row = torch.tensor([1.5, -1.25, 1.375, -1.125, 1.4375, -1.3125] * d)[:d]
    vl = row.expand(2, 2, nk, d).to(low).contiguous()
    exact = reference_bnhd(ql.double(), kl.double(), vl.double(), causal=True)
    keep = torch.ones(n, nk, dtype=torch.bool).tril(nk - n)
    return ql, kl, vl, exact, F.scaled_dot_product_attention(ql, kl, vl, attn_mask=keep).transpose(1, 2)


def precision_row_sum(my_attention) -> None:
    """The sum of exp (and the max) stays fp32: with value the same on every key (:func:`constant_v_case`) the
    output is exact, no floor is given, and a row sum rounded to bf16/fp16 (half a spacing: 0.4% in bf16) moves
    every output by one spacing. Small scores and N < Nk (causal): every row averages over 90+ keys, so rounding
    each probability to bf16 before @ V (as the rule allows) leaves their sum within 0.1% of 1."""
    g = torch.Generator().manual_seed(2)
    for low, (n, nk, d) in ((torch.bfloat16, (40, 128, 16)), (torch.float16, (33, 120, 24))):
        q_low, k_low, v_same, exact, plain = constant_v_case(low, n, nk, d, g)
        grading.check_within_2x(my_attention(CAUSAL, q_low, k_low, v_same, None)[0], exact, plain,
                                name=f"精度規則：{str(low)[6:]} 輸入、value 在每個 key 都相同（輸出應剛好等於 value，N={n}, Nk={nk}）",
                                rule="softmax 的統計量（每列的最大值與 exp 的總和）在 fp32 計算與保存，機率算完才轉回 value.dtype",
                                hint="每列的總和 l = exp(s - m).sum(-1) 要留在 fp32：把 l（或先把 exp 的結果）轉成 bf16/fp16 再相除，"
                                     "整列機率的和就差到半個間距（bf16 約 0.4%），每個輸出一起偏掉。"
                                     "最簡單的寫法：torch.softmax(fp32 的分數, dim=-1)，算完才 .to(value.dtype)。")


def identity_v_case(n, nk, spread, scaling, gen):
    """(query, key, value = I, exact P [B, N, H, Nk], SDPA's output) in bf16, D = Nk, no mask."""
    ql, kl = ((spread * torch.randn(2, 2, length, nk, generator=gen)).to(torch.bfloat16) for length in (n, nk))
    vl = torch.eye(nk).expand(2, 2, nk, nk).to(torch.bfloat16)
    scale = nk ** -0.5 if scaling is None else scaling
    exact = torch.softmax(ql.double() @ kl.double().transpose(-2, -1) * scale, dim=-1).transpose(1, 2)
    return ql, kl, vl, exact, F.scaled_dot_product_attention(ql, kl, vl, scale=scale).transpose(1, 2)


def precision_each_probability(my_attention) -> None:
    """Each probability on its own: value = I (D = Nk, :func:`identity_v_case`), so output row i IS row i of P (cast
    to bf16, as the rule allows). Scores spread over about +-50 (module not causal): each probability's relative
    error (log against float64) shows roundings the bf16 output hides elsewhere. A scale rounded to bf16
    (1/sqrt(48): 0.14%) moves a score of 50 by 0.07, and an exp argument s - m rounded to bf16 errs by up to
    2^-8 |s - m|: a few percent on the probabilities far below the row max, against 2^-8 for the output's own
    rounding (SDPA's bf16 error is about 2x that)."""
    g = torch.Generator().manual_seed(11)
    for n, nk, spread, scaling in ((30, 48, 3.0, None), (20, 40, 2.0, 0.5)):
        q_low, k_low, v_eye, exact, plain = identity_v_case(n, nk, spread, scaling, g)
        got = my_attention(BIDIRECTIONAL, q_low, k_low, v_eye, None, scaling=scaling)[0]
        grading.check_within_2x(got.double().log(), exact.log(), plain.double().log(),
                                name=f"精度規則：value = 單位矩陣（輸出就是機率），分數約 ±50，每個機率的相對誤差（log；N={n}, Nk=D={nk}, scaling={scaling}）",
                                rule="分數乘上 scaling、softmax 的 s - m 與 exp 都在 fp32 計算，機率算完才轉回 value.dtype",
                                hint="scaling 用 Python float 乘在 fp32 的分數上，不要變成 bf16 的張量（torch.tensor(scaling, dtype=query.dtype)）；"
                                     "自己寫 softmax 時 s - m 不要先轉成 value.dtype 再 exp：比最大值低 30 的分數，差值在 bf16 的間距是 0.125，機率差到 6%。")


def mask_on_query_device(my_attention) -> None:
    """The causal mask is built on query's device: inputs on the meta device (shapes, no data) give a meta
    [1, 5, 2, 8] output for query [1, 2, 5, 8], key and value [1, 2, 7, 8], without a GPU."""
    try:
        on_meta = my_attention(CAUSAL, torch.empty(1, 2, 5, 8, device="meta"),
                               *(torch.empty(1, 2, 7, 8, device="meta") for _ in range(2)), None)[0]
        made = (on_meta.device.type, tuple(on_meta.shape))
    except (RuntimeError, NotImplementedError) as err:
        made = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    grading.check_true(made == ("meta", (1, 5, 2, 8)), name="my_attention: the causal mask on query's device (inputs on meta)",
                       detail=f"輸入在 meta 裝置上時，應回傳 meta 上的 [1, 5, 2, 8]，得到 {made}。",
                       hint="torch.arange(n, device=query.device)：自己建的因果遮罩要和分數在同一個裝置上，否則 GPU 上會碰到 CPU 上的遮罩而出錯。")
