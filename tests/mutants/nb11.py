"""Notebook 11 (11_determinism): rules its exercises state, wrong answers, answers fitted to visible cases."""

ASSIGNMENT = "11_determinism"
SETUP = ['MODE = lk.tritonmode.setup()']

# grade_id -> the rules its visible tests check
RULES = {
    'ex1_fixed_order_sum': [
        "own code: not lk.detreduce.atomic_sum; launches a Triton kernel defined in the notebook, one program per block (a launch of grid (cdiv(n, block),): n = 100, block 32), and no kernel it launches calls tl.atomic_add",
        "the same bits (raw bytes) over 8 program orders of the interpreter (the loop's own and 7 shuffled): n = 2000, block 32",
        "the sum against float64 within 1e-6 sum |x| (values over six orders of magnitude): n = 1, 63, 64, 1000, 4097 with block 16, 64, 128 (n not a multiple of the block, one element, one block, 257 slots); bf16 x (left bf16 and unchanged); an fp32 0-dim tensor; no load or store outside the tensors",
        "contract: x as a strided view (buf[::2]) gives the contiguous copy's bits and is left unchanged",
    ],
    'ex2_det_backward': [
        "own code: no SDPA, torch.autograd.grad or the given lk.detbackward.atomic_backward; launches a Triton kernel defined in the notebook with grid (cdiv(N_k, block_n), B * H) and BLOCK_M, BLOCK_N the block_m, block_n passed (32, N_k = 40; bf16 inputs), fp32 dq_slots of B x H x cdiv(N_k, block_n) x N x d, and no kernel it launches calls tl.atomic_add",
        "dq, dk, dv against float64 autograd within 1e-4 (fp32): N = 40 != N_k = 56 (d = 32, not the block), causal N = 70 > N_k = 45 (rows that see no key; d = 16, block_n = 32 != block_m), causal N = 33 < N_k = 80 (d = 64); the inputs' dtypes and shapes; no load or store outside the tensors",
        "bf16 and fp16 (N = 70, N_k = 90, d = 32, causal): each gradient in that dtype and within 2x the error of autograd through plain attention in that dtype (plus the exact gradient's rounding)",
        "dq, dk and dv hold the same bits (torch.equal of the raw bytes) over 5 program orders of the interpreter (the loop's own and 4 shuffled), at two shapes with 3 to 5 key blocks per head",
        "contract: every tensor argument, contiguous (lse holding -inf: causal N = 40 > N_k = 24) and as a transposed view, is left unchanged; the views give the same gradients",
    ],
    'ex3_invariant_decode': [
        "the combine is the reader's: lk.detdecode.combine, dynamic_decode and unsplit_decode not reached",
        "o against float64 attention of each request's own keys within 1e-5 (fp32; lengths 37, 1, 130, 61, 95, 7; d = 16 and 64; q x 100, scores in the hundreds); o fp32 [B, H, d]; bf16: o bf16, by the 2x rule against attention in bf16, and (split_size 16) the fp32 combine of the same partials rounded once (at most 2% of the entries differ)",
        "split_partials receives the split_size passed (32 and 16, requests longer than the split)",
        "batch invariance: 17 requests of 1-150 keys (few multiples of 16); each request's output alone equals (torch.equal) its output in batches of 3, 8 and 17 (members and positions shuffled)",
        "a batch of 8 gives the same bits over 4 program orders of the interpreter",
        "contract: q, the caches and lens as views give the same o and are left unchanged",
    ],
}

MISTAKES = {
    'ex1_fixed_order_sum': [
        ('atomics kept (partials added into one cell)', 'tl.store(slots_ptr + pid, part)', 'tl.atomic_add(slots_ptr, part)'),
        ('the last, short block dropped (n // block slots)', 'n_slots = triton.cdiv(x.numel(), block)', 'n_slots = x.numel() // block'),
        ('no mask on the last block', 'tl.load(x_ptr + offs, mask=offs < n, other=0.0)', 'tl.load(x_ptr + offs)'),
        ('the combine skips slot 0', 'total = tl.load(slots_ptr)\n    for s in range(1, n_slots):', 'total = 0.0\n    for s in range(1, n_slots):'),
        ('partials kept in the input dtype', 'tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)', 'tl.load(x_ptr + offs, mask=offs < n, other=0.0)'),
        ('x assumed contiguous', '    x = x.contiguous()\n', ''),
        ('the block argument ignored (always 64)', 'n_slots = triton.cdiv(x.numel(), block)', 'block = 64\n    n_slots = triton.cdiv(x.numel(), block)'),
        ('the partials summed in PyTorch (only the combine is a kernel)', '_partials_kernel[(n_slots,)](x, slots, x.numel(), BLOCK=block)', 'slots = torch.nn.functional.pad(x.float(), (0, n_slots * block - x.numel())).view(n_slots, block).sum(1)'),
        ('each partial atomically added into its own zeroed slot', 'tl.store(slots_ptr + pid, part)', 'tl.store(slots_ptr + pid, 0.0)\n    tl.atomic_add(slots_ptr + pid, part)'),
        ("the caller's x converted to fp32 in place", '    x = x.contiguous()\n', '    x.data = x.data.float()\n    x = x.contiguous()\n'),
        ('64 slots allocated whatever n and block', 'slots = torch.empty(n_slots,', 'slots = torch.empty(64,'),
    ],
    'ex2_det_backward': [
        ('atomics kept (every share added into slot 0)', 'tl.store(slot + rows, tl.dot(ds.to(k_tile.dtype), k_tile) * sm_scale, mask=in_q[:, None])', 'tl.atomic_add(dq_slots_ptr + bh * N_KEY_BLOCKS * N_Q * D + rows, tl.dot(ds.to(k_tile.dtype), k_tile) * sm_scale, mask=in_q[:, None])'),
        ('one slot shared by every key block (the last program to store wins)', 'slot = dq_slots_ptr + (bh * N_KEY_BLOCKS + j) * N_Q * D', 'slot = dq_slots_ptr + bh * N_KEY_BLOCKS * N_Q * D'),
        ('dq share not scaled by sm_scale', 'tl.dot(ds.to(k_tile.dtype), k_tile) * sm_scale, mask=in_q[:, None])', 'tl.dot(ds.to(k_tile.dtype), k_tile), mask=in_q[:, None])'),
        ('causal top-left aligned (j <= i)', 'offs_m[:, None] + (N_K - N_Q)', 'offs_m[:, None]'),
        ('D not subtracted (dS = P * dP)', 'ds = p * (tl.dot(do_tile, tl.trans(v_tile)) - delta[:, None])', 'ds = p * tl.dot(do_tile, tl.trans(v_tile))'),
        ('lse not subtracted (P = exp(S))', 'p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)', 'p = tl.where(visible, tl.exp(s), 0.0)'),
        ('dK not scaled by sm_scale', '(dk * sm_scale).to(dk_ptr.dtype.element_ty)', 'dk.to(dk_ptr.dtype.element_ty)'),
        ('each dQ share atomically added into its own zeroed slot', 'tl.store(slot + rows, tl.dot(ds.to(k_tile.dtype), k_tile) * sm_scale, mask=in_q[:, None])', 'tl.atomic_add(slot + rows, tl.dot(ds.to(k_tile.dtype), k_tile) * sm_scale, mask=in_q[:, None])'),
        ('block_m and block_n ignored (16 each)', '    n_blocks = triton.cdiv(n_k, block_n)', '    block_m = block_n = 16\n    n_blocks = triton.cdiv(n_k, block_n)'),
        ("lse's -inf rows overwritten in place (the caller's lse)", '    delta = (do.float() * o.float()).sum(-1).contiguous()', '    lse = lse.float().contiguous()\n    lse[lse == float("-inf")] = 0.0\n    delta = (do.float() * o.float()).sum(-1).contiguous()'),
        ('dq returned in fp32 for bf16 and fp16 inputs', '    return dq.to(q.dtype), dk, dv\n', '    return dq, dk, dv\n'),
        ("dQ slots in the input's dtype", 'dq_slots = torch.zeros(B, H, n_blocks, N, D, dtype=torch.float32, device=q.device)', 'dq_slots = torch.zeros(B, H, n_blocks, N, D, dtype=q.dtype, device=q.device)'),
        ('the given atomic backward called', '    return dq.to(q.dtype), dk, dv\n', '    return lk.detbackward.atomic_backward(q, k, v, o, lse, do, causal, block_m=block_m, block_n=block_n)\n'),
    ],
    'ex3_invariant_decode': [
        ('split count from the batch (the launch heuristic)', '    num_splits = -(-longest // split_size)', '    num_splits = lk.detdecode.heuristic_num_splits(q.shape[0] * q.shape[1], 132, -(-longest // 16))\n    split_size = -(-longest // num_splits)'),
        ('split size derived from the longest request (4 splits)', '    num_splits = -(-longest // split_size)', '    num_splits = 4\n    split_size = -(-longest // num_splits)'),
        ('no max subtracted in the combine', 'w = torch.exp(lse_part - top)', 'w = torch.exp(lse_part)'),
        ('the combine shifted by the batch\'s largest lse, not each request\'s', 'top = lse_part.amax(dim=-1, keepdim=True)', 'top = lse_part.amax()'),
        ('partials averaged, not weighted by their lse', 'o = (w[..., None] * o_part).sum(dim=-2) / w.sum(dim=-1, keepdim=True)', 'o = ((w > 0)[..., None] * o_part).sum(dim=-2) / (w > 0).sum(dim=-1, keepdim=True)'),
        ('the split_size argument ignored (always 48)', '    longest = int(lens.max())', '    split_size = 48\n    longest = int(lens.max())'),
        ("o left in fp32 for bf16 q", 'return o.to(q.dtype)', 'return o'),
        ('the partials rounded to q\'s dtype before the combine', '    top = lse_part.amax(dim=-1, keepdim=True)', '    o_part = o_part.to(q.dtype)\n    top = lse_part.amax(dim=-1, keepdim=True)'),
        ('the combine divided in q\'s dtype', 'o = (w[..., None] * o_part).sum(dim=-2) / w.sum(dim=-1, keepdim=True)', 'o = (w[..., None] * o_part).sum(dim=-2).to(q.dtype) / w.sum(dim=-1, keepdim=True).to(q.dtype)'),
        ('the given combine called', 'o = (w[..., None] * o_part).sum(dim=-2) / w.sum(dim=-1, keepdim=True)', 'o = lk.detdecode.combine(o_part, lse_part, torch.float32)'),
    ],
}

# every mistake above fails a visible test
HIDDEN_ONLY = {}

# answers fitted to the visible cases: they pass the visible tests and fail the hidden ones
FITTED = {
    'ex1_fixed_order_sum': [
        ("the combine stops at 257 slots (the visible tests' most)", 'for s in range(1, n_slots):', 'for s in range(1, min(n_slots, 257)):'),
    ],
    'ex2_det_backward': [
        ("at most 6 key blocks per head (the visible tests' most)", 'n_blocks = triton.cdiv(n_k, block_n)', 'n_blocks = min(triton.cdiv(n_k, block_n), 6)'),
    ],
    'ex3_invariant_decode': [
        ("splits enough for the visible tests' longest request (150 keys)", '    num_splits = -(-longest // split_size)', '    num_splits = -(-150 // split_size)'),
    ],
}

# right answers written another way: each must pass the whole test cell
ACCEPTED = {
    'ex1_fixed_order_sum': [
        ('the slots added by torch in one fixed order', '_in_order_kernel[(1,)](slots, out, n_slots)\n    return out[0]', 'return slots.sum()'),
    ],
    'ex2_det_backward': [
        ('the slots added by a Python loop in index order', 'dq = dq_slots.sum(dim=2)', 'dq = dq_slots[:, :, 0].clone()\n    for j in range(1, n_blocks):\n        dq += dq_slots[:, :, j]'),
    ],
    'ex3_invariant_decode': [
        ('an online combine over the splits in index order', 'top = lse_part.amax(dim=-1, keepdim=True)', 'top = lse_part[..., :1].clone()\n    for s in range(1, num_splits):\n        top = torch.maximum(top, lse_part[..., s:s + 1])'),
    ],
}
