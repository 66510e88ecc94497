"""Notebook 06 (06_triton_flashattention): rules its exercises state, wrong answers, answers fitted to visible cases."""

ASSIGNMENT = "06_triton_flashattention"
SETUP = ['MODE = lk.tritonmode.setup()']

# grade_id -> the rules its visible tests check
RULES = {
    "ex1_softmax": [
        "padded lanes not stored: one row of 50 launched by hand into an output followed by a spare row (first)",
        "launches softmax_kernel; no torch.softmax / F.softmax / labkit",
        "rows of 50: masked tail read as -inf",
        "logits in the hundreds: max subtracted (no overflow)",
        "every logit near -200: padded lanes read as -inf also in the max (no 0 / 0)",
        "bf16 in -> bf16 out, same shape",
        "BLOCK = next_power_of_2(row length): rows of 50, of exactly 64 and of 300 (launch recorded)",
        "precision (2x rule vs float64, against torch.softmax in that dtype): bf16 and fp16 rows of 300",
        "precision in the compiled Triton IR (bf16 and fp16 launches): no arithmetic, exp or sum on bf16/fp16 values, "
        "a value converted to the input dtype only stored",
    ],
    "ex2_flash_forward": [
        "_key_range alone: every whole tile unmasked (also N_k a multiple of the tile, and N = N_k + 1), tail tile masked, causal tiles skipped, bottom-right alignment "
        "(N = N_k, N < N_k, N > N_k), no off-by-one at N = 63, N_k = 64",
        "_fwd_tile alone: acc and l rescaled, rows that saw no key stay 0 (no NaN) and keep m = -inf, scores near 1e4",
        "padded query rows not stored (o, lse): _fwd_kernel launched by hand into outputs followed by spare rows, "
        "before any other forward",
        "forward vs fp64, in stages: whole tiles, a tail tile (N = 100), causal N = N_k, N < N_k, "
        "N > N_k (o = 0, lse = -inf, no NaN), N = 63 / N_k = 64",
        "bf16 in -> o bf16, lse fp32 [..., N]",
        "precision (2x rule vs float64, against plain attention in that dtype): o and lse for bf16 and fp16, "
        "N = 70, N_k = 90, d = 32, causal and not",
        "precision over many key tiles (2x rule): o for bf16 and fp16 at N_k = 1000 (63 tiles): acc kept fp32 in the loop",
        "every score near -250 (fp32): the running max starts at -inf and is taken after the mask (no underflow to l = 0)",
        "the grid follows the tuned BLOCK_M: one forward with the kernel's config swapped for 16 x 16",
        "causal tiles skipped (interpreter's loaded elements)",
        "padded query rows not read: N = 40, elements counted (q's load masked)",
        "64-bit head offsets: _fwd_kernel launched by hand with the head's program id past 2^23, no int32 overflow",
        "launches _fwd_kernel; no SDPA / softmax / labkit",
        "_fwd_kernel compiles for sm80 and sm90 (no plain Python global in a kernel)",
        "fp32 inputs stay IEEE fp32: no TF32 mma / wgmma in the compiled sm80 and sm90 code",
        "precision in the compiled Triton IR (bf16 and fp16 launches): s, m, l, the exp2 argument and lse in fp32; a value "
        "converted to the input dtype only a tl.dot operand (p) or stored (o)",
    ],
    "ex3_flash_backward": [
        "_query_range alone: query tiles before lo skipped, diagonal masked, bottom-right alignment, "
        "no off-by-one at N = 63, N_k = 64",
        "padded rows not stored (delta, lse2, dK, dV, dQ): the three kernels launched by hand into outputs followed "
        "by spare rows, before any other backward",
        "padded rows and keys not read: the same launch with Q, K, V, dO, lse2 and D in buffers with spare rows, reads "
        "outside the tensors counted (interpreter)",
        "dV, then dK, then dQ vs fp64 autograd, in stages: whole tiles, a tail tile, causal N = N_k, N < N_k, "
        "N > N_k (no NaN), N = 63 / N_k = 64",
        "bf16 in -> bf16 gradients",
        "precision (2x rule vs float64 autograd, against autograd through plain attention in that dtype, plus the "
        "rounding of the exact gradient): dV, dK, dQ for bf16 and fp16, N = 70, N_k = 90, d = 32, causal",
        "D from bf16 O and dO stays fp32: _bwd_preprocess launched by hand against float64 row sums",
        "the D and lse2 buffers are fp32 for bf16 inputs (launches recorded)",
        "dO not contiguous (a transposed view): gradients vs fp64",
        "precision over many query tiles (2x rule): dV, dK, dQ for bf16 and fp16 at N = 1024 (64 tiles), N_k = 32: "
        "dK and dV kept fp32 in the loop",
        "the grids follow the tuned tiles: one backward with both kernels' configs swapped for 16 x 16",
        "both kernels skip causal tiles (interpreter's loaded elements)",
        "64-bit head offsets in the three kernels (launched by hand, head program id past 2^23, no int32 overflow)",
        "launches _bwd_dkdv_kernel and _bwd_dq_kernel; no autograd / SDPA / labkit",
        "the backward kernels compile for sm80 and sm90",
        "fp32 inputs stay IEEE fp32: no TF32 mma / wgmma in the compiled sm80 and sm90 code",
        "precision in the compiled Triton IR (bf16 and fp16 launches): P, dP, dS, D and the accumulators in fp32; a value "
        "converted to the input dtype only a tl.dot operand (P^T, dS) or stored (the gradients)",
    ],
    "ex4_flash_function": [
        "forward returns o only and saves exactly one lse [..., N]",
        "o and gradients vs autograd, causal and not, [B, H, N, d] and [batch, n, d] inputs",
        "Triton kernels launched in forward and backward (is_causal kept for backward)",
        "bf16 in -> bf16 out and gradients",
        "bf16 and fp16 inputs save an fp32 lse; o and gradients by the 2x rule (d = 32, N = 70, causal)",
    ],
    "ex5_gqa_window": [
        "launches _fwd_gqa_window_kernel; K/V not repeated in memory",
        "vs fp64: GQA without a window (also non-causal with N - 1 > N_k: every key seen), causal window, "
        "non-causal symmetric window, causal N > N_k (no NaN), the last row's own key starting a key tile, "
        "the first row's leftmost key ending one",
        "every score near -250 (fp32, GQA, causal window): the running max starts at -inf",
        "64-bit head and K/V head offsets (kernel launched by hand, head program id past 2^24, no int32 overflow)",
        "fp32 inputs launch with PREC=\"ieee\" (launch recorded)",
        "bf16 and fp16 in -> o in q's dtype, lse fp32; both by the 2x rule (GQA, causal window, d = 32)",
        "only the key tiles inside the window read: load lanes of the kernel launched by hand (BLOCK_M = 32, "
        "BLOCK_N = 16) against those of a kernel reading exactly the tiles of the window's key range "
        "(causal: no +w on the right)",
        "padded query rows not read: N = 40, elements counted",
    ],
}

# grade_id -> [(mistake, text in the answer, replacement)]: each fails a visible test
MISTAKES = {'ex1_softmax': [('row max over padded lanes read as 0', 'x = x - tl.max(x, axis=0)',
                             'x = x - tl.max(tl.where(inside, x, 0.0), axis=0)'),
                            ('BLOCK one power of 2 too large at an exact power',
                             'BLOCK=triton.next_power_of_2(x2.shape[1])', 'BLOCK=1 << x2.shape[1].bit_length()'),
                            ('store unmasked (padding lanes written)',
                             'tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=inside)',
                             'tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty))'),
                            ('no max subtraction', 'x = x - tl.max(x, axis=0)', 'x = x - 0.0'),
                 ('tail padded with 0', 'other=float("-inf")).to(tl.float32)', 'other=0.0).to(tl.float32)'),
                 ('PyTorch only',
                  'softmax_kernel[(x2.shape[0],)](x2, y, x2.shape[1], BLOCK=triton.next_power_of_2(x2.shape[1]))',
                  'y = torch.softmax(x2.float(), dim=-1).to(x2.dtype)'),
                 ('kernel launched, torch.softmax returned', '    return y.reshape(x.shape)\n',
                  '    return torch.softmax(x.float(), dim=-1).to(x.dtype)\n'),
                 ('output in fp32', 'y = torch.empty_like(x2)', 'y = torch.empty_like(x2, dtype=torch.float32)'),
                 ('BLOCK fixed at 64 (rows up to 64 only)', 'BLOCK=triton.next_power_of_2(x2.shape[1])', 'BLOCK=64'),
                 ('BLOCK fixed at 1024', 'BLOCK=triton.next_power_of_2(x2.shape[1])', 'BLOCK=1024'),
                 ('exponentials summed in the input dtype', '    e = tl.exp(x)\n',
                  '    e = tl.exp(x).to(y_ptr.dtype.element_ty)\n'),
                 ('row max rounded to bf16', 'x = x - tl.max(x, axis=0)', 'x = x - tl.max(x, axis=0).to(tl.bfloat16)'),
                 ('row max rounded to the output dtype', 'x = x - tl.max(x, axis=0)',
                  'x = x - tl.max(x, axis=0).to(y_ptr.dtype.element_ty)'),
                 ('x - m rounded to the input dtype, widened for exp', '    e = tl.exp(x)\n',
                  '    e = tl.exp(x.to(x_ptr.dtype.element_ty).to(tl.float32))\n'),
                 ('exponentials rounded for the sum only', 'y = e / tl.sum(e, axis=0)',
                  'y = e / tl.sum(e.to(x_ptr.dtype.element_ty), axis=0)'),
                 ('row kept in the input dtype (x - m in bf16, widened for exp)',
                  'other=float("-inf")).to(tl.float32)\n    x = x - tl.max(x, axis=0)',
                  'other=float("-inf"))\n    x = (x - tl.max(x, axis=0).to(x.dtype)).to(tl.float32)'),
                    ('sum through fp16 (hard-coded, whatever the input)',
                     'y = e / tl.sum(e, axis=0)',
                     'y = e / tl.sum(e.to(tl.float16), axis=0).to(tl.float32)'),
                    ('normalised in the output dtype',
                     'y = e / tl.sum(e, axis=0)',
                     'y = e.to(y_ptr.dtype.element_ty) / tl.sum(e, axis=0).to(y_ptr.dtype.element_ty)'),
                    ('leading dims not flattened for the grid',
                     'softmax_kernel[(x2.shape[0],)]',
                     'softmax_kernel[(x.shape[0],)]')],
 'ex2_flash_forward': [('non-causal mid masks the last whole tile', 'mid = N_K // BLOCK_N * BLOCK_N',
                        'mid = (N_K - 1) // BLOCK_N * BLOCK_N'),
                       ('causal mid without the first row\'s own key', 'mid = tl.maximum(start_m + shift + 1, 0) // BLOCK_N * BLOCK_N',
                        'mid = tl.maximum(start_m + shift, 0) // BLOCK_N * BLOCK_N'),
                       ('o store unmasked (padded query rows written)', ', mask=offs_m[:, None] < N_Q)', ')'),
                       ('lse store unmasked', 'tl.store(lse_ptr + bh * N_Q + offs_m, lse, mask=offs_m < N_Q)',
                        'tl.store(lse_ptr + bh * N_Q + offs_m, lse)'),
                       ('causal tiles masked, not skipped',
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
                       ('lse in the input dtype',
                        'lse = torch.empty(q3.shape[:2], dtype=torch.float32, device=q.device)',
                        'lse = torch.empty(q3.shape[:2], dtype=q.dtype, device=q.device)'),
                       ('p rounded to the input dtype before the row sum (l in low precision)',
                        'p = tl.math.exp2(s * qk_scale - m_new[:, None])',
                        'p = tl.math.exp2(s * qk_scale - m_new[:, None]).to(v.dtype)'),
                       ('acc rounded to the input dtype every tile',
                        'acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)              # accumulate in place',
                        'acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC).to(v.dtype).to(tl.float32)'),
                       ('running max initialised to 0 (every exp underflows when all scores are very negative)',
                        'm_i = tl.full([BLOCK_M], float("-inf"), tl.float32)\n    l_i = tl.zeros([BLOCK_M], tl.float32)\n'
                        '    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)\n    mid, hi = _key_range(',
                        'm_i = tl.zeros([BLOCK_M], tl.float32)\n    l_i = tl.zeros([BLOCK_M], tl.float32)\n'
                        '    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)\n    mid, hi = _key_range('),
                       ('grid written for the interpreter\'s BLOCK_M = 32',
                        'grid = lambda meta: (triton.cdiv(n, meta["BLOCK_M"]), q3.shape[0])',
                        'grid = lambda meta: (triton.cdiv(n, 32), q3.shape[0])'),
                       ('row max taken before masking (masked tail keys read as 0 count)',
                        '    if MASKED:\n        s = tl.where(keep, s, float("-inf"))\n    m_max = tl.maximum(m_i, tl.max(s, 1) * qk_scale)',
                        '    m_max = tl.maximum(m_i, tl.max(s, 1) * qk_scale)\n    if MASKED:\n        s = tl.where(keep, s, float("-inf"))'),
                       ('running max returned as 0 for a row with no key yet (a window\'s first tiles)',
                        '    return acc, m_max, l_i ', '    return acc, m_new, l_i '),
                       ('shift of the unmasked tiles rounded to the input dtype', 'm_new = m_max ',
                        'm_new = m_max.to(v.dtype) '),
                       ('row max taken over scores rounded to the input dtype', 'tl.max(s, 1) * qk_scale',
                        'tl.max(s.to(v.dtype), 1) * qk_scale'),
                       ('scores rounded to the input dtype after the dot',
                        's = tl.dot(q, kt, input_precision=PREC)  ', 's = tl.dot(q, kt, input_precision=PREC).to(q.dtype)  '),
                       ('exp2 argument rounded to the input dtype, widened for exp2',
                        'p = tl.math.exp2(s * qk_scale - m_new[:, None])',
                        'p = tl.math.exp2((s * qk_scale - m_new[:, None]).to(v.dtype).to(tl.float32))'),
                       ('p rounded for the row sum only', 'l_i = l_i * alpha + tl.sum(p, 1)',
                        'l_i = l_i * alpha + tl.sum(p.to(v.dtype), 1)'),
                       ('lse rounded to the input dtype before it is stored',
                        'tl.store(lse_ptr + bh * N_Q + offs_m, lse, mask=offs_m < N_Q)',
                        'tl.store(lse_ptr + bh * N_Q + offs_m, lse.to(o_ptr.dtype.element_ty), mask=offs_m < N_Q)'),
                       ('PREC="tf32" for fp32 inputs', 'PREC="ieee" if q.dtype == torch.float32 else "tf32")',
                        'PREC="tf32")'),
                       ('tl.dot without input_precision (TF32 on a GPU for fp32)',
                        's = tl.dot(q, kt, input_precision=PREC)', 's = tl.dot(q, kt)'),
                       ('scale hard-coded for d = 16', 'd ** -0.5 * LOG2E, n, k3.shape[1]',
                        '0.25 * LOG2E, n, k3.shape[1]'),
                       ('32-bit head offsets', 'bh = tl.program_id(1).to(tl.int64)  ', 'bh = tl.program_id(1)  '),
                       ('block size passed to the autotuned kernel',
                        'PREC="ieee" if q.dtype == torch.float32 else "tf32")',
                        'PREC="ieee" if q.dtype == torch.float32 else "tf32", BLOCK_M=32)'),
                       ('PyTorch only',
                        '_fwd_kernel[grid](q3, k3, v3, o, lse, d ** -0.5 * LOG2E,',
                        'o_, lse_ = lk.attention.reference_attention(q3, k3, v3, causal=is_causal); o.copy_(o_); '
                        'lse.copy_(lse_)\n'
                        '    (lambda *a, **kw: None)(q3, k3, v3, o, lse, d ** -0.5 * LOG2E,'),
                    ('rescale factor rounded to the input dtype',
                     '    acc = acc * alpha[:, None]\n',
                     '    acc = acc * alpha.to(v.dtype)[:, None]\n'),
                    ('o = acc / l computed in the input dtype',
                     '(acc / l_safe[:, None]).to(o_ptr.dtype.element_ty)',
                     '(acc.to(o_ptr.dtype.element_ty) / l_safe[:, None].to(o_ptr.dtype.element_ty))'),
                    ("hi rounded down to a whole tile (the diagonal's last keys dropped)",
                     'hi = tl.minimum(N_K, start_m + BLOCK_M + shift)',
                     'hi = tl.minimum(N_K, (start_m + BLOCK_M + shift) // BLOCK_N * BLOCK_N)'),
                    ('q of the last query tile loaded without the row mask',
                     'q = tl.load(q_ptrs, mask=offs_m[:, None] < N_Q, other=0.0)              # [BM, D], loaded once',
                     'q = tl.load(q_ptrs)'),
                    ("q's head offset with N_K",
                     'q_ptrs = q_ptr + bh * N_Q * HEAD_DIM',
                     'q_ptrs = q_ptr + bh * N_K * HEAD_DIM')],
 'ex3_flash_backward': [('_query_range mid one row too far', 'mid = tl.maximum(start_n + BLOCK_N - 1 - shift, 0)',
                         'mid = tl.maximum(start_n + BLOCK_N - shift, 0)'),
                        ('dO not made contiguous', 'q3, k3, v3, o3, do3 = (_as_heads(t) for t in (q, k, v, o, do))',
                         'q3, k3, v3, o3 = (_as_heads(t) for t in (q, k, v, o))\n    do3 = do.reshape(-1, *do.shape[-2:])'),
                        ('lse2 buffer in the input dtype', 'lse2 = torch.empty_like(delta)',
                         'lse2 = torch.empty(bh, n, dtype=q.dtype, device=q.device)'),
                        ('D buffer in the input dtype',
                         'delta = torch.empty(bh, n, dtype=torch.float32, device=q.device)      # [BH, N] rowsum(dO * O)\n'
                         '    lse2 = torch.empty_like(delta)',
                         'delta = torch.empty(bh, n, dtype=q.dtype, device=q.device)\n'
                         '    lse2 = torch.empty(bh, n, dtype=torch.float32, device=q.device)'),
                        ('dQ store unmasked (padded query rows written)',
                         'tl.store(dq_ptr + offs, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=rows[:, None])',
                         'tl.store(dq_ptr + offs, (dq * sm_scale).to(dq_ptr.dtype.element_ty))'),
                        ('dV store unmasked (padded keys written)',
                         'tl.store(dv_ptr + kv_offs, dv.to(dv_ptr.dtype.element_ty), mask=keys)',
                         'tl.store(dv_ptr + kv_offs, dv.to(dv_ptr.dtype.element_ty))'),
                        ('D store unmasked', 'tl.store(delta_ptr + bh * N_Q + offs_m, tl.sum(o * do, axis=1), mask=rows)',
                         'tl.store(delta_ptr + bh * N_Q + offs_m, tl.sum(o * do, axis=1))'),
                        ('missing D term in dS', 'dst = pt * (dpt - delta[None, :])', 'dst = pt * dpt'),
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
                        ('D computed in the input dtype (O, dO not upcast)',
                         '    o = tl.load(o_ptr + offs, mask=rows[:, None], other=0.0).to(tl.float32)\n'
                         '    do = tl.load(do_ptr + offs, mask=rows[:, None], other=0.0).to(tl.float32)\n',
                         '    o = tl.load(o_ptr + offs, mask=rows[:, None], other=0.0)\n'
                         '    do = tl.load(do_ptr + offs, mask=rows[:, None], other=0.0)\n'),
                        ('dK/dV accumulators in the input dtype',
                         '    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)\n    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)\n',
                         '    dk = tl.zeros([BLOCK_N, HEAD_DIM], k_ptr.dtype.element_ty)\n'
                         '    dv = tl.zeros([BLOCK_N, HEAD_DIM], k_ptr.dtype.element_ty)\n'),
                        ('dQ rounded to the input dtype every tile',
                         'dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=PREC)',
                         'dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=PREC).to(kt.dtype)'),
                        ('PREC="tf32" for fp32 inputs', 'PREC="ieee" if q.dtype == torch.float32 else "tf32")',
                         'PREC="tf32")'),
                        ('dP without input_precision (TF32 on a GPU for fp32)',
                         'dpt = tl.dot(v, tl.trans(do), input_precision=PREC)', 'dpt = tl.dot(v, tl.trans(do))'),
                        ('scale hard-coded for d = 16',
                         'args = dict(qk_scale=d ** -0.5 * LOG2E, sm_scale=d ** -0.5,',
                         'args = dict(qk_scale=0.25 * LOG2E, sm_scale=0.25,'),
                        ('32-bit head offsets in the dK/dV kernel',
                         '    start_n = tl.program_id(0) * BLOCK_N\n    bh = tl.program_id(1).to(tl.int64)\n',
                         '    start_n = tl.program_id(0) * BLOCK_N\n    bh = tl.program_id(1)\n'),
                        ('32-bit head offsets in the preprocess kernel',
                         '    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)\n    bh = tl.program_id(1).to(tl.int64)\n',
                         '    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)\n    bh = tl.program_id(1)\n'),
                        ('32-bit head offsets in the dQ kernel',
                         '    start_m = tl.program_id(0) * BLOCK_M\n    bh = tl.program_id(1).to(tl.int64)\n',
                         '    start_m = tl.program_id(0) * BLOCK_M\n    bh = tl.program_id(1)\n'),
                        ('gradients in fp32 for bf16 inputs',
                         'dq, dk, dv = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3)',
                         'dq, dk, dv = (torch.empty(t.shape, device=t.device) for t in (q3, k3, v3))'),
                        ('D rounded to the input dtype before it is stored',
                         'tl.store(delta_ptr + bh * N_Q + offs_m, tl.sum(o * do, axis=1), mask=rows)',
                         'tl.store(delta_ptr + bh * N_Q + offs_m, tl.sum(o * do, axis=1).to(o_ptr.dtype.element_ty).to(tl.float32), '
                         'mask=rows)'),
                        ('dV accumulator rounded to the input dtype every query tile',
                         'dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PREC)',
                         'dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PREC).to(do.dtype).to(tl.float32)'),
                        ('dK accumulator rounded to the input dtype every query tile',
                         'dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=PREC)',
                         'dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=PREC).to(qt.dtype).to(tl.float32)'),
                        ('dQ grid written for the interpreter\'s BLOCK_M = 32',
                         '_bwd_dq_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_M"]), bh)]',
                         '_bwd_dq_kernel[lambda meta: (triton.cdiv(n, 32), bh)]'),
                        ('dK/dV grid written for the interpreter\'s BLOCK_N = 32',
                         '_bwd_dkdv_kernel[lambda meta: (triton.cdiv(nk, meta["BLOCK_N"]), bh)]',
                         '_bwd_dkdv_kernel[lambda meta: (triton.cdiv(nk, 32), bh)]'),
                        ('P rounded to the input dtype before dS (dK/dV kernel)',
                         'pt = tl.math.exp2(tl.dot(k, qt, input_precision=PREC) * qk_scale - lse2[None, :])',
                         'pt = tl.math.exp2(tl.dot(k, qt, input_precision=PREC) * qk_scale - lse2[None, :]).to(do.dtype)'),
                        ('P rounded to the input dtype before dS (dQ kernel)',
                         'p = tl.math.exp2(tl.dot(q, kt, input_precision=PREC) * qk_scale - lse2[:, None])',
                         'p = tl.math.exp2(tl.dot(q, kt, input_precision=PREC) * qk_scale - lse2[:, None]).to(q.dtype)'),
                        ('dP rounded to the input dtype (dQ kernel)', 'dp = tl.dot(do, vt, input_precision=PREC)',
                         'dp = tl.dot(do, vt, input_precision=PREC).to(do.dtype)'),
                    ('dP^T rounded to the input dtype (dK/dV kernel)',
                     'dpt = tl.dot(v, tl.trans(do), input_precision=PREC)',
                     'dpt = tl.dot(v, tl.trans(do), input_precision=PREC).to(do.dtype)'),
                    ('dQ causal mask by multiplication (NaN on rows that see no key)',
                     '            p = tl.where(keep, p, 0.0)\n',
                     '            p = p * keep\n'),
                    ('lse2 rounded to the input dtype',
                     'tl.store(lse2_ptr + bh * N_Q + offs_m, lse * 1.4426950408889634, mask=rows)',
                     'tl.store(lse2_ptr + bh * N_Q + offs_m, (lse * 1.4426950408889634).to(o_ptr.dtype.element_ty), mask=rows)'),
                    ('dK/dV grid over N_Q',
                     '_bwd_dkdv_kernel[lambda meta: (triton.cdiv(nk, meta["BLOCK_N"]), bh)]',
                     '_bwd_dkdv_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), bh)]'),
                    ('dP^T - D rounded before the multiply',
                     'dst = pt * (dpt - delta[None, :])',
                     'dst = pt * (dpt - delta[None, :]).to(qt.dtype)'),
                    ("_query_range's mid not rounded up to a whole query tile",
                     'mid = tl.minimum(tl.maximum((mid + BLOCK_M - 1) // BLOCK_M * BLOCK_M, lo), N_Q)',
                     'mid = tl.minimum(tl.maximum(mid, lo), N_Q)'),
                    ('D from O*dO rounded to the input dtype',
                     'tl.sum(o * do, axis=1), mask=rows)',
                     'tl.sum((o * do).to(o_ptr.dtype.element_ty).to(tl.float32), axis=1), mask=rows)'),
                    ("Q's padded rows read (dQ kernel's q load unmasked)",
                     'q = tl.load(q_ptr + offs, mask=rows[:, None], other=0.0)',
                     'q = tl.load(q_ptr + offs)'),
                    ("dO's padded rows read (dQ kernel)",
                     'do = tl.load(do_ptr + offs, mask=rows[:, None], other=0.0)\n    lse2',
                     'do = tl.load(do_ptr + offs)\n    lse2'),
                    ("K's padded keys read (dK/dV kernel's k load unmasked)",
                     'k = tl.load(k_ptr + kv_offs, mask=keys, other=0.0)  ',
                     'k = tl.load(k_ptr + kv_offs)  '),
                    ("K's tail keys read (dQ stage's masked tile loaded unmasked)",
                     'kt = tl.load(kt_ptrs, mask=inside[None, :], other=0.0)',
                     'kt = tl.load(kt_ptrs)')],
 'ex4_flash_function': [('causal flag lost for backward', 'ctx.is_causal = is_causal', 'ctx.is_causal = False'),
                        ('forward ignores is_causal',
                         'flash_attention_forward(q, k, v, is_causal=is_causal)',
                         'flash_attention_forward(q, k, v)'),
                        ('output upcast to fp32', '        return o\n', '        return o.float()\n'),
                        ('no gradient slot for is_causal', 'return dq, dk, dv, None', 'return dq, dk, dv'),
                        ('lse saved in the input dtype', 'ctx.save_for_backward(q, k, v, o, lse)',
                         'ctx.save_for_backward(q, k, v, o, lse.to(q.dtype))'),
                    ('forward returns (o, lse)',
                     '        return o\n',
                     '        return o, lse\n'),
                    ('dk and dv swapped',
                     'return dq, dk, dv, None',
                     'return dq, dv, dk, None')],
 'ex5_gqa_window': [('window hi from the inclusive last key, not + 1',
                     'hi = tl.minimum(start_m + BLOCK_M + (N_K - N_Q) + right, N_K)',
                     'hi = tl.minimum(start_m + BLOCK_M - 1 + (N_K - N_Q) + right, N_K)'),
                    ('window lo one key too far right', 'lo = tl.maximum(start_m + (N_K - N_Q) - WINDOW, 0) // BLOCK_N * BLOCK_N',
                     'lo = tl.maximum(start_m + (N_K - N_Q) - WINDOW + 1, 0) // BLOCK_N * BLOCK_N'),
                    ('K/V head from the 32-bit program id', 'kv = bh // GROUP ', 'kv = tl.program_id(1) // GROUP '),
                    ('K/V head by modulo', 'kv = bh // GROUP', 'kv = bh % (tl.num_programs(1) // GROUP)'),
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
                     'right = 0 if CAUSAL else N_K'),
                    ('window kept on the right under causal too (future tiles read)',
                     'hi = tl.minimum(start_m + BLOCK_M + (N_K - N_Q) + right, N_K)',
                     'hi = tl.minimum(start_m + BLOCK_M + (N_K - N_Q) + WINDOW, N_K)'),
                    ('keys read up to N_K (tiles after the window not skipped)',
                     'hi = tl.minimum(start_m + BLOCK_M + (N_K - N_Q) + right, N_K)', 'hi = N_K + 0 * right'),
                    ('o in fp32 for bf16 inputs', 'o = torch.empty_like(q3)', 'o = torch.empty_like(q3, dtype=torch.float32)'),
                    ('32-bit head offsets', 'bh = tl.program_id(1).to(tl.int64)', 'bh = tl.program_id(1)'),
                    ('lse in the input dtype', 'lse = torch.empty(q3.shape[:2], dtype=torch.float32, device=q.device)',
                     'lse = torch.empty(q3.shape[:2], dtype=q.dtype, device=q.device)'),
                    ('PREC="tf32" for fp32 inputs', 'PREC="ieee" if q.dtype == torch.float32 else "tf32", BLOCK_M',
                     'PREC="tf32", BLOCK_M'),
                    ('scale hard-coded for d = 16', 'd ** -0.5 * LOG2E, n, nk, hq // hkv, window',
                     '0.25 * LOG2E, n, nk, hq // hkv, window'),
                    ('running max initialised to 0', 'm_i = tl.full([BLOCK_M], float("-inf"), tl.float32)',
                     'm_i = tl.zeros([BLOCK_M], tl.float32)'),
                    ('GROUP passed as H_kv',
                     'n, nk, hq // hkv, window',
                     'n, nk, hkv, window'),
                    ('window=None taken as N_k',
                     'window = n + nk if window is None else int(window)',
                     'window = nk if window is None else int(window)'),
                    ('q of the last query tile loaded without the row mask',
                     'q = tl.load(q_ptrs, mask=offs_m[:, None] < N_Q, other=0.0)\n    k_base',
                     'q = tl.load(q_ptrs)\n    k_base'),
                    ('query position without the N_K - N_Q shift',
                     'pos = offs_m + (N_K - N_Q) ',
                     'pos = offs_m '),
                    ("window's left bound strict",
                     '(offs_n[None, :] >= pos[:, None] - WINDOW)',
                     '(offs_n[None, :] > pos[:, None] - WINDOW)')]}

# (grade_id, mistake) -> why no visible check can catch it (at most one per notebook)
HIDDEN_ONLY = {}

# grade_id -> [(name, text in the answer, replacement)]: pass the visible tests, fail the hidden ones
FITTED = {
    "ex1_softmax": [("rows assumed packed (no .contiguous(): a sliced input read wrong)",
                     "x2 = x.reshape(-1, x.shape[-1]).contiguous()", "x2 = x.reshape(-1, x.shape[-1])")],
    "ex2_flash_forward": [("lse shaped for [B, H, N, d] inputs only",
                           "return o.reshape(q.shape), lse.reshape(q.shape[:-1])",
                           "return o.reshape(q.shape), lse.reshape(*q.shape[:2], -1)")],
    "ex3_flash_backward": [("gradients shaped for [B, H, N, d] inputs only",
                            "return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)",
                            "return (dq.reshape(q.shape[0], -1, n, d), dk.reshape(k.shape[0], -1, nk, d),\n"
                            "            dv.reshape(v.shape[0], -1, nk, d))")],
    "ex4_flash_function": [("saved lse squeezed as if it were [..., N, 1] (wrong at N = 1 only)",
                            "ctx.save_for_backward(q, k, v, o, lse)", "ctx.save_for_backward(q, k, v, o, lse.squeeze(-1))")],
    "ex5_gqa_window": [("window = 0 taken as no window (truthiness)", "window = n + nk if window is None else int(window)",
                        "window = n + nk if not window else int(window)")],
}

# Loads and stores past a tensor's end, which a value check misses (the extra keys' scores are masked afterwards) or
# which corrupt the interpreter's heap: the visible tests run every kernel under lk.tritonbounds.outside_accesses.
RULES["ex2_flash_forward"] += ["no load or store outside the tensors handed to the kernel (lk.tritonbounds), in every run of the staged tests"]
RULES["ex3_flash_backward"] += ["no load or store outside the tensors handed to the kernel (lk.tritonbounds), in every run of the staged tests"]
RULES["ex5_gqa_window"] += ["no load or store outside the tensors handed to the kernel (lk.tritonbounds), in every run of the staged tests"]
MISTAKES["ex2_flash_forward"] += [
    ("V of the tail tile loaded past N_K", "v = tl.load(v_ptrs, mask=inside[:, None], other=0.0)", "v = tl.load(v_ptrs)"),
    ("K and V of the tail tile masked one key too far (<=)",
     "kt = tl.load(kt_ptrs, mask=inside[None, :], other=0.0)\n            v = tl.load(v_ptrs, mask=inside[:, None], other=0.0)",
     "kt = tl.load(kt_ptrs, mask=(offs_n <= N_K)[None, :], other=0.0)\n"
     "            v = tl.load(v_ptrs, mask=(offs_n <= N_K)[:, None], other=0.0)"),
]
MISTAKES["ex3_flash_backward"] += [
    ("dQ kernel rows bounded by N_K",
     "    rows = offs_m < N_Q\n    offs = bh * N_Q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]\n    q = tl.load",
     "    rows = offs_m < N_K\n    offs = bh * N_Q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]\n    q = tl.load"),
]
MISTAKES["ex5_gqa_window"] += [
    ("V tile loaded past N_K", "v = tl.load(v_base + offs_n[:, None] * HEAD_DIM + offs_d[None, :], mask=inside[:, None], other=0.0)",
     "v = tl.load(v_base + offs_n[:, None] * HEAD_DIM + offs_d[None, :])"),
]

# Issue 58, the contract of each graded function (labkit.checks.contract): inputs that are views (one call on
# transposed q, k, v, also checking that the call leaves them unchanged), block sizes and row lengths past the
# visible constants (freed memory filled with NaN so rows left unwritten show), N != N_k, no [..., N, N_k] tensor,
# no state between calls, 64-bit row offsets in the softmax.
RULES["ex1_softmax"] += [
    "x as a transposed view (non-contiguous): same values, x left unchanged (one call)",
    "one row of 3000 (longer than 1024): BLOCK = 4096 and values (freed memory filled with NaN)",
    "64-bit row offsets: softmax_kernel launched by hand with the row's program id past 2^26, no int32 overflow",
]
RULES["ex2_flash_forward"] += [
    "no tensor as large as the [..., N, N_k] scores built (torch calls watched in every stage)",
    "q, k, v as transposed views (non-contiguous): same o and lse, inputs left unchanged (one call)",
    "the tuned tiles varied: BLOCK_M = 16, BLOCK_N = 32 (freed memory filled with NaN)",
]
RULES["ex3_flash_backward"] += [
    "no tensor as large as [..., N, N_k] built (torch calls watched in every stage)",
    "q, k, v, o, lse, dO as transposed views (non-contiguous): same gradients, inputs left unchanged (one call)",
    "the tuned tiles varied: dK/dV 32 x 16, dQ 16 x 32 (freed memory filled with NaN)",
]
RULES["ex4_flash_function"] += [
    "N != N_k (N = 70, N_k = 50 causal and not; [batch, n, d] N = 48, N_k = 40): o, and gradients of k's and v's shape",
    "the forward leaves q, k, v unchanged",
    "no state between calls: two forwards (non-causal, causal), then both backwards",
]
RULES["ex5_gqa_window"] += [
    "q, k, v as transposed views (non-contiguous): same o and lse, inputs left unchanged (one call)",
    "block_m = 64, block_n = 32 (away from the defaults 32, 16): same o and lse (freed memory filled with NaN)",
]
MISTAKES["ex1_softmax"] += [
    ("output allocated like the input (its strides)", "y = torch.empty_like(x2)", "y = torch.empty_like(x)"),
    ("softmax written over the input (in place)", "y = torch.empty_like(x2)", "y = x2"),
    ("BLOCK capped at 1024", "BLOCK=triton.next_power_of_2(x2.shape[1])",
     "BLOCK=min(triton.next_power_of_2(x2.shape[1]), 1024)"),
    ("32-bit row offsets", "row = tl.program_id(0).to(tl.int64)", "row = tl.program_id(0)"),
]
MISTAKES["ex2_flash_forward"] += [
    ("output allocated like q (its strides)", "o = torch.empty_like(q3)", "o = torch.empty_like(q)"),
    ("q scaled in place on the host (the caller's q changed)",
     "q3, k3, v3 = _as_heads(q), _as_heads(k), _as_heads(v)",
     "q3, k3, v3 = _as_heads(q).mul_(d ** -0.5), _as_heads(k), _as_heads(v)"),
    ("dense N x N_k logsumexp on the host",
     "return o.reshape(q.shape), lse.reshape(q.shape[:-1])",
     "s = (q.float() @ k.float().transpose(-2, -1)) * d ** -0.5\n"
     "    if is_causal:\n"
     "        keep = torch.ones(n, k.shape[-2], dtype=torch.bool, device=q.device).tril(k.shape[-2] - n)\n"
     "        s = s.masked_fill(~keep, float(\"-inf\"))\n"
     "    return o.reshape(q.shape), torch.logsumexp(s, -1)"),
]
MISTAKES["ex3_flash_backward"] += [
    ("gradients allocated like the inputs (their strides)",
     "dq, dk, dv = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3)",
     "dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)"),
    ("D from a dense P * dP on the host",
     "HEAD_DIM=d, BLOCK_M=64)\n",
     "HEAD_DIM=d, BLOCK_M=64)\n"
     "    s = (q3.float() @ k3.float().transpose(-2, -1)) * d ** -0.5\n"
     "    if is_causal:\n"
     "        s = s.masked_fill(~torch.ones(n, nk, dtype=torch.bool, device=q.device).tril(nk - n), float(\"-inf\"))\n"
     "    p = torch.exp(s - lse.reshape(bh, n, 1)).nan_to_num(0.0)\n"
     "    delta = (p * (do3.float() @ v3.float().transpose(-2, -1))).sum(-1)\n"),
]
MISTAKES["ex4_flash_function"] += [
    ("gradients shaped like q (N_k = N only)", "return dq, dk, dv, None", "return dq, dk.view_as(q), dv.view_as(q), None"),
    ("is_causal kept on a class, not on ctx (the last forward's flag in every backward)",
     "ctx.is_causal = is_causal", "type(ctx).is_causal = is_causal"),
]
MISTAKES["ex5_gqa_window"] += [
    ("BLOCK_M hard-coded at 32", "BLOCK_M=block_m", "BLOCK_M=32"),
    ("output allocated like q (its strides)", "o = torch.empty_like(q3)", "o = torch.empty_like(q)"),
]

# An outside read of 06's kernels (2026-12-07): mistakes the visible tests did not catch before.
RULES["ex1_softmax"] = [r.replace("one row of 3000 (longer than 1024)", "one row of 5000 (longer than 1024 and 4096)")
                        for r in RULES["ex1_softmax"]]
RULES["ex2_flash_forward"] += ["calls causal and not in turns: each answers as alone (no output tensor kept and reused)"]
RULES["ex5_gqa_window"] += ["k, v as the first d columns of a wider buffer (a fused KV tensor's slices): same o and lse",
                            "block_m = 16, block_n = 64 too (freed memory filled with NaN): the grid follows block_m"]
MISTAKES["ex1_softmax"] += [
    ("BLOCK capped at 4096", "BLOCK=triton.next_power_of_2(x2.shape[1])",
     "BLOCK=min(triton.next_power_of_2(x2.shape[1]), 4096)"),
]
MISTAKES["ex2_flash_forward"] += [
    ("o and lse kept per shape and reused by the next call",
     "    o = torch.empty_like(q3)\n    lse = torch.empty(q3.shape[:2], dtype=torch.float32, device=q.device)  # [BH, N]\n",
     "    cache = globals().setdefault(\"_OUTPUTS\", {})\n"
     "    if (q3.shape, q3.dtype) not in cache:\n"
     "        cache[(q3.shape, q3.dtype)] = (torch.empty_like(q3),\n"
     "                                       torch.empty(q3.shape[:2], dtype=torch.float32, device=q.device))\n"
     "    o, lse = cache[(q3.shape, q3.dtype)]\n"),
]
MISTAKES["ex5_gqa_window"] += [
    ("grid written for block_m = 32", "[(triton.cdiv(n, block_m), b * hq)]", "[(triton.cdiv(n, 32), b * hq)]"),
    ("k, v flattened with reshape, not made contiguous", "q3, k3, v3 = _as_heads(q), _as_heads(k), _as_heads(v)",
     "q3, k3, v3 = _as_heads(q), k.reshape(-1, nk, d), v.reshape(-1, nk, d)"),
]
RULES["ex3_flash_backward"] += ["the D the dK/dV and dQ kernels read: fp64 row sums of bf16 O and dO to 1e-3 (no bf16 sum)"]
MISTAKES["ex3_flash_backward"] += [
    ("D recomputed on the host in the input dtype after the preprocess kernel",
     "    dq, dk, dv = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3)\n",
     "    delta = (do3 * o3).sum(-1).float()\n"
     "    dq, dk, dv = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3)\n"),
]
