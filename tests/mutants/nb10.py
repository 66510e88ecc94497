"""Notebook 10 (10_fp8_attention): rules its exercises state, wrong answers, answers fitted to visible cases."""

ASSIGNMENT = "10_fp8_attention"
SETUP = ['MODE = lk.tritonmode.setup()']

# grade_id -> the rules its visible tests check
RULES = {
    'ex1_quantizers': [
        "per tensor, fp32 / bf16 / fp16 x of 0-d to 4-d: x8 e4m3 of x's shape; descale an fp32 0-dim tensor = amax / 448 with amax in fp32 (within 1e-6)",
        "round trip: |x8 * descale - x| <= descale * half e4m3's spacing at |x / descale| (plus fp32's rounding of it)",
        "saturation: an amax (4 * 1.0234375) whose x / descale lands just above fmax in fp32 reaches the cast clamped (every value handed to a float8 cast watched; torch 2.13's CPU cast saturates, 2.11's CUDA cast gives NaN); no NaN in x8",
        'an all-zero tensor and an all-zero tile: descale 1, x8 zero, no NaN',
        "per block, x [B, H, N, D] with B, H > 1, N not a multiple of block, block != D, block 1: descale fp32 [B, H, ceil(N / block)] = each tile's amax / 448 (float64 loop over the tiles, the last one short)",
        "e5m2: x8 in e5m2, descale amax / 57344, clamped, round trip within e5m2's half spacing (both quantizers)",
        'dtype bf16 / fp16 / int8 -> ValueError (both); block 0 or a 3-d x -> ValueError',
        "contract: x unchanged, x as a view (transposed, sliced), every tensor on x's device (meta; no returned tensor made without device=)",
    ],
    'ex2_rotation': [
        'hadamard(d), d = 1 ... 64: fp32 [d, d] equal to (-1)^popcount(i & j); H H^T = d I; d = 0, 3, 6, 12, 48 -> ValueError',
        'random_rotation(d), d = 16, 64, 128: fp32 [d, d], |R R^T - I| <= 2 d 2^-24; equal to diag(s) H / sqrt(d) with s = randint(0, 2, (d,), generator) * 2 - 1 for seeds 0-5 (the generator used, signs on the rows); seeds give different R; generator=None: the global generator (after torch.manual_seed(7))',
        "rotate_qk (fp32, bf16, fp16; D = 32, 64): q's and k's dtypes and shapes; x @ R computed in fp32 and cast once (within D 2^-24 |x_row| plus one step of the dtype); fp32: (q R)(k R)^T = q k^T within 8 D 2^-24 |q_i| |k_j|",
        'contract: q, k, R unchanged; views',
    ],
    'ex3_fp8_kernel': [
        'own code: no SDPA / torch.softmax / labkit but lk.fp8cast; launches _fp8_fwd_kernel',
        "o vs float64 attention of the dequantized inputs within the e4m3 bound (per key 2^-4 P + 2^-10 / p_scale, plus o's bf16 rounding), lse within 1e-4: N = 40 != Nk = 56 (tails), D = 32, Hq = 4 over Hkv = 2 (GQA), causal and not, causal N = 56 > Nk = 40, B = 2, per-tensor and per-block descales, p_scale 1 and 256, forward and reverse; block_n = 2 block_m (q's tiles not k's)",
        'rows that see no key (causal N = 24 > Nk = 8): o = 0, lse = -inf, no NaN',
        "causal tiles past the diagonal never loaded: interpreter's loaded elements at most 3/4 of non-causal's",
        'reverse=True walks the key tiles from the last (a sink: forward + p_scale 1 loses 127 keys below 2^-10, reverse keeps them), p_scale really scales P before the cast (forward + p_scale 256 keeps them)',
        'P cast to e4m3: one tile equals a model with P * p_scale cast to e4m3, not one with P in bf16',
        'both tl.dot in FP8: sm90 PTX has wgmma .e4m3.e4m3 for QK^T (n = BLOCK_N) and PV (n = D), no bf16/f16 MMA',
        'no load or store outside the tensors (tails masked: K, V by N_K; q, o, lse by N_Q), in every run',
        'bad input -> ValueError: v not e4m3, q in e5m2, a descale shaped for another block, Hq % Hkv != 0, D not a power of two',
        'contract: q8, k8, v8 and the descales as transposed views give the same o and lse and stay unchanged',
    ],
    'ex4_pipeline': [
        "block + rotation (seed 3, block_m 16, block_n 32, causal, p_scale 64, reverse; bf16 [2, 2, 40, 32]): one fp8_attention call; e4m3 operands; q_descale [2, 2, 3], k and v [2, 2, 2]; causal, p_scale, reverse, block_m, block_n passed through; q8, k8 dequantized ~ q R, k R with the same R (the seed's first draw), v8 ~ v",
        "quant='tensor': 0-dim descales, no rotation; with rotate=True (seed 3): q8 ~ q R, k8 ~ k R, v8 ~ v; quant='row' -> ValueError; o bf16 [B, H, N, D]",
        "goals at the study's CPU shapes with the reader's kernel: outliers per-tensor RMSE >= 2 x per-block + rotation; sink forward p_scale 1 RMSE >= 3 x reverse p_scale 256",
    ],
}

MISTAKES = {
    'ex1_quantizers': [
        ('no clamp before the cast (per tensor)', 'x8 = (x.float() / descale).clamp(-fmax, fmax).to(dtype)', 'x8 = (x.float() / descale).to(dtype)'),
        ('no clamp before the cast (per block)', 'x8 = (xf / descale[..., None]).clamp(-fmax, fmax).to(dtype)', 'x8 = (xf / descale[..., None]).to(dtype)'),
        ("clamp to the input dtype's max", 'x8 = (x.float() / descale).clamp(-fmax, fmax).to(dtype)', 'x8 = (x.float() / descale).clamp(-torch.finfo(x.dtype).max, torch.finfo(x.dtype).max).to(dtype)'),
        ('amax == 0 not handled (descale 0, x8 NaN)', 'amax = x.detach().abs().amax().float()                           # max |x| in fp32\n    descale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))\n', 'amax = x.detach().abs().amax().float()\n    descale = amax / fmax\n'),
        ("descale in x's dtype (amax not cast to fp32)", 'amax = x.detach().abs().amax().float()', 'amax = x.detach().abs().amax()'),
        ('fmax hard-coded to 448', '    fmax = torch.finfo(dtype).max\n    amax = x.detach()', '    fmax = 448.0\n    amax = x.detach()'),
        ('multiplied by the descale instead of divided', 'x8 = (x.float() / descale).clamp(-fmax, fmax).to(dtype)', 'x8 = (x.float() * descale).clamp(-fmax, fmax).to(dtype)'),
        ('the scale returned instead of the descale', 'amax = x.detach().abs().amax().float()                           # max |x| in fp32\n    descale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))\n', 'amax = x.detach().abs().amax().float()\n    descale = torch.where(amax > 0, fmax / amax, torch.ones_like(amax))\n'),
        ('one scale per head instead of per tile', 'amax = xf.abs().amax(dim=-1)  ', 'amax = xf.abs().amax(dim=(-2, -1))[..., None].expand(B, H, tiles)  '),
        ('the short last tile dropped (N // block)', 'tiles = -(-N // block)', 'tiles = N // block'),
        ('any dtype accepted (per tensor)', '    if dtype not in FP8_DTYPES:\n        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")\n    fmax = torch.finfo(dtype).max\n    amax = x.detach()', '    fmax = torch.finfo(dtype).max\n    amax = x.detach()'),
        ('divided in place (changes a float32 x)', 'x8 = (x.float() / descale).clamp(-fmax, fmax).to(dtype)', 'x8 = x.float().div_(descale).clamp(-fmax, fmax).to(dtype)'),
        ('descale rebuilt from a Python float (no device=)', '    x8 = (x.float() / descale).clamp(-fmax, fmax).to(dtype)           # clamp first: torch\'s cast may not saturate\n    return x8, descale\n', '    x8 = (x.float() / descale).clamp(-fmax, fmax).to(dtype)\n    return x8, torch.tensor(float(descale))\n'),
        ('descale returned as a Python float', '    return x8, descale\n    ### END SOLUTION\n\n\ndef quantize_per_block', '    return x8, descale.item()\n    ### END SOLUTION\n\n\ndef quantize_per_block'),
    ],
    'ex2_rotation': [
        ('hadamard without the minus block', 'torch.cat([h, -h], dim=1)', 'torch.cat([h, h], dim=1)'),
        ('hadamard normalized by sqrt(d)', '    return h\n    ### END SOLUTION\n\n\ndef random_rotation', '    return h / math.sqrt(d)\n    ### END SOLUTION\n\n\ndef random_rotation'),
        ('no power-of-two test', 'if d < 1 or d & (d - 1):', 'if d < 1:'),
        ('no random signs (plain H / sqrt(d))', 'return signs[:, None].float() * hadamard(d) / math.sqrt(d)', 'return hadamard(d) / math.sqrt(d)'),
        ('generator ignored', 'torch.randint(0, 2, (d,), generator=generator)', 'torch.randint(0, 2, (d,))'),
        ('signs on the columns', 'signs[:, None].float() * hadamard(d)', 'signs[None, :].float() * hadamard(d)'),
        ('divided by d instead of sqrt(d)', 'hadamard(d) / math.sqrt(d)', 'hadamard(d) / d'),
        ('k rotated by R transposed', '(k.float() @ r).to(k.dtype)', '(k.float() @ r.T).to(k.dtype)'),
        ('rotated in the input dtype (R rounded to bf16)', 'return (q.float() @ r).to(q.dtype), (k.float() @ r).to(k.dtype)', 'return q @ r.to(q.dtype), k @ r.to(k.dtype)'),
        ('rotated in place (changes a float32 q)', 'return (q.float() @ r).to(q.dtype)', 'return q.float().copy_(q.float() @ r).to(q.dtype)'),
        ('rotate_qk returns fp32', 'return (q.float() @ r).to(q.dtype), (k.float() @ r).to(k.dtype)', 'return q.float() @ r, k.float() @ r'),
        ('generator=None replaced by a fixed seed (every R alike)', '    signs = torch.randint(0, 2, (d,), generator=generator)', '    generator = generator or torch.Generator().manual_seed(0)\n    signs = torch.randint(0, 2, (d,), generator=generator)'),
    ],
    'ex3_fp8_kernel': [
        ('k descale left out', 's = tl.dot(q, kt) * (q_scale * tl.load(kd_base + j))', 's = tl.dot(q, kt) * q_scale'),
        ('v descale left out', 'tl.dot(p8, v) * tl.load(vd_base + j)', 'tl.dot(p8, v)'),
        ('q descale of the first tile for every query tile', 'tl.load(qd_ptr + bh * Q_TILES + tile_m)', 'tl.load(qd_ptr + bh * Q_TILES)'),
        ('o not divided by p_scale', 'o = acc / (l_safe * p_scale)[:, None]', 'o = acc / l_safe[:, None]'),
        ('GQA: query head h reads kv head h % Hkv', '(bh % H_Q) // GROUP', '(bh % H_Q) % (H_Q // GROUP)'),
        ('acc not rescaled by alpha', 'acc = acc * alpha[:, None] + tl.dot(p8, v)', 'acc = acc + tl.dot(p8, v)'),
        ('scores not scaled by D^-0.5', 'D ** -0.5 * LOG2E', 'LOG2E'),
        ('causal top-left aligned (j <= i)', 'offs_m[:, None] + (N_K - N_Q)', 'offs_m[:, None]'),
        ('lse left in log2 units', '(m_i + tl.math.log2(l_safe)) * 0.6931471805599453)', '(m_i + tl.math.log2(l_safe)))'),
        ('rows that see no key shifted by -inf (NaN)', 'm_new = tl.where(m_max == float("-inf"), 0.0, m_max)', 'm_new = m_max'),
        ('causal tiles masked, not skipped', 'n_tiles = tl.cdiv(hi, BLOCK_N)', 'n_tiles = tl.cdiv(N_K, BLOCK_N)'),
        ('reverse ignored', 'j = n_tiles - 1 - t if REVERSE else t', 'j = t'),
        ('P cast to bf16 (V widened to bf16 for the dot)', 'p8 = lk.fp8cast.to_e4m3(p * p_scale, EXACT)', 'p8 = (p * p_scale).to(tl.bfloat16)\n        v = v.to(tl.bfloat16)'),
        ('o stored without the row mask', 'o.to(o_ptr.dtype.element_ty), mask=offs_m[:, None] < N_Q)', 'o.to(o_ptr.dtype.element_ty))'),
        ('Hq % Hkv not checked', '    if Hq % Hkv != 0:\n', '    if False:\n'),
        ('strides assumed contiguous (no .contiguous())', 'q8.contiguous(), k8.contiguous(), v8.contiguous()', 'q8, k8, v8'),
        ('e5m2 operands accepted', 'if t.dtype != torch.float8_e4m3fn or t.dim() != 4:', 'if t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or t.dim() != 4:'),
        ('the kernel launched with BLOCK_N = block_m', 'BLOCK_N=block_n, CAUSAL=bool(causal)', 'BLOCK_N=block_m, CAUSAL=bool(causal)'),
        ('o from SDPA on the dequantized inputs', '    return o, lse\n', '    o = torch.nn.functional.scaled_dot_product_attention(q8.float(), k8.float(), v8.float()).to(o.dtype)\n    return o, lse\n'),
        ("the head size fixed at the visible tests' 32", 'HEAD_DIM=D, BLOCK_M=block_m', 'HEAD_DIM=32, BLOCK_M=block_m'),
    ],
    'ex4_pipeline': [
        ('a rotation drawn for q and another for k', 'q, k = rotate_qk(q, k, random_rotation(q.shape[-1], generator))', 'q = rotate_qk(q, q, random_rotation(q.shape[-1], generator))[0]\n        k = rotate_qk(k, k, random_rotation(k.shape[-1], generator))[0]'),
        ('v rotated too', 'q, k = rotate_qk(q, k, random_rotation(q.shape[-1], generator))', 'r = random_rotation(q.shape[-1], generator)\n        q, k = rotate_qk(q, k, r)\n        v = rotate_qk(v, v, r)[0]'),
        ('generator not passed to random_rotation', 'random_rotation(q.shape[-1], generator)', 'random_rotation(q.shape[-1])'),
        ('k and v quantized with block_m', 'quantize_per_block(k, block_n)', 'quantize_per_block(k, block_m)'),
        ('p_scale not passed to fp8_attention', 'p_scale=p_scale, reverse=reverse,', 'reverse=reverse,'),
        ('reverse not passed to fp8_attention', 'p_scale=p_scale, reverse=reverse,', 'p_scale=p_scale,'),
        ('block sizes not passed to fp8_attention', 'reverse=reverse, **tiles)', 'reverse=reverse)'),
        ("quant='tensor' ignored (always per block)", 'if quant == "tensor":', 'if quant == "per_tensor":'),
        ("rotation only with per-block scaling", '    if rotate:\n', '    if rotate and quant == "block":\n'),
    ],
}

# every mistake above fails a visible test
HIDDEN_ONLY = {}

# answers fitted to the visible cases: they pass the visible tests and fail the hidden ones
FITTED = {
    'ex1_quantizers': [
        ("the last tile padded with ones (right while every tile's amax >= 1)", 'xf = F.pad(x.float(), (0, 0, 0, tiles * block - N))', 'xf = F.pad(x.float(), (0, 0, 0, tiles * block - N), value=1.0)'),
    ],
    'ex2_rotation': [
        ("hadamard built up to d = 128 only (the visible tests' largest d)", 'while h.shape[0] < d:', 'while h.shape[0] < min(d, 128):'),
    ],
    'ex3_fp8_kernel': [
        ('the query-head group fixed at the visible tests\' 2 (or 1)', 'Hq, Hq // Hkv, N, Nk,', 'Hq, 2 if Hq != Hkv else 1, N, Nk,'),
    ],
    'ex4_pipeline': [
        ("k and v quantized with the visible tests' block_n = 32", 'quantize_per_block(k, block_n),\n                                        quantize_per_block(v, block_n)', 'quantize_per_block(k, 32),\n                                        quantize_per_block(v, 32)'),
    ],
}

# right answers written another way: each must pass the whole test cell
ACCEPTED = {
    'ex1_quantizers': [
        ('multiplied by 1 / descale', 'x8 = (x.float() / descale).clamp(-fmax, fmax).to(dtype)', 'x8 = (x.float() * (1.0 / descale)).clamp(-fmax, fmax).to(dtype)'),
        ('amax from max and min', 'amax = x.detach().abs().amax().float()', 'amax = torch.maximum(x.detach().max(), -x.detach().min()).float()'),
    ],
    'ex2_rotation': [
        ('hadamard by Kronecker products', 'h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)', 'h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]]), h)'),
        ('signs through torch.diag', 'return signs[:, None].float() * hadamard(d) / math.sqrt(d)', 'return torch.diag(signs.float()) @ hadamard(d) / d ** 0.5'),
    ],
    'ex3_fp8_kernel': [
        ('k descale as a second multiply', 's = tl.dot(q, kt) * (q_scale * tl.load(kd_base + j))', 's = tl.dot(q, kt) * q_scale * tl.load(kd_base + j)'),
        ('GQA kv head as bh // GROUP (b * Hkv + h // GROUP)', 'bh_kv = (bh // H_Q) * (H_Q // GROUP) + (bh % H_Q) // GROUP', 'bh_kv = bh // GROUP'),
    ],
    'ex4_pipeline': [
        ('descales passed by keyword', 'o, _ = fp8_attention(q8, k8, v8, qd, kd, vd, causal,', 'o, _ = fp8_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=causal,'),
    ],
}
