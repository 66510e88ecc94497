"""Visible tests of 09_flex_attention's exercises 1-4: the dense reference, mask_mods, score_mods, block lists.

Shared with :mod:`labkit.checks.nb09_sparse`: :func:`table` (a mask_mod's boolean table) and :func:`attention64`
(float64 attention masked by a table, with an optional sink). The references compute another way than the
answers: PyTorch's flex_attention run eagerly in float64 (``lk.flexlib.flex``), the rules written out position by
position, ``create_block_mask``'s own lists (``lk.flexlib.torch_lists``).

Used in: 09_flex_attention (test cells of ex1, ex2, ex3, ex4)
"""
from __future__ import annotations

import math

import torch
from torch.nn.attention.flex_attention import create_block_mask

from labkit.checks import contract
from labkit.core import grading
from labkit.flex import lib as flexlib


def table(mask_mod, Nq: int, Nk: int) -> torch.Tensor:
    """The bool table [Nq, Nk] of ``mask_mod`` (b = h = 0 as 0-d tensors: and_masks / or_masks call tensor methods)."""
    zero = torch.tensor(0)
    got = mask_mod(zero, zero, torch.arange(Nq).view(Nq, 1), torch.arange(Nk).view(1, Nk))
    return torch.as_tensor(got).expand(Nq, Nk).bool()


def attention64(q, k, v, allowed, sink=None):
    """float64 attention masked by ``allowed`` [Nq, Nk] (True: seen), sink [H] one more score column (value 0).

    q [B, H, Nq, d], k, v [B, H, Nk, d] -> (o [B, H, Nq, d], lse [B, H, Nq]), float64, differentiable (autograd
    through q, k, v and the sink); a row that sees no key (and no sink) gives o = 0, lse = -inf.
    """
    s = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~allowed, float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.double().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))[..., :k.shape[-2]]
    return p @ v.double(), lse


def _with_flex(dense_attention, q, k, v, **kwargs):
    """(o, lse) of the answer and (o, lse) of flex_attention (eager, block 16) on the same inputs and rules."""
    return (*dense_attention(q, k, v, **kwargs), *flexlib.flex(q, k, v, block=16, **kwargs))


def _inputs(seed: int, *shape_n: int, dtype=torch.float64, d: int = 8, B: int = 2, H: int = 3):
    """Seeded ``torch.randn(B, H, n, d)`` for each n in ``shape_n``."""
    torch.manual_seed(seed)
    return tuple(torch.randn(B, H, n, d, dtype=dtype) for n in shape_n)


def dense_matches_flex(dense_attention, causal, relative_bias) -> None:
    """Exercise 1 against flex_attention (float64, q [2, 3, 20, 8], k, v [2, 3, 28, 8]): no mods, a score_mod on
    the scaled scores (``relative_bias``), the scale argument (0.3 and 0: uniform weights), ``causal``, rules that read b and h, the mask after a
    soft-capping score_mod, rows 1000 apart whose hidden keys score highest (each row's own max)."""
    q, k, v = _inputs(2, 20, 28, 28)
    cases = [("no mods (Nq = 20, Nk = 28)", {}, "o = softmax(scale · q kᵀ) v；scale = 1/√d。"),
             ("score_mod on the scaled scores", dict(score_mod=relative_bias),
              "score_mod 收到的是已經乘過 scale 的分數：先乘 scale，再呼叫 score_mod（不是之後再乘）。"),
             ("scale = 0.3", dict(scale=0.3), "scale 引數不是 None 時就用它，不用 1/√d。"),
             ("scale = 0（每個鍵權重相同）", dict(scale=0.0),
              "scale = 0.0 也是給定的值：用 `scale is None` 判斷，不要用 `scale or 1/√d`（0.0 為假，會被換成 1/√d）。"),
             ("causal mask_mod", dict(mask_mod=causal), "mask_mod 回傳 False 的位置設成 -inf，索引順序是 (b, h, q_idx, kv_idx)。"),
             ("rules that read b and h", dict(score_mod=lambda s, b, h, q_idx, kv_idx: s + 0.3 * h - 0.2 * b,
                                              mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + 2 * h + b),
              "b = arange(B) 形狀 [B, 1, 1, 1]、h = arange(H) 形狀 [1, H, 1, 1]：規則可以依 batch 與 head 而不同。")]
    for what, kwargs, hint in cases:
        o, lse, o_ref, lse_ref = _with_flex(dense_attention, q, k, v, **kwargs)
        grading.check_tensor(o, o_ref, name=f"練習 1：o，{what}", atol=1e-10, hint=hint)
        grading.check_tensor(lse, lse_ref, name=f"練習 1：lse，{what}", atol=1e-10,
                             hint="lse = m + log(Σ exp(s - m))：別漏了加回每列的最大值 m。")

    def softcap_20(score, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(score / 20.0)

    o, _, o_ref, _ = _with_flex(dense_attention, q, k, v, score_mod=softcap_20, mask_mod=causal)
    grading.check_tensor(o, o_ref, name="練習 1：遮罩在 score_mod 之後（軟上限 + 因果）", atol=1e-10,
                         hint="先呼叫 score_mod、再遮罩：先設 -inf 再做 c·tanh(s/c) 會把 -inf 變回 -c，被遮住的鍵又看得見了。")

    def far_rows(score, b, h, q_idx, kv_idx):   # rows 1000 apart; the keys the causal mask hides score highest
        return score - 1000.0 * q_idx + 2000.0 * (kv_idx > q_idx)

    o, lse, o_ref, lse_ref = _with_flex(dense_attention, q, k, v, score_mod=far_rows, mask_mod=causal)
    grading.check_tensor(o, o_ref, name="練習 1：每列各自的最大值（列與列差 1000、被遮住的鍵分數最高）", atol=1e-10,
                         hint="先遮罩（-inf）再取每一列自己的最大值 m：用整個張量的最大值、遮罩前的最大值或 exp 之後才乘遮罩，"
                              "別的列或被遮住的鍵會讓看得見的 exp 全部下溢成 0。")
    grading.check_tensor(lse, lse_ref, name="練習 1：lse（列與列差 1000）", atol=1e-8)


def dense_empty_rows(dense_attention) -> None:
    """Exercise 1: the first 5 of 20 queries see no key (q [2, 3, 20, 8], float64), hidden by a mask_mod, then by a
    score_mod that returns -inf for their whole rows: o = 0, lse = -inf, no NaN."""
    q, k, v = _inputs(2, 20, 28, 28)

    def late_start(b, h, q_idx, kv_idx):   # the first 5 queries see no key at all
        return (q_idx >= 5) & (q_idx >= kv_idx)

    def late_scores(score, b, h, q_idx, kv_idx):   # the same rows, hidden by the score_mod (no mask_mod)
        return torch.where(q_idx >= 5, score, float("-inf"))

    for how, mods in (("mask_mod", dict(mask_mod=late_start)), ("score_mod 回傳 -inf", dict(score_mod=late_scores))):
        o, lse, o_ref, lse_ref = _with_flex(dense_attention, q, k, v, **mods)
        grading.check_true(bool(torch.isfinite(o).all()), name=f"練習 1：看不見任何鍵的列沒有 NaN（{how}）",
                           detail=f"前 5 列一個鍵都看不見，o 卻有 {int((~torch.isfinite(o)).sum())} 個 NaN／Inf。",
                           hint="那一列的最大值是 -inf，s - m = -inf - (-inf) = NaN：最大值是 -inf 時改減 0；再把 l = 0 的列除以 1（得到 0）。"
                                "score_mod 也能讓整列變成 -inf：不論有沒有 mask_mod 都要這樣處理。")
        grading.check_tensor(o, o_ref, name=f"練習 1：看不見任何鍵的列輸出 0（{how}）", atol=1e-10,
                             hint="一個鍵都看不見的列：o = 0、lse = -inf（FlexAttention 的約定）。")
        grading.check_tensor(lse, lse_ref, name=f"練習 1：看不見任何鍵的列 lse = -inf（{how}）", atol=1e-10,
                             hint="lse = m + log(l)：l = 0 時 log(0) = -inf，m 那時要是 0（不是 -inf）。")


def dense_contract(dense_attention, causal) -> None:
    """Exercise 1's contract (:mod:`labkit.checks.contract`) on q [1, 2, 6, 4], k, v [1, 2, 9, 4] with ``causal``:
    fp32 and float64 inputs left unchanged (``.to(fp32)`` of an fp32 tensor is that tensor), views."""
    for dtype in (torch.float32, torch.float64):
        q, k, v = _inputs(4, 6, 9, 9, dtype=dtype, d=4, B=1, H=2)
        contract.check_inputs_unchanged(dense_attention, q, k, v, mask_mod=causal, name=f"練習 1（{str(dtype)[6:]}）")
    contract.check_views(dense_attention, q, k, v, mask_mod=causal, name="練習 1")


def dense_low_precision(dense_attention, causal, relative_bias) -> None:
    """Exercise 1 on bf16 and fp16 inputs: o in the input dtype and lse fp32 [B, H, N_q]; o and lse by the 2x rule
    (q, k, v [1, 2, 64, 32], causal with ``relative_bias``); bf16's o rounded once (equal to the float64 answer
    rounded to bf16, up to 8 ties)."""
    qb, kb, vb = (t.to(torch.bfloat16) for t in _inputs(2, 20, 28, 28))
    ob, lseb = dense_attention(qb, kb, vb, mask_mod=causal)
    grading.check_true(ob.dtype == torch.bfloat16 and lseb.dtype == torch.float32 and tuple(lseb.shape) == (2, 3, 20),
                       name="練習 1：bf16 輸入 -> o 是 bf16、lse 是 fp32 [B, H, N_q]",
                       detail=f"得到 o {ob.dtype}、lse {lseb.dtype} {tuple(lseb.shape)}。",
                       hint="統計量（最大值、指數和、lse）在 fp32 中計算；o 最後才 .to(q.dtype)。")
    rule = "分數、最大值、指數和與 lse 以 fp32 計算，o 最後才轉回輸入的 dtype"
    for dtype in grading.LOW_PRECISION:
        ql, kl, vl = (t.mul(2.0).to(dtype) for t in _inputs(3, 64, 64, 64, dtype=torch.float32, d=32, B=1, H=2))
        mods = dict(score_mod=relative_bias, mask_mod=causal)
        o_low, lse_low = dense_attention(ql, kl, vl, **mods)
        o64, lse64 = flexlib.flex(ql.double(), kl.double(), vl.double(), block=16, **mods)
        o_base, lse_base = flexlib.flex(ql, kl, vl, block=16, **mods)
        grading.check_within_2x(o_low, o64, o_base, name=f"練習 1：{dtype} 的 o", rule=rule)
        grading.check_within_2x(lse_low, lse64, lse_base.float(), name=f"練習 1：{dtype} 的 lse", rule=rule)
    ql, kl, vl = (t.mul(2.0).to(torch.bfloat16) for t in _inputs(3, 64, 64, 64, dtype=torch.float32, d=32, B=1, H=2))
    o_low, _ = dense_attention(ql, kl, vl, mask_mod=causal)
    o64, _ = flexlib.flex(ql.double(), kl.double(), vl.double(), mask_mod=causal, block=16)
    off = int((o_low != o64.to(torch.bfloat16)).sum())
    grading.check_true(off <= 8, name="練習 1：bf16 的 o 只在最後捨入一次",
                       detail=f"{off} 個元素與 float64 的結果捨入到 bf16 不同（容許 8 個：捨入的邊界情況）。",
                       hint="P 與 P·V 都留在 fp32，o 最後才 .to(q.dtype)；不要把 P 先轉成 bf16 再乘 V。")


def mask_rule(mask_mod, rule, n: int, name: str, hint: str) -> None:
    """``mask_mod`` on the whole [n, n] index grid equals ``rule(i, j)`` position by position; then it runs under
    vmap (create_block_mask, block 8) and shows some block."""
    got, want = table(mask_mod, n, n), torch.tensor([[bool(rule(i, j)) for j in range(n)] for i in range(n)])
    bad = (got != want).nonzero()
    first = tuple(bad[0].tolist()) if len(bad) else ()
    grading.check_true(len(bad) == 0, name=name, hint=hint,
                       detail=f"{len(bad)} 個位置不符，例如查詢 {first[0]}、鍵 {first[1]}：得到 {bool(got[first])}，"
                              f"應為 {bool(want[first])}。" if len(bad) else "")
    blocks = create_block_mask(mask_mod, None, None, n, n, device="cpu", BLOCK_SIZE=8)   # runs the rule under vmap
    grading.check_true(blocks.kv_num_blocks.sum() + blocks.full_kv_num_blocks.sum() > 0, name=name + "（vmap）",
                       detail="create_block_mask 沒找到任何看得見的區塊。")


def mask_mods_follow_rules(sliding_window, document_mask, packed_causal, prefix_lm) -> None:
    """Exercise 2's four rules (:func:`mask_rule`): sliding_window(3) on 12 positions and (0) on 6, document_mask
    and packed_causal on 10 tokens of 4 documents, prefix_lm(4) on 10."""
    mask_rule(sliding_window(3), lambda i, j: j <= i and i - j <= 3, 12, "練習 2：sliding_window(3)",
              "位置 i 看 i - w … i：共 w + 1 個鍵（含自己），而且因果（不看 j > i）。")
    mask_rule(sliding_window(0), lambda i, j: i == j, 6, "練習 2：sliding_window(0) 只看自己",
              "w = 0 時只剩對角線：q_idx - kv_idx <= w，不是 < w。")
    doc = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
    mask_rule(document_mask(doc), lambda i, j: doc[i] == doc[j], 10, "練習 2：document_mask（同一份文件、雙向）",
              "document_id[q_idx] == document_id[kv_idx]：不同文件一律看不見（不能用 <=，那會看見前面的文件）。")
    mask_rule(packed_causal(doc), lambda i, j: doc[i] == doc[j] and j <= i, 10, "練習 2：packed_causal（同文件且因果）",
              "and_masks(causal, document_mask(document_id))：兩個條件都要成立；or_masks 會讓文件互相看見。")
    mask_rule(prefix_lm(4), lambda i, j: j < 4 or j <= i, 10, "練習 2：prefix_lm(4)",
              "前綴是位置 0 … prefix_len - 1（kv_idx < prefix_len）；or_masks(causal, 鍵在前綴裡)。")


def score_mods_follow_rules(alibi_slopes, alibi, softcap, causal) -> None:
    """Exercise 3: alibi_slopes(8) = 1/2 ... 1/256 (fp32 tensor), (4) and (16) by the formula; ALiBi's bias on the
    grid of batch 2, 8 heads, 5 positions; softcap(30) at small and large scores, not in place; both run inside
    flex_attention with ``causal`` (q, k, v [1, 8, 24, 16]) and give finite outputs."""
    def formula(n_heads):
        return torch.tensor([2.0 ** (-8.0 * (i + 1) / n_heads) for i in range(n_heads)])

    slopes8 = alibi_slopes(8)
    grading.check_tensor(slopes8, torch.tensor([2.0 ** -(i + 1) for i in range(8)]), name="練習 3：alibi_slopes(8)",
                         atol=1e-9, hint="m_h = 2^(-8(h+1)/H)，h 從 0 起：第一個 head 的斜率是 2^(-8/H)，不是 1。")
    for n_heads in (4, 16):   # the formula for any power of 2, not H = 8's table
        grading.check_tensor(alibi_slopes(n_heads), formula(n_heads), name=f"練習 3：alibi_slopes({n_heads})", atol=1e-9,
                             hint="m_h = 2^(-8(h+1)/H) 隨 H 而變：H = 4 時是 1/4、1/16、1/64、1/256；別寫死 H = 8 的 1/2、1/4、…。")
    grading.check_true(isinstance(slopes8, torch.Tensor) and slopes8.dtype == torch.float32, name="練習 3：斜率是 fp32 張量",
                       detail=f"得到 {type(slopes8).__name__} {getattr(slopes8, 'dtype', '')}。")
    b, h = torch.arange(2).view(2, 1, 1, 1), torch.arange(8).view(1, 8, 1, 1)
    qi, ki = torch.arange(5).view(1, 1, 5, 1), torch.arange(5).view(1, 1, 1, 5)
    bias = alibi(slopes8)(torch.zeros(2, 8, 5, 5), b, h, qi, ki)
    want = torch.tensor([[[[float(slopes8[hh]) * (j - i) for j in range(5)] for i in range(5)] for hh in range(8)]] * 2)
    grading.check_tensor(bias, want, name="練習 3：ALiBi 的偏差 slopes[h]·(kv_idx − q_idx)", atol=1e-7,
                         hint="每個 head 用自己的斜率 slopes[h]（不是 slopes[b]）；鍵在查詢之前（kv_idx < q_idx）時偏差是負的。")
    scores = [-200.0, -30.0, -1.0, 0.0, 0.5, 30.0, 200.0]
    grading.check_tensor(softcap(30.0)(torch.tensor(scores), 0, 0, 0, 0), 30.0 * torch.tanh(torch.tensor(scores) / 30.0),
                         name="練習 3：softcap(30)", atol=1e-5,
                         hint="c·tanh(s/c)：先除以 c 再 tanh、再乘回 c；不是裁切（clamp），小的分數幾乎不變、不是被壓到 tanh(s)。")
    q3, k3, v3 = (torch.randn(1, 8, 24, 16) for _ in range(3))
    for mod in (alibi(slopes8), softcap(30.0)):
        o3, _ = flexlib.flex(q3, k3, v3, score_mod=mod, mask_mod=causal, block=8)
        grading.check_true(bool(torch.isfinite(o3).all()), name="練習 3：在 flex_attention 裡執行",
                           detail="flex_attention 的輸出含 NaN／Inf。")
    s_in = torch.tensor(scores)
    softcap(30.0)(s_in, 0, 0, 0, 0)
    grading.check_tensor(s_in, torch.tensor(scores), name="練習 3：softcap 不改動傳入的分數", atol=0,
                         hint="score_mod 是純函式：回傳新的張量（cap * torch.tanh(score / cap)），不要用 div_／tanh_／mul_ 原地改寫 score。")


LIST_HINTS = {"kv": "部分區塊 = 有 True 但不全是 True；全滿區塊 = 全是 True（any 與 all 不能混用）；"
                    "N 不是區塊的倍數時，補到整塊的序列外位置算 False（看不見），不是 True。",
              "full": "全滿 = 區塊內每個位置都是 True；序列外的位置算 False，所以尾端的區塊最多是部分的。",
              "q": "轉置清單：同一張 [n_q, n_k] 的表按行讀（chosen.T），每個鍵區塊列出看見它的查詢區塊。"}


def lists_match(mine, mask_mod, Nq: int, Nk: int, block: int, what: str) -> None:
    """Exercise 4's eight lists ``mine`` (name -> tensor) vs create_block_mask's for ``mask_mod``: shapes, counts
    exactly, then the first ``count`` indices of every row (ascending)."""
    want = flexlib.torch_lists(mask_mod, Nq, Nk, block)
    for name in flexlib.LIST_NAMES:
        hint = LIST_HINTS["q" if name.startswith(("q_", "full_q")) else "full" if name.startswith("full") else "kv"]
        got = mine.get(name) if isinstance(mine, dict) else None
        grading.check_true(isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(want[name].shape),
                           name=f"練習 4：{what} 的 {name} 形狀", hint="個數 [n]、編號 [n, m]；n 與 m 用無條件進位的區塊數。",
                           detail=f"應為 {tuple(want[name].shape)} 的張量，得到 {type(got).__name__} {tuple(getattr(got, 'shape', ()))}。")
        if name.endswith("num_blocks"):
            grading.check_true(torch.equal(got.long(), want[name]), name=f"練習 4：{what} 的 {name}", hint=hint,
                               detail=f"得到 {got.tolist()}，應為 {want[name].tolist()}。")
            continue
        for row, count in enumerate(want[name.replace("indices", "num_blocks")].tolist()):
            grading.check_true(got[row, :count].long().tolist() == want[name][row, :count].tolist(),
                               name=f"練習 4：{what} 的 {name}[{row}]",
                               hint=hint + "編號要升冪（torch.argsort 要 stable=True：不穩定的排序在較長的列上會打亂順序）。",
                               detail=f"前 {count} 個得到 {got[row, :count].tolist()}，應為 {want[name][row, :count].tolist()}。")


def block_lists_match(block_lists, causal, sliding_window, packed_causal) -> None:
    """Exercise 4 (:func:`lists_match`), block 16: causal N = 64 and 72 (a tail block), window 20, a packed document
    mask with N = 100, causal N_q = 40 != N_k = 72; block 8: causal N = 44 (counts first), N = 144 (rows of 18)."""
    doc = torch.repeat_interleave(torch.arange(4), torch.tensor([30, 7, 41, 22]))   # 100 tokens, 4 documents
    for mask_mod, Nq, Nk, what in ((causal, 64, 64, "因果 N = 64"), (causal, 72, 72, "因果 N = 72（尾端區塊）"),
                                   (sliding_window(20), 64, 64, "視窗 w = 20"),
                                   (packed_causal(doc), 100, 100, "文件遮罩 N = 100"), (causal, 40, 72, "因果 N_q = 40、N_k = 72")):
        lists_match(block_lists(mask_mod, Nq, Nk, 16), mask_mod, Nq, Nk, 16, what)
    lists8 = block_lists(causal, 44, 44, 8)
    n8 = tuple(getattr(lists8.get("kv_num_blocks") if isinstance(lists8, dict) else None, "shape", ()))
    grading.check_true(n8 == (6,), name="練習 4：區塊 8、N = 44 的查詢區塊數",
                       detail=f"kv_num_blocks 的形狀應為 (6,)（⌈44 / 8⌉），得到 {n8}。",
                       hint="用引數 block，不要寫死 16：n_q = ⌈N_q / block⌉、view 成 [n_q, block, n_k, block]。")
    lists_match(lists8, causal, 44, 44, 8, "因果 N = 44、區塊 8")
    lists_match(block_lists(causal, 144, 144, 8), causal, 144, 144, 8, "因果 N = 144、區塊 8（每列最多 18 個區塊）")


PACK_HINTS = {"tokens": "torch.cat(docs)：依序首尾相接。",
              "cu_seqlens": "長度 n + 1、從 0 起的累積長度：[0, ℓ0, ℓ0 + ℓ1, …]（開頭的 0 不能少）。",
              "position_ids": "位置在每份文件的開頭歸零：全域位置減去這份文件的起點 cu_seqlens[document_ids]。",
              "document_ids": "第 t 個詞元屬於第幾份文件（從 0 起）：torch.repeat_interleave(torch.arange(n), lengths)。"}


def contamination(document_ids, seed: int = 0) -> float:
    """max |d loss(last document) / d x(earlier documents)| through one float64 causal attention masked by
    ``document_ids`` [T] (x [1, 1, T, 8]): 0 when no token sees another document."""
    torch.manual_seed(seed)
    T = len(document_ids)
    x = torch.randn(1, 1, T, 8, dtype=torch.float64, requires_grad=True)
    allowed = (document_ids.view(T, 1) == document_ids.view(1, T)) & torch.ones(T, T, dtype=torch.bool).tril()
    s = (x @ x.transpose(-2, -1)).masked_fill(~allowed, float("-inf"))
    o = torch.softmax(s, dim=-1) @ x
    last = int(document_ids[-1])
    o[..., document_ids == last, :].pow(2).sum().backward()
    return float(x.grad[..., document_ids != last, :].abs().max())


def packing_follows_rules(pack) -> None:
    """Exercise 8: three documents of lengths 3, 1, 4 written out (tokens, cu_seqlens, document_ids, position_ids),
    the dtypes (cu_seqlens int32, the rest int64); the documents passed in left unchanged; no cross-document
    contamination (lengths 5, 9, 4, 7)."""
    packed = pack([torch.tensor([5, 6, 7]), torch.tensor([9]), torch.tensor([1, 2, 3, 4])])
    want = {"tokens": [5, 6, 7, 9, 1, 2, 3, 4], "cu_seqlens": [0, 3, 4, 8], "document_ids": [0, 0, 0, 1, 2, 2, 2, 2],
            "position_ids": [0, 1, 2, 0, 0, 1, 2, 3]}   # document ids before positions: positions are read from them
    for key, values in want.items():
        got = packed.get(key) if isinstance(packed, dict) else None
        grading.check_true(isinstance(got, torch.Tensor) and got.tolist() == values, name=f"練習 8：{key}（長度 3、1、4）",
                           detail=f"應為 {values}，得到 {got.tolist() if isinstance(got, torch.Tensor) else got!r}。",
                           hint=PACK_HINTS[key])
    grading.check_true(packed["cu_seqlens"].dtype == torch.int32 and packed["position_ids"].dtype == torch.int64
                       and packed["document_ids"].dtype == torch.int64 and packed["tokens"].dtype == torch.int64,
                       name="練習 8：dtype（cu_seqlens int32，其他 int64）",
                       detail=f"得到 {({k: str(v.dtype) for k, v in packed.items()})}。",
                       hint="varlen 核心要 int32 的 cu_seqlens；位置與編號拿來索引，用 int64。")
    contract.check_inputs_unchanged(pack, [torch.tensor([5, 6, 7]), torch.tensor([9])], name="練習 8")
    leak = contamination(pack([torch.randint(0, 100, (n,)) for n in (5, 9, 4, 7)])["document_ids"])
    grading.check_true(leak == 0.0, name="練習 8：沒有跨文件污染（最後一份文件的損失對前面文件的梯度 = 0）",
                       detail=f"最後一份文件的損失對前面文件輸入的梯度最大是 {leak:.3g}，應正好是 0：有詞元看見了別份文件。",
                       hint="document_ids 要讓每份文件自成一組：同一份文件同一個編號、不同文件不同編號。")
