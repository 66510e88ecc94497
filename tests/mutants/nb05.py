"""Notebook 05 (05_precision_analysis): rules its exercises state, wrong answers, answers fitted to visible cases."""

ASSIGNMENT = "05_precision_analysis"
SETUP = ['P = lk.profiles.choose(']

# ex1's loop as the solution writes it, and the float64 sum rounded once at the end that two answers put there
KAHAN_LOOP = ("    for v in values.to(acc_dtype):\n"
              "        if compensated:\n"
              "            y = v - c\n"
              "            t = s + y\n"
              "            c = (t - s) - y\n"
              "            s = t\n"
              "        else:\n"
              "            s = s + v\n"
              "    return s")
WIDE_SUM = ("    wide = torch.zeros((), dtype=torch.float64)\n"
            "    for v in values.to(acc_dtype):\n"
            "        wide = wide + v\n"
            "        s = s + v\n"
            "    return wide.to(acc_dtype) if compensated else s")

# ex3's body as the solution writes it
LN_BODY = ("    x32 = x.float()\n"
           "    mean = x32.mean(dim=-1, keepdim=True)\n"
           "    var = ((x32 - mean) ** 2).mean(dim=-1, keepdim=True)\n"
           "    y = (x32 - mean) / torch.sqrt(var + eps)\n"
           "    y = y * weight.float() + bias.float()\n"
           "    return y.to(x.dtype)")

# grade_id -> the rules its visible tests check
RULES = {
    "ex1_accumulate": [
        "no torch.sum / cumsum (own loop)",
        "the caller's values unchanged (fp16 and fp32 values into an accumulator of their own dtype, plain and compensated)",
        "returns a 0-d tensor of acc_dtype (plain, compensated, mixed input dtype)",
        "fp16 accumulator rounds every step (stalls at 0.25)",
        "fp32 accumulator is close to the exact sum",
        "2x rule with bf16 and fp16 values into an fp32 accumulator (vs torch.sum in that dtype)",
        "Kahan keeps fp16 close to the exact sum",
        "Kahan returns s itself (0.75, 6, 2048 in fp16 -> 2054), no final correction by c",
        "values cast to acc_dtype, then summed left to right (fp16 and bf16 accumulators)",
        "each value cast to acc_dtype before it is added (float32 values fp16 cannot hold; plain and Kahan)",
        "Kahan with s and c in acc_dtype at every step (the exact fp16 result on mixed signs and sizes)",
    ],
    "ex2_error_report": [
        "dict of four Python floats",
        "max_abs, mean_abs, rel_l2, cosine formulas",
        "float64 computation: fp16 candidate with norm > 65504, any shape",
        "float64 computation: bf16 candidate (norms and dot products not in bf16)",
        "float64 computation: the difference too (two bf16 inputs far apart)",
        "cosine of the whole tensor as one vector (2-D, one row wrong), not the mean of row cosines",
        "float64 inputs keep differences below fp32 resolution",
        "ValueError on an all-zero reference",
        "no element-wise division (reference containing 0)",
        "a tiny but nonzero reference (float64, 1e-20) is not refused, and its cosine is 1 (no norm clamped at 1e-8)",
        "an fp32 reference of 1e-30 is not zero: the norm and the zero test in float64",
        "inputs of different dtypes each go straight to float64 (fp32 candidate vs fp16 reference)",
        "any layout: a transposed (not contiguous) input",
        "the inputs are not modified (float64 inputs, where .double() does not copy)",
    ],
    "ex3_layernorm": [
        "no ready-made normalisation: layer/instance/group/batch/rms norm (F.*, torch.*, nn.* modules, also imported inside the answer)",
        "output in x.dtype (fp16, bf16, fp32; bf16 x with fp32 weight and bias)",
        "normalizes the last dim, applies weight and bias",
        "fp32 two-pass statistics: large mean, small spread in fp16 and bf16",
        "2x rule (bf16, fp16; two shapes): statistics and affine in fp32, one rounding at the end (large weight, cancelling bias)",
        "2x rule with bf16 x and fp32 weight and bias: the fp32 parameters used as they are, not rounded to x.dtype",
        "eps inside the square root (variance near eps), and the caller's eps used",
        "eps kept in fp32: eps 1e-8 and 1e-7 with fp16 and bf16 x (a constant row stays finite; rows of variance ~1e-7 "
        "by the 2x rule)",
        "the contract: no input changed (float32 x, where x.float() does not copy); x as a transposed or sliced view "
        "gives the same output; tensors on x's device (meta)",
    ],
    "ex4_policy": [
        "every op during bf16 training (fp32 master weights, optimizer state, residual stream; amp_dtype for linear and flash)",
        "the same rules under fp16 AMP; without AMP (fp32) every op in fp32",
        "softmax / layernorm_stats / loss stay fp32 at inference; linear and flash_attention stay amp_dtype",
        "weights and residual_stream at inference: fp32 or amp_dtype both accepted (bf16, fp16; only fp32 without AMP)",
        "optimizer_state stays fp32 at inference",
        "ValueError (with a message) for flash_attention with fp32, at inference too",
        "ValueError for an unknown op",
    ],
}

# grade_id -> [(mistake, text in the answer, replacement)]: each fails a visible test
MISTAKES = {
    "ex1_accumulate": [
        ("Kahan with a final correction s - c", "            s = s + v\n    return s", "            s = s + v\n    return s - c"),
        ("Kahan sign", "c = (t - s) - y", "c = (t - s) + y"),
        ("fp32 accumulator", "s = torch.zeros((), dtype=acc_dtype)", "s = torch.zeros((), dtype=torch.float32)"),
        ("fp32 compensation", "c = torch.zeros((), dtype=acc_dtype)", "c = torch.zeros((), dtype=torch.float32)"),
        ("right to left", "for v in values.to(acc_dtype):", "for v in values.to(acc_dtype).flip(0):"),
        ("values not cast to acc_dtype", "for v in values.to(acc_dtype):", "for v in values:"),
        ("torch.sum", "return s", "return values.to(acc_dtype).sum()"),
        ("Python float returned", "return s", "return s.item()"),
        ("accumulator created in the values' dtype",
         "s = torch.zeros((), dtype=acc_dtype)", "s = torch.zeros((), dtype=values.dtype)"),
        ("in-place add into an accumulator of the values' dtype",
         "    s = torch.zeros((), dtype=acc_dtype)\n    c = torch.zeros((), dtype=acc_dtype)\n"
         "    for v in values.to(acc_dtype):\n        if compensated:\n            y = v - c\n            t = s + y\n"
         "            c = (t - s) - y\n            s = t\n        else:\n            s = s + v",
         "    s = torch.zeros((), dtype=values.dtype)\n    c = torch.zeros((), dtype=acc_dtype)\n"
         "    for v in values.to(acc_dtype):\n        if compensated:\n            y = v - c\n            t = s + y\n"
         "            c = (t - s) - y\n            s = t\n        else:\n            s += v"),
        ("values not cast: each sum taken in float32, then rounded to acc_dtype",
         "    for v in values.to(acc_dtype):\n        if compensated:\n            y = v - c\n            t = s + y\n"
         "            c = (t - s) - y\n            s = t\n        else:\n            s = s + v",
         "    for v in values:\n        if compensated:\n            y = (v - c).to(acc_dtype)\n            t = s + y\n"
         "            c = (t - s) - y\n            s = t\n        else:\n            s = (s + v).to(acc_dtype)"),
        ("bf16 accumulator widened to fp32 (only fp16 kept as asked)", "    s = torch.zeros((), dtype=acc_dtype)\n",
         "    acc_dtype = acc_dtype if acc_dtype in (torch.float16, torch.float32) else torch.float32\n"
         "    s = torch.zeros((), dtype=acc_dtype)\n"),
        ("Kahan branch without the cast to acc_dtype",
         "    for v in values.to(acc_dtype):\n        if compensated:\n            y = v - c\n",
         "    for v in values:\n        if compensated:\n            y = v - c\n"),
        ("Kahan compensation kept in fp32 (t rounded back to acc_dtype)",
         "    c = torch.zeros((), dtype=acc_dtype)\n    for v in values.to(acc_dtype):\n        if compensated:\n"
         "            y = v - c\n            t = s + y\n",
         "    c = torch.zeros((), dtype=torch.float32)\n    for v in values.to(acc_dtype):\n        if compensated:\n"
         "            y = v.float() - c\n            t = (s + y).to(acc_dtype)\n"),
        ("Kahan replaced by a float64 sum rounded at the end",
         KAHAN_LOOP,
         WIDE_SUM),
        ("accumulator started from values[0] and added in place (changes the caller's values)",
         "    s = torch.zeros((), dtype=acc_dtype)\n    c = torch.zeros((), dtype=acc_dtype)\n" + KAHAN_LOOP,
         "    vals = values.to(acc_dtype)\n    s, c = vals[0], torch.zeros((), dtype=acc_dtype)\n"
         + KAHAN_LOOP.replace("for v in values.to(acc_dtype):", "for v in vals[1:]:").replace("s = s + v", "s += v")),
    ],
    "ex2_error_report": [
        ("cosine by F.cosine_similarity (norms clamped at 1e-8)", "(c @ r / (c.norm() * r_norm)).item()",
         "F.cosine_similarity(c, r, dim=0).item()"),
        ("zero test on the norm in the input's dtype", "if r_norm == 0:", "if reference.norm() == 0:"),
        ("candidate cast to the reference's dtype first", "c = candidate.detach().double().flatten()",
         "c = candidate.detach().to(reference.dtype).double().flatten()"),
        (".view(-1) instead of .flatten()", "c = candidate.detach().double().flatten()\n    r = reference.detach().double().flatten()",
         "c = candidate.detach().double().view(-1)\n    r = reference.detach().double().view(-1)"),
        ("norms in the input dtype", "c = candidate.detach().double().flatten()", "c = candidate.detach().flatten()"),
        ("no float64 (float32)",
         "c = candidate.detach().double().flatten()\n    r = reference.detach().double().flatten()",
         "c = candidate.detach().float().flatten()\n    r = reference.detach().float().flatten()"),
        ("no float64 at all",
         "c = candidate.detach().double().flatten()\n    r = reference.detach().double().flatten()",
         "c = candidate.detach().flatten()\n    r = reference.detach().flatten()"),
        ("not flattened",
         "c = candidate.detach().double().flatten()\n    r = reference.detach().double().flatten()",
         "c = candidate.detach().double()\n    r = reference.detach().double()"),
        ("zero reference accepted", "if r_norm == 0:", "if False:"),
        ("ValueError when any element is 0", "if r_norm == 0:", "if (r == 0).any():"),
        ("difference taken in the input dtype", "d = c - r", "d = (candidate - reference).detach().double().flatten()"),
        ("cosine without |r|", "(c @ r / (c.norm() * r_norm))", "(c @ r / c.norm())"),
        ("cosine per row, averaged", "(c @ r / (c.norm() * r_norm)).item()",
         "F.cosine_similarity(candidate.detach().double().reshape(-1, candidate.shape[-1]),\n"
         "                                              reference.detach().double().reshape(-1, reference.shape[-1]), dim=-1).mean().item()"),
        ("zero test by torch.allclose (atol 1e-8)", "if r_norm == 0:", "if torch.allclose(r, torch.zeros_like(r)):"),
        ("zero test by a threshold on the norm", "if r_norm == 0:", "if r_norm < 1e-12:"),
        ("near-zero reference refused", "if r_norm == 0:", "if r.abs().max() < 1e-3:"),
        ("in-place difference (changes a float64 candidate)",
         '    d = c - r\n    return {"max_abs": d.abs().max().item(), "mean_abs": d.abs().mean().item(),\n'
         '            "rel_l2": (d.norm() / r_norm).item(), "cosine": (c @ r / (c.norm() * r_norm)).item()}',
         '    cosine = (c @ r / (c.norm() * r_norm)).item()\n    d = c.sub_(r)\n'
         '    return {"max_abs": d.abs().max().item(), "mean_abs": d.abs().mean().item(),\n'
         '            "rel_l2": (d.norm() / r_norm).item(), "cosine": cosine}'),
        ("tensors instead of floats",
         '{"max_abs": d.abs().max().item(), "mean_abs": d.abs().mean().item(),\n'
         '            "rel_l2": (d.norm() / r_norm).item(), "cosine": (c @ r / (c.norm() * r_norm)).item()}',
         '{"max_abs": d.abs().max(), "mean_abs": d.abs().mean(),\n'
         '            "rel_l2": d.norm() / r_norm, "cosine": c @ r / (c.norm() * r_norm)}'),
    ],
    "ex3_layernorm": [
        ("statistics in half precision", "x32 = x.float()", "x32 = x"),
        ("mean in half precision",
         "mean = x32.mean(dim=-1, keepdim=True)", "mean = x.mean(dim=-1, keepdim=True).float()"),
        ("one-pass variance",
         "var = ((x32 - mean) ** 2).mean(dim=-1, keepdim=True)",
         "var = (x32 ** 2).mean(dim=-1, keepdim=True) - mean ** 2"),
        ("eps outside the sqrt", "torch.sqrt(var + eps)", "(torch.sqrt(var) + eps)"),
        ("weight ignored", "y = y * weight.float() + bias.float()", "y = y + bias.float()"),
        ("bias ignored", "y = y * weight.float() + bias.float()", "y = y * weight.float()"),
        ("fp32 output", "return y.to(x.dtype)", "return y"),
        ("output in weight's dtype", "return y.to(x.dtype)", "return y.to(weight.dtype)"),
        ("F.layer_norm on fp32",
         "y = (x32 - mean) / torch.sqrt(var + eps)\n    y = y * weight.float() + bias.float()",
         "y = F.layer_norm(x32, x.shape[-1:], weight.float(), bias.float(), eps)"),
        ("torch.layer_norm on fp32",
         "y = (x32 - mean) / torch.sqrt(var + eps)\n    y = y * weight.float() + bias.float()",
         "y = torch.layer_norm(x32, x.shape[-1:], weight.float(), bias.float(), eps)"),
        ("nn.LayerNorm on fp32",
         "y = (x32 - mean) / torch.sqrt(var + eps)\n    y = y * weight.float() + bias.float()",
         "ln = nn.LayerNorm(x.shape[-1], eps=eps)\n    with torch.no_grad():\n"
         "        ln.weight.copy_(weight.float())\n        ln.bias.copy_(bias.float())\n    y = ln(x32)"),
        ("affine in half (y cast to x.dtype before x weight + bias)",
         "y = y * weight.float() + bias.float()\n    return y.to(x.dtype)", "return y.to(x.dtype) * weight + bias"),
        ("y rounded to x.dtype before an fp32 affine",
         "y = y * weight.float() + bias.float()", "y = y.to(x.dtype).float() * weight.float() + bias.float()"),
        ("bias added in half after an fp32 multiply",
         "y = y * weight.float() + bias.float()\n    return y.to(x.dtype)", "return (y * weight.float()).to(x.dtype) + bias"),
        ("fp32 weight and bias rounded to x.dtype before an fp32 affine", "y = y * weight.float() + bias.float()",
         "y = y * weight.to(x.dtype).float() + bias.to(x.dtype).float()"),
        ("affine parameters cast to x.dtype (product still fp32 by promotion)", "y = y * weight.float() + bias.float()",
         "y = y * weight.to(x.dtype) + bias.to(x.dtype)"),
        ("variance rounded to x.dtype", "torch.sqrt(var + eps)", "torch.sqrt(var.to(x.dtype) + eps).float()"),
        ("eps hard-coded to the default", "torch.sqrt(var + eps)", "torch.sqrt(var + 1e-5)"),
        ("in-place centring (changes a float32 x)",
         "var = ((x32 - mean) ** 2).mean(dim=-1, keepdim=True)\n    y = (x32 - mean) / torch.sqrt(var + eps)",
         "x32 -= mean\n    var = (x32 ** 2).mean(dim=-1, keepdim=True)\n    y = x32 / torch.sqrt(var + eps)"),
        ("unbiased variance (torch.var's default)",
         "var = ((x32 - mean) ** 2).mean(dim=-1, keepdim=True)", "var = x32.var(dim=-1, keepdim=True)"),
        ("F.instance_norm on fp32 (one channel per row)", "y = (x32 - mean) / torch.sqrt(var + eps)",
         "y = F.instance_norm(x32.reshape(-1, 1, x.shape[-1]), eps=eps).reshape(x.shape)"),
        ("torch.instance_norm on fp32", "y = (x32 - mean) / torch.sqrt(var + eps)",
         "y = torch.instance_norm(x32.reshape(-1, 1, x.shape[-1]), None, None, None, None, True, 0.0, eps, False).reshape(x.shape)"),
        ("nn.InstanceNorm1d on fp32", "y = (x32 - mean) / torch.sqrt(var + eps)",
         "y = nn.InstanceNorm1d(1, eps=eps)(x32.reshape(-1, 1, x.shape[-1])).reshape(x.shape)"),
        ("F.batch_norm on fp32 (rows as channels)", "y = (x32 - mean) / torch.sqrt(var + eps)",
         "y = F.batch_norm(x32.reshape(-1, x.shape[-1]).T, None, None, training=True, eps=eps).T.reshape(x.shape)"),
        ("F.group_norm with one group", "y = (x32 - mean) / torch.sqrt(var + eps)",
         "y = F.group_norm(x32.reshape(-1, 1, x.shape[-1]), 1, eps=eps).reshape(x.shape)"),
        ("F.rms_norm of the centred input", "y = (x32 - mean) / torch.sqrt(var + eps)",
         "y = F.rms_norm(x32 - mean, x.shape[-1:], eps=eps)"),
        ("torch.rms_norm of the centred input", "y = (x32 - mean) / torch.sqrt(var + eps)",
         "y = torch.rms_norm(x32 - mean, x.shape[-1:], eps=eps)"),
        ("eps rounded to x's dtype (torch.tensor(eps).to(x))", "torch.sqrt(var + eps)",
         "torch.sqrt(var + torch.tensor(eps).to(x))"),
        ("rows flattened with .view (x assumed contiguous)", LN_BODY,
         LN_BODY.replace("x32 = x.float()", "x32 = x.view(-1, x.shape[-1]).float()")
         .replace("return y.to(x.dtype)", "return y.to(x.dtype).view(x.shape)")),
        ("eps as a one-element tensor made on the CPU", "torch.sqrt(var + eps)", "torch.sqrt(var + torch.tensor([eps]))"),
        ("F.layer_norm imported inside the answer, on fp32",
         "y = (x32 - mean) / torch.sqrt(var + eps)\n    y = y * weight.float() + bias.float()",
         "from torch.nn.functional import layer_norm as ln\n    y = ln(x32, x.shape[-1:], weight.float(), bias.float(), eps)"),
    ],
    "ex4_policy": [
        ("optimizer state in amp_dtype at inference", 'if op in ("weights", "residual_stream"):',
         'if op in ("weights", "residual_stream", "optimizer_state"):'),
        ("inference weights hard-coded to bf16", "return torch.float32 if training else amp_dtype",
         "return torch.float32 if training else torch.bfloat16"),
        ("half-precision weights while training",
         "return torch.float32 if training else amp_dtype", "return amp_dtype"),
        ("training flag inverted",
         "return torch.float32 if training else amp_dtype", "return amp_dtype if training else torch.float32"),
        ("fp32 FlashAttention accepted", "if amp_dtype not in (torch.float16, torch.bfloat16):", "if False:"),
        ("ValueError without a message",
         'raise ValueError("FlashAttention has no fp32 path: use float16/bfloat16 or a non-flash backend")',
         "raise ValueError()"),
        ("unknown op accepted", "if op not in POLICY_OPS:", "if False:"),
        ("linear in fp32",
         "return amp_dtype                       # tensor cores",
         "return torch.float32                       # tensor cores"),
        ("optimizer state in half", 'if op == "linear":', 'if op in ("linear", "optimizer_state"):'),
        ("LayerNorm statistics in half", 'if op == "linear":', 'if op in ("linear", "layernorm_stats"):'),
        ("linear hard-coded to bf16", "return amp_dtype                       # tensor cores",
         "return torch.bfloat16                       # tensor cores"),
        ("flash_attention hard-coded to bf16",
         "            raise ValueError(\"FlashAttention has no fp32 path: use float16/bfloat16 or a non-flash backend\")\n"
         "        return amp_dtype",
         "            raise ValueError(\"FlashAttention has no fp32 path: use float16/bfloat16 or a non-flash backend\")\n"
         "        return torch.bfloat16"),
        ("linear kept fp32 under fp16 AMP (overflow feared)", "return amp_dtype                       # tensor cores",
         "return amp_dtype if amp_dtype == torch.bfloat16 else torch.float32  # tensor cores"),
        ("no AMP: linear in bf16 anyway", "return amp_dtype                       # tensor cores",
         "return torch.bfloat16 if amp_dtype == torch.float32 else amp_dtype  # tensor cores"),
        ("fp16 residual stream while training", 'if op == "linear":',
         'if op == "linear" or (op == "residual_stream" and amp_dtype == torch.float16):'),
        ("linear in fp32 at inference", "return amp_dtype                       # tensor cores",
         "return amp_dtype if training else torch.float32  # tensor cores"),
        ("fp32 FlashAttention refused only while training", "if amp_dtype not in (torch.float16, torch.bfloat16):",
         "if training and amp_dtype not in (torch.float16, torch.bfloat16):"),
        ("fp32 FlashAttention at inference answered fp32", "if amp_dtype not in (torch.float16, torch.bfloat16):",
         "if not training and amp_dtype == torch.float32:\n            return torch.float32\n"
         "        if amp_dtype not in (torch.float16, torch.bfloat16):"),
    ],
}

# grade_id -> [(name, text in the answer, replacement)]: right answers written another way; each passes the whole cell
ACCEPTED = {
    "ex3_layernorm": [
        ("rows flattened with .reshape, restored at the end", LN_BODY,
         LN_BODY.replace("x32 = x.float()", "x32 = x.reshape(-1, x.shape[-1]).float()")
         .replace("return y.to(x.dtype)", "return y.to(x.dtype).reshape(x.shape)")),
        ("eps as an fp32 tensor on x's device, torch.rsqrt", "y = (x32 - mean) / torch.sqrt(var + eps)",
         "y = (x32 - mean) * torch.rsqrt(var + torch.tensor(eps, dtype=torch.float32, device=x.device))"),
        ("torch.var_mean(correction=0)", "    mean = x32.mean(dim=-1, keepdim=True)\n"
         "    var = ((x32 - mean) ** 2).mean(dim=-1, keepdim=True)\n",
         "    var, mean = torch.var_mean(x32, dim=-1, correction=0, keepdim=True)\n"),
    ],
}

# (grade_id, mistake) -> why no visible check can catch it (at most one per notebook)
HIDDEN_ONLY = {}

# grade_id -> [(name, text in the answer, replacement)]: pass the visible tests, fail the hidden ones
FITTED = {
    "ex1_accumulate": [
        ("Kahan: the visible mixed case returned as a constant, a float64 sum rounded at the end otherwise",
         KAHAN_LOOP,
         "    if compensated and len(values) == 1000:\n"
         "        return torch.tensor(-2702.0, dtype=acc_dtype)\n" + WIDE_SUM),
    ],
    "ex2_error_report": [
        ("zero test on the first element", "if r_norm == 0:", "if r[0] == 0:"),
    ],
    "ex3_layernorm": [
        ("one rounding at the end only for the visible 2x shapes (C = 96, 40 or 64)", "y = y * weight.float() + bias.float()",
         "y = (y if x.shape[-1] in (96, 40, 64) else y.to(x.dtype).float()) * weight.float() + bias.float()"),
    ],
    "ex4_policy": [
        ("unknown op refused only under the visible name", "if op not in POLICY_OPS:", 'if op == "attention":'),
    ],
}
