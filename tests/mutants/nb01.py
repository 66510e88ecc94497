"""Notebook 01 (01_setup_and_comparison): rules its exercises state, wrong answers, answers fitted to visible cases."""

ASSIGNMENT = "01_setup_and_comparison"
SETUP = ['P = lk.profiles.choose(']

# grade_id -> the rules its visible tests check
RULES = {
    'ex1_standard_attention': [
        'own softmax/LSE: no labkit, SDPA, torch.softmax, log_softmax or logsumexp',
        'o and lse match the reference (fp32)',
        'o in q.dtype, lse [..., N] in fp32 (fp32 for bf16/fp16, fp64 for fp64 inputs)',
        'mask argument honoured ([B, 1, N, Nk] and [N, Nk]), AND-ed with is_causal',
        'scale argument honoured, also scale=0.0 (only None means 1/sqrt(d))',
        'causal bottom-right with N < Nk, decode N=1 and N > Nk',
        'fully masked rows: o = 0, lse = -inf, no NaN',
        'scores near +-1e4: per-row max subtraction',
        'row max taken after masking (hidden keys with the largest scores)',
        'fp64 inputs computed in fp64',
        'bf16/fp16 inputs: statistics (m, l, lse) in fp32, by the 2x rule',
        'bf16/fp16 inputs: lse within 1e-4 of float64 (scores, exp and sums in fp32)',
        'q, k, v and the caller\'s mask left unchanged (no in-place mask &= causal)',
        'views (transposed, sliced) of q, k, v and the mask give the same o and lse',
        'tensors made inside follow the inputs\' device (meta inputs, mask and is_causal)',
    ],
    'ex2_score_matrix_bytes': [
        'B*H*N^2 times the element size in bytes (not bits)',
        'element size right for 8-, 4-, 2- and 1-byte dtypes (float, int and bool)',
        'returns a Python int',
        'complex64 is 8 bytes (finfo bits count one component)',
        'value past 2**31 exact (no 32-bit integer product)',
    ],
    'ex3_online_softmax': [
        'matches torch.softmax for block sizes that do and do not divide N',
        'no torch.softmax, log_softmax or logsumexp',
        'running max: values ~1e4 of both signs do not overflow',
        'rows of values near -1e4 only: running max starts at -inf, not 0',
        '-inf entries, leading all -inf blocks: no NaN',
        'fp64 computed in fp64; result in the input dtype (fp32, fp64, bf16, fp16)',
        'bf16/fp16 inputs: running max and sum in fp32, by the 2x rule (long rows, many blocks)',
        'bf16 values near 100: statistics (m, l, m + log l) not rounded to bf16, by the 2x rule',
        "bf16 rows spread over +-30: x - m in fp32, each probability's relative error by the 2x rule",
        "bf16/fp16 rows of many blocks: each block's sum in fp32, each row's distance of its sum from 1 by the 2x rule",
        'reads x only in slices of <= block_size columns',
        'each column of x read at most twice, blocks in any order: m and l streamed together (no separate max pass)',
        'x left unchanged (no in-place edit of a block of x)',
        'views (transposed, sliced) of x give the same result',
        'tensors made inside follow x\'s device (meta inputs)',
    ],
    'ex4_flash_forward': [
        'own code: no labkit, SDPA or torch.softmax',
        'o and lse match the reference, N not a multiple of the blocks',
        'o in q.dtype, lse in the accumulator dtype (fp32 for fp32/bf16/fp16, fp64 for fp64)',
        'causal bottom-right with N < Nk, decode N=1 and N > Nk',
        'rows that see no key: o = 0, lse = -inf, no NaN',
        'causal tiles above the diagonal are skipped (NaN V never read), also with N > Nk (N=64, Nk=32: the signed offset)',
        'skip bound keeps the tile the diagonal crosses (N=63, Nk=64, 16-row blocks)',
        'scores near +-1e4: running max in every tile',
        'tile max taken after the causal mask',
        'fp64 accumulators for fp64 inputs',
        'bf16/fp16 inputs: m, l and the O accumulator in fp32 across tiles, by the 2x rule',
        'bf16/fp16 inputs: lse within 1e-4 of float64 (tile scores and exp in fp32; head sizes 24 and 40, scale no power of two)',
        'no N x Nk tensor',
        'outer loop over Q blocks (FA2 order): each Q block read once, in any order',
        'q, k, v left unchanged (no in-place scaling of a block of q)',
        'views (transposed, sliced) of q, k, v give the same o and lse',
        'tensors made inside follow the inputs\' device (meta inputs)',
    ],
    'ex5a_flash_backward': [
        'own code: no labkit, autograd, SDPA or torch.softmax',
        'dq, dk, dv match autograd through the reference (scale on dq and dk, D term)',
        'gradients in the input dtype (fp32, fp64, bf16, fp16)',
        'causal bottom-right with N < Nk and N > Nk; rows that see no key give 0, no NaN',
        'fp64 accumulators for fp64 inputs',
        'skip start keeps the tile the diagonal crosses (N=63, Nk=64, 16-row blocks)',
        'causal tiles above the diagonal are skipped (NaN dO never read), also with N > Nk (N=64, Nk=32: the signed offset)',
        'bf16/fp16 inputs: dq, dk, dv accumulated in fp32, by the 2x rule (many tiles)',
        'D = rowsum(dO * O) in fp32 from bf16/fp16 o and do: upcast before the product, not stored in bf16 (2x rule)',
        'lse read in fp32, not rounded to bf16 (scores near 100 exact in bf16, 2x rule)',
        'dQ accumulator alone in fp32 over 128 K tiles (2x rule)',
        'every input left unchanged, lse too (no in-place edit of the -inf rows)',
        'views (transposed, sliced) of q, k, v, o, lse and do give the same gradients',
        'tensors made inside follow the inputs\' device (meta inputs)',
    ],
    'ex5b_flash_function': [
        'own code: no labkit, SDPA or torch.softmax',
        'forward returns o only; saves exactly q, k, v, o and one lse of shape [..., N]',
        'o and gradients match autograd through the reference, causal and not',
        'is_causal reaches backward; None gradient for it',
        'causal bottom-right with N < Nk and N > Nk through the Function, in fp64',
        'no N x N tensor built in the forward or the backward (no standard_attention, no autograd through it)',
        'backward calls flash_attention_backward: no autograd inside it',
        'bf16 inputs: o in bf16, saved lse in fp32',
        'is_causal kept per call on ctx: causal then non-causal forward, backward of the first (and the reverse)',
        'views (transposed, sliced) of q, k, v and do give the same o and gradients through the Function',
    ],
}


# Blocks of the answers that the multi-line mistakes below rewrite (each occurs once in its answer).
_EX1_MASK = """    s = (q.to(acc) @ k.to(acc).transpose(-2, -1)) * scale       # [..., N, Nk]: the full score matrix
    keep = None
    if is_causal:                                               # bottom-right aligned
        keep = torch.ones(n, nk, dtype=torch.bool, device=q.device).tril(nk - n)
    if mask is not None:
        keep = mask if keep is None else keep & mask
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)                            # [..., N, 1] row max
"""
_EX1_KEEP = """    keep = None
    if is_causal:                                               # bottom-right aligned
        keep = torch.ones(n, nk, dtype=torch.bool, device=q.device).tril(nk - n)
    if mask is not None:
        keep = mask if keep is None else keep & mask
"""
_EX1_SOFTMAX = """    m = s.amax(dim=-1, keepdim=True)                            # [..., N, 1] row max
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # fully masked row: avoid -inf - (-inf)
    p = torch.exp(s - m)                                        # every entry <= 1: no overflow
    l = p.sum(dim=-1, keepdim=True)                             # [..., N, 1]
    lse = (m + torch.log(l)).squeeze(-1)                        # [..., N]; -inf for a fully masked row
    p = p / torch.where(l > 0, l, torch.ones_like(l))           # a fully masked row stays all zero
    return (p @ v.to(acc)).to(q.dtype), lse
"""
_EX3_PASS1 = """        m_new = torch.maximum(m, xb.amax(dim=-1, keepdim=True))
        shift = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
        l = l * torch.exp(m - shift) + torch.exp(xb - shift).sum(dim=-1, keepdim=True)
        m = m_new
"""
_EX3_THREE_PASSES = """        m = torch.maximum(m, xb.amax(dim=-1, keepdim=True))   # pass 1: the row max only
    shift = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    for start in range(0, n, block_size):                              # pass 2: the sum
        l = l + torch.exp(x[..., start:start + block_size].to(acc) - shift).sum(dim=-1, keepdim=True)
"""
_EX4_V1_ORDER = """    m_all = torch.full((*lead, n, 1), float("-inf"), dtype=acc, device=q.device)
    l_all = torch.zeros((*lead, n, 1), dtype=acc, device=q.device)
    o_all = torch.zeros((*lead, n, d), dtype=acc, device=q.device)
    for j0 in range(0, nk, block_n):                               # FlashAttention v1's order: K/V blocks outside
        j1 = min(j0 + block_n, nk)
        kj, vj = k[..., j0:j1, :].to(acc), v[..., j0:j1, :].to(acc)
        for i0 in range(0, n, block_m):
            i1 = min(i0 + block_m, n)
            if is_causal and j0 > i1 - 1 + nk - n:
                continue
            s = (q[..., i0:i1, :].to(acc) * scale) @ kj.transpose(-2, -1)
            if is_causal:
                rows = torch.arange(i0, i1, device=q.device)[:, None] + (nk - n)
                s = s.masked_fill(torch.arange(j0, j1, device=q.device)[None, :] > rows, float("-inf"))
            m_old = m_all[..., i0:i1, :]
            m_new = torch.maximum(m_old, s.amax(dim=-1, keepdim=True))
            shift = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
            p, alpha = torch.exp(s - shift), torch.exp(m_old - shift)
            l_all[..., i0:i1, :] = alpha * l_all[..., i0:i1, :] + p.sum(dim=-1, keepdim=True)
            o_all[..., i0:i1, :] = alpha * o_all[..., i0:i1, :] + p @ vj
            m_all[..., i0:i1, :] = m_new
    o = (o_all / torch.where(l_all > 0, l_all, torch.ones_like(l_all))).to(q.dtype)
    return o, (m_all + torch.log(l_all)).squeeze(-1)
"""
_EX4_HEAD = """    acc = torch.promote_types(q.dtype, torch.float32)              # fp32 accumulators (fp64 for gradcheck)
    *lead, n, d = q.shape
    nk = k.shape[-2]
    scale = d ** -0.5
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)       # [..., N, d]
    lse = torch.empty((*lead, n), dtype=acc, device=q.device)      # [..., N]
"""
_EX4_TILE = """            if is_causal and j1 - 1 > i0 + nk - n:                 # the tile crosses the diagonal
                rows = torch.arange(i0, i1, device=q.device)[:, None] + (nk - n)
                cols = torch.arange(j0, j1, device=q.device)[None, :]
                s = s.masked_fill(cols > rows, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
"""
_EX5A_ZEROS = """    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
"""
_EX5A_DELTA = "delta = (do.to(acc) * o.to(acc)).sum(dim=-1, keepdim=True)"
_EX5B_SAVED = """        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = is_causal
        return o
        ### END SOLUTION

    @staticmethod
    def backward(ctx, do):
        ### BEGIN SOLUTION
        q, k, v, o, lse = ctx.saved_tensors
"""
_EX5B_STATE = _EX5B_SAVED + "        dq, dk, dv = flash_attention_backward(q, k, v, o, lse, do, is_causal=ctx.is_causal)\n"
_EX5B_BACKWARD = """        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(q, k, v, o, lse, do, is_causal=ctx.is_causal)
"""

# grade_id -> [(mistake, text in the answer, replacement)]: each fails a visible test
MISTAKES = {'ex1_standard_attention': [('scale=0.0 taken as not given', 'scale = q.shape[-1] ** -0.5 if scale is None else scale',
                                        'scale = scale or q.shape[-1] ** -0.5'),
                                       ('causal mask aligned top-left', '.tril(nk - n)', '.tril()'),
                            ('no max subtraction',
                             'm = s.amax(dim=-1, keepdim=True)',
                             'm = torch.zeros_like(s[..., :1])'),
                            ('global max instead of the row max',
                             'm = s.amax(dim=-1, keepdim=True)',
                             'm = s.amax()'),
                            ('fp32 accumulator for fp64',
                             'acc = torch.promote_types(q.dtype, torch.float32)',
                             'acc = torch.float32'),
                            ('softmax in the input dtype',
                             'acc = torch.promote_types(q.dtype, torch.float32)',
                             'acc = q.dtype'),
                            ('NaN on an empty row',
                             'p = p / torch.where(l > 0, l, torch.ones_like(l))',
                             'p = p / l'),
                            ('no guard for a -inf row max',
                             'm = torch.where(torch.isneginf(m), torch.zeros_like(m), m)',
                             'm = m'),
                            ('mask ignored when causal',
                             'keep = mask if keep is None else keep & mask',
                             'keep = mask if keep is None else keep'),
                            ('mask argument ignored', 'if mask is not None:', 'if False:'),
                            ('scale argument ignored',
                             'scale = q.shape[-1] ** -0.5 if scale is None else scale',
                             'scale = q.shape[-1] ** -0.5'),
                            ('lse keeps the last dim', 'lse = (m + torch.log(l)).squeeze(-1)', 'lse = m + torch.log(l)'),
                            ('torch.softmax for the weights',
                             'p = p / torch.where(l > 0, l, torch.ones_like(l))',
                             'p = torch.softmax(s, dim=-1).nan_to_num(0.0)'),
                            ('SDPA for the output',
                             'return (p @ v.to(acc)).to(q.dtype), lse',
                             'return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep, '
                             'scale=scale), lse'),
                            ('row max taken before masking', _EX1_MASK,
                             _EX1_MASK.replace("    keep = None\n", "    m = s.amax(dim=-1, keepdim=True)\n    keep = None\n", 1)
                             .replace("    m = s.amax(dim=-1, keepdim=True)                            # [..., N, 1] row max\n", "")),
                            ('softmax statistics in the input dtype, lse cast back to fp32', _EX1_SOFTMAX,
                             "    s = s.to(q.dtype)\n" + _EX1_SOFTMAX
                             .replace("lse = (m + torch.log(l)).squeeze(-1)", "lse = (m + torch.log(l)).squeeze(-1).to(acc)")
                             .replace("return (p @ v.to(acc)).to(q.dtype), lse", "return (p @ v).to(q.dtype), lse")),
                            ('sum l in the input dtype', 'l = p.sum(dim=-1, keepdim=True)',
                             'l = p.to(q.dtype).sum(dim=-1, keepdim=True)'),
                            ('log_softmax for the weights',
                             'p = p / torch.where(l > 0, l, torch.ones_like(l))',
                             'p = torch.log_softmax(s, dim=-1).exp().nan_to_num(0.0)'),
                            ('scores from a bf16/fp16 matmul, statistics in fp32',
                             's = (q.to(acc) @ k.to(acc).transpose(-2, -1)) * scale',
                             's = (q @ k.transpose(-2, -1)).to(acc) * scale'),
                            ('s - m rounded to the input dtype before exp', 'p = torch.exp(s - m)',
                             'p = torch.exp((s - m).to(q.dtype)).to(acc)'),
                            ('mask polarity inverted (True = hide)',
                             'keep = mask if keep is None else keep & mask',
                             'keep = ~mask if keep is None else keep & ~mask'),
                            ('causal OR-ed with the mask',
                             'keep = mask if keep is None else keep & mask',
                             'keep = mask if keep is None else keep | mask'),
                            ("causal mask AND-ed into the caller's mask in place (mask &= tril)", _EX1_KEEP,
                             '''    keep = mask
    if is_causal:                                               # bottom-right aligned
        causal = torch.ones(n, nk, dtype=torch.bool, device=q.device).tril(nk - n)
        if keep is None:
            keep = causal
        else:
            keep &= causal
'''),
                            ('causal mask built without device= (on the CPU)',
                             'torch.ones(n, nk, dtype=torch.bool, device=q.device)', 'torch.ones(n, nk, dtype=torch.bool)')],
 'ex2_score_matrix_bytes': [('bf16 size hard-coded', 'dtype.itemsize', '2'),
                            ('float dtypes only', 'dtype.itemsize', '(4 if dtype == torch.float32 else 2)'),
                            ('bits instead of bytes', 'dtype.itemsize', 'torch.finfo(dtype).bits'),
                            ('bits divided by 8 (a float)', 'dtype.itemsize', 'torch.finfo(dtype).bits / 8'),
                            ('N not squared', 'int(seq_len) ** 2', 'int(seq_len)'),
                            ('heads ignored', 'int(batch) * int(heads) *', 'int(batch) *'),
                            ('bits // 8 from finfo/iinfo (bool has neither)', 'dtype.itemsize',
                             '((torch.finfo(dtype).bits if dtype.is_floating_point else torch.iinfo(dtype).bits) // 8)'),
                            ('finfo bits // 8 (complex64 counted as one component)', 'dtype.itemsize',
                             '((torch.finfo(dtype).bits if dtype.is_floating_point or dtype.is_complex else 8 * dtype.itemsize) // 8)'),
                            ('product in 32-bit integers (wraps past 2**31)',
                             'int(batch) * int(heads) * int(seq_len) ** 2 * dtype.itemsize',
                             'int(__import__("numpy").prod([batch, heads, seq_len, seq_len], dtype="int32")) * dtype.itemsize')],
 'ex3_online_softmax': [('missing rescale of l', 'l = l * torch.exp(m - shift) +', 'l = l +'),
                        ('-inf - -inf trap',
                         'shift = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)',
                         'shift = m_new'),
                        ('fp32 accumulator for fp64',
                         'acc = torch.promote_types(x.dtype, torch.float32)',
                         'acc = torch.float32'),
                        ('no running max at all',
                         'm_new = torch.maximum(m, xb.amax(dim=-1, keepdim=True))',
                         'm_new = torch.zeros_like(m)'),
                        ('block max instead of the running max',
                         'm_new = torch.maximum(m, xb.amax(dim=-1, keepdim=True))',
                         'm_new = xb.amax(dim=-1, keepdim=True)'),
                        ('torch.softmax itself', 'return out', 'return torch.softmax(x, dim=-1)'),
                        ('whole x cast before slicing',
                         'xb = x[..., start:start + block_size].to(acc)                  # [..., <=block]',
                         'xb = x.to(acc)[..., start:start + block_size]'),
                        ('result in the accumulator dtype',
                         'out = torch.empty(x.shape, dtype=x.dtype',
                         'out = torch.empty(x.shape, dtype=acc'),
                        ('running max and sum in the input dtype',
                         'acc = torch.promote_types(x.dtype, torch.float32)',
                         'acc = x.dtype'),
                        ('running max starts at 0',
                         'm = torch.full(stats, float("-inf"), dtype=acc, device=x.device)',
                         'm = torch.zeros(stats, dtype=acc, device=x.device)'),
                        ('second pass divides by exp(lse) rounded to the input dtype',
                         '(torch.exp(xb - m) / l)',
                         'torch.exp(xb - (m + torch.log(l)).to(x.dtype).to(acc))'),
                        ('logsumexp of each block',
                         'l = l * torch.exp(m - shift) + torch.exp(xb - shift).sum(dim=-1, keepdim=True)',
                         'l = l * torch.exp(m - shift) + torch.exp(torch.logsumexp(xb, dim=-1, keepdim=True) - shift)'),
                        ('three passes: the row max first, then the sum', _EX3_PASS1, _EX3_THREE_PASSES),
                        ('x - m subtracted in the input dtype before the fp32 exp',
                         'out[..., start:start + block_size] = (torch.exp(xb - m) / l).to(x.dtype)',
                         'out[..., start:start + block_size] = (torch.exp((x[..., start:start + block_size] '
                         '- m.to(x.dtype)).to(acc)) / l).to(x.dtype)'),
                        ("each block's sum rounded to the input dtype, added to the fp32 l",
                         'torch.exp(xb - shift).sum(dim=-1, keepdim=True)',
                         'torch.exp(xb - shift).to(x.dtype).sum(dim=-1, keepdim=True).to(acc)'),
                        ('second pass subtracts m in place from a block of x (xb -= m)',
                         'out[..., start:start + block_size] = (torch.exp(xb - m) / l).to(x.dtype)',
                         'xb -= m\n        out[..., start:start + block_size] = (torch.exp(xb) / l).to(x.dtype)'),
                        ('running max built without device= (on the CPU)',
                         'm = torch.full(stats, float("-inf"), dtype=acc, device=x.device)',
                         'm = torch.full(stats, float("-inf"), dtype=acc)')],
 'ex4_flash_forward': [('skip bound with |Nk - N|', 'j_end = max(0, min(nk, i1 + nk - n))', 'j_end = max(0, min(nk, i1 + abs(nk - n)))'),
                       ('skip bound with the offset clamped at 0', 'j_end = max(0, min(nk, i1 + nk - n))',
                        'j_end = max(0, min(nk, i1 + max(0, nk - n)))'),
                       ('causal tiles masked but not skipped',
                        'j_end = max(0, min(nk, i1 + nk - n)) if is_causal else nk',
                        'j_end = nk'),
                       ('skip bound off by one',
                        'j_end = max(0, min(nk, i1 + nk - n))',
                        'j_end = max(0, min(nk, i1 - 1 + nk - n))'),
                       ('skip bound aligned top-left', 'j_end = max(0, min(nk, i1 + nk - n))', 'j_end = min(nk, i1)'),
                       ('missing rescale of O', 'acc_o = alpha * acc_o + p @ vj', 'acc_o = acc_o + p @ vj'),
                       ('tile mask aligned top-left', '[:, None] + (nk - n)', '[:, None]'),
                       ('diagonal tile found by j0 == i0',
                        'if is_causal and j1 - 1 > i0 + nk - n:',
                        'if is_causal and j0 == i0:'),
                       ('NaN on rows that see no key',
                        '(acc_o / torch.where(l > 0, l, torch.ones_like(l)))',
                        '(acc_o / l)'),
                       ('-inf - -inf in a fully masked tile row',
                        'shift = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)',
                        'shift = m_new'),
                       ('no running max in tiles',
                        'm_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))',
                        'm_new = torch.zeros_like(m)'),
                       ('fp32 accumulator for fp64',
                        'acc = torch.promote_types(q.dtype, torch.float32)',
                        'acc = torch.float32'),
                       ('accumulators in the input dtype',
                        'acc = torch.promote_types(q.dtype, torch.float32)',
                        'acc = q.dtype'),
                       ('SDPA for the output',
                        'return o, lse',
                        'return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal), lse'),
                       ('accumulators in the input dtype, lse stored as fp32', _EX4_HEAD,
                        _EX4_HEAD.replace("acc = torch.promote_types(q.dtype, torch.float32)", "acc = q.dtype")
                        .replace("lse = torch.empty((*lead, n), dtype=acc",
                                 "lse = torch.empty((*lead, n), dtype=torch.promote_types(q.dtype, torch.float32)")),
                       ('O accumulator rounded to the input dtype each tile',
                        'acc_o = alpha * acc_o + p @ vj',
                        'acc_o = (alpha * acc_o + p @ vj).to(q.dtype)'),
                       ('tile max taken before the causal mask', _EX4_TILE,
                        "            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))\n"
                        + _EX4_TILE.rsplit("            m_new", 1)[0]),
                       ('tile mask cut from a full N x Nk causal mask',
                        '''                rows = torch.arange(i0, i1, device=q.device)[:, None] + (nk - n)
                cols = torch.arange(j0, j1, device=q.device)[None, :]
                s = s.masked_fill(cols > rows, float("-inf"))''',
                        '''                full = torch.ones(n, nk, dtype=torch.bool, device=q.device).tril(nk - n)
                s = s.masked_fill(~full[i0:i1, j0:j1], float("-inf"))'''),
                       ('tile scores from a bf16/fp16 matmul', 's = qi @ kj.transpose(-2, -1)',
                        's = (q[..., i0:i1, :] @ k[..., j0:j1, :].transpose(-2, -1)).to(acc) * scale'),
                       ('exp of tile scores in the input dtype', 'p = torch.exp(s - shift)',
                        'p = torch.exp((s - shift).to(q.dtype)).to(acc)'),
                       ('K/V blocks outside, Q blocks inside (v1 order)', _EX4_HEAD, _EX4_HEAD + _EX4_V1_ORDER),
                       ('scale applied to q in the input dtype, then upcast',
                        'qi = q[..., i0:i1, :].to(acc) * scale', 'qi = (q[..., i0:i1, :] * scale).to(acc)'),
                       ('block of q scaled in place (qi *= scale)', 'qi = q[..., i0:i1, :].to(acc) * scale',
                        'qi = q[..., i0:i1, :].to(acc)\n        qi *= scale'),
                       ('tile mask columns built without device= (on the CPU)',
                        'cols = torch.arange(j0, j1, device=q.device)[None, :]', 'cols = torch.arange(j0, j1)[None, :]')],
 'ex5a_flash_backward': [('causal start with |Nk - N|', '(max(0, j0 - (nk - n)) // block_m)', '(max(0, j0 - abs(nk - n)) // block_m)'),
                         ('causal start with the offset clamped at 0', '(max(0, j0 - (nk - n)) // block_m)',
                          '(max(0, j0 - max(0, nk - n)) // block_m)'),
                         ('causal start ignores Nk - N', '(max(0, j0 - (nk - n)) // block_m)', '(j0 // block_m)'),
                         ('skip start off by one',
                          '(max(0, j0 - (nk - n)) // block_m)',
                          '(max(0, j0 - (nk - n) + 1) // block_m)'),
                         ('causal tiles masked but not skipped',
                          'i_first = (max(0, j0 - (nk - n)) // block_m) * block_m if is_causal else 0',
                          'i_first = 0'),
                         ('tile mask aligned top-left', '[:, None] + (nk - n)', '[:, None]'),
                         ('missing D term in dS', 'ds = p * (dp - delta[..., i0:i1, :])', 'ds = p * dp'),
                         ('dq without scale',
                          'dq[..., i0:i1, :] += (ds @ kj) * scale',
                          'dq[..., i0:i1, :] += ds @ kj'),
                         ('dk without scale',
                          'dk[..., j0:j1, :] += (ds.transpose(-2, -1) @ qi) * scale',
                          'dk[..., j0:j1, :] += ds.transpose(-2, -1) @ qi'),
                         ('NaN for rows that see no key',
                          'lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)',
                          'lse = lse'),
                         ('fp32 accumulator for fp64',
                          'acc = torch.promote_types(q.dtype, torch.float32)',
                          'acc = torch.float32'),
                         ('gradients returned in the accumulator dtype',
                          'return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)',
                          'return dq, dk, dv'),
                         ('autograd through standard attention',
                          'return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)',
                          'q, k, v = (t.detach().requires_grad_() for t in (q, k, v))\n'
                          '    return torch.autograd.grad(standard_attention(q, k, v, is_causal=is_causal)[0], (q, k, v), do)'),
                         ('everything in the input dtype (gradients of bf16 sums)',
                          'acc = torch.promote_types(q.dtype, torch.float32)',
                          'acc = q.dtype'),
                         ('dq, dk, dv accumulated in the input dtype', _EX5A_ZEROS,
                          _EX5A_ZEROS.replace("dtype=acc", "dtype=q.dtype")),
                         ('D from the bf16/fp16 product and sum (no upcast)', _EX5A_DELTA,
                          'delta = (do * o).sum(dim=-1, keepdim=True).to(acc)'),
                         ('D: dO * O rounded to bf16/fp16, then summed in fp32', _EX5A_DELTA,
                          'delta = (do * o).to(acc).sum(dim=-1, keepdim=True)'),
                         ('D summed in fp32, stored in the input dtype', _EX5A_DELTA,
                          'delta = (do.to(acc) * o.to(acc)).sum(dim=-1, keepdim=True).to(q.dtype)'),
                         ('lse rounded to the input dtype before P is recomputed',
                          'lse = lse.to(acc).unsqueeze(-1)', 'lse = lse.to(q.dtype).to(acc).unsqueeze(-1)'),
                         ('dq alone accumulated in the input dtype (zeros_like(q))',
                          'dq = torch.zeros(q.shape, dtype=acc, device=q.device)', 'dq = torch.zeros_like(q)'),
                         ("rows that see no key: the caller's lse set to +inf in place",
                          'lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)',
                          'lse[torch.isneginf(lse)] = float("inf")'),
                         ('tile mask columns built without device= (on the CPU)',
                          'cols = torch.arange(j0, j1, device=q.device)[None, :]', 'cols = torch.arange(j0, j1)[None, :]')],
 'ex5b_flash_function': [('causal flag lost for backward', 'ctx.is_causal = is_causal', 'ctx.is_causal = False'),
                         ('forward ignores is_causal',
                          'flash_attention_forward(q, k, v, is_causal=is_causal)',
                          'flash_attention_forward(q, k, v)'),
                         ('backward in fp32',
                          'flash_attention_backward(q, k, v, o, lse, do,',
                          'flash_attention_backward(q.float(), k.float(), v.float(), o.float(), lse.float(), '
                          'do.float(),'),
                         ('forward returns (o, lse)', 'return o\n', 'return o, lse\n'),
                         ('extra statistic saved',
                          'ctx.save_for_backward(q, k, v, o, lse)',
                          'ctx.save_for_backward(q, k, v, o, lse, torch.exp(lse))'),
                         ('no gradient slot for is_causal', 'return dq, dk, dv, None', 'return dq, dk, dv'),
                         ('forward through standard_attention (N x N scores)',
                          'flash_attention_forward(q, k, v, is_causal=is_causal)',
                          'standard_attention(q, k, v, is_causal=is_causal)'),
                         ('backward by autograd through standard_attention', _EX5B_BACKWARD,
                          """        q, k, v, o, lse = ctx.saved_tensors
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            dq, dk, dv = torch.autograd.grad(standard_attention(q, k, v, is_causal=ctx.is_causal)[0], (q, k, v), do)
"""),
                         ('backward by autograd through the tiled forward', _EX5B_BACKWARD,
                          """        q, k, v, o, lse = ctx.saved_tensors
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            o = flash_attention_forward(q, k, v, is_causal=ctx.is_causal)[0]
            dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
"""),
                         ('o not saved: the forward recomputed in backward', _EX5B_SAVED,
                          _EX5B_SAVED.replace("ctx.save_for_backward(q, k, v, o, lse)", "ctx.save_for_backward(q, k, v, lse)")
                          .replace("q, k, v, o, lse = ctx.saved_tensors",
                                   "q, k, v, lse = ctx.saved_tensors\n        o, _ = flash_attention_forward(q, k, v, is_causal=ctx.is_causal)")),
                         ('is_causal saved as a tensor', _EX5B_SAVED,
                          _EX5B_SAVED.replace("ctx.save_for_backward(q, k, v, o, lse)",
                                              "ctx.save_for_backward(q, k, v, o, lse, torch.tensor(is_causal))")
                          .replace("q, k, v, o, lse = ctx.saved_tensors", "q, k, v, o, lse, _flag = ctx.saved_tensors")),
                         ('forward upcasts bf16/fp16 inputs to fp32 (fp32 o)',
                          'o, lse = flash_attention_forward(q, k, v, is_causal=is_causal)',
                          'o, lse = flash_attention_forward(*(t.float() if t.dtype in (torch.bfloat16, torch.float16) else t '
                          'for t in (q, k, v)), is_causal=is_causal)'),
                         ('lse saved in the input dtype',
                          'ctx.save_for_backward(q, k, v, o, lse)', 'ctx.save_for_backward(q, k, v, o, lse.to(q.dtype))'),
                         ('leading dims flattened with .view (fails on a transposed q)',
                          'o, lse = flash_attention_forward(q, k, v, is_causal=is_causal)',
                          'o, lse = flash_attention_forward(*(t.view(-1, *t.shape[-2:]) for t in (q, k, v)), is_causal=is_causal)\n'
                          '        o, lse = o.view(q.shape[:-1] + o.shape[-1:]), lse.view(q.shape[:-1])'),
                         ('is_causal kept on the class, not on ctx', _EX5B_STATE,
                          _EX5B_STATE.replace("ctx.is_causal = is_causal", "FlashAttention2.is_causal = is_causal")
                          .replace("is_causal=ctx.is_causal", "is_causal=FlashAttention2.is_causal")),
                         ('is_causal kept in a module-level global, not on ctx', _EX5B_STATE,
                          _EX5B_STATE.replace("ctx.is_causal = is_causal", "global _IS_CAUSAL\n        _IS_CAUSAL = is_causal")
                          .replace("is_causal=ctx.is_causal", "is_causal=_IS_CAUSAL"))]}

# (grade_id, mistake) -> why no visible check can catch it (at most one per notebook)
HIDDEN_ONLY = {}

# grade_id -> [(name, text in the answer, replacement)]: right answers written another way the prose allows
ACCEPTED = {
    'ex3_online_softmax': [('first pass right to left (the prose sets no order)',
                            'for start in range(0, n, block_size):                              # pass 1',
                            'for start in reversed(range(0, n, block_size)):                    # pass 1')],
    'ex4_flash_forward': [('Q blocks visited last to first (they run in parallel on a GPU)',
                           'for i0 in range(0, n, block_m):                                # outer loop',
                           'for i0 in reversed(range(0, n, block_m)):                      # outer loop')],
}

# grade_id -> [(name, text in the answer, replacement)]: pass the visible tests, fail the hidden ones
FITTED = {
    'ex1_standard_attention': [('bottom-right offset only for the visible shapes', '.tril(nk - n)',
                                '.tril(nk - n if n in (1, 12, 20, 48) else 0)')],
    'ex2_score_matrix_bytes': [('element sizes of the visible dtypes only', 'dtype.itemsize',
                                '{torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.float64: 8, '
                                'torch.int8: 1, torch.bool: 1, torch.complex64: 8}[dtype]')],
    'ex3_online_softmax': [('blocks only for the visible block sizes',
                            '    acc = torch.promote_types(x.dtype, torch.float32)\n',
                            '    acc = torch.promote_types(x.dtype, torch.float32)\n'
                            '    if block_size not in (8, 12, 16, 32, 100, 128):\n'
                            '        block_size = x.shape[-1]\n')],
    'ex4_flash_forward': [('tile mask offset only for the visible shapes', '[:, None] + (nk - n)',
                           '[:, None] + (nk - n if n in (1, 24, 40, 48, 57, 63, 64) else 0)')],
    'ex5a_flash_backward': [('tile mask offset only for the visible shapes', '[:, None] + (nk - n)',
                             '[:, None] + (nk - n if n in (24, 44, 57, 63, 64, 128) else 0)')],
    'ex5b_flash_function': [('lse saved as [B, H, N] (4-D inputs only)',
                             'ctx.save_for_backward(q, k, v, o, lse)',
                             'ctx.save_for_backward(q, k, v, o, lse.reshape(-1, *lse.shape[-2:]))')],
}
