"""Notebook 06 (06_triton_flashattention): rules its exercises state, wrong answers, answers fitted to visible cases."""

ASSIGNMENT = "06_triton_flashattention"
SETUP = ['MODE = lk.tritonmode.setup()']

# grade_id -> the rules its visible tests check
RULES = {
    "ex1_softmax": [
        "launches softmax_kernel; no torch.softmax / F.softmax / labkit",
        "rows of 50: masked tail read as -inf",
        "logits in the hundreds: max subtracted (no overflow)",
        "bf16 in -> bf16 out, same shape",
    ],
    "ex2_flash_forward": [
        "_key_range alone: whole tiles unmasked, tail tile masked, causal tiles skipped, bottom-right alignment "
        "(N = N_k, N < N_k, N > N_k), no off-by-one at N = 63, N_k = 64",
        "_fwd_tile alone: acc and l rescaled, rows that saw no key stay 0 (no NaN), scores near 1e4",
        "forward vs fp64, in stages: whole tiles, a tail tile (N = 100), causal N = N_k, N < N_k, "
        "N > N_k (o = 0, lse = -inf, no NaN), N = 63 / N_k = 64",
        "bf16 in -> o bf16, lse fp32 [..., N]",
        "causal tiles skipped (interpreter's loaded elements)",
        "launches _fwd_kernel; no SDPA / softmax / labkit",
        "_fwd_kernel compiles for sm80 and sm90 (no plain Python global in a kernel)",
    ],
    "ex3_flash_backward": [
        "_query_range alone: query tiles before lo skipped, diagonal masked, bottom-right alignment, "
        "no off-by-one at N = 63, N_k = 64",
        "dV, then dK, then dQ vs fp64 autograd, in stages: whole tiles, a tail tile, causal N = N_k, N < N_k, "
        "N > N_k (no NaN), N = 63 / N_k = 64",
        "bf16 in -> bf16 gradients",
        "both kernels skip causal tiles (interpreter's loaded elements)",
        "launches _bwd_dkdv_kernel and _bwd_dq_kernel; no autograd / SDPA / labkit",
        "the backward kernels compile for sm80 and sm90",
    ],
    "ex4_flash_function": [
        "forward returns o only and saves exactly one lse [..., N]",
        "o and gradients vs autograd, causal and not, [B, H, N, d] and [batch, n, d] inputs",
        "Triton kernels launched in forward and backward (is_causal kept for backward)",
        "bf16 in -> bf16 out and gradients",
    ],
    "ex5_gqa_window": [
        "launches _fwd_gqa_window_kernel; K/V not repeated in memory",
        "vs fp64: GQA without a window, causal window, non-causal symmetric window, causal N > N_k (no NaN)",
        "tiles outside the window skipped (interpreter's loaded elements)",
    ],
}

# grade_id -> [(mistake, text in the answer, replacement)]: each fails a visible test
MISTAKES = {'ex1_softmax': [('no max subtraction', 'x = x - tl.max(x, axis=0)', 'x = x - 0.0'),
                 ('tail padded with 0', 'other=float("-inf")).to(tl.float32)', 'other=0.0).to(tl.float32)'),
                 ('PyTorch only',
                  'softmax_kernel[(x2.shape[0],)](x2, y, x2.shape[1], BLOCK=triton.next_power_of_2(x2.shape[1]))',
                  'y = torch.softmax(x2.float(), dim=-1).to(x2.dtype)'),
                 ('kernel launched, torch.softmax returned', '    return y.reshape(x.shape)\n',
                  '    return torch.softmax(x.float(), dim=-1).to(x.dtype)\n'),
                 ('output in fp32', 'y = torch.empty_like(x2)', 'y = torch.empty_like(x2, dtype=torch.float32)')],
 'ex2_flash_forward': [('causal tiles masked, not skipped',
                        'hi = tl.minimum(N_K, start_m + BLOCK_M + shift)',
                        'hi = N_K + 0 * shift'),
                       ('hi off by one (drops a needed K tile)',
                        'hi = tl.minimum(N_K, start_m + BLOCK_M + shift)',
                        'hi = tl.minimum(N_K, start_m + BLOCK_M - 1 + shift)'),
                       ('key range aligned top-left', 'shift = N_K - N_Q', 'shift = 0'),
                       ('tail tile counted as a whole tile',
                        'mid = N_K // BLOCK_N * BLOCK_N', 'mid = N_K + 0 * BLOCK_N'),
                       ('missing rescale of acc', '    acc = acc * alpha[:, None]\n', ''),
                       ('causal mask aligned top-left',
                        'keep = keep & (offs_n[None, :] <= offs_m[:, None] + (N_K - N_Q))',
                        'keep = keep & (offs_n[None, :] <= offs_m[:, None])'),
                       ('tail keys kept in the softmax', 'keep = inside[None, :]\n', 'keep = offs_n[None, :] >= 0\n'),
                       ('K not transposed',
                        'kt_ptrs = k_base + offs_n[None, :] * HEAD_DIM + offs_d[:, None]',
                        'kt_ptrs = k_base + offs_n[:, None] * HEAD_DIM + offs_d[None, :]'),
                       ('NaN on a row that sees no key',
                        'l_safe = tl.where(l_i == 0.0, 1.0, l_i)',
                        'l_safe = l_i'),
                       ('lse left in log2 units', '* 0.6931471805599453)  # natural log', ')  # natural log'),
                       ('global read inside @triton.jit',
                        '(m_i + tl.math.log2(l_safe)) * 0.6931471805599453)',
                        '(m_i + tl.math.log2(l_safe)) / LOG2E)'),
                       ('exp with a log2-scaled score',
                        'p = tl.math.exp2(s * qk_scale - m_new[:, None])',
                        'p = tl.exp(s * qk_scale - m_new[:, None])'),
                       ('o in fp32', 'o = torch.empty_like(q3)', 'o = torch.empty_like(q3, dtype=torch.float32)'),
                       ('block size passed to the autotuned kernel',
                        'PREC="ieee" if q.dtype == torch.float32 else "tf32")',
                        'PREC="ieee" if q.dtype == torch.float32 else "tf32", BLOCK_M=32)'),
                       ('PyTorch only',
                        '_fwd_kernel[grid](q3, k3, v3, o, lse, d ** -0.5 * LOG2E,',
                        'o_, lse_ = lk.attention.reference_attention(q3, k3, v3, causal=is_causal); o.copy_(o_); '
                        'lse.copy_(lse_)\n'
                        '    (lambda *a, **kw: None)(q3, k3, v3, o, lse, d ** -0.5 * LOG2E,')],
 'ex3_flash_backward': [('missing D term in dS', 'dst = pt * (dpt - delta[None, :])', 'dst = pt * dpt'),
                        ('dk without scale', '(dk * sm_scale).to(', 'dk.to('),
                        ('dK/dV causal mask aligned top-left',
                         'pt = tl.where(offs_n[:, None] <= offs_m[None, :] + (N_K - N_Q), pt, 0.0)',
                         'pt = tl.where(offs_n[:, None] <= offs_m[None, :], pt, 0.0)'),
                        ('dK/dV mask by multiplication (NaN on rows that see no key)',
                         'pt = tl.where(offs_n[:, None] <= offs_m[None, :] + (N_K - N_Q), pt, 0.0)',
                         'pt = pt * (offs_n[:, None] <= offs_m[None, :] + (N_K - N_Q))'),
                        ('dQ causal mask aligned top-left',
                         'keep = keep & (offs_n[None, :] <= offs_m[:, None] + (N_K - N_Q))',
                         'keep = keep & (offs_n[None, :] <= offs_m[:, None])'),
                        ('D without O', 'tl.sum(o * do, axis=1)', 'tl.sum(do, axis=1)'),
                        ('dK/dV causal tiles masked, not skipped',
                         'lo = tl.minimum(tl.maximum(start_n - shift, 0) // BLOCK_M * BLOCK_M, N_Q)',
                         'lo = 0 * shift'),
                        ('dQ causal tiles masked, not skipped',
                         '_dq_stage(dq, q, do, lse2, delta, k_base, v_base, mid, hi,',
                         '_dq_stage(dq, q, do, lse2, delta, k_base, v_base, mid, N_K,'),
                        ('query range aligned top-left', 'shift = N_K - N_Q', 'shift = 0'),
                        ('query range off by one (drops a needed query tile)',
                         'tl.maximum(start_n - shift, 0)', 'tl.maximum(start_n - shift + 1, 0)'),
                        ('global read inside @triton.jit', 'lse * 1.4426950408889634', 'lse * LOG2E'),
                        ('gradients in fp32 for bf16 inputs',
                         'dq, dk, dv = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3)',
                         'dq, dk, dv = (torch.empty(t.shape, device=t.device) for t in (q3, k3, v3))')],
 'ex4_flash_function': [('causal flag lost for backward', 'ctx.is_causal = is_causal', 'ctx.is_causal = False'),
                        ('forward ignores is_causal',
                         'flash_attention_forward(q, k, v, is_causal=is_causal)',
                         'flash_attention_forward(q, k, v)'),
                        ('output upcast to fp32', '        return o\n', '        return o.float()\n'),
                        ('no gradient slot for is_causal', 'return dq, dk, dv, None', 'return dq, dk, dv')],
 'ex5_gqa_window': [('K/V head by modulo', 'kv = bh // GROUP', 'kv = bh % (tl.num_programs(1) // GROUP)'),
                    ('K/V repeated in memory',
                     '    q3, k3, v3 = _as_heads(q), _as_heads(k), _as_heads(v)\n',
                     '    k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)\n'
                     '    hkv = hq\n'
                     '    q3, k3, v3 = _as_heads(q), _as_heads(k), _as_heads(v)\n'),
                    ('window tiles not skipped',
                     'lo = tl.maximum(start_m + (N_K - N_Q) - WINDOW, 0) // BLOCK_N * BLOCK_N',
                     'lo = 0 * WINDOW'),
                    ('right side of a non-causal window ignored',
                     'right = 0 if CAUSAL else WINDOW',
                     'right = 0 if CAUSAL else N_K')]}

# (grade_id, mistake) -> why no visible check can catch it (at most one per notebook)
HIDDEN_ONLY = {}

# grade_id -> [(name, text in the answer, replacement)]: pass the visible tests, fail the hidden ones
FITTED = {
    "ex1_softmax": [("BLOCK fixed at 64 (rows up to 64 only)", "BLOCK=triton.next_power_of_2(x2.shape[1])",
                     "BLOCK=64")],
    "ex2_flash_forward": [("scale hard-coded for d = 16", "d ** -0.5 * LOG2E, n, k3.shape[1]",
                           "0.25 * LOG2E, n, k3.shape[1]")],
    "ex3_flash_backward": [("scale hard-coded for d = 16", "args = dict(qk_scale=d ** -0.5 * LOG2E, sm_scale=d ** -0.5,",
                            "args = dict(qk_scale=0.25 * LOG2E, sm_scale=0.25,")],
    "ex4_flash_function": [("gradients shaped like q (N_k = N only)", "return dq, dk, dv, None",
                            "return dq, dk.view_as(q), dv.view_as(q), None")],
    "ex5_gqa_window": [("scale hard-coded for d = 16", "d ** -0.5 * LOG2E, n, nk, hq // hkv, window",
                        "0.25 * LOG2E, n, nk, hq // hkv, window")],
}
