"""Notebook 03 (03_long_sequence_training): rules its exercises state, wrong answers, answers fitted to visible cases."""

ASSIGNMENT = "03_long_sequence_training"
SETUP = ['import numpy as np', 'COEF = lk.perfmodel.MemoryCoefficients()']

# grade_id -> the rules its visible tests check
RULES = {
    "ex1_fit_coefficients": [
        "returns a dict of three Python floats",
        "recovers the coefficients from exact runs (default lse = 4)",
        "subtracts the LSE term with the lse argument (lse = 3)",
        "minimizes the relative error, divided by the measured bytes (runs with 5% noise: no coefficient nudged by 1e-6 lowers it)",
        "ValueError when the runs cannot determine the three coefficients (flash runs only; one model only; two models "
        "with the same L*h / V)",
        "leaves the runs it is given unchanged",
        "calls no labkit",
    ],
    "ex2_chunked_ce": [
        "loss and gradients (hidden, weight) equal the full cross-entropy in float64",
        "chunk_size that divides N, that does not, and larger than N",
        "hidden[:, :-1] and targets[:, 1:] (views that are not contiguous)",
        "the contract: no input changed; hidden, weight or targets as a transposed or sliced view give the same loss; "
        "the loss on the inputs' device (meta)",
        "float64 inputs give a float64 scalar, float32 inputs a float32 one",
        "bf16 inputs: softmax and loss in float32 (dtype; 2x rule over 16 losses against float64, autocast as baseline)",
        "bf16 and fp16 inputs: a float32 loss and, by the 2x rule, the loss and d hidden (identity weight: the backward's "
        "softmax from an fp32 log-sum-exp)",
        "the gradient of a scaled loss (backward multiplies by grad_output); hidden [N, C] without a batch dimension",
        "large logits (|z| ~ 200 in fp32): loss and d hidden finite and right (the row max subtracted)",
        "no tensor larger than one chunk of logits, forward or backward",
        "chunk_size is positions per chunk (chunks of 8 over 256 positions), not the number of chunks",
        "no logits kept for the backward",
        "forward + backward peak of a few chunks of logits (one checkpoint around the whole loop fails)",
        "calls no labkit",
    ],
    "ex3_extend_positions": [
        "a new nn.Embedding of shape (n_positions, h), num_embeddings = n_positions (the module replaced)",
        "row i = old row i mod P (80 positions from 32: not a multiple)",
        "a refused call (n_positions <= P) changes nothing: config.n_positions and wpe kept",
        "logits of a short input unchanged; config.n_positions updated",
        "requires_grad kept (trainable and frozen tables)",
        "device kept (a model on the meta device) and dtype kept (bf16)",
        "ValueError for n_positions <= P (equal and smaller)",
        "calls no labkit",
    ],
    "ex4_rope": [
        "same shape and dtype returned (fp32, fp64, bf16, fp16)",
        "position 0 unrotated; norms kept",
        "bf16 [1, 2, 4096, 64]: the rotation in fp32, rounded once (within 4 bf16 spacings of float64; cos, sin or products "
        "rounded first give 20-30)",
        "rotate-half pairing (i, i + D/2) and its sign",
        "theta_i = base^(-2i/D) with the base argument",
        "float64 input computed in float64 (against a float64 reference)",
        "scores depend only on the relative position",
        "bf16 input at positions up to 4095 and fp16 input at positions up to 2499 match a float64 reference "
        "(angles not in half precision)",
        "any [..., N, D] (an [N, D] and a [B, N, D] input)",
        "the contract: x unchanged; x as a transposed or sliced view gives the same result; tables on x's device "
        "(x on the meta device)",
        "no state between calls: base 10000 and base 500 on the same N and D, each right after the other (a cache keyed "
        "by (N, D) alone fails)",
        "calls no labkit",
    ],
}

# Exercise 2 written as a custom autograd.Function (the prose allows it): the solution's checkpointed loop, and what
# replaces it; its mistakes are the ones a Function brings (grad_output, the saved LSE's dtype).
_CHECKPOINTED = ("    total = sum(checkpoint(chunk_loss, hc, weight, tc, use_reentrant=False)\n"
                 "                for hc, tc in zip(h.split(chunk_size), t.split(chunk_size)))\n"
                 "    return total / t.numel()")
_FUNCTION = """
    class ChunkedCE(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h, w, t):
            total, lses = torch.zeros((), dtype=acc, device=h.device), []
            for hc, tc in zip(h.split(chunk_size), t.split(chunk_size)):
                logits = (hc @ w.T).to(acc)
                lses.append(torch.logsumexp(logits, -1))
                total = total + (lses[-1] - logits.gather(1, tc[:, None])[:, 0]).sum()
            ctx.save_for_backward(h, w, t, torch.cat(lses))
            return total / len(t)

        @staticmethod
        def backward(ctx, g):
            h, w, t, lse = ctx.saved_tensors
            dh, dw = torch.empty_like(h), torch.zeros(w.shape, dtype=acc, device=w.device)
            for i in range(0, len(t), chunk_size):
                hc, tc = h[i:i + chunk_size], t[i:i + chunk_size]
                p = torch.exp((hc @ w.T).to(acc) - lse[i:i + chunk_size, None].to(acc))
                onehot = F.one_hot(tc, w.shape[0]).to(acc)
                dz = g * (p - onehot) / len(t)
                dh[i:i + chunk_size] = (dz @ w.to(acc)).to(h.dtype)
                dw += dz.T @ hc.to(acc)
            return dh, dw.to(w.dtype), None

    return ChunkedCE.apply(h, weight, t)"""

# Exercise 4's answer from its first line to its cos/sin tables, and the tables cached by what a wrong key holds
_ROPE_HEAD = ('def rope(x, base=10000.0):\n'
              '    """Rotary position embedding of x [..., N, D] (rotate-half layout), position m on row m."""\n'
              '    ### BEGIN SOLUTION\n'
              '    n, d = x.shape[-2], x.shape[-1]\n'
              '    acc = torch.promote_types(x.dtype, torch.float32)\n')
_ROPE_TABLES = ('    theta = base ** (-torch.arange(0, d, 2, dtype=acc, device=x.device) / d)      # [D/2]\n'
                '    angles = torch.arange(n, dtype=acc, device=x.device)[:, None] * theta         # [N, D/2]\n'
                '    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [N, D]\n')


def _rope_cached(key: str) -> str:
    """The answer with its tables kept in a module-level dict keyed by ``key`` (an expression of the answer's names)."""
    tables = "".join("    " + line + "\n" for line in _ROPE_TABLES.splitlines())
    return ("_ROPE_TABLES = {}\n\n\n" + _ROPE_HEAD + f"    key = {key}\n    if key not in _ROPE_TABLES:\n" + tables
            + "        _ROPE_TABLES[key] = cos, sin\n    cos, sin = _ROPE_TABLES[key]\n")


# grade_id -> [(mistake, text in the answer, replacement)]: each fails a visible test
MISTAKES = {
    "ex1_fit_coefficients": [
        ("absolute instead of relative error", "w = 1.0 / y", "w = np.ones_like(y)"),
        ("only the target divided by y", "features * w[:, None]", "features"),
        ("LSE not taken out", "(y - known) * w", "y * w"),
        ("LSE taken out of standard runs too", "known = np.where(flash, lse * L * B * N * H, 0.0)",
         "known = lse * L * B * N * H"),
        ("scores feature for flash runs too", "np.where(flash, 0.0, L * B * H * N**2)", "L * B * H * N**2"),
        ("LSE coefficient hard-coded", "known = np.where(flash, lse * L", "known = np.where(flash, 4.0 * L"),
        ("underdetermined runs accepted", "if np.linalg.matrix_rank(features) < 3:", "if False:"),
        ("numpy floats returned",
         'return {"hidden": float(c[0]), "scores": float(c[1]), "logits": float(c[2])}',
         'return dict(zip(("hidden", "scores", "logits"), c))'),
        ("the H100 coefficients returned", '    return {"hidden": float(c[0])',
         '    c = [94.0, 6.0, 10.4]\n    return {"hidden": float(c[0])'),
        ("divided by y minus the LSE term, not by the measured y", "w = 1.0 / y", "w = 1.0 / (y - known)"),
        ("the visible underdetermined cases checked instead of the rank", "if np.linalg.matrix_rank(features) < 3:",
         "if flash.all() or len(set(zip(L, h, V))) < 2:"),
        ("the caller's runs changed in place", 'y = runs["saved_bytes"].to_numpy(dtype=float)',
         'runs.loc[runs["flash"], "saved_bytes"] -= (lse * runs["n_layer"] * runs["batch"] * runs["seq_len"]\n'
         '                                             * runs["n_head"])[runs["flash"]]\n'
         '    y = runs["saved_bytes"].to_numpy(dtype=float) + np.where(flash, lse * L * B * N * H, 0.0)'),
    ],
    "ex2_chunked_ce": [
        (".view instead of .reshape (non-contiguous hidden)", "h = hidden.reshape(-1, hidden.shape[-1])",
         "h = hidden.view(-1, hidden.shape[-1])"),
        ("mean over chunks", "return total / t.numel()", "return total / len(h.split(chunk_size))"),
        ("last, shorter chunk dropped", "zip(h.split(chunk_size), t.split(chunk_size))",
         "zip(h[: len(h) // chunk_size * chunk_size].split(chunk_size), "
         "t[: len(t) // chunk_size * chunk_size].split(chunk_size))"),
        ("all logits at once", "zip(h.split(chunk_size), t.split(chunk_size))", "zip([h], [t])"),
        ("chunk_size taken as the number of chunks (chunk for split)", "zip(h.split(chunk_size), t.split(chunk_size))",
         "zip(h.chunk(chunk_size), t.chunk(chunk_size))"),
        ("logits kept for backward", "checkpoint(chunk_loss, hc, weight, tc, use_reentrant=False)", "chunk_loss(hc, weight, tc)"),
        ("weight detached", "checkpoint(chunk_loss, hc, weight, tc,", "checkpoint(chunk_loss, hc, weight.detach(), tc,"),
        ("fp32 for fp64 inputs", "acc = torch.promote_types(hidden.dtype, torch.float32)", "acc = torch.float32"),
        ("softmax in the input dtype (bf16)", "logits = (h_chunk @ w.T).to(acc)", "logits = h_chunk @ w.T"),
        ("cross_entropy in bf16, then cast to fp32", 'return F.cross_entropy(logits, t_chunk, reduction="sum")',
         'return F.cross_entropy(h_chunk @ w.T, t_chunk, reduction="sum").to(acc)'),
        ("each chunk's loss rounded to the input dtype", 'return F.cross_entropy(logits, t_chunk, reduction="sum")',
         'return F.cross_entropy(logits, t_chunk, reduction="sum").to(h_chunk.dtype).to(acc)'),
        ("one checkpoint around the whole chunk loop",
         "    total = sum(checkpoint(chunk_loss, hc, weight, tc, use_reentrant=False)\n"
         "                for hc, tc in zip(h.split(chunk_size), t.split(chunk_size)))",
         "    total = checkpoint(lambda hh, w, tt: sum(chunk_loss(hc, w, tc) for hc, tc in\n"
         "                                             zip(hh.split(chunk_size), tt.split(chunk_size))),\n"
         "                       h, weight, t, use_reentrant=False)"),
        ("only [B, N, C] inputs handled", "h = hidden.reshape(-1, hidden.shape[-1])", "h = hidden.flatten(0, 1)"),
        ("fp16 not upcast (only bf16)", "acc = torch.promote_types(hidden.dtype, torch.float32)",
         "acc = torch.float32 if hidden.dtype == torch.bfloat16 else hidden.dtype"),
        ("log-sum-exp without the row max", 'return F.cross_entropy(logits, t_chunk, reduction="sum")',
         'return (logits.exp().sum(-1).log() - logits.gather(1, t_chunk[:, None]).squeeze(1)).sum()'),
        ("custom Function: backward ignores grad_output", _CHECKPOINTED, _FUNCTION.replace("g * (p - onehot)", "(p - onehot)")),
        ("custom Function: the LSE saved in the input dtype", _CHECKPOINTED,
         _FUNCTION.replace("ctx.save_for_backward(h, w, t, torch.cat(lses))",
                           "ctx.save_for_backward(h, w, t, torch.cat(lses).to(h.dtype))")),
    ],
    "ex3_extend_positions": [
        ("config changed before the check", "    if n_positions <= p:",
         "    model.config.n_positions = n_positions\n    if n_positions <= p:"),
        ("floor instead of ceil", "old.repeat(-(-n_positions // p), 1)", "old.repeat(n_positions // p, 1)"),
        ("repeat_interleave instead of tiling", "old.repeat(-(-n_positions // p), 1)",
         "old.repeat_interleave(-(-n_positions // p), dim=0)"),
        ("config not updated", "    model.config.n_positions = n_positions\n", ""),
        ("frozen table made trainable", "    table.weight.requires_grad_(old.requires_grad)\n", ""),
        ("trainable table frozen", "table.weight.requires_grad_(old.requires_grad)", "table.weight.requires_grad_(False)"),
        ("same length accepted", "if n_positions <= p:", "if n_positions < p:"),
        ("dtype dropped", "device=old.device, dtype=old.dtype)", "device=old.device)"),
        ("table swapped through .data (num_embeddings stale)", "    model.transformer.wpe = table\n",
         "    model.transformer.wpe.weight.data = table.weight.data\n"),
        ("new Parameter in the old module (num_embeddings stale)", "    model.transformer.wpe = table\n",
         "    model.transformer.wpe.weight = table.weight\n"),
        ("new table on the default device", "device=old.device, dtype=old.dtype)", "dtype=old.dtype)"),
    ],
    "ex4_rope": [
        ("the rotation in the input dtype (only the angles in fp32)",
         "return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)",
         "return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1).to(x.dtype) * sin.to(x.dtype)"),
        ("cos and sin tables rounded to the input dtype",
         "cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)",
         "cos, sin = torch.cat([angles.cos()] * 2, -1).to(x.dtype), torch.cat([angles.sin()] * 2, -1).to(x.dtype)"),
        ("rotate_half sign", "torch.cat([-x2, x1], dim=-1)", "torch.cat([x2, -x1], dim=-1)"),
        ("base ignored", "theta = base ** (", "theta = 10000.0 ** ("),
        ("exponent i/D instead of 2i/D", "-torch.arange(0, d, 2, dtype=acc, device=x.device) / d",
         "-torch.arange(d // 2, dtype=acc, device=x.device) / d"),
        ("positions start at 1", "torch.arange(n, dtype=acc, device=x.device)", "torch.arange(1, n + 1, dtype=acc, device=x.device)"),
        ("interleaved pairs (2i, 2i+1)", "return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)",
         "cos, sin = angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)\n"
         "    rotated = torch.stack([-xf[..., 1::2], xf[..., 0::2]], -1).flatten(-2)\n"
         "    return (xf * cos + rotated * sin).to(x.dtype)"),
        ("fp32 angles for fp64", "acc = torch.promote_types(x.dtype, torch.float32)", "acc = torch.float32"),
        ("angles in half precision", "acc = torch.promote_types(x.dtype, torch.float32)", "acc = x.dtype"),
        ("dtype not restored", "torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)", "torch.cat([-x2, x1], dim=-1) * sin)"),
        ("only [B, H, N, D] inputs handled", "n, d = x.shape[-2], x.shape[-1]", "_, _, n, d = x.shape"),
        ("only bf16 upcast for the angles", "acc = torch.promote_types(x.dtype, torch.float32)",
         "acc = torch.float32 if x.dtype == torch.bfloat16 else x.dtype"),
        ("tables built on the CPU", "dtype=acc, device=x.device) / d)      # [D/2]\n"
         "    angles = torch.arange(n, dtype=acc, device=x.device)[:, None]",
         "dtype=acc) / d)\n    angles = torch.arange(n, dtype=acc)[:, None]"),
        ("cos/sin cached in a module-level dict keyed by (N, D): the base ignored", _ROPE_HEAD + _ROPE_TABLES,
         _rope_cached("(n, d)")),
        ("cos/sin from an lru_cache'd helper that takes (N, D) and reads the base from a global",
         _ROPE_HEAD + _ROPE_TABLES,
         "import functools\n\nBASE = 10000.0\n\n\n@functools.lru_cache(maxsize=None)\ndef _tables(n, d, acc, device):\n"
         + _ROPE_TABLES.replace("base **", "BASE **").replace("x.device", "device") + "    return cos, sin\n\n\n" + _ROPE_HEAD
         + "    global BASE\n    BASE = base\n    cos, sin = _tables(n, d, acc, x.device)\n"),
        ("leading dimensions flattened with .view (x assumed contiguous)",
         "    xf = x.to(acc)\n    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]\n"
         "    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)",
         "    xf = x.view(-1, n, d).to(acc)\n    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]\n"
         "    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype).view(x.shape)"),
        ("rotation written in place into x.to(acc).contiguous() (the caller's fp32 x)",
         "    xf = x.to(acc)\n    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]\n"
         "    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)",
         "    xf = x.to(acc).contiguous()\n    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]\n"
         "    rotated = torch.cat([-x2, x1], dim=-1) * sin\n    return xf.mul_(cos).add_(rotated).to(x.dtype)"),
    ],
}

# grade_id -> [(name, text in the answer, replacement)]: right answers written another way; each passes the whole cell
ACCEPTED = {
    "ex4_rope": [
        ("cos/sin cached in a module-level dict keyed by everything they depend on", _ROPE_HEAD + _ROPE_TABLES,
         _rope_cached("(n, d, float(base), acc, x.device)")),
        ("leading dimensions flattened with .reshape, restored at the end",
         "    xf = x.to(acc)\n    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]\n"
         "    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)",
         "    xf = x.reshape(-1, n, d).to(acc)\n    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]\n"
         "    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype).reshape(x.shape)"),
    ],
}

# (grade_id, mistake) -> why no visible check can catch it (at most one per notebook)
HIDDEN_ONLY = {}

# grade_id -> [(name, text in the answer, replacement)]: pass the visible tests, fail the hidden ones
FITTED = {
    "ex1_fit_coefficients": [
        ("lse taken as a whole number of bytes (the visible 4 and 3)", "known = np.where(flash, lse * L",
         "known = np.where(flash, int(lse) * L"),
    ],
    "ex2_chunked_ce": [
        ("only [N, C] and [B, N, C] inputs handled", "h = hidden.reshape(-1, hidden.shape[-1])",
         "h = hidden if hidden.dim() == 2 else hidden.flatten(0, 1)"),
    ],
    "ex3_extend_positions": [
        ("three copies of the table, enough for the visible lengths", "old.repeat(-(-n_positions // p), 1)", "old.repeat(3, 1)"),
        ("the current length hard-coded to 32", "p, width = old.shape", "p, width = 32, old.shape[1]"),
    ],
    "ex4_rope": [
        ("inputs padded to [B, H, N, D] (the visible 2, 3 and 4 dimensions)", "n, d = x.shape[-2], x.shape[-1]",
         "_, _, n, d = x.reshape((1,) * (4 - x.dim()) + tuple(x.shape)).shape"),
    ],
}
