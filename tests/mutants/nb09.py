"""Notebook 09 (09_flex_attention): rules its exercises state, wrong answers, answers fitted to visible cases."""

ASSIGNMENT = "09_flex_attention"
SETUP = ['MODE = lk.tritonmode.setup()', 'def causal(b, h, q_idx, kv_idx):', 'MASKS = {']

# grade_id -> the rules its visible tests check
RULES = {
    "ex1_dense_reference": [
        "own code: no flex_attention / SDPA / labkit",
        "o and lse vs flex_attention (eager, float64): no mods with N_q != N_k, a score_mod on the scaled scores, "
        "the scale argument (0.3, and 0: not `scale or 1/sqrt(d)`), causal, a score_mod and a mask_mod that read b and h",
        "the mask applied after score_mod (soft-capping + causal)",
        "each row's own max, taken after the mask: rows 1000 apart whose hidden keys score highest",
        "bf16: o rounded once (equal to the float64 answer rounded to bf16, up to 8 ties)",
        "rows that see no key, hidden by a mask_mod or by a score_mod returning -inf: o = 0, lse = -inf, no NaN",
        "contract: fp32 and float64 inputs left unchanged; q, k, v as views (transposed, sliced)",
        "bf16 in -> o bf16, lse fp32 [B, H, N_q]",
        "precision (2x rule vs float64 flex_attention, against flex_attention in that dtype): o and lse for bf16 "
        "and fp16 with a score_mod and causal",
    ],
    "ex2_mask_mods": [
        "each rule on the whole index grid vs the rule written position by position; each runs under vmap "
        "(create_block_mask)",
        "sliding_window(w): causal, w + 1 keys (w = 3 and w = 0: no off-by-one)",
        "document_mask: same document only, both ways (no leak to earlier documents)",
        "packed_causal: causal AND the same document",
        "prefix_lm(p): keys 0..p-1 seen by all, causal after (no off-by-one)",
    ],
    "ex3_score_mods": [
        "alibi_slopes(8) = 1/2 ... 1/256 as an fp32 tensor; alibi_slopes(4) and (16) by the formula (not H = 8's table)",
        "ALiBi bias slopes[h] * (kv_idx - q_idx) on a grid of 2 batches x 8 heads (per head, sign)",
        "softcap: cap * tanh(score / cap) at small and large scores (not a clamp, not tanh(score)); the score passed in "
        "is left unchanged (a pure function)",
        "both run inside flex_attention with causal (finite)",
    ],
    "ex4_block_lists": [
        "own code: no create_block_mask / labkit",
        "the eight lists (shapes, counts, the first `count` indices per row, ascending) match create_block_mask's "
        "for causal N = 64 and N = 72, a window, a packed document mask with N = 100, causal N_q = 40 != N_k = 72",
        "block 8 with N = 44 (the block argument, not 16): counts, then the lists as above; block 8 with N = 144 "
        "(rows of up to 18 blocks: ascending, which an unstable sort breaks)",
        "padding past N is masked: a tail block is never full",
        "partial and full blocks disjoint; the q_* lists are the table transposed",
    ],
    "ex5_sparse_kernel": [
        "own code: no flex_attention / SDPA; launches _sparse_fwd_kernel",
        "fp32 vs a float64 dense reference (block 16, create_block_mask's lists): causal N = 64, a tail block "
        "(N = 72), window w = 20, a packed document mask (N = 100, ids loaded per block), causal N_q = 40 != N_k = 72; "
        "head size 32 != block 16 (HEAD_DIM and scale from the input); window 0 (the diagonal only); block 32 (the "
        "argument, not the notebook's P.block); outputs a kernel never writes read NaN",
        "full blocks skip the mask, partial blocks apply it (lists forged: every block full / every block partial)",
        "only the listed blocks read: interpreter's loaded elements between the K/V of the listed blocks and that "
        "plus q, ids and list entries (window 16, N = 128)",
        "only the listed blocks computed: interpreter's tl.dot products at most twice the listed blocks' (a loop over "
        "every slot with masked loads reads little but computes every block)",
        "contract: q, k, v, the lists and the sink (fp32) left unchanged in every run; q, k, v as views",
        "no load or store outside the tensors handed to the kernel, in every run above (tail blocks masked: K, V, "
        "key ids by N_K; q, o, lse by N_Q)",
        "the sink: vs the reference with one more column (value 0); the identity o_sink = o * sigmoid(lse - sink); "
        "rows that see no key: o = 0 and lse = sink (with) or -inf (without), no NaN; B = 2: sink[bh % H] per head",
        "an all-zero sink (sink = zeros(H), causal N = 40) vs the reference: still one more key, e^0 = 1 in every row's "
        "denominator (not skipped for its values)",
        "bf16 and fp16 in -> o in that dtype, lse fp32; o by the 2x rule at N = 128 (8 key blocks)",
        "fp32 inputs launch with PREC=\"ieee\", bf16 and fp16 inputs with \"tf32\" (launches recorded)",
        "every score near -144 (fp32, causal N = 32): the running max starts at -inf, not 0 (no row read as empty)",
        "fp32 statistics in the Triton IR of bf16 launches of every branch (document mask with a sink; causal and "
        "window without one)",
        "64-bit head offsets: the kernel launched by hand with the head's program id past 2^27 (bh * N and bh * N * d "
        "past 2^31; no int32 overflow)",
        "_sparse_fwd_kernel compiles for sm80 and sm90 (128 x 128 tiles, d = 64, bf16)",
    ],
    "ex6_sink_grad": [
        "dsink vs float64 autograd through dense attention with the sink as an extra column (B = 2, H = 3, N = 40): "
        "sign, exp(sink - lse), summed over batch and rows, [H] fp32",
        "bf16 o and dO (d = 64): within 1e-4 (relative) of the formula in float64 on the same bf16 values: D in fp32",
        "contract: fp32 o, dO, lse and sink left unchanged (`.float()` of fp32 is the same tensor); views",
    ],
    "ex7_sparse_backward": [
        "own code: no autograd; launches _sparse_bwd_dkdv_kernel and _sparse_bwd_dq_kernel (apart, or both in one launch "
        "of the given _sparse_bwd_kernel)",
        "dV, dK, dQ vs float64 autograd through dense attention with the same table (block 16, create_block_mask's "
        "lists): causal N = 64, a tail block (N = 72), window 20, documents N = 100, causal N_q = 40 != N_k = 72, "
        "B = 2 with head size 32 != block 16, a sink, window 0, block 32 (the argument, not P.block); outputs a kernel "
        "never writes read NaN",
        "rows that see no key (lse = -inf; window 4, N_q = 32 > N_k = 16): no NaN in dQ, dK, dV",
        "no load or store outside the tensors handed to the kernels, in every run above (tail blocks masked)",
        "64-bit head offsets in both kernels (and the optional preprocess kernel where the wrapper launches it): "
        "launched by hand with the head's program id past 2^27 (lse and D offsets too; no int32 overflow)",
        "dK/dV read the transposed (q_*) lists, dQ the kv lists; partial blocks masked (P = 0)",
        "full blocks skip the mask in both kernels (kv and q_* lists forged: every block full, MASK = causal; dQ, dK, dV "
        "vs the unmasked reference)",
        "both kernels read only listed blocks (interpreter's loaded elements, window 16, N = 128) and compute only "
        "them (tl.dot products at most twice the listed blocks')",
        "contract: q, k, v, o, lse, dO (fp32) and the lists left unchanged in every run; each as a view",
        "fp32 inputs launch both kernels with PREC=\"ieee\", bf16 and fp16 inputs with \"tf32\" (launches recorded)",
        "D handed to the kernels in fp32: the recorded delta_ptr of a bf16 launch (d = 64) within 1e-4 of float64 row sums",
        "bf16 and fp16 in -> gradients in that dtype; dQ, dK, dV by the 2x rule (vs float64 autograd, against autograd "
        "through plain attention in that dtype), causal N = 64",
        "fp32 accumulators and statistics in the Triton IR of bf16 launches (causal, window and document masks)",
        "both kernels compile for sm80 and sm90 (64 x 64 tiles, d = 64, bf16)",
    ],
    "ex8_packing": [
        "tokens, cu_seqlens (leading 0), position_ids (restart per document), document_ids (from 0) for lengths 3, 1, 4",
        "dtypes: cu_seqlens int32, the rest int64; the documents passed in left unchanged",
        "no cross-document contamination: the last document's loss has zero gradient on the earlier documents' "
        "inputs through attention masked by document_ids",
    ],
}

# 09 exercise 7's D and lse2: the solution's preprocess launch (replaced by PyTorch in some mistakes below)
PREPROCESS_LAUNCH = (
    "delta = torch.empty(B * H, Nq, dtype=torch.float32, device=q.device)             # D = rowsum(dO o O), fp32\n"
    "    lse2 = torch.empty_like(delta)                                                   # lse * log2(e)\n"
    "    _sparse_bwd_preprocess[(triton.cdiv(Nq, 64), B * H)](_as_heads(o), do3, lse.float().reshape(B * H, Nq).contiguous(),\n"
    "                                                         delta, lse2, Nq, HEAD_DIM=d, BLOCK_M=64)\n")


def torch_d_and_lse2(delta: str, lse2: str) -> str:
    """The wrapper's lines that compute D and lse2 in PyTorch instead: ``delta`` and ``lse2`` are the expressions."""
    return (f"delta = {delta}.reshape(B * H, Nq).contiguous()\n"
            f"    lse2 = {lse2}.reshape(B * H, Nq).contiguous()\n")

# 09 exercise 7: the solution's one launch of both kernels, and the two kernels launched apart instead
ONE_LAUNCH = (
    "            _sparse_bwd_kernel[(max(triton.cdiv(Nk, block), triton.cdiv(Nq, block)), B * H, 2)](   # both kernels, one launch\n"
    "                q3, k3, v3, do3, lse2, delta, dq, dk, dv, doc,\n"
    "                as_i32(\"q_num_blocks\"), q_idx, as_i32(\"full_q_num_blocks\"), as_i32(\"full_q_indices\"),\n"
    "                as_i32(\"kv_num_blocks\"), kv_idx, as_i32(\"full_kv_num_blocks\"), as_i32(\"full_kv_indices\"),\n"
    "                d ** -0.5 * LOG2E, d ** -0.5, Nq, Nk, int(window), q_idx.shape[-1], kv_idx.shape[-1],\n"
    "                HEAD_DIM=d, MASK=MASKS[mask], PREC=\"ieee\" if q.dtype == torch.float32 else \"tf32\", BLOCK_M=block,\n"
    "                BLOCK_N=block, DKDV_SPLIT=dkdv_split, DQ_SPLIT=dq_split, num_warps=warps, num_stages=stages)\n")
TWO_LAUNCHES = (
    "            common = dict(HEAD_DIM=d, MASK=MASKS[mask], PREC=\"ieee\" if q.dtype == torch.float32 else \"tf32\",\n"
    "                          BLOCK_M=block, BLOCK_N=block, num_warps=warps, num_stages=stages)\n"
    "            _sparse_bwd_dkdv_kernel[(triton.cdiv(Nk, block), B * H)](\n"
    "                q3, k3, v3, do3, lse2, delta, dk, dv, doc, as_i32(\"q_num_blocks\"), q_idx, as_i32(\"full_q_num_blocks\"),\n"
    "                as_i32(\"full_q_indices\"), d ** -0.5 * LOG2E, d ** -0.5, Nq, Nk, int(window), q_idx.shape[-1],\n"
    "                SPLIT=dkdv_split, **common)\n"
    "            _sparse_bwd_dq_kernel[(triton.cdiv(Nq, block), B * H)](\n"
    "                q3, k3, v3, do3, lse2, delta, dq, doc, as_i32(\"kv_num_blocks\"), kv_idx, as_i32(\"full_kv_num_blocks\"),\n"
    "                as_i32(\"full_kv_indices\"), d ** -0.5 * LOG2E, d ** -0.5, Nq, Nk, int(window), kv_idx.shape[-1],\n"
    "                SPLIT=dq_split, **common)\n")

# grade_id -> [(mistake, text in the answer, replacement)]: each fails a visible test
MISTAKES = {
    "ex1_dense_reference": [
        ("empty rows shifted by -inf (NaN)",
         "    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)              # a row that sees no key: shift by 0\n",
         ""),
        ("empty rows divided by l = 0", "/ torch.where(l == 0, torch.ones_like(l), l)", "/ l"),
        ("mask before score_mod",
         "    if score_mod is not None:\n        s = score_mod(s, b, h, q_idx, kv_idx)\n"
         "    if mask_mod is not None:\n        s = s.masked_fill(~mask_mod(b, h, q_idx, kv_idx), float(\"-inf\"))\n",
         "    if mask_mod is not None:\n        s = s.masked_fill(~mask_mod(b, h, q_idx, kv_idx), float(\"-inf\"))\n"
         "    if score_mod is not None:\n        s = score_mod(s, b, h, q_idx, kv_idx)\n"),
        ("score_mod on unscaled scores", "s = score_mod(s, b, h, q_idx, kv_idx)",
         "s = score_mod(s / scale, b, h, q_idx, kv_idx) * scale"),
        ("statistics in bf16/fp16", "work = torch.float64 if q.dtype == torch.float64 else torch.float32",
         "work = q.dtype"),
        ("lse without the row max", "lse = (m + torch.log(l)).squeeze(-1)", "lse = torch.log(l).squeeze(-1)"),
        ("scale ignored", "scale = 1.0 / math.sqrt(d) if scale is None else scale", "scale = 1.0 / math.sqrt(d)"),
        ("scale = 0 read as unset (`scale or 1/sqrt(d)`)", "scale = 1.0 / math.sqrt(d) if scale is None else scale",
         "scale = scale or 1.0 / math.sqrt(d)"),
        ("empty rows handled only under a mask_mod (a score_mod's -inf row gives NaN)",
         "    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)              # a row that sees no key: shift by 0\n",
         "    if mask_mod is not None:                                             # only a mask hides a whole row\n"
         "        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)\n"),
        ("scores scaled in place on q (the caller's q changed)",
         "s = (q.to(work) @ k.to(work).transpose(-2, -1)) * scale", "s = q.to(work).mul_(scale) @ k.to(work).transpose(-2, -1)"),
        ("rules called for head 0 only", "h = torch.arange(H, device=q.device).view(1, H, 1, 1)",
         "h = torch.zeros(1, 1, 1, 1, dtype=torch.long)"),
        ("empty rows: NaN lse, o cleaned with nan_to_num",
         "    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)              # a row that sees no key: shift by 0\n",
         "    p = torch.exp(s - m)\n    o = torch.nan_to_num((p @ v.to(work)) / p.sum(dim=-1, keepdim=True))\n"
         "    return o.to(q.dtype), (m + torch.log(p.sum(dim=-1, keepdim=True))).squeeze(-1)\n"),
    ],
    "ex2_mask_mods": [
        ("window off by one (w keys)", "(q_idx - kv_idx <= window)", "(q_idx - kv_idx < window)"),
        ("window not causal", "(q_idx >= kv_idx) & (q_idx - kv_idx <= window)", "(q_idx - kv_idx).abs() <= window"),
        ("document mask leaks to earlier documents", "document_id[q_idx] == document_id[kv_idx]",
         "document_id[q_idx] >= document_id[kv_idx]"),
        ("packed with or_masks (documents see each other)", "and_masks(causal, document_mask(document_id))",
         "or_masks(causal, document_mask(document_id))"),
        ("prefix off by one", "kv_idx < prefix_len", "kv_idx <= prefix_len"),
        ("prefix with and_masks", "or_masks(causal, in_prefix)", "and_masks(causal, in_prefix)"),
        ("python if on a tensor", "        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)\n",
         "        if (q_idx - kv_idx > window).all():\n            return q_idx < 0\n"
         "        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)\n"),
    ],
    "ex3_score_mods": [
        ("slopes from h = 0 (first slope 1)", "(-8.0 * (h + 1) / n_heads)", "(-8.0 * h / n_heads)"),
        ("bias sign flipped", "score + slopes[h] * (kv_idx - q_idx)", "score + slopes[h] * (q_idx - kv_idx)"),
        ("slope by batch", "score + slopes[h] * (kv_idx - q_idx)", "score + slopes[b] * (kv_idx - q_idx)"),
        ("softcap without the division", "cap * torch.tanh(score / cap)", "cap * torch.tanh(score)"),
        ("softcap as a clamp", "cap * torch.tanh(score / cap)", "score.clamp(-cap, cap)"),
        ("slopes as a list", "return torch.tensor([2.0 ** (-8.0 * (h + 1) / n_heads) for h in range(n_heads)], "
         "dtype=torch.float32)", "return [2.0 ** (-8.0 * (h + 1) / n_heads) for h in range(n_heads)]"),
        ("slopes written for 8 heads (1/2^(h+1))", "(-8.0 * (h + 1) / n_heads)", "(-(h + 1.0))"),
    ],
    "ex4_block_lists": [
        ("floor division drops the tail block", "n_q, n_k = -(-Nq // block), -(-Nk // block)",
         "n_q, n_k = Nq // block, Nk // block"),
        ("partial blocks treated as full", "full = tiles.all(dim=3).all(dim=1)", "full = tiles.any(dim=3).any(dim=1)"),
        ("padding counted as visible (tail block full)",
         "dense = torch.zeros(n_q * block, n_k * block, dtype=torch.bool)",
         "dense = torch.ones(n_q * block, n_k * block, dtype=torch.bool)"),
        ("full blocks listed as partial too", "partial = seen & ~full", "partial = seen"),
        ("transposed lists not transposed", 'out["q_num_blocks"], out["q_indices"] = as_lists(partial.T)',
         'out["q_num_blocks"], out["q_indices"] = as_lists(partial)'),
        ("indices in descending order", "torch.argsort((~chosen).to(torch.int8), dim=1, stable=True)",
         "torch.flip(torch.argsort((~chosen).to(torch.int8), dim=1, stable=True), dims=(1,))"),
        ("block fixed at 16", "    n_q, n_k = -(-Nq // block), -(-Nk // block)",
         "    block = 16\n    n_q, n_k = -(-Nq // block), -(-Nk // block)"),
        ("indices sorted by an unstable argsort", "torch.argsort((~chosen).to(torch.int8), dim=1, stable=True)",
         "torch.argsort((~chosen).to(torch.int8), dim=1)"),
        ("seen = every query row sees a key (any, then all)", "seen = tiles.any(dim=3).any(dim=1)",
         "seen = tiles.any(dim=3).all(dim=1)"),
        ("transposed partial lists from seen (full blocks listed as partial)", "as_lists(partial.T)", "as_lists(seen.T)"),
    ],
    "ex5_sparse_kernel": [
        ("every slot of the partial list computed, unlisted ones masked off (reads only listed blocks)",
         "    for j in range(0, tl.load(kv_num_ptr + qb)):               # partial blocks: bounds and the rule\n"
         "        start_n = tl.load(kv_idx_ptr + qb * N_KV_BLOCKS + j) * BLOCK_N\n"
         "        offs_n = start_n + tl.arange(0, BLOCK_N)\n"
         "        inside = offs_n < N_K\n",
         "    for j in range(0, N_KV_BLOCKS):                            # every slot, the unlisted ones masked off\n"
         "        start_n = tl.load(kv_idx_ptr + qb * N_KV_BLOCKS + j) * BLOCK_N\n"
         "        offs_n = start_n + tl.arange(0, BLOCK_N)\n"
         "        inside = (offs_n < N_K) & (j + 0 * offs_n < tl.load(kv_num_ptr + qb))\n"),
        ("block fixed at the notebook's P.block (the block argument ignored)", "    B, H, Nq, d = q.shape\n",
         "    B, H, Nq, d = q.shape\n    block = P.block                                  # the notebook's block size\n"),
        ("window 0 read as no window (`window or N_k`)", "H, int(window), kv_idx.shape[-1]", "H, int(window or Nk), kv_idx.shape[-1]"),
        ("window rule written for w >= 4 (window 0 sees 4 keys)", "(offs_m[:, None] - offs_n[None, :] <= WINDOW)",
         "(offs_m[:, None] - offs_n[None, :] <= tl.maximum(WINDOW, 4))"),
        ("every key block read (listed or not), masked",
         "    for j in range(0, tl.load(kv_num_ptr + qb)):               # partial blocks: bounds and the rule\n"
         "        start_n = tl.load(kv_idx_ptr + qb * N_KV_BLOCKS + j) * BLOCK_N\n",
         "    for j in range(0, tl.cdiv(N_K, BLOCK_N)):\n        start_n = j * BLOCK_N\n"),
        ("partial blocks treated as full (no mask)",
         "acc, m_i, l_i = _online_tile(acc, m_i, l_i, q, kt, v, keep, qk_scale, True, PREC)",
         "acc, m_i, l_i = _online_tile(acc, m_i, l_i, q, kt, v, keep, qk_scale, False, PREC)"),
        ("full blocks masked too (rule applied to full blocks)",
         "acc, m_i, l_i = _online_tile(acc, m_i, l_i, q, kt, v, 0, qk_scale, False, PREC)",
         "acc, m_i, l_i = _online_tile(acc, m_i, l_i, q, kt, v, offs_m[:, None] >= offs_n[None, :], qk_scale, True, PREC)"),
        ("sink dropped", "HAS_SINK=sink is not None", "HAS_SINK=False"),
        ("an all-zero sink skipped (`sink.any()`: e^0 = 1 left out of every row)", "HAS_SINK=sink is not None",
         "HAS_SINK=sink is not None and bool(sink.any())"),
        ("sink added with l = 0 (max only)", "        l_i = tl.full([BLOCK_M], 1.0, tl.float32)\n",
         "        l_i = tl.zeros([BLOCK_M], tl.float32)\n"),
        ("sink of head 0 for every head", "tl.load(sink_ptr + bh % H)", "tl.load(sink_ptr)"),
        ("sink in natural-log units (no log2(e))", "(tl.load(sink_ptr + bh % H) * 1.4426950408889634)",
         "tl.load(sink_ptr + bh % H)"),
        ("window off by one", "(offs_m[:, None] - offs_n[None, :] <= WINDOW)", "(offs_m[:, None] - offs_n[None, :] < WINDOW)"),
        ("document rule not causal", "keep = keep & (offs_m[:, None] >= offs_n[None, :]) & (doc_q[:, None] == doc_k[None, :])",
         "keep = keep & (doc_q[:, None] == doc_k[None, :])"),
        ("partial blocks without bounds", "keep = inside[None, :] & (offs_m[:, None] >= 0)", "keep = offs_m[:, None] >= 0"),
        ("empty rows divided by l = 0", "l_safe = tl.where(l_i == 0.0, 1.0, l_i)", "l_safe = l_i"),
        ("accumulator in the input dtype", "acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)",
         "acc = tl.zeros([BLOCK_M, HEAD_DIM], q_ptr.dtype.element_ty)"),
        ("32-bit head offsets", "bh = tl.program_id(1).to(tl.int64)", "bh = tl.program_id(1)"),
        ("tf32 for fp32 inputs", 'PREC="ieee" if q.dtype == torch.float32 else "tf32"', 'PREC="tf32"'),
        ("key offsets from the query block's row count", "kv_idx.shape[-1],", "triton.cdiv(Nq, block),"),
        ("sink by program id (bh, not bh % H)", "tl.load(sink_ptr + bh % H)", "tl.load(sink_ptr + bh)"),
        ("head size fixed at 16", "HEAD_DIM=d, MASK=MASKS[mask], HAS_SINK", "HEAD_DIM=16, MASK=MASKS[mask], HAS_SINK"),
        ("scale fixed at 1/4 (d = 16)", "d ** -0.5 * LOG2E, Nq, Nk, H", "0.25 * LOG2E, Nq, Nk, H"),
        ("running max starts at 0, not -inf", 'm_i = tl.full([BLOCK_M], float("-inf"), tl.float32)',
         "m_i = tl.zeros([BLOCK_M], tl.float32)"),
        ("bf16 launched with PREC=\"ieee\" too", 'PREC="ieee" if q.dtype == torch.float32 else "tf32"', 'PREC="ieee"'),
        ("sink scaled like a raw score (qk_scale)", "(tl.load(sink_ptr + bh % H) * 1.4426950408889634)",
         "(tl.load(sink_ptr + bh % H) * qk_scale)"),
        ("document rule >= (earlier documents leak)", "& (doc_q[:, None] == doc_k[None, :])",
         "& (doc_q[:, None] >= doc_k[None, :])"),
        ("key document id read once per block", "doc_k = tl.load(doc_ptr + offs_n, mask=inside, other=-2)",
         "doc_k = tl.load(doc_ptr + start_n + 0 * offs_n)"),
        ("running max in the input dtype (no sink)", '        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)\n',
         '        m_i = tl.full([BLOCK_M], float("-inf"), q_ptr.dtype.element_ty)\n'),
        ("running sum in the input dtype (no sink)", "        l_i = tl.zeros([BLOCK_M], tl.float32)\n",
         "        l_i = tl.zeros([BLOCK_M], q_ptr.dtype.element_ty)\n"),
        ("lse offset from the 32-bit program id", "tl.store(lse_ptr + bh * N_Q + offs_m, lse, mask=offs_m < N_Q)",
         "tl.store(lse_ptr + tl.program_id(1) * N_Q + offs_m, lse, mask=offs_m < N_Q)"),
        ("K of a partial block loaded past N_K (keep hides it)",
         "kt = tl.load(k_base + offs_n[None, :] * HEAD_DIM + offs_d[:, None], mask=inside[None, :], other=0.0)",
         "kt = tl.load(k_base + offs_n[None, :] * HEAD_DIM + offs_d[:, None])"),
        ("o stored without the row bound", "(acc / l_safe[:, None]).to(o_ptr.dtype.element_ty), mask=offs_m[:, None] < N_Q)",
         "(acc / l_safe[:, None]).to(o_ptr.dtype.element_ty))"),
        ("lse stored without the row bound", "tl.store(lse_ptr + bh * N_Q + offs_m, lse, mask=offs_m < N_Q)",
         "tl.store(lse_ptr + bh * N_Q + offs_m, lse)"),
        ("fp16 launched with PREC=\"ieee\"", 'PREC="ieee" if q.dtype == torch.float32 else "tf32"',
         'PREC="tf32" if q.dtype == torch.bfloat16 else "ieee"'),
    ],
    "ex6_sink_grad": [
        ("sign flipped", "return -(p_sink * D).sum(dim=(0, 2))", "return (p_sink * D).sum(dim=(0, 2))"),
        ("exp(lse - sink)", "torch.exp(sink.float().view(1, -1, 1) - lse.float())", "torch.exp(lse.float() - sink.float().view(1, -1, 1))"),
        ("not summed over the batch", "(p_sink * D).sum(dim=(0, 2))", "(p_sink * D).sum(dim=2)[0]"),
        ("D in bf16", "D = (do.float() * o.float()).sum(dim=-1)", "D = (do * o).sum(dim=-1).float()"),
        ("sigmoid instead of exp", "torch.exp(sink.float().view(1, -1, 1) - lse.float())",
         "torch.sigmoid(sink.float().view(1, -1, 1) - lse.float())"),
        ("mean over the batch", "return -(p_sink * D).sum(dim=(0, 2))", "return -(p_sink * D).sum(dim=2).mean(dim=0)"),
        ("o overwritten in place (`.float().mul_()`: the caller's fp32 o)", "D = (do.float() * o.float()).sum(dim=-1)",
         "D = o.float().mul_(do.float()).sum(dim=-1)"),
    ],
    "ex7_sparse_backward": [
        ("full blocks masked too (dK/dV kernel)",
         "            if part == 1:                         # partial: bounds and the rule\n",
         "            if part >= 0:                         # every block: bounds and the rule\n"),
        ("full blocks masked too (dQ kernel)", "            if part == 1:\n                keep = rows[:, None] & inside[None, :]\n",
         "            if part >= 0:\n                keep = rows[:, None] & inside[None, :]\n"),
        ("dK/dV kernel given the forward's lists (not transposed)",
         'as_i32("q_num_blocks"), q_idx, as_i32("full_q_num_blocks"), as_i32("full_q_indices"),\n                as_i32("kv_num_blocks")',
         'as_i32("kv_num_blocks"), kv_idx, as_i32("full_kv_num_blocks"), as_i32("full_kv_indices"),\n                as_i32("kv_num_blocks")'),
        ("dQ kernel given the transposed lists",
         'as_i32("kv_num_blocks"), kv_idx, as_i32("full_kv_num_blocks"), as_i32("full_kv_indices"),\n                d ** -0.5',
         'as_i32("q_num_blocks"), q_idx, as_i32("full_q_num_blocks"), as_i32("full_q_indices"),\n                d ** -0.5'),
        ("partial blocks unmasked in dK/dV",
         "                    keep = keep & (offs_m[None, :] >= offs_n[:, None]) & (doc_q[None, :] == doc_k[:, None])\n"
         "                pt = tl.where(keep, pt, 0.0)\n            dv = tl.dot(",
         "                    keep = keep & (offs_m[None, :] >= offs_n[:, None]) & (doc_q[None, :] == doc_k[:, None])\n"
         "            dv = tl.dot("),
        ("D left out (dS = P dP)", "dst = pt * (tl.dot(v, tl.trans(do), input_precision=PREC) - delta[None, :])",
         "dst = pt * tl.dot(v, tl.trans(do), input_precision=PREC)"),
        ("dK not scaled", "(dk * sm_scale).to(dk_ptr.dtype.element_ty)", "dk.to(dk_ptr.dtype.element_ty)"),
        ("lse in natural-log units (preprocess kernel)",
         "tl.store(lse2_ptr + bh * N_Q + offs_m, lse * 1.4426950408889634, mask=rows)",
         "tl.store(lse2_ptr + bh * N_Q + offs_m, lse, mask=rows)"),
        ("lse in natural-log units (D and lse2 from PyTorch)", PREPROCESS_LAUNCH,
         torch_d_and_lse2("(do.float() * o.float()).sum(dim=-1)", "lse.float()")),
        ("tf32 for fp32 inputs (backward)", 'PREC="ieee" if q.dtype == torch.float32 else "tf32"', 'PREC="tf32"'),
        ("D in the input dtype (preprocess kernel)",
         "    o = tl.load(o_ptr + offs, mask=rows[:, None], other=0.0).to(tl.float32)\n"
         "    do = tl.load(do_ptr + offs, mask=rows[:, None], other=0.0).to(tl.float32)\n",
         "    o = tl.load(o_ptr + offs, mask=rows[:, None], other=0.0)\n"
         "    do = tl.load(do_ptr + offs, mask=rows[:, None], other=0.0)\n"),
        ("D in the input dtype (D and lse2 from PyTorch)", PREPROCESS_LAUNCH,
         torch_d_and_lse2("(do * o).sum(dim=-1).float()", "(lse.float() * LOG2E)")),
        ("32-bit head offsets (preprocess kernel)",
         "    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)\n    bh = tl.program_id(1).to(tl.int64)\n",
         "    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)\n    bh = tl.program_id(1)\n"),
        ("dV accumulator in the input dtype", "    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)\n",
         "    dv = tl.zeros([BLOCK_N, HEAD_DIM], v_ptr.dtype.element_ty)\n"),
        ("dK accumulator in the input dtype", "    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)\n",
         "    dk = tl.zeros([BLOCK_N, HEAD_DIM], k_ptr.dtype.element_ty)\n"),
        ("dQ accumulator in the input dtype", "    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)\n",
         "    dq = tl.zeros([BLOCK_M, HEAD_DIM], q_ptr.dtype.element_ty)\n"),
        ("dQ kernel reads every key block",
         "        for t in range(0, count * SPLIT):\n            start_n = tl.load(idx_ptr + t // SPLIT) * BLOCK_N",
         "        for t in range(0, tl.cdiv(N_K, BLOCK_N) * SPLIT * part):\n            start_n = (t // SPLIT) * BLOCK_N"),
        ("32-bit head offsets (dK/dV kernel)", "    kb = tl.program_id(0)\n    bh = tl.program_id(1).to(tl.int64)\n",
         "    kb = tl.program_id(0)\n    bh = tl.program_id(1)\n"),
        ("32-bit head offsets (dQ kernel)", "    qb = tl.program_id(0)\n    bh = tl.program_id(1).to(tl.int64)\n",
         "    qb = tl.program_id(0)\n    bh = tl.program_id(1)\n"),
        ("head size fixed at 16 (backward)", "HEAD_DIM=d, MASK=MASKS[mask], PREC=", "HEAD_DIM=16, MASK=MASKS[mask], PREC="),
        ("scale fixed at 1/4 (backward)", "d ** -0.5 * LOG2E, d ** -0.5, Nq, Nk, int(window), q_idx.shape[-1]",
         "0.25 * LOG2E, 0.25, Nq, Nk, int(window), q_idx.shape[-1]"),
        ("dK/dV grid over query blocks", "_sparse_bwd_kernel[(max(triton.cdiv(Nk, block), triton.cdiv(Nq, block)), B * H, 2)]",
         "_sparse_bwd_kernel[(triton.cdiv(Nq, block), B * H, 2)]"),
        ("bf16 launched with PREC=\"ieee\" too (backward)", 'PREC="ieee" if q.dtype == torch.float32 else "tf32"',
         'PREC="ieee"'),
        ("dQ not scaled", "(dq * sm_scale).to(dq_ptr.dtype.element_ty)", "dq.to(dq_ptr.dtype.element_ty)"),
        ("dS from P rounded to the input dtype (dK/dV)", "dst = pt * (tl.dot(v,", "dst = pt.to(qt.dtype).to(tl.float32) * (tl.dot(v,"),
        ("masked P set to -inf, not 0", "                pt = tl.where(keep, pt, 0.0)\n            dv = tl.dot(",
         "                pt = tl.where(keep, pt, float(\"-inf\"))\n            dv = tl.dot("),
        ("window off by one in dQ only",
         "(offs_m[:, None] - offs_n[None, :] <= WINDOW)\n                if MASK == 3:\n                    doc_k",
         "(offs_m[:, None] - offs_n[None, :] < WINDOW)\n                if MASK == 3:\n                    doc_k"),
        ("lse and D offsets from the 32-bit program id (dQ kernel)",
         "    lse2 = tl.load(lse2_ptr + bh * N_Q + offs_m, mask=rows, other=0.0)\n"
         "    delta = tl.load(delta_ptr + bh * N_Q + offs_m, mask=rows, other=0.0)\n",
         "    lse2 = tl.load(lse2_ptr + tl.program_id(1) * N_Q + offs_m, mask=rows, other=0.0)\n"
         "    delta = tl.load(delta_ptr + tl.program_id(1) * N_Q + offs_m, mask=rows, other=0.0)\n"),
        ("lse and D offsets from the 32-bit program id (dK/dV kernel)",
         "            lse2 = tl.load(lse2_ptr + bh * N_Q + offs_m, mask=rows, other=0.0)\n"
         "            delta = tl.load(delta_ptr + bh * N_Q + offs_m, mask=rows, other=0.0)\n",
         "            lse2 = tl.load(lse2_ptr + tl.program_id(1) * N_Q + offs_m, mask=rows, other=0.0)\n"
         "            delta = tl.load(delta_ptr + tl.program_id(1) * N_Q + offs_m, mask=rows, other=0.0)\n"),
        ("query document ids in dK/dV loaded past N_Q",
         "                    doc_q = tl.load(doc_ptr + offs_m, mask=rows, other=-1)",
         "                    doc_q = tl.load(doc_ptr + offs_m)"),
        ("dQ stored without the row bound", "(dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=rows[:, None])",
         "(dq * sm_scale).to(dq_ptr.dtype.element_ty))"),
        ("dK and dV stored without the key bound",
         "    tl.store(dk_ptr + kv_off, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=offs_n[:, None] < N_K)\n"
         "    tl.store(dv_ptr + kv_off, dv.to(dv_ptr.dtype.element_ty), mask=offs_n[:, None] < N_K)\n",
         "    tl.store(dk_ptr + kv_off, (dk * sm_scale).to(dk_ptr.dtype.element_ty))\n"
         "    tl.store(dv_ptr + kv_off, dv.to(dv_ptr.dtype.element_ty))\n"),
        ("fp16 launched with PREC=\"ieee\" (backward)", 'PREC="ieee" if q.dtype == torch.float32 else "tf32"',
         'PREC="tf32" if q.dtype == torch.bfloat16 else "ieee"'),
        ("block fixed at the notebook's P.block (backward)", "    B, H, Nq, d = q.shape\n",
         "    B, H, Nq, d = q.shape\n    block = P.block                                  # the notebook's block size\n"),
        ("window 0 read as no window (backward)", "Nq, Nk, int(window), q_idx.shape[-1], kv_idx.shape[-1]",
         "Nq, Nk, int(window or Nk), q_idx.shape[-1], kv_idx.shape[-1]"),
        ("window rule written for w >= 16 (dK/dV)",
         "(offs_m[None, :] - offs_n[:, None] <= WINDOW)\n                if MASK == 3:\n                    doc_q",
         "(offs_m[None, :] - offs_n[:, None] <= tl.maximum(WINDOW, 16))\n                if MASK == 3:\n                    doc_q"),
        ("masked scores set to -inf before exp2 (dK/dV: -inf - lse2 = NaN where lse = -inf)",
         "                pt = tl.where(keep, pt, 0.0)\n            dv = tl.dot(",
         "                pt = tl.math.exp2(tl.where(keep, tl.dot(k, qt, input_precision=PREC) * qk_scale, float(\"-inf\"))"
         " - lse2[None, :])\n            dv = tl.dot("),
        ("dQ kernel computes every slot of the lists, unlisted ones masked off (reads only listed blocks)",
         "        for t in range(0, count * SPLIT):\n"
         "            start_n = tl.load(idx_ptr + t // SPLIT) * BLOCK_N + (t % SPLIT) * (BLOCK_N // SPLIT)\n"
         "            offs_n = start_n + tl.arange(0, BLOCK_N // SPLIT)\n"
         "            inside = offs_n < N_K\n",
         "        for t in range(0, N_KV_BLOCKS * SPLIT):\n"
         "            start_n = tl.load(idx_ptr + t // SPLIT) * BLOCK_N + (t % SPLIT) * (BLOCK_N // SPLIT)\n"
         "            offs_n = start_n + tl.arange(0, BLOCK_N // SPLIT)\n"
         "            inside = (offs_n < N_K) & (t // SPLIT + 0 * offs_n < count)\n"),
        ("lse scaled in place (`lse.float().mul_()`: the caller's fp32 lse)", PREPROCESS_LAUNCH,
         torch_d_and_lse2("(do.float() * o.float()).sum(dim=-1)", "lse.float().mul_(LOG2E)")),
    ],
    "ex8_packing": [
        ("cu_seqlens without the leading 0", '"cu_seqlens": cu_seqlens,', '"cu_seqlens": cu_seqlens[1:],'),
        ("positions not restarted", "position_ids = torch.arange(int(lengths.sum())) - cu_seqlens[:-1].long()[document_ids]",
         "position_ids = torch.arange(int(lengths.sum()))"),
        ("document ids from 1", "document_ids = torch.repeat_interleave(torch.arange(len(docs)), lengths)",
         "document_ids = torch.repeat_interleave(torch.arange(1, len(docs) + 1), lengths)"),
        ("cu_seqlens int64", "cu_seqlens = torch.zeros(len(docs) + 1, dtype=torch.int32)",
         "cu_seqlens = torch.zeros(len(docs) + 1, dtype=torch.int64)"),
        ("one document id for all (contaminated)", "document_ids = torch.repeat_interleave(torch.arange(len(docs)), lengths)",
         "document_ids = torch.zeros(int(lengths.sum()), dtype=torch.int64)"),
    ],
}

# {(grade_id, mistake): why no visible check can catch it}: at most one per notebook
MISTAKES["ex1_dense_reference"] += [
    ("one max over the whole score tensor", "m = s.amax(dim=-1, keepdim=True)", "m = s.amax(dim=(-2, -1), keepdim=True)"),
    ("row max taken before masking",
     "    if mask_mod is not None:\n        s = s.masked_fill(~mask_mod(b, h, q_idx, kv_idx), float(\"-inf\"))\n"
     "    m = s.amax(dim=-1, keepdim=True)\n",
     "    m = s.amax(dim=-1, keepdim=True)\n    if mask_mod is not None:\n"
     "        s = s.masked_fill(~mask_mod(b, h, q_idx, kv_idx), float(\"-inf\"))\n"),
    ("P rounded to the input dtype before P V", "o = (p @ v.to(work))", "o = (p.to(q.dtype) @ v).to(work)"),
    ("row max clamped at -1e4 instead of the -inf test", "m = torch.where(torch.isinf(m), torch.zeros_like(m), m)",
     "m = m.clamp_min(-1e4)"),
]
MISTAKES["ex3_score_mods"] += [("softcap in place", "cap * torch.tanh(score / cap)", "score.div_(cap).tanh_().mul_(cap)")]

HIDDEN_ONLY = {}

# grade_id -> [(name, text, replacement)]: passes the visible tests, fails the hidden ones
FITTED = {
    "ex1_dense_reference": [
        ("row max clamped at -2.5e4 (below every visible score) instead of the -inf test",
         "m = torch.where(torch.isinf(m), torch.zeros_like(m), m)", "m = m.clamp_min(-2.5e4)"),
    ],
    "ex2_mask_mods": [
        ("window fixed at 3 for w > 0", "(q_idx - kv_idx <= window)", "(q_idx - kv_idx <= min(window, 3))"),
    ],
    "ex3_score_mods": [
        ("softcap written for cap 30", "cap * torch.tanh(score / cap)", "30.0 * torch.tanh(score / 30.0)"),
    ],
    "ex4_block_lists": [
        ("full blocks only below the diagonal (written for causal masks)", "partial = seen & ~full",
         "full = full & torch.ones(n_q, n_k, dtype=torch.bool).tril(-1)\n    partial = seen & ~full"),
    ],
    "ex5_sparse_kernel": [
        ("window rule right for even windows only (every visible window is even)",
         "(offs_m[:, None] - offs_n[None, :] <= WINDOW)", "(offs_m[:, None] - offs_n[None, :] <= WINDOW + WINDOW % 2)"),
    ],
    "ex6_sink_grad": [
        ("batch of two summed by hand", "(p_sink * D).sum(dim=(0, 2))", "(p_sink[:2] * D[:2]).sum(dim=(0, 2))"),
    ],
    "ex7_sparse_backward": [
        ("window rule right for even windows only (dK/dV; every visible window is even)",
         "(offs_m[None, :] - offs_n[:, None] <= WINDOW)\n                if MASK == 3:\n                    doc_q",
         "(offs_m[None, :] - offs_n[:, None] <= WINDOW + WINDOW % 2)\n                if MASK == 3:\n                    doc_q"),
    ],
    "ex8_packing": [
        ("cu_seqlens for three documents", '"cu_seqlens": cu_seqlens,', '"cu_seqlens": cu_seqlens[:4],'),
    ],
}

# grade_id -> [(name, text, replacement)]: other right answers the prose allows; each passes the whole cell
ACCEPTED = {
    "ex7_sparse_backward": [
        ("D and lse2 from PyTorch in fp32 (no preprocess kernel)", PREPROCESS_LAUNCH,
         torch_d_and_lse2("(do.float() * o.float()).sum(dim=-1)", "(lse.float() * LOG2E)")),
        ("the two kernels launched apart (not through _sparse_bwd_kernel)", ONE_LAUNCH, TWO_LAUNCHES),
    ],
}

# A second outside read (2026-12-07): the one new mistake the visible tests missed.
RULES["ex5_sparse_kernel"] += ["bf16 and fp16 inputs with a sink bf16 cannot hold (0.3, -2.7): lse within 1e-4 of float64"]
MISTAKES["ex5_sparse_kernel"] += [
    ("sink rounded to the inputs' dtype", "(sink if sink is not None else lse).to(device=q.device, dtype=torch.float32)",
     "(sink if sink is not None else lse).to(device=q.device, dtype=q.dtype)"),
]
