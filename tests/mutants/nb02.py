"""Notebook 02 (02_gpt2_integration): rules its exercises state, wrong answers, answers fitted to visible cases."""

ASSIGNMENT = "02_gpt2_integration"
SETUP = ['P = lk.profiles.choose(', 'TINY = lk.gpt2.build_model(']

# grade_id -> the rules its visible tests check
RULES = {
    "ex1_attention": [
        "own formula: no F.scaled_dot_product_attention, no labkit",
        "returns (out, None), out in [B, N, H, D]",
        "the causal mask built on query's device (inputs on meta)",
        "uses the scaling passed; 1/sqrt(D) when None",
        "no mask for a non-causal module",
        "causal rule aligned bottom-right, N < Nk (decode) and N > Nk",
        "boolean attention_mask used as given (True = attend)",
        "a given mask is not AND-ed with another causal rule (N < Nk, causal module, padding)",
        "fully masked rows give 0, not NaN",
        "scores in the thousands do not overflow (max subtracted)",
        "output dtype follows value (bf16 in, bf16 out)",
        "fp64 inputs computed in fp64 (atol 1e-12)",
        "precision rule: scores and softmax in fp32 for bf16/fp16 inputs (2x rule against float64, large scores)",
        "softmax statistics (row max, sum of exp, lse) kept fp32: value equal on every key gives that value exactly",
        "scaling, s - m and exp in fp32: value = I exposes each probability, relative error by the 2x rule (scores +-50)",
    ],
    "ex2_register": [
        "returns name",
        "fn registered in AttentionInterface under name",
        "a mask function registered under the same name, and it is sdpa_mask",
        "a left-padded row gives its unpadded logits (the mask is applied)",
        "ValueError for a name containing 'flash' anywhere, in any case ('Flash', 'FLASH')",
        "a refused name is registered in neither table",
    ],
    "ex3_agreement": [
        "no labkit",
        "err_eager, err_impl are Python floats, ok a bool",
        "relative L2 error against fp32 eager without autocast",
        "baseline is eager under autocast; candidate under the same autocast",
        "ok = err_impl <= factor * err_eager + 1e-6 with the factor passed",
        "the 1e-6 floor: dtype=torch.float32 (autocast off) gives err_eager = 0 and sdpa passes",
        "eager against itself with factor=1: equal errors, ok (<=, not <)",
        "a wrong implementation (no scaling) does not pass",
        "relative L2 divides by the reference's norm (a large error tells ||ref|| from ||x||)",
        "relative L2 computed in float64: logits ~1e19 give the same ~1% (fp32 squares overflow to inf)",
        "model.eval() first: dropout off",
    ],
    "ex4_padding": [
        "returns three torch.long tensors [B, L]",
        "left and right padding put the tokens on the right side",
        "width L is the longest sequence's length (not the first's)",
        "pads filled with pad_id (not 0)",
        "attention_mask 1 for tokens, 0 for pads",
        "position_ids count from the first real token; 0 on pads, both sides",
        "side defaults to 'left'",
        "ValueError for an unknown side",
        "left-padded logits equal each sequence's unpadded logits",
    ],
    "ex5_decode": [
        "no model.generate",
        "shape [B, N + max_new_tokens], prompt included",
        "same tokens as decoding without a cache (eager and labkit)",
        "KV cache used: one token per forward after the prefill, keys grow by one",
    ],
}

_EX1_SOFTMAX = "probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)"

# grade_id -> [(mistake, text in the answer, replacement)]: each fails a visible test
MISTAKES = {
    "ex1_attention": [
        ("causal mask on the default device", "i = torch.arange(n, device=query.device).unsqueeze(1)\n        j = torch.arange(nk, device=query.device).unsqueeze(0)",
         "i = torch.arange(n).unsqueeze(1)\n        j = torch.arange(nk).unsqueeze(0)"),
        ("causal mask aligned top-left", "keep = j <= i + (nk - n)", "keep = j <= i"),
        ("scaling argument ignored", "scale = d ** -0.5 if scaling is None else scaling", "scale = d ** -0.5"),
        ("[B, H, N, D] returned", "return out.transpose(1, 2), None", "return out, None"),
        ("NaN on a fully masked row", "torch.softmax(scores, dim=-1).nan_to_num(0.0)", "torch.softmax(scores, dim=-1)"),
        ("non-causal module masked", 'if keep is None and getattr(module, "is_causal", True):', "if keep is None:"),
        ("no max subtraction (own softmax)", "torch.softmax(scores, dim=-1).nan_to_num(0.0)",
         "(scores.exp() / scores.exp().sum(-1, keepdim=True)).nan_to_num(0.0)"),
        ("attention_mask ignored", "keep = attention_mask", "keep = None"),
        ("calls SDPA", "out = probs.to(value.dtype) @ value",
         "out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=keep, scale=scale)"),
        ("output left in fp32", "out = probs.to(value.dtype) @ value", "out = probs @ value.float()"),
        ("mask polarity inverted", 'scores = torch.where(keep, scores, float("-inf"))',
         'scores = torch.where(keep, float("-inf"), scores)'),
        ("scores rounded to bf16 before the fp32 softmax", "(query.to(acc) @ key.to(acc).transpose(-2, -1))",
         "(query @ key.transpose(-2, -1)).to(acc)"),
        ("scores and softmax in the input dtype", "scores = (query.to(acc) @ key.to(acc).transpose(-2, -1)) * scale",
         "scores = (query @ key.transpose(-2, -1)) * scale"),
        ("scores cast to value.dtype before the softmax", "torch.softmax(scores, dim=-1).nan_to_num(0.0)",
         "torch.softmax(scores.to(value.dtype), dim=-1).nan_to_num(0.0)"),
        ("query scaled in bf16 before the upcast", "scores = (query.to(acc) @ key.to(acc).transpose(-2, -1)) * scale",
         "scores = (query * scale).to(acc) @ key.to(acc).transpose(-2, -1)"),
        ("own softmax with bf16 max and sum", "probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)",
         "low = scores.to(value.dtype)\n    e = (low - low.amax(-1, keepdim=True)).exp()\n"
         "    probs = (e / e.sum(-1, keepdim=True)).nan_to_num(0.0)"),
        ("fp64 inputs computed in fp32", "acc = torch.promote_types(query.dtype, torch.float32)", "acc = torch.float32"),
        ("given mask AND-ed with a top-left causal rule", "keep = attention_mask\n",
         "keep = attention_mask\n    if keep is not None and getattr(module, \"is_causal\", True):\n"
         "        keep = keep & (torch.arange(nk)[None, :] <= torch.arange(n)[:, None])\n"),
        ("boolean mask added to the scores", 'scores = torch.where(keep, scores, float("-inf"))', "scores = scores + keep"),
        ("output reshaped to [B, N, H, D], not transposed", "return out.transpose(1, 2), None",
         "return out.reshape(out.shape[0], out.shape[2], out.shape[1], out.shape[3]), None"),
        ("masked scores set to finfo.min (a fully masked row averages V)", 'scores = torch.where(keep, scores, float("-inf"))',
         "scores = torch.where(keep, scores, torch.finfo(acc).min)"),
        ("own softmax: fp32 exp, its sum rounded to the input dtype", _EX1_SOFTMAX,
         "m = scores.amax(-1, keepdim=True)\n    e = torch.exp(scores - m)\n"
         "    probs = (e / e.sum(-1, keepdim=True).to(value.dtype)).nan_to_num(0.0)"),
        ("own softmax: exp rounded to the input dtype, then summed", _EX1_SOFTMAX,
         "m = scores.amax(-1, keepdim=True)\n    e = torch.exp(scores - m).to(value.dtype)\n"
         "    probs = (e / e.sum(-1, keepdim=True)).nan_to_num(0.0)"),
        ("own softmax: row max and sum kept in the input dtype", _EX1_SOFTMAX,
         "m = scores.amax(-1, keepdim=True).to(value.dtype)\n    e = torch.exp(scores - m)\n"
         "    probs = (e / e.sum(-1, keepdim=True).to(value.dtype)).nan_to_num(0.0)"),
        ("own softmax: lse in the input dtype", _EX1_SOFTMAX,
         "m = scores.amax(-1, keepdim=True)\n"
         "    lse = (m + torch.exp(scores - m).sum(-1, keepdim=True).log()).to(value.dtype)\n"
         "    probs = torch.exp(scores - lse).nan_to_num(0.0)"),
        ("scale rounded to the input dtype (a bf16 tensor)", "scores = (query.to(acc) @ key.to(acc).transpose(-2, -1)) * scale",
         "scores = (query.to(acc) @ key.to(acc).transpose(-2, -1)) * torch.tensor(scale, dtype=query.dtype)"),
        ("own softmax: exp argument s - m rounded to the input dtype", _EX1_SOFTMAX,
         "m = scores.amax(-1, keepdim=True)\n    e = torch.exp((scores - m).to(value.dtype)).to(acc)\n"
         "    probs = (e / e.sum(-1, keepdim=True)).nan_to_num(0.0)"),
    ],
    "ex2_register": [
        ("mask function not registered", "    AttentionMaskInterface.register(name, sdpa_mask)\n", ""),
        ("mask function returns None", "AttentionMaskInterface.register(name, sdpa_mask)",
         "AttentionMaskInterface.register(name, lambda *args, **kwargs: None)"),
        ("no check of 'flash' names", 'if "flash" in name.lower():', "if False:"),
        ("name not returned", "return name", "return fn"),
        ("fn registered as the mask function", "AttentionMaskInterface.register(name, sdpa_mask)",
         "AttentionMaskInterface.register(name, fn)"),
        ("mask function under a fixed name", "AttentionMaskInterface.register(name, sdpa_mask)",
         'AttentionMaskInterface.register("sdpa", sdpa_mask)'),
        ("only names starting with 'flash' refused", 'if "flash" in name.lower():', 'if name.startswith("flash"):'),
        ("registered before the 'flash' check", 'if "flash" in name.lower():',
         'AttentionInterface.register(name, fn)\n    if "flash" in name.lower():'),
        ("eager_mask registered (an additive float mask)", "AttentionMaskInterface.register(name, sdpa_mask)",
         'AttentionMaskInterface.register(name, __import__("transformers.masking_utils", fromlist=["eager_mask"]).eager_mask)'),
        ("'flash' matched case-sensitively", 'if "flash" in name.lower():', 'if "flash" in name:'),
    ],
    "ex3_agreement": [
        ("dropout left on", "    model.eval()\n", ""),
        ("factor ignored", "factor * err_eager", "2.0 * err_eager"),
        ("reference is the candidate itself", 'ref = logits("eager", False)', "ref = logits(implementation, False)"),
        ("absolute error", 'err_eager = float((logits("eager", True) - ref).norm() / ref_norm)',
         'err_eager = float((logits("eager", True) - ref).norm())'),
        ("baseline without autocast", 'logits("eager", True)', 'logits("eager", False)'),
        ("candidate without autocast", "logits(implementation, True)", "logits(implementation, False)"),
        ("comparison reversed", "err_impl <= factor * err_eager + 1e-6", "err_eager <= factor * err_impl + 1e-6"),
        ("tensor returned, not a float", 'err_eager = float((logits("eager", True) - ref).norm() / ref_norm)',
         'err_eager = (logits("eager", True) - ref).norm() / ref_norm'),
        ("strict < without the 1e-6 floor", "err_impl <= factor * err_eager + 1e-6", "err_impl < factor * err_eager"),
        ("autocast device hard-coded to cuda", "torch.autocast(input_ids.device.type,", 'torch.autocast("cuda",'),
        ("relative L2 in fp32", ".logits.double()", ".logits.float()"),
        ("divided by the candidate's norm", 'err_impl = float((logits(implementation, True) - ref).norm() / ref_norm)',
         'cand = logits(implementation, True)\n    err_impl = float((cand - ref).norm() / cand.norm())'),
        ("logits not upcast (fp32 arithmetic on bf16 and fp32 logits)", ".logits.double()", ".logits"),
        ("no 1e-6 floor (<= kept)", "err_impl <= factor * err_eager + 1e-6", "err_impl <= factor * err_eager"),
    ],
    "ex4_padding": [
        ("right pads keep the last position", "(attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)",
         "(attention_mask.cumsum(-1) - 1).clamp(min=0)"),
        ("sides swapped", 'if side == "left" else', 'if side == "right" else'),
        ("pad_id ignored", "torch.full((len(seqs), width), pad_id, dtype=torch.long)",
         "torch.zeros((len(seqs), width), dtype=torch.long)"),
        ("unknown side accepted", 'if side not in ("left", "right"):', "if False:"),
        ("default side right", 'def pad_batch(seqs, pad_id, side="left"):', 'def pad_batch(seqs, pad_id, side="right"):'),
        ("position ids ignore the padding",
         "position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)",
         "position_ids = torch.arange(width).repeat(len(seqs), 1)"),
        ("boolean attention_mask", "attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)",
         "attention_mask = torch.zeros((len(seqs), width), dtype=torch.bool)"),
        ("width from the first sequence", "width = max(len(s) for s in seqs)", "width = len(seqs[0])"),
        ("left pads get position -1", "(attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)",
         "(attention_mask.cumsum(-1) - 1)"),
        ("int32 attention_mask", "attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)",
         "attention_mask = torch.zeros((len(seqs), width), dtype=torch.int32)"),
    ],
    "ex5_decode": [
        ("no KV cache", "out = model(input_ids=nxt, use_cache=True, **lk.hfcompat.cache_kwarg(model, cache))",
         "out = model(input_ids=torch.cat(tokens, dim=1), use_cache=False)"),
        ("one token short", "for step in range(max_new_tokens):", "for step in range(max_new_tokens - 1):"),
        ("first position's logits", "out.logits[:, -1]", "out.logits[:, 0]"),
        ("cache not passed back", "out = model(input_ids=nxt, use_cache=True, **lk.hfcompat.cache_kwarg(model, cache))",
         "out = model(input_ids=nxt, use_cache=True)"),
        ("whole sequence fed with the cache", "out = model(input_ids=nxt, use_cache=True,",
         "out = model(input_ids=torch.cat(tokens, dim=1), use_cache=True,"),
        ("prompt left out", "return torch.cat(tokens, dim=1)", "return torch.cat(tokens[1:], dim=1)"),
        ("calls model.generate", "    tokens = [input_ids]\n",
         "    return model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,"
         " min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)\n    tokens = [input_ids]\n"),
        ("position ids restarted at 0 each step", "out = model(input_ids=nxt, use_cache=True,",
         "out = model(input_ids=nxt, position_ids=torch.zeros_like(nxt), use_cache=True,"),
        ("sampled instead of argmax", "out.logits[:, -1].argmax(-1, keepdim=True)",
         "torch.multinomial(out.logits[:, -1].softmax(-1), 1)"),
    ],
}

# (grade_id, mistake) -> why no visible check can catch it (at most one per notebook)
HIDDEN_ONLY = {}

# grade_id -> [(name, text in the answer, replacement)]: pass the visible tests, fail the hidden ones
FITTED = {
    "ex1_attention": [
        ("scaling hard-coded to the visible 0.5", "scale = d ** -0.5 if scaling is None else scaling",
         "scale = d ** -0.5 if scaling is None else 0.5"),
    ],
    "ex2_register": [
        ("only the visible 'flash' names refused", 'if "flash" in name.lower():',
         'if name in ("my_flash_kernel", "MyFlashKernel") or name.lower().startswith("ex2_flash"):'),
    ],
    "ex3_agreement": [
        ("autocast dtype hard-coded to bf16 (fp32 passed through)", "dtype=dtype",
         "dtype=torch.bfloat16 if dtype != torch.float32 else dtype"),
    ],
    "ex4_padding": [
        ("pad_id hard-coded to the visible 9", "torch.full((len(seqs), width), pad_id, dtype=torch.long)",
         "torch.full((len(seqs), width), 9, dtype=torch.long)"),
        ("width from the first three sequences (the visible batches have at most three)",
         "width = max(len(s) for s in seqs)", "width = max(len(s) for s in seqs[:3])"),
    ],
    "ex5_decode": [
        ("max_new_tokens hard-coded to the visible 8", "for step in range(max_new_tokens):", "for step in range(8):"),
    ],
}
