"""Notebook 09 (09_flex_attention): rules its exercises state, wrong answers, answers fitted to visible cases."""

ASSIGNMENT = "09_flex_attention"
SETUP = ['MODE = lk.tritonmode.setup()', 'def causal(b, h, q_idx, kv_idx):']

# grade_id -> the rules its visible tests check
RULES = {
    "ex1_dense_reference": [
        "own code: no flex_attention / SDPA / labkit",
        "o and lse vs flex_attention (eager, float64): no mods with N_q != N_k, a score_mod on the scaled scores, "
        "the scale argument, causal",
        "the mask applied after score_mod (soft-capping + causal)",
        "rows that see no key: o = 0, lse = -inf, no NaN",
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
        "alibi_slopes(8) = 1/2 ... 1/256 as an fp32 tensor",
        "ALiBi bias slopes[h] * (kv_idx - q_idx) on a grid of 2 batches x 8 heads (per head, sign)",
        "softcap: cap * tanh(score / cap) at small and large scores (not a clamp, not tanh(score))",
        "both run inside flex_attention with causal (finite)",
    ],
    "ex4_block_lists": [
        "own code: no create_block_mask / labkit",
        "the eight lists (shapes, counts, the first `count` indices per row, ascending) match create_block_mask's "
        "for causal N = 64 and N = 72, a window, a packed document mask with N = 100, causal N_q = 40 != N_k = 72",
        "padding past N is masked: a tail block is never full",
        "partial and full blocks disjoint; the q_* lists are the table transposed",
    ],
}

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
    ],
}

# {(grade_id, mistake): why no visible check can catch it}: at most one per notebook
HIDDEN_ONLY = {}

# grade_id -> [(name, text, replacement)]: passes the visible tests, fails the hidden ones
FITTED = {
    "ex1_dense_reference": [
        ("rules called for batch 0, head 0 only", "h = torch.arange(H, device=q.device).view(1, H, 1, 1)",
         "h = torch.zeros(1, 1, 1, 1, dtype=torch.long)"),
    ],
    "ex2_mask_mods": [
        ("window fixed at 3 for w > 0", "(q_idx - kv_idx <= window)", "(q_idx - kv_idx <= min(window, 3))"),
    ],
    "ex3_score_mods": [
        ("slopes written for 8 heads", "(-8.0 * (h + 1) / n_heads)", "(-(h + 1.0))"),
    ],
    "ex4_block_lists": [
        ("block fixed at 16", "    n_q, n_k = -(-Nq // block), -(-Nk // block)",
         "    block = 16\n    n_q, n_k = -(-Nq // block), -(-Nk // block)"),
    ],
}
