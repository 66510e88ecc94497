"""Visible tests of 09_flex_attention's exercise 5: the block-sparse forward kernel (``sparse_attention``).

fp32 against a float64 dense attention masked by the same boolean table (:func:`labkit.checks.nb09.attention64`,
the sink one more score column with value 0), block 16, ``create_block_mask``'s lists (``lk.flexlib.torch_lists``);
every run checked for loads and stores outside the tensors (``lk.tritonbounds``). The mask_mods come from the
notebook (``causal``, exercise 2's ``sliding_window`` and ``packed_causal``).

Used in: 09_flex_attention (test cell of ex5)
"""
from __future__ import annotations

import torch

from labkit.checks import contract
from labkit.core import grading
from labkit.tritonlab import bounds as tritonbounds, compile as tritoncompile, mode as tritonmode
from labkit.flex import lib as flexlib
from labkit.checks.nb09 import attention64, table

LOG2E = 1.4426950408889634
HEAD_ID_64 = "bh 取 tl.program_id(1).to(tl.int64)"   # what the hints ask for, not a line of source a student could copy
DOCS = (30, 7, 41, 22)   # document lengths of the visible document-mask runs (N = 100)
RULE_BF16 = "累加器 acc 與統計量 m、l 以 fp32 保存（tl.zeros(..., tl.float32)），p 只在 tl.dot 前轉成 v 的 dtype"


def documents(lengths) -> torch.Tensor:
    """Document ids [sum(lengths)] of consecutive documents of these lengths."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def forged_lists(n: int, full: bool) -> dict:
    """The eight lists of n x n blocks (kv and q_* alike) listing every block as full (``full``) or every block as
    partial, whatever the mask rule says: a kernel that skips the rule on full blocks and applies it on partial ones
    sees every key in the first case and the rule's keys in the second."""
    listed = (torch.full((n,), n), torch.arange(n).repeat(n, 1))                  # every block, in order
    unlisted = (torch.zeros(n, dtype=torch.long), torch.zeros(n, n, dtype=torch.long))
    as_full, as_partial = (listed, unlisted) if full else (unlisted, listed)
    lists = {}
    for pre in ("kv_", "q_"):
        lists[f"full_{pre}num_blocks"], lists[f"full_{pre}indices"] = as_full
        lists[f"{pre}num_blocks"], lists[f"{pre}indices"] = as_partial
    return {name: t.clone() for name, t in lists.items()}


def forward_matches(sparse_attention, what: str, mask_mod, Nq: int, Nk: int, hint: str, mask: str = "causal",
                    lists=None, allowed=None, dtype=torch.float32, B: int = 1, d: int = 16, block: int = 16, **kw):
    """``sparse_attention`` on seeded q [B, 2, Nq, d], k, v [B, 2, Nk, d] (``block``, ``lists`` or create_block_mask's
    for ``mask_mod``; ``kw``: window, document_id, sink) touches only its tensors and matches the float64 reference
    masked by ``allowed`` (default: ``mask_mod``'s table): o and lse within 1e-5; q, k, v, the lists and the sink
    left unchanged. Outputs a kernel never writes read NaN. Returns (o, lse)."""
    dev = tritonmode.device()
    torch.manual_seed(5)
    q, k, v = torch.randn(B, 2, Nq, d), torch.randn(B, 2, Nk, d), torch.randn(B, 2, Nk, d)
    lists = lists or flexlib.torch_lists(mask_mod, Nq, Nk, block)
    # counts (and skips) reads and writes past the tensors; outputs start as NaN: rows never written read NaN
    with tritonbounds.outside_accesses() as outside, contract.new_memory_reads_nan():
        o, lse = contract.check_inputs_unchanged(sparse_attention, *(t.to(dev, dtype) for t in (q, k, v)), lists, block,
                                                 mask=mask, name=f"練習 5（{what}）", **kw)
    tritonbounds.check_inside(outside, name=f"練習 5：只讀寫傳入的張量，{what}",
                              hint="尾端區塊（N 不是區塊的倍數）的載入與儲存都要 mask：K、V 與鍵的文件編號用 offs_n < N_K，"
                                   "q、o、lse 與查詢的文件編號用 offs_m < N_Q。")
    o_ref, lse_ref = attention64(q, k, v, table(mask_mod, Nq, Nk) if allowed is None else allowed, kw.get("sink"))
    grading.check_tensor(o.cpu(), o_ref, name=f"練習 5：o，{what}", atol=1e-5, hint=hint)
    grading.check_tensor(lse.cpu(), lse_ref, name=f"練習 5：lse，{what}", atol=1e-5, hint=hint)
    return o, lse


def _precisions(sparse_attention, causal, dtype) -> set:
    """The PREC arguments of _sparse_fwd_kernel's launches for causal inputs [1, 1, 32, 16] in ``dtype``."""
    dev = tritonmode.device()
    with tritoncompile.recorded() as launches:
        sparse_attention(*(torch.randn(1, 1, 32, 16, device=dev).to(dtype) for _ in range(3)),
                         flexlib.torch_lists(causal, 32, 32, 16), 16)
    return {launch.args.get("PREC") for launch in launches if launch.kernel == "_sparse_fwd_kernel"}


def forward_launch_and_precision(sparse_attention, causal) -> None:
    """Causal N = 64 (:func:`forward_matches`) launches _sparse_fwd_kernel; fp32 inputs launch it with
    PREC="ieee", bf16 and fp16 with "tf32" (inputs [1, 1, 32, 16])."""
    with tritonmode.launches() as launched:
        forward_matches(sparse_attention, "因果 N = 64", causal, 64, 64,
                        "先掃全滿區塊（MASKED=False），再掃部分區塊（MASKED=True，keep = q_idx >= kv_idx）；"
                        "第 j 個區塊的鍵從 indices[i, j] * BLOCK_N 起。")
    grading.check_true(launched["_sparse_fwd_kernel"] >= 1, name="練習 5：啟動 _sparse_fwd_kernel",
                       detail=f"啟動紀錄：{dict(launched)}。", hint="_sparse_fwd_kernel[(n_q, B * H)](...)。")
    precs = _precisions(sparse_attention, causal, torch.float32)
    grading.check_true(precs == {"ieee"}, name="練習 5：fp32 輸入以 PREC=\"ieee\" 啟動",
                       detail=f"fp32 輸入的啟動用了 PREC = {precs}。",
                       hint="fp32 輸入要精確的 fp32 乘法（\"ieee\"）；\"tf32\" 只給 bf16／fp16（直譯器看不出差別，GPU 上 tf32 會差到 1e-3）。")
    for half in (torch.bfloat16, torch.float16):
        precs = _precisions(sparse_attention, causal, half)
        grading.check_true(precs == {"tf32"}, name=f"練習 5：{str(half)[6:]} 輸入以 PREC=\"tf32\" 啟動",
                           detail=f"{half} 輸入的啟動用了 PREC = {precs}。",
                           hint="PREC = \"ieee\" if q.dtype == torch.float32 else \"tf32\"：bf16 與 fp16 的 tl.dot 都走張量核心。")


def forward_masks(sparse_attention, causal, sliding_window, packed_causal) -> None:
    """:func:`forward_matches` on: a tail block (N = 72); every score near -144 (fp32, causal N = 32: the running max
    starts at -inf); lists forged with every block full (the mask skipped) and every block partial (the mask
    applied); window 20 (N = 80) and 0 (N = 32: the diagonal only); documents (N = 100); head size 32;
    N_q = 40 != N_k = 72; block 32 (the argument, not the notebook's P.block: 16 on a CPU)."""
    forward_matches(sparse_attention, "因果 N = 72（尾端區塊）", causal, 72, 72,
                    "部分區塊載入 K/V 時要 mask=offs_n < N_K（other=0），keep 也要含邊界；o、lse 存回時要 mask=offs_m < N_Q。")
    # Every score near -144 (q near +6, k near -6, d = 16; fp32): the running max starts at -inf, not 0, or every
    # exp2(s - m) underflows to 0 and the row reads as empty. lse is about -144: fp32 rounding alone is ~1e-5, so atol 1e-4.
    dev, gen = tritonmode.device(), torch.Generator().manual_seed(25)
    q_low = torch.randn(1, 2, 32, 16, generator=gen) * 0.1 + 6.0
    k_low = -(torch.randn(1, 2, 32, 16, generator=gen) * 0.1 + 6.0)
    v_low = torch.randn(1, 2, 32, 16, generator=gen)
    got = sparse_attention(q_low.to(dev), k_low.to(dev), v_low.to(dev), flexlib.torch_lists(causal, 32, 32, 16), 16)
    for what, g, want in zip(("o", "lse"), got, attention64(q_low, k_low, v_low, table(causal, 32, 32))):
        grading.check_tensor(g.cpu(), want, name=f"練習 5：{what}，每個分數都在 -144 附近（因果 N = 32）", atol=1e-4,
                             hint="沒有匯點時 m 從 -inf 開始（tl.full(..., float(\"-inf\"), ...)），不是 0：從 0 開始時 exp2(s - 0) "
                                  "全部下溢成 0，l = 0，整列被當成看不見任何鍵。")
    forward_matches(sparse_attention, "全滿區塊不算遮罩（四個區塊都列為全滿、MASK = causal）", causal, 64, 64, mask="causal",
                    lists=forged_lists(4, full=True), allowed=torch.ones(64, 64, dtype=torch.bool),
                    hint="全滿區塊的每個分數都看得見：_online_tile(..., MASKED=False)，不求 MASK 的規則（省下的正是這一步）。")
    forward_matches(sparse_attention, "部分區塊要算遮罩（四個區塊都列為部分、MASK = causal）", causal, 64, 64, mask="causal",
                    lists=forged_lists(4, full=False), hint="部分區塊一定要求 MASK 的規則；把部分區塊當全滿算，看不見的鍵就漏進來了。")
    forward_matches(sparse_attention, "視窗 w = 20，N = 80", sliding_window(20), 80, 80, mask="window", window=20,
                    hint="MASK == 2：keep = 邊界 & (q >= j) & (q - j <= WINDOW)。")
    forward_matches(sparse_attention, "視窗 w = 0（只看自己），N = 32", sliding_window(0), 32, 32, mask="window", window=0,
                    hint="w = 0 是合法的視窗（只看對角線）：不要用 `window or ...` 把 0 當成「沒有視窗」，也不要把 WINDOW 下限夾到別的值。")
    doc = documents(DOCS)
    forward_matches(sparse_attention, "文件遮罩 N = 100", packed_causal(doc), 100, 100, mask="document", document_id=doc,
                    hint="MASK == 3：查詢區塊的文件編號在迴圈外讀一次（other=-1），鍵的編號每個區塊隨 K/V 讀（other=-2），keep 要求相等而且因果。")
    forward_matches(sparse_attention, "因果 N = 40、d = 32（head 大小 ≠ 區塊 16）", causal, 40, 40, d=32,
                    hint="HEAD_DIM = d 與 scale = 1/√d 從輸入的形狀來（q.shape[-1]），不要寫死 16 或 1/4。")
    forward_matches(sparse_attention, "因果 N_q = 40、N_k = 72", causal, 40, 72,
                    "N_q ≠ N_k：q 的偏移用 N_Q、k/v 的偏移用 N_K；清單每列的長度是 N_KV_BLOCKS（鍵區塊數）。")
    forward_matches(sparse_attention, "因果 N = 40、區塊 32（引數 block，不是 P.block）", causal, 40, 40, block=32,
                    hint="網格、BLOCK_M 與 BLOCK_N 都用引數 block（清單是以它切的），不要用 notebook 的 P.block 或寫死 16。")


def check_blocks_computed(count, listed: int, dots: int, name: str, hint: str) -> None:
    """The ``tl.dot`` products ``count["products"]`` (:func:`labkit.tritonlab.mode.loaded_elements`) at most twice what
    ``listed`` blocks of 16 x 16 (d = 16) need with ``dots`` products of a block each: unlisted blocks not computed."""
    need = listed * dots * 16 * 16 * 16
    grading.check_true(count["products"] <= 2 * need, name=name, hint=hint,
                       detail=f"tl.dot 共做了 {count['products']:,} 次乘加；清單上 {listed} 個區塊各 {dots} 個 16×16×16 的 tl.dot "
                              f"共 {need:,} 次，最多容許兩倍：算了清單以外的區塊（載入被遮住，計算照做）。")


def forward_reads_listed_blocks(sparse_attention, sliding_window) -> None:
    """Interpreter only: window 16, N = 128, inputs [1, 1, 128, 16]: the elements loaded lie between the K and V of
    the listed blocks and that plus q, ids and the list entries; the tl.dot products at most twice the listed
    blocks' (:func:`check_blocks_computed`: two dots a block)."""
    if tritonmode.current() != "interpreter":
        return
    dev = tritonmode.device()
    qw, kw_, vw = (torch.randn(1, 1, 128, 16, device=dev) for _ in range(3))
    lists_w = flexlib.torch_lists(sliding_window(16), 128, 128, 16)
    listed = int(lists_w["kv_num_blocks"].sum() + lists_w["full_kv_num_blocks"].sum())
    with tritonmode.loaded_elements() as count:
        sparse_attention(qw, kw_, vw, lists_w, 16, mask="window", window=16)
    kv_listed = listed * 16 * 16 * 2
    ceiling = kv_listed + 128 * 16 + 8 * (2 + 17 * listed)
    grading.check_true(kv_listed <= count["elements"] <= ceiling, name="練習 5：只讀清單上的區塊（視窗 16、N = 128：讀取的元素）",
                       detail=f"讀了 {count['elements']:,} 個元素；清單上 {listed} 個區塊的 K、V 共 {kv_listed:,} 個，"
                              f"加上 q 與清單本身最多 {ceiling:,} 個。",
                       hint="迴圈跑 range(0, num)，每次讀 indices[i, j] 那一個區塊；不要掃過所有鍵區塊再用遮罩濾掉（那樣照樣讀了）。")
    check_blocks_computed(count, listed, 2, name="練習 5：只算清單上的區塊（視窗 16、N = 128：tl.dot 的乘加數）",
                          hint="迴圈跑 range(0, num)：掃過清單的每個欄位（range(0, N_KV_BLOCKS)）再把沒列出的遮掉，"
                               "讀的元素雖少，每個欄位的 tl.dot 照樣要算；稀疏的好處正是不算那些區塊。")


def forward_contract(sparse_attention, causal) -> None:
    """Exercise 5's contract (:mod:`labkit.checks.contract`) on fp32 causal inputs [1, 2, 16, 16] (one block) with a
    sink: q, k, v as views (:func:`forward_matches` checks every run leaves its inputs unchanged)."""
    dev = tritonmode.device()
    torch.manual_seed(16)
    q, k, v = (torch.randn(1, 2, 16, 16, device=dev) for _ in range(3))
    lists, sink = flexlib.torch_lists(causal, 16, 16, 16), torch.tensor([1.5, -0.5], device=dev)
    contract.check_views(sparse_attention, q, k, v, lists, 16, sink=sink, name="練習 5")


def forward_head_offsets_64bit(fwd_kernel, causal) -> None:
    """Interpreter only: ``fwd_kernel`` (_sparse_fwd_kernel) launched by hand on [1, 20, 16] tensors (document mask,
    sink) with the head's program id from 2^27 (bh * N and bh * N * d past 2^31): no int32 +, -, * overflows."""
    if tritonmode.current() != "interpreter":
        return
    dev = tritonmode.device()
    q3, k3, v3 = (torch.randn(1, 20, 16, device=dev) for _ in range(3))
    o3, lse3 = torch.empty_like(q3), torch.empty(1, 20, device=dev)
    l20 = {name: t.to(torch.int32).contiguous() for name, t in flexlib.torch_lists(causal, 20, 20, 16).items()}
    sink2, doc20 = torch.zeros(2, device=dev), torch.zeros(20, dtype=torch.int32, device=dev)
    with tritonbounds.int32_overflows(keep=(q3, k3, v3, o3, lse3, sink2, doc20, *l20.values()), pid_offset=(0, 2**27, 0)) as seen:
        fwd_kernel[(2, 1)](q3, k3, v3, o3, lse3, sink2, doc20, l20["kv_num_blocks"], l20["kv_indices"],
                           l20["full_kv_num_blocks"], l20["full_kv_indices"], 0.25 * LOG2E, 20, 20, 2, 0, 2,
                           HEAD_DIM=16, MASK=3, HAS_SINK=True, PREC="ieee", BLOCK_M=16, BLOCK_N=16)
    grading.check_true(seen["overflows"] == 0, name="練習 5：64 位元的 head 偏移量（bh 從 2^27 起、N = 20、d = 16）",
                       detail=f"head 編號 2^27 起（bh * N 與 bh * N * d 都超過 2^31），核心裡有 {seen['overflows']} 個 int32 加減乘的結果溢位。",
                       hint=f"{HEAD_ID_64}：之後 bh * N_Q * HEAD_DIM、bh * N_K * HEAD_DIM、bh * N_Q 都是 64 位元；"
                            "32 位元在 GPU 上會悄悄繞回，讀寫到別的 head。")


def forward_sink(sparse_attention, causal, sliding_window) -> None:
    """The sink [1.5, -0.5] (:func:`forward_matches`): causal N = 72; B = 2 (sink[bh % H]); an all-zero sink (still one
    more key, e^0 = 1 in every row's denominator: not skipped); the identity
    o_sink = o * sigmoid(lse - sink) with the run without one; window 4 with N_q = 64 > N_k = 40 (rows that see no
    key: o = 0, lse = sink with one, -inf without)."""
    sink = torch.tensor([1.5, -0.5])
    o_s, _ = forward_matches(sparse_attention, "匯點（因果 N = 72）", causal, 72, 72, sink=sink,
                             hint="HAS_SINK：每列從 m = s_h·log2(e)、l = 1 開始（匯點是分數 s_h、值 0 的一個鍵），h = bh % H。")
    forward_matches(sparse_attention, "匯點、B = 2（每個 head 一個匯點）", causal, 40, 40, sink=sink, B=2,
                    hint="程式編號 bh = b·H + h：匯點要取 sink[bh % H]（這個 head 的），不是 sink[bh] 或 sink[bh // H]。")
    forward_matches(sparse_attention, "匯點全為 0（因果 N = 40）", causal, 40, 40, sink=torch.zeros(2),
                    hint="值全為 0 的匯點仍是一個分數 0 的鍵：每列的分母多一項 e^0 = 1，o 與 lse 都會變。"
                         "有沒有匯點只看 sink 是不是 None，不看它的值（例如 sink.any()）。")
    o_n, lse_n = forward_matches(sparse_attention, "沒有匯點（同一組輸入）", causal, 72, 72,
                                 "sink=None 時 HAS_SINK=False：m = -inf、l = 0。")
    grading.check_tensor(o_s.cpu(), o_n.cpu() * torch.sigmoid(lse_n.cpu() - sink.view(1, 2, 1)).unsqueeze(-1),
                         name="練習 5：恆等式 o_sink = o · sigmoid(lse − sink)", atol=1e-5,
                         hint="忽略匯點的核心（或只在最後才除）會讓這一關失敗：匯點在分母裡，每一列都變小。")
    # Window 4 with N_q = 64 > N_k = 40: rows 45..63 see no key (query blocks 3 lists no block at all).
    forward_matches(sparse_attention, "匯點、視窗 4、N_q = 64 > N_k = 40（第 45 列起看不見任何鍵）", sliding_window(4), 64, 40,
                    mask="window", window=4, sink=sink,
                    hint="看不見任何鍵的列：o = 0、lse = s_h（只剩匯點）；整個查詢區塊沒有任何清單上的區塊時也要存 o 與 lse。")
    forward_matches(sparse_attention, "沒有匯點、同上", sliding_window(4), 64, 40, mask="window", window=4,
                    hint="沒有匯點時看不見任何鍵的列：l = 0，o = 0、lse = -inf（不是 NaN）：除以 l 之前把 l = 0 換成 1。")


def _bf16_launches(sparse_attention, d: int, variants) -> None:
    """sparse_attention on bf16 inputs [1, 2, 64, d], once per (mask_mod, keyword arguments) in ``variants``."""
    dev = tritonmode.device()
    for mask_mod, kw in variants:
        sparse_attention(*(torch.randn(1, 2, 64, d, device=dev).to(torch.bfloat16) for _ in range(3)),
                         flexlib.torch_lists(mask_mod, 64, 64, 16), 16, **kw)


def forward_low_precision(sparse_attention, causal, sliding_window, packed_causal) -> None:
    """bf16 and fp16 inputs [1, 2, 128, 16] (causal, a sink bf16 cannot hold exactly): o in that dtype, lse fp32, o by
    the 2x rule (8 key blocks), lse within 1e-4 of float64 (only fp32 rounding: a sink rounded to the inputs' dtype
    moves it by about 1e-3); fp32 statistics in the Triton IR of bf16 launches of every branch (document mask with a sink, causal
    and window without); compiles for sm80 and sm90 at a GPU's tiles (128 x 128, d = 64, bf16)."""
    dev, sink = tritonmode.device(), torch.tensor([0.3, -2.7])   # fp32 logits; in bf16: 0.30078, -2.7031
    allowed = table(causal, 128, 128)
    for dtype in grading.LOW_PRECISION:
        torch.manual_seed(6)
        ql, kl, vl = (torch.randn(1, 2, 128, 16).mul(1.5).to(dtype) for _ in range(3))
        o_l, lse_l = sparse_attention(ql.to(dev), kl.to(dev), vl.to(dev), flexlib.torch_lists(causal, 128, 128, 16), 16,
                                      mask="causal", sink=sink)
        grading.check_true(o_l.dtype == dtype and lse_l.dtype == torch.float32, name=f"練習 5：{dtype} 輸入的 dtype",
                           detail=f"o {o_l.dtype}、lse {lse_l.dtype}：應為 {dtype} 與 float32。",
                           hint="o = torch.empty_like(q3)；lse 用 torch.float32；存 o 之前 .to(o_ptr.dtype.element_ty)。")
        o64, lse64 = attention64(ql, kl, vl, allowed, sink)
        grading.check_tensor(lse_l.cpu().double(), lse64, atol=1e-4, name=f"練習 5：{dtype} 輸入的 lse（fp32 的匯點）",
                             hint="sink 是 fp32 的 logit：以 float32 交給核心（不要轉成輸入的 dtype），m、l 與 lse 都以 fp32 計算。")
        s_low = torch.cat([(ql @ kl.transpose(-2, -1)) / 4.0 + torch.where(allowed, 0.0, float("-inf")).to(dtype),
                           sink.to(dtype).view(1, 2, 1, 1).expand(1, 2, 128, 1)], dim=-1)   # plain attention in that dtype
        o_base = torch.softmax(s_low, dim=-1)[..., :128] @ vl
        grading.check_within_2x(o_l.cpu(), o64, o_base, name=f"練習 5：{dtype} 的 o（N = 128，8 個鍵區塊）", rule=RULE_BF16)
    doc = documents(DOCS)[:64]
    branches = [(packed_causal(doc), dict(mask="document", document_id=doc, sink=sink)),   # every kernel branch:
                (causal, dict(mask="causal")), (sliding_window(20), dict(mask="window", window=20))]  # with and without a sink
    tritoncompile.check_fp32_statistics(lambda: _bf16_launches(sparse_attention, 16, branches),
                                        name="練習 5：_sparse_fwd_kernel", rule=RULE_BF16,
                                        hint="m、l、acc 用 fp32 建立；分數與指數在 fp32 中計算。")
    tritoncompile.check_compiles(lambda: _bf16_launches(sparse_attention, 64, branches[:1]), name="練習 5：_sparse_fwd_kernel",
                                 config=dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2))


def sink_grad_matches(sink_grad, B: int, H: int, N: int, seed: int, what: str, dtype=None, d: int = 8) -> None:
    """Exercise 6: ``sink_grad(o, do, lse, sink)`` -> [H] fp32 vs float64 autograd through causal attention with the
    sink as one more score column (q, k, v [B, H, N, d], dO random); with ``dtype`` (bf16, fp16), o and dO rounded to
    it vs the formula in float64 on the same rounded values (D in fp32: within 1e-4). In fp32 (no ``dtype``): o, dO,
    lse and the sink in fp32 left unchanged (``.float()`` of an fp32 tensor is that tensor), and as views."""
    torch.manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, d, dtype=torch.float64) for _ in range(3))
    sink = torch.randn(H, dtype=torch.float64).mul(2.0).requires_grad_()
    o, lse = attention64(q, k, v, torch.ones(N, N, dtype=torch.bool).tril(), sink)
    grad_o = torch.randn_like(o)
    (o * grad_o).sum().backward()
    if dtype is None:
        got = sink_grad(o.detach(), grad_o, lse.detach().float(), sink.detach().float())
        grading.check_tensor(got, sink.grad, name=f"練習 6：{what}", atol=1e-4, rtol=1e-4,
                             hint="dsink_h = −Σ_b Σ_i exp(s_h − lse_i) · D_i，D = rowsum(dO ∘ O)：負號、exp(s − lse)（不是 lse − s），"
                                  "對 batch 與列加總、每個 head 各一個值。")
        fp32 = [t.float() for t in (o.detach(), grad_o, lse.detach(), sink.detach())]
        contract.check_inputs_unchanged(sink_grad, *fp32, name="練習 6（fp32 輸入）")
        contract.check_views(sink_grad, *fp32, name="練習 6", atol=1e-4)
        grading.check_true(isinstance(got, torch.Tensor) and got.dtype == torch.float32 and tuple(got.shape) == (H,),
                           name=f"練習 6：{what} 的形狀與 dtype", detail=f"應為 [{H}] fp32，得到 {getattr(got, 'dtype', type(got))} "
                                                                      f"{tuple(getattr(got, 'shape', ()))}。",
                           hint="對 dim=(0, 2)（batch 與列）加總，留下 head 一維。")
        return
    ol, dol = o.detach().to(dtype), grad_o.to(dtype)
    got = sink_grad(ol, dol, lse.detach().float(), sink.detach().float())
    exact = -(torch.exp(sink.detach().view(1, -1, 1) - lse.detach()) * (dol.double() * ol.double()).sum(-1)).sum(dim=(0, 2))
    grading.check_tensor(got, exact, name=f"練習 6：{what}", atol=1e-4, rtol=1e-4,
                         hint="D = rowsum(dO ∘ O) 與 exp(s − lse) 以 fp32 計算：先 .float() 再相乘相加"
                              "（在 bf16 裡加總 d 個乘積，每一步都捨入到 8 位有效位元）。")
