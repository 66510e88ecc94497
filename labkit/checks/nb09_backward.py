"""Visible tests of 09_flex_attention's exercise 7: the block-sparse backward kernels (``sparse_attention_backward``).

fp32 against float64 autograd through a dense attention masked by the same boolean table
(:func:`labkit.checks.nb09.attention64`, the sink one more column), block 16, ``create_block_mask``'s eight lists;
o and lse from that dense attention (not the student's forward); every run checked for loads and stores outside
the tensors (``lk.tritonbounds``). The kernels are launched apart (_sparse_bwd_dkdv_kernel, _sparse_bwd_dq_kernel)
or in one launch of the notebook's _sparse_bwd_kernel.

Used in: 09_flex_attention (test cell of ex7)
"""
from __future__ import annotations

import torch

from labkit.checks import contract
from labkit.core import grading
from labkit.tritonlab import bounds as tritonbounds, compile as tritoncompile, mode as tritonmode
from labkit.flex import lib as flexlib
from labkit.checks.nb09 import attention64, table
from labkit.checks.nb09_forward import DOCS, HEAD_ID_64, LOG2E, check_blocks_computed, documents, forged_lists

KERNELS = ("_sparse_bwd_dkdv_kernel", "_sparse_bwd_dq_kernel", "_sparse_bwd_kernel")   # launched apart or in one
PREC_HINT = "和練習 5 一樣：fp32 用 \"ieee\"，bf16／fp16 用 \"tf32\"。"


def grads64(q, k, v, do, allowed, sink=None):
    """float64 autograd: (o, lse, dq, dk, dv) of :func:`attention64` masked by ``allowed`` [Nq, Nk], loss sum(o * do)."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    o, lse = attention64(q, k, v, allowed, sink)
    (o * do.double()).sum().backward()
    return o.detach(), lse.detach(), q.grad, k.grad, v.grad


def backward_matches(sparse_attention_backward, what: str, mask_mod, Nq: int, Nk: int, hint: str, mask: str = "causal",
                     sink=None, B: int = 1, d: int = 16, block: int = 16, lists=None, allowed=None, **kw) -> None:
    """``sparse_attention_backward`` (``block``, ``lists`` or create_block_mask's for ``mask_mod``) on seeded q, dO
    [B, 2, Nq, d], k, v [B, 2, Nk, d] with o and lse (fp32) from the float64 attention masked by ``allowed`` (default:
    ``mask_mod``'s table; ``kw``: window, document_id) touches only its tensors; dV, dK, dQ within 2e-5 of float64
    autograd; q, k, v, o, lse, dO and the lists left unchanged. Outputs a kernel never writes read NaN."""
    dev = tritonmode.device()
    torch.manual_seed(13)
    q, k, v = torch.randn(B, 2, Nq, d), torch.randn(B, 2, Nk, d), torch.randn(B, 2, Nk, d)
    do = torch.randn(B, 2, Nq, d)
    o, lse, dq_ref, dk_ref, dv_ref = grads64(q, k, v, do, table(mask_mod, Nq, Nk) if allowed is None else allowed, sink)
    lists = lists or flexlib.torch_lists(mask_mod, Nq, Nk, block)
    # counts (and skips) reads and writes past the tensors; outputs start as NaN: rows never written read NaN
    with tritonbounds.outside_accesses() as outside, contract.new_memory_reads_nan():
        dq, dk, dv = contract.check_inputs_unchanged(
            sparse_attention_backward, *(t.to(dev) for t in (q, k, v, o.float(), lse.float(), do)), lists, block, mask=mask,
            name=f"練習 7（{what}）", **kw)
    tritonbounds.check_inside(outside, name=f"練習 7：只讀寫傳入的張量，{what}",
                              hint="尾端區塊的載入與儲存都要 mask：K、V、dK、dV 與鍵的文件編號用 offs_n < N_K，"
                                   "q、dO、lse、D、dQ 與查詢的文件編號用 offs_m < N_Q。")
    for name, got, want in (("dV", dv, dv_ref), ("dK", dk, dk_ref), ("dQ", dq, dq_ref)):
        grading.check_tensor(got.cpu(), want, name=f"練習 7：{name}，{what}", atol=2e-5, hint=hint)


def backward_masks(sparse_attention_backward, causal, sliding_window, packed_causal):
    """:func:`backward_matches` on causal N = 64 (both kernels launched), a tail block (N = 72), window 20 and 0,
    rows that see no key (lse = -inf: window 4, N_q = 32 > N_k = 16), documents (N = 100), N_q = 40 != N_k = 72
    causal and unmasked, B = 2 with head size 32, a sink, block 32 (the argument, not P.block); lists forged with every
    block full (kv and q_* lists, MASK = causal: full blocks skip the mask, every key seen). Returns the launch
    counts of the first run (kernel name -> launches)."""
    with tritonmode.launches() as launched:
        backward_matches(sparse_attention_backward, "因果 N = 64", causal, 64, 64,
                         "dK、dV 核心讀轉置清單（q_num_blocks、q_indices 與 full_q_*），dQ 核心讀 kv 清單；P = exp2(s·qk_scale − lse·log2 e)，"
                         "dS = P ∘ (dP − D)，dK 與 dQ 乘 scale。")
    grading.check_true(launched["_sparse_bwd_dkdv_kernel"] >= 1 and launched["_sparse_bwd_dq_kernel"] >= 1
                       or launched["_sparse_bwd_kernel"] >= 1,
                       name="練習 7：啟動兩個反向核心（各自啟動，或由 _sparse_bwd_kernel 一次啟動）", detail=f"啟動紀錄：{dict(launched)}。")
    cases = [("因果 N = 72（尾端區塊）", causal, 72, 72, "部分區塊：載入時檢查 N_Q／N_K 的邊界，keep 也含邊界；看不見的 P 設成 0。", {}),
             ("視窗 w = 20、N = 80", sliding_window(20), 80, 80, "MASK == 2 的規則與前向相同：(q >= j) & (q − j <= WINDOW)。",
              dict(mask="window", window=20)),
             ("視窗 w = 0（只看自己）、N = 32", sliding_window(0), 32, 32,
              "w = 0 是合法的視窗（只看對角線）：不要用 `window or ...` 把 0 當成「沒有視窗」，也不要把 WINDOW 下限夾到別的值。",
              dict(mask="window", window=0)),
             ("看不見任何鍵的列（視窗 4、N_q = 32 > N_k = 16：第 20 列起，lse = -inf）", sliding_window(4), 32, 16,
              "這些列的 lse = -inf：先把看不見的分數設成 -inf 再 exp2(s − lse) 會得到 -inf − (-inf) = NaN。"
              "先算 P = exp2(s·qk_scale − lse2)，再用 tl.where(keep, P, 0.0) 把看不見的設成 0。", dict(mask="window", window=4)),
             ("文件遮罩 N = 100", packed_causal(documents(DOCS)), 100, 100, "MASK == 3：兩個核心都要讀查詢與鍵的文件編號。",
              dict(mask="document", document_id=documents(DOCS))),
             ("因果 N_q = 40、N_k = 72", causal, 40, 72,
              "N_q ≠ N_k：dK/dV 核心的清單每列長 N_Q_BLOCKS（查詢區塊數），dQ 核心的每列長 N_KV_BLOCKS（鍵區塊數）；"
              "q、dO、lse、D 的偏移用 N_Q，k、v 用 N_K。", {}),
             ("無遮罩 N_q = 40、N_k = 72（每個鍵都有梯度）", lambda b, h, q_idx, kv_idx: q_idx >= 0, 40, 72,
              "dK/dV 核心的網格是鍵區塊數 (cdiv(N_k, block), B·H)，dQ 核心是查詢區塊數 (cdiv(N_q, block), B·H)："
              "N_q ≠ N_k 時兩者不同，網格少了的鍵區塊 dK、dV 就沒有寫。", dict(mask="none")),
             ("B = 2、d = 32（head 大小 ≠ 區塊 16）", causal, 40, 40,
              "HEAD_DIM = d 與 scale = 1/√d 從輸入的形狀來（q.shape[-1]），不要寫死 16 或 1/4。", dict(B=2, d=32)),
             ("匯點（因果 N = 64）", causal, 64, 64, "lse 含匯點：公式不變，P 直接用前向存下的 lse 重算。",
              dict(sink=torch.tensor([1.0, -2.0]))),
             ("因果 N = 40、區塊 32（引數 block，不是 P.block）", causal, 40, 40,
              "網格、BLOCK_M 與 BLOCK_N 都用引數 block（清單是以它切的），不要用 notebook 的 P.block 或寫死 16。", dict(block=32))]
    for what, mask_mod, Nq, Nk, hint, kw in cases:
        backward_matches(sparse_attention_backward, what, mask_mod, Nq, Nk, hint, **kw)
    # Lists forged with every block full (both ways) while MASK = causal: full blocks skip the rule, so every key is seen
    backward_matches(sparse_attention_backward, "全滿區塊不算遮罩（四個區塊都列為全滿、MASK = causal）", causal, 64, 64,
                     "全滿區塊的每個 P 都留著：兩個核心都只在部分區塊求 MASK 的規則、把看不見的 P 設成 0，"
                     "全滿區塊不求規則（和練習 5 的 MASKED=False 一樣）。",
                     lists=forged_lists(4, full=True), allowed=torch.ones(64, 64, dtype=torch.bool))
    return launched


def backward_head_offsets_64bit(dkdv_kernel, dq_kernel, preprocess_kernel, launched, causal) -> None:
    """Interpreter only: ``dkdv_kernel`` and ``dq_kernel`` (and ``preprocess_kernel`` where ``launched``, the counts
    :func:`backward_masks` returns, shows the wrapper launches it) launched by hand on [1, 20, 16] tensors (document
    mask) with the head's program id from 2^27: no int32 +, -, * overflows (lse and D offsets too)."""
    if tritonmode.current() != "interpreter":
        return
    qo, ko, vo, doo = (torch.randn(1, 20, 16) for _ in range(4))
    dqo, dko, dvo = (torch.empty_like(qo) for _ in range(3))
    lse2o, deltao, doco = torch.zeros(1, 20), torch.zeros(1, 20), torch.zeros(20, dtype=torch.int32)
    lo = {name: t.to(torch.int32).contiguous() for name, t in flexlib.torch_lists(causal, 20, 20, 16).items()}
    tiles = dict(HEAD_DIM=16, MASK=3, PREC="ieee", BLOCK_M=16, BLOCK_N=16)
    with tritonbounds.int32_overflows(keep=(qo, ko, vo, doo, dqo, dko, dvo, lse2o, deltao, doco, *lo.values()),
                                      pid_offset=(0, 2**27, 0)) as seen:
        dkdv_kernel[(2, 1)](qo, ko, vo, doo, lse2o, deltao, dko, dvo, doco, lo["q_num_blocks"], lo["q_indices"],
                            lo["full_q_num_blocks"], lo["full_q_indices"], 0.25 * LOG2E, 0.25, 20, 20, 0, 2, **tiles)
        dq_kernel[(2, 1)](qo, ko, vo, doo, lse2o, deltao, dqo, doco, lo["kv_num_blocks"], lo["kv_indices"],
                          lo["full_kv_num_blocks"], lo["full_kv_indices"], 0.25 * LOG2E, 0.25, 20, 20, 0, 2, **tiles)
        if launched["_sparse_bwd_preprocess"]:   # the optional preprocess kernel, where the wrapper launches it
            preprocess_kernel[(2, 1)](qo, doo, lse2o, deltao, lse2o, 20, HEAD_DIM=16, BLOCK_M=16)
    grading.check_true(seen["overflows"] == 0, name="練習 7：64 位元的 head 偏移量（兩個核心與前處理核心，bh 從 2^27 起、N = 20、d = 16）",
                       detail=f"head 編號 2^27 起（bh * N 與 bh * N * d 都超過 2^31：lse、D 的偏移也是），核心裡有 {seen['overflows']} 個 int32 加減乘的結果溢位。",
                       hint=f"每個核心（前處理核心也是）都要 {HEAD_ID_64}，和練習 5 一樣；32 位元在 GPU 上會悄悄繞回，讀寫到別的 head。")


def backward_reads_listed_blocks(sparse_attention_backward, sliding_window) -> None:
    """Interpreter only: window 16, N = 128, inputs [1, 1, 128, 16]: both kernels together load between Q and dO
    (dK/dV kernel) plus K and V (dQ kernel) of each listed block once and that plus each program's own tiles, ids,
    lse and D, and a preprocess kernel's one read of O, dO and lse; the tl.dot products at most twice the listed
    blocks' (:func:`labkit.checks.nb09_forward.check_blocks_computed`: seven dots a block, four for dK/dV, three for dQ)."""
    if tritonmode.current() != "interpreter":
        return
    qw, kw_, vw, ow, dow = (torch.randn(1, 1, 128, 16) for _ in range(5))
    lists_w = flexlib.torch_lists(sliding_window(16), 128, 128, 16)
    listed = int(lists_w["kv_num_blocks"].sum() + lists_w["full_kv_num_blocks"].sum())   # the same count both ways
    with tritonmode.loaded_elements() as count:
        sparse_attention_backward(qw, kw_, vw, ow, torch.zeros(1, 1, 128), dow, lists_w, 16, mask="window", window=16)
    floor = 2 * listed * 16 * 16 * 2                # Q and dO (dK/dV kernel), K and V (dQ kernel) of each listed block
    ceiling = floor + 4 * 128 * 16 + 64 * listed + 2 * 128 * 2 + (2 * 128 * 16 + 128)   # + each program's own tiles, ids,
    # lse and D; + a preprocess kernel's one read of O, dO and lse (D from PyTorch reads none of them through Triton)
    grading.check_true(floor <= count["elements"] <= ceiling, name="練習 7：只讀清單上的區塊（視窗 16、N = 128）",
                       detail=f"兩個核心共讀了 {count['elements']:,} 個元素；清單上的區塊讀一次應在 {floor:,} 到 {ceiling:,} 之間。",
                       hint="每個核心都只跑 range(0, 個數)，讀編號列出的區塊；dK/dV 核心用轉置清單。")
    check_blocks_computed(count, listed, 7, name="練習 7：只算清單上的區塊（視窗 16、N = 128：tl.dot 的乘加數）",
                          hint="兩個核心都只跑 range(0, 個數)：掃過清單的每個欄位再把沒列出的遮掉，讀的元素雖少，"
                               "每個欄位的 tl.dot 照樣要算。")


def backward_contract(sparse_attention_backward, causal) -> None:
    """Exercise 7's contract (:mod:`labkit.checks.contract`) on fp32 causal inputs [1, 2, 16, 16] (one block), o and
    lse from the float64 attention: each of q, k, v, o, lse, dO as a view (:func:`backward_matches` checks every run
    leaves its inputs unchanged)."""
    dev = tritonmode.device()
    torch.manual_seed(17)
    q, k, v, do = (torch.randn(1, 2, 16, 16) for _ in range(4))
    o, lse = (t.float().to(dev) for t in attention64(q, k, v, table(causal, 16, 16)))
    args = (*(t.to(dev) for t in (q, k, v)), o, lse, do.to(dev), flexlib.torch_lists(causal, 16, 16, 16), 16)
    contract.check_views(sparse_attention_backward, *args, name="練習 7")


def _launched_args(sparse_attention_backward, q, k, v, o, do, causal, N: int):
    """The recorded launches of the backward kernels for these inputs [1, H, N, d] (lse 0, causal lists)."""
    dev = tritonmode.device()
    with tritoncompile.recorded() as launches:
        sparse_attention_backward(q.to(dev), k.to(dev), v.to(dev), o.to(dev), torch.zeros(*q.shape[:-1], device=dev),
                                  do.to(dev), flexlib.torch_lists(causal, N, N, 16), 16)
    return [launch for launch in launches if launch.kernel in KERNELS]


def backward_precision(sparse_attention_backward, causal) -> None:
    """fp32 inputs [1, 1, 32, 16] launch both kernels with PREC="ieee", fp16 ones with "tf32"; bf16 (d = 64): "tf32"
    and D handed to the kernels in fp32, within 1e-4 of the float64 row sums of the bf16 dO o O."""
    for dtype, want, word in ((torch.float32, "ieee", "fp32"), (torch.float16, "tf32", "fp16")):
        x = [torch.randn(1, 1, 32, 16).to(dtype) for _ in range(5)]
        precs = {launch.args.get("PREC") for launch in _launched_args(sparse_attention_backward, *x, causal, 32)}
        grading.check_true(precs == {want}, name=f"練習 7：{word} 輸入以 PREC=\"{want}\" 啟動兩個核心",
                           detail=f"{word} 輸入的啟動用了 PREC = {precs}。",
                           hint="和練習 5 一樣：fp32 用 \"ieee\"，bf16 與 fp16 都用 \"tf32\"。" if dtype == torch.float16 else PREC_HINT)
    torch.manual_seed(15)   # D handed to the kernels: fp32 row sums of the bf16 dO o O (d = 64), exact to ~1e-6
    ob16, dob16 = (torch.randn(1, 2, 32, 64).to(torch.bfloat16) for _ in range(2))
    qkv = [torch.randn(1, 2, 32, 64).to(torch.bfloat16) for _ in range(3)]
    launches = _launched_args(sparse_attention_backward, *qkv, ob16, dob16, causal, 32)
    precs = {launch.args.get("PREC") for launch in launches}
    grading.check_true(precs == {"tf32"}, name="練習 7：bf16 輸入以 PREC=\"tf32\" 啟動兩個核心",
                       detail=f"bf16 輸入的啟動用了 PREC = {precs}。", hint=PREC_HINT)
    delta = next((launch.args.get("delta_ptr") for launch in launches if launch.kernel != "_sparse_bwd_dq_kernel"), None)
    grading.check_true(isinstance(delta, torch.Tensor) and delta.dtype == torch.float32,
                       name="練習 7：D 以 fp32 交給核心", detail=f"delta_ptr 收到 {getattr(delta, 'dtype', delta)}。",
                       hint="delta = (do.float() * o.float()).sum(-1)，或前處理核心裡 o、do 載入後先 .to(tl.float32)：fp32 的 [B·H, N_q]。")
    grading.check_tensor(delta.reshape(1, 2, 32).cpu(), (dob16.double() * ob16.double()).sum(-1),
                         name="練習 7：D = rowsum(dO ∘ O) 在 fp32 中計算（bf16 的 o、dO，d = 64）", atol=1e-4,
                         hint="先轉成 fp32（PyTorch 的 .float()、前處理核心的 .to(tl.float32)）再相乘相加：在 bf16 裡加總 64 個乘積，每一步都捨入到 8 位有效位元（誤差約 0.1）。")


def _bf16_backward(sparse_attention_backward, mask_mod, d: int = 16, **kw) -> None:
    """sparse_attention_backward on bf16 inputs [1, 2, 64, d] (o and dO bf16, lse fp32)."""
    dev = tritonmode.device()
    sparse_attention_backward(*(torch.randn(1, 2, 64, d, device=dev).to(torch.bfloat16) for _ in range(4)),
                              torch.zeros(1, 2, 64, device=dev), torch.randn(1, 2, 64, d, device=dev).to(torch.bfloat16),
                              flexlib.torch_lists(mask_mod, 64, 64, 16), 16, **kw)


def backward_low_precision(sparse_attention_backward, causal, sliding_window, packed_causal) -> None:
    """bf16 and fp16 inputs [1, 2, 64, 16] (causal): gradients in that dtype, dQ, dK, dV by the 2x rule (vs float64
    autograd, against autograd through plain attention in that dtype); fp32 accumulators in the Triton IR of bf16
    launches (causal, window, document masks); both kernels compile for sm80 and sm90 (64 x 64 tiles, d = 64)."""
    dev, allowed = tritonmode.device(), table(causal, 64, 64)
    for dtype in grading.LOW_PRECISION:   # the 2x rule: D and lse * log2(e) in fp32, fp32 accumulators
        torch.manual_seed(14)
        ql, kl, vl, dol = (torch.randn(1, 2, 64, 16).to(dtype) for _ in range(4))
        o64, lse64, dq64, dk64, dv64 = grads64(ql, kl, vl, dol, allowed)
        qb, kb, vb = (t.clone().requires_grad_() for t in (ql, kl, vl))   # plain attention in that dtype, autograd
        sb = ((qb @ kb.transpose(-2, -1)) / 4.0).masked_fill(~allowed, float("-inf"))
        (torch.softmax(sb, dim=-1) @ vb * dol).sum().backward()
        got = sparse_attention_backward(ql.to(dev), kl.to(dev), vl.to(dev), o64.to(dtype).to(dev), lse64.float().to(dev),
                                        dol.to(dev), flexlib.torch_lists(causal, 64, 64, 16), 16)
        for name, g, want, base in zip(("dQ", "dK", "dV"), got, (dq64, dk64, dv64), (qb.grad, kb.grad, vb.grad)):
            grading.check_true(g.dtype == dtype, name=f"練習 7：{dtype} 輸入的 {name} dtype", detail=f"得到 {g.dtype}。",
                               hint="dq, dk, dv = torch.empty_like(q3) 等：與輸入同 dtype；核心存回前 .to(element_ty)。")
            grading.check_within_2x(g.cpu(), want, base, name=f"練習 7：{dtype} 的 {name}",
                                    rule="D = rowsum(dO ∘ O) 與 lse·log2(e) 以 fp32 先算好（PyTorch 或前處理核心），累加器與 P、dS 以 fp32 計算")
    doc = documents(DOCS)[:64]
    tritoncompile.check_fp32_statistics(   # every mask branch of both kernels
        lambda: [_bf16_backward(sparse_attention_backward, causal),
                 _bf16_backward(sparse_attention_backward, sliding_window(20), mask="window", window=20),
                 _bf16_backward(sparse_attention_backward, packed_causal(doc), mask="document", document_id=doc)],
        name="練習 7：反向核心", rule="dK、dV、dQ 的累加器與 P、dS 以 fp32 計算，只在 tl.dot 前轉成輸入的 dtype",
        hint="dk、dv、dq 用 tl.zeros(..., tl.float32)；p、ds 在 fp32 中算，.to(q.dtype) 只用在 tl.dot 的運算元。")
    tritoncompile.check_compiles(
        lambda: _bf16_backward(sparse_attention_backward, causal, d=64, mask="document", document_id=torch.zeros(64, dtype=torch.long)),
        name="練習 7：反向核心", config=dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2))
