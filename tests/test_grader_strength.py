"""The autograders reject wrong answers: a mutation suite over every autograded exercise of 01-05.

Each mutant is a plausible student mistake (an off-by-one tile bound, a missing rescale, a mask
convention, a dtype slip, a missing gradient term, an ignored argument, a forgotten registration),
written as a text substitution in the solution's answer. It runs against the exercise's test cell,
visible part first, then with the hidden tests, and must fail one of them. The unmodified solution
passes the whole cell and the blank release answer fails it. Cells run in-process, one namespace per
notebook (tests/notebook_grader.py), cpu profile. ``-rA`` (or ``-s``) shows the per-notebook table.
"""
from __future__ import annotations

import collections

import pytest
from notebook_grader import NotebookRunner, exercises, setup_cells

pytestmark = pytest.mark.slow

# assignment -> markers of the ungraded cells the exercises need (the profile cell first)
SETUP = {
    "01_setup_and_comparison": ["P = lk.profiles.choose("],
    "02_gpt2_integration": ["P = lk.profiles.choose(", "TINY = lk.gpt2.build_model("],
    "03_long_sequence_training": ["import numpy as np", "COEF = lk.perfmodel.MemoryCoefficients()"],
    "04_performance_analysis": ["P = lk.profiles.choose(", "ridge = peak_tflops", "sweep = lk.predictor.time_grid("],
    "05_precision_analysis": ["P = lk.profiles.choose("],
    "06_triton_flashattention": ["MODE = lk.tritonmode.setup()"],
    "07_context_parallel": ["P = lk.profiles.choose("],
}

# assignment -> grade_id -> [(what the mistake is, text in the answer, replacement)]
MUTANTS = {
    "01_setup_and_comparison": {
        "ex1_standard_attention": [
            ("causal mask aligned top-left", ".tril(nk - n)", ".tril()"),
            ("no max subtraction", "m = s.amax(dim=-1, keepdim=True)", "m = torch.zeros_like(s[..., :1])"),
            ("fp32 accumulator for fp64", "acc = torch.promote_types(q.dtype, torch.float32)", "acc = torch.float32"),
            ("NaN on an empty row", "p = p / torch.where(l > 0, l, torch.ones_like(l))", "p = p / l"),
            ("mask ignored when causal", "keep = mask if keep is None else keep & mask",
             "keep = mask if keep is None else keep"),
        ],
        "ex2_score_matrix_bytes": [
            ("bf16 size hard-coded", "dtype.itemsize", "2"),
            ("float dtypes only", "dtype.itemsize", "(4 if dtype == torch.float32 else 2)"),
            ("bits instead of bytes", "dtype.itemsize", "torch.finfo(dtype).bits"),
        ],
        "ex3_online_softmax": [
            ("missing rescale of l", "l = l * torch.exp(m - shift) +", "l = l +"),
            ("-inf - -inf trap", "shift = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)",
             "shift = m_new"),
            ("fp32 accumulator for fp64", "acc = torch.promote_types(x.dtype, torch.float32)", "acc = torch.float32"),
        ],
        "ex4_flash_forward": [
            ("no causal block skipping", "j_end = max(0, min(nk, i1 + nk - n)) if is_causal else nk", "j_end = nk"),
            ("missing rescale of O", "acc_o = alpha * acc_o + p @ vj", "acc_o = acc_o + p @ vj"),
            ("tile mask aligned top-left", "[:, None] + (nk - n)", "[:, None]"),
            ("fp32 accumulator for fp64", "acc = torch.promote_types(q.dtype, torch.float32)", "acc = torch.float32"),
        ],
        "ex5a_flash_backward": [
            ("causal start ignores Nk - N", "(max(0, j0 - (nk - n)) // block_m)", "(j0 // block_m)"),
            ("missing D term in dS", "ds = p * (dp - delta[..., i0:i1, :])", "ds = p * dp"),
            ("dq without scale", "dq[..., i0:i1, :] += (ds @ kj) * scale", "dq[..., i0:i1, :] += ds @ kj"),
            ("fp32 accumulator for fp64", "acc = torch.promote_types(q.dtype, torch.float32)", "acc = torch.float32"),
        ],
        "ex5b_flash_function": [
            ("causal flag lost for backward", "ctx.is_causal = is_causal", "ctx.is_causal = False"),
            ("forward ignores is_causal", "flash_attention_forward(q, k, v, is_causal=is_causal)",
             "flash_attention_forward(q, k, v)"),
            ("backward in fp32", "flash_attention_backward(q, k, v, o, lse, do,",
             "flash_attention_backward(q.float(), k.float(), v.float(), o.float(), lse.float(), do.float(),"),
        ],
    },
    "02_gpt2_integration": {
        "ex1_attention": [
            ("causal mask aligned top-left", "keep = j <= i + (nk - n)", "keep = j <= i"),
            ("scaling argument ignored", "scale = d ** -0.5 if scaling is None else scaling", "scale = d ** -0.5"),
            ("[B, H, N, D] returned", "return out.transpose(1, 2), None", "return out, None"),
            ("NaN on a fully masked row", "torch.softmax(scores, dim=-1).nan_to_num(0.0)", "torch.softmax(scores, dim=-1)"),
            ("non-causal module masked", 'if keep is None and getattr(module, "is_causal", True):', "if keep is None:"),
        ],
        "ex2_register": [
            ("mask function not registered", "    AttentionMaskInterface.register(name, sdpa_mask)\n", ""),
            ("mask function returns None", "AttentionMaskInterface.register(name, sdpa_mask)",
             "AttentionMaskInterface.register(name, lambda *args, **kwargs: None)"),
            ("no check of 'flash' names", 'if "flash" in name.lower():', "if False:"),
            ("name not returned", "return name", "return fn"),
        ],
        "ex3_agreement": [
            ("dropout left on", "    model.eval()\n", ""),
            ("factor ignored", "factor * err_eager", "2.0 * err_eager"),
            ("reference is the candidate itself", 'ref = logits("eager", False)', "ref = logits(implementation, False)"),
            ("absolute error", "err_eager = float((logits(\"eager\", True) - ref).norm() / ref_norm)",
             "err_eager = float((logits(\"eager\", True) - ref).norm())"),
        ],
        "ex4_padding": [
            ("position ids count pads", "(attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)",
             "(attention_mask.cumsum(-1) - 1).clamp(min=0)"),
            ("sides swapped", 'if side == "left" else', 'if side == "right" else'),
            ("pad_id ignored", "torch.full((len(seqs), width), pad_id, dtype=torch.long)",
             "torch.zeros((len(seqs), width), dtype=torch.long)"),
            ("unknown side accepted", 'if side not in ("left", "right"):', "if False:"),
        ],
        "ex5_decode": [
            ("no KV cache", "out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)",
             "out = model(input_ids=torch.cat(tokens, dim=1), use_cache=False)"),
            ("one token short", "for step in range(max_new_tokens):", "for step in range(max_new_tokens - 1):"),
            ("first position's logits", "out.logits[:, -1]", "out.logits[:, 0]"),
        ],
    },
    "03_long_sequence_training": {
        "ex1_fit_coefficients": [
            ("absolute instead of relative error", "w = 1.0 / y", "w = np.ones_like(y)"),
            ("LSE not taken out", "(y - known) * w", "y * w"),
            ("scores feature for flash runs too", "np.where(flash, 0.0, L * B * H * N**2)", "L * B * H * N**2"),
            ("LSE coefficient hard-coded", "known = np.where(flash, lse * L", "known = np.where(flash, 4.0 * L"),
            ("underdetermined runs accepted", "if np.linalg.matrix_rank(features) < 3:", "if False:"),
            ("the H100 coefficients returned", "    return {\"hidden\": float(c[0])",
             "    c = [94.0, 6.0, 10.4]\n    return {\"hidden\": float(c[0])"),
        ],
        "ex2_chunked_ce": [
            ("mean over chunks", "return total / t.numel()", "return total / len(h.split(chunk_size))"),
            ("logits kept for backward", "checkpoint(chunk_loss, hc, weight, tc, use_reentrant=False)",
             "chunk_loss(hc, weight, tc)"),
            ("fp32 for fp64 inputs", "acc = torch.promote_types(hidden.dtype, torch.float32)", "acc = torch.float32"),
        ],
        "ex3_extend_positions": [
            ("floor instead of ceil", "old.repeat(-(-n_positions // p), 1)", "old.repeat(n_positions // p, 1)"),
            ("config not updated", "    model.config.n_positions = n_positions\n", ""),
            ("frozen table made trainable", "    table.weight.requires_grad_(old.requires_grad)\n", ""),
            ("same length accepted", "if n_positions <= p:", "if n_positions < p:"),
            ("dtype dropped", "device=old.device, dtype=old.dtype)", "device=old.device)"),
        ],
        "ex4_rope": [
            ("rotate_half sign", "torch.cat([-x2, x1], dim=-1)", "torch.cat([x2, -x1], dim=-1)"),
            ("base ignored", "theta = base ** (", "theta = 10000.0 ** ("),
            ("fp32 angles for fp64", "acc = torch.promote_types(x.dtype, torch.float32)", "acc = torch.float32"),
            ("dtype not restored", "torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)", "torch.cat([-x2, x1], dim=-1) * sin)"),
        ],
    },
    "04_performance_analysis": {
        "ex1_phase_counts": [
            ("softmax FLOPs", '"softmax": (5 * bh * nn,', '"softmax": (3 * bh * nn,'),
            ("bf16 bytes hard-coded", "elem_bytes * bh * 2 * nn", "2 * bh * 2 * nn"),
            ("Q and K reads forgotten", "elem_bytes * bh * (2 * N * D + nn)", "elem_bytes * bh * nn"),
        ],
        "ex2_flash_bytes": [
            ("floor tile count", "tiles = math.ceil(N / block_m)", "tiles = N // block_m"),
            ("LSE forgotten", " + 4 * B * H * N", ""),
            ("zero bytes accepted", "if nbytes <= 0:", "if False:"),
        ],
        "ex3_roofline": [
            ("scalar min", "np.minimum(peak_tflops,", "min(peak_tflops,"),
            ("ridge point counted as memory", "intensity < peak_tflops", "intensity <= peak_tflops"),
            ("bytes/s not converted", "* bandwidth / 1e12)", "* bandwidth)"),
        ],
        "ex4_predictor": [
            ("causal factor ignored", 'np.where(df["causal"].to_numpy(dtype=bool), 0.5, 1.0)', "np.ones(len(df))"),
            ("plain least squares", "np.linalg.lstsq(A / scale, np.ones(len(y)), rcond=None)[0] / scale",
             "np.linalg.lstsq(X, y, rcond=None)[0]"),
            ("signed denominator", "np.abs(pred - true) / np.abs(true)", "np.abs(pred - true) / true"),
        ],
    },
    "05_precision_analysis": {
        "ex1_accumulate": [
            ("Kahan sign", "c = (t - s) - y", "c = (t - s) + y"),
            ("fp32 accumulator", "s = torch.zeros((), dtype=acc_dtype)", "s = torch.zeros((), dtype=torch.float32)"),
            ("fp32 compensation", "c = torch.zeros((), dtype=acc_dtype)", "c = torch.zeros((), dtype=torch.float32)"),
        ],
        "ex2_error_report": [
            ("norms in the input dtype", "c = candidate.detach().double().flatten()", "c = candidate.detach().flatten()"),
            ("zero reference accepted", "if r_norm == 0:", "if False:"),
            ("cosine without |r|", "(c @ r / (c.norm() * r_norm))", "(c @ r / c.norm())"),
        ],
        "ex3_layernorm": [
            ("one-pass variance", "var = ((x32 - mean) ** 2).mean(dim=-1, keepdim=True)",
             "var = (x32 ** 2).mean(dim=-1, keepdim=True) - mean ** 2"),
            ("eps outside the sqrt", "torch.sqrt(var + eps)", "(torch.sqrt(var) + eps)"),
            ("weight ignored", "y = y * weight.float() + bias.float()", "y = y + bias.float()"),
            ("fp32 output", "return y.to(x.dtype)", "return y"),
        ],
        "ex4_policy": [
            ("bf16 master weights", "return torch.float32 if training else amp_dtype", "return amp_dtype"),
            ("fp32 FlashAttention accepted", 'if amp_dtype not in (torch.float16, torch.bfloat16):', "if False:"),
            ("linear in fp32", "return amp_dtype                       # tensor cores",
             "return torch.float32                       # tensor cores"),
        ],
    },
    "07_context_parallel": {
        "ex1_merge": [
            ("plain average, no rescale", "o = w1 * o1.to(acc) + w2 * o2.to(acc)", "o = 0.5 * (o1.to(acc) + o2.to(acc))"),
            ("max instead of logaddexp", "lse = torch.logaddexp(lse1, lse2)", "lse = torch.maximum(lse1, lse2)"),
            ("exp of lse overflows", "lse = torch.logaddexp(lse1, lse2)", "lse = torch.log(torch.exp(lse1) + torch.exp(lse2))"),
            ("-inf - -inf trap", "shift = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)", "shift = lse"),
            ("lse in o's dtype", "return o.to(o1.dtype), lse", "return o.to(o1.dtype), lse.to(o1.dtype)"),
        ],
        "ex2_zigzag": [
            ("round-robin instead of head-tail", "[[i, 2 * P - 1 - i] for i in range(P)]", "[[i, i + P] for i in range(P)]"),
            ("tail off by one", "[[i, 2 * P - 1 - i] for i in range(P)]", "[[i, 2 * P - i] for i in range(P)]"),
            ("tail hard-coded from P = 2", "[[i, 2 * P - 1 - i] for i in range(P)]", "[[i, 3 - i] for i in range(P)]"),
        ],
        "ex3_causal_work": [
            ("diagonal block counted whole", "c * m * m + m * (m + 1) // 2", "(c + 1) * m * m"),
            ("diagonal itself left out", "m * (m + 1) // 2", "m * (m - 1) // 2"),
            ("true division: a float", "m * (m + 1) // 2", "m * (m + 1) / 2"),
            ("chunk index ignored", "for c in chunks)", "for c in range(len(chunks)))"),
        ],
    },
    "06_triton_flashattention": {
        "ex1_softmax": [
            ("no max subtraction", "x = x - tl.max(x, axis=0)", "x = x - 0.0"),
            ("tail padded with 0", 'other=float("-inf")).to(tl.float32)', "other=0.0).to(tl.float32)"),
            ("PyTorch only",
             "softmax_kernel[(x2.shape[0],)](x2, y, x2.shape[1], BLOCK=triton.next_power_of_2(x2.shape[1]))",
             "y = torch.softmax(x2.float(), dim=-1).to(x2.dtype)"),
        ],
        "ex2_flash_forward": [
            ("causal tiles masked, not skipped", "hi = tl.minimum(N_K, start_m + BLOCK_M + shift)",
             "hi = N_K + 0 * shift"),
            ("missing rescale of acc", "    acc = acc * alpha[:, None]\n", ""),
            ("causal mask aligned top-left", "keep = keep & (offs_n[None, :] <= offs_m[:, None] + (N_K - N_Q))",
             "keep = keep & (offs_n[None, :] <= offs_m[:, None])"),
            ("NaN on a row that sees no key", "l_safe = tl.where(l_i == 0.0, 1.0, l_i)", "l_safe = l_i"),
            ("lse left in log2 units", "* 0.6931471805599453)  # natural log", ")  # natural log"),
            ("exp with a log2-scaled score", "p = tl.math.exp2(s * qk_scale - m_new[:, None])",
             "p = tl.exp(s * qk_scale - m_new[:, None])"),
            ("PyTorch only", "_fwd_kernel[grid](q3, k3, v3, o, lse, d ** -0.5 * LOG2E,",
             "o_, lse_ = lk.attention.reference_attention(q3, k3, v3, causal=is_causal); o.copy_(o_); lse.copy_(lse_)\n"
             "    (lambda *a, **kw: None)(q3, k3, v3, o, lse, d ** -0.5 * LOG2E,"),
        ],
        "ex3_flash_backward": [
            ("missing D term in dS", "dst = pt * (dpt - delta[None, :])", "dst = pt * dpt"),
            ("dk without scale", "(dk * sm_scale).to(", "dk.to("),
            ("dK/dV causal mask aligned top-left",
             "pt = tl.where(offs_n[:, None] <= offs_m[None, :] + (N_K - N_Q), pt, 0.0)",
             "pt = tl.where(offs_n[:, None] <= offs_m[None, :], pt, 0.0)"),
            ("D without O", "tl.sum(o * do, axis=1)", "tl.sum(do, axis=1)"),
        ],
        "ex4_flash_function": [
            ("causal flag lost for backward", "ctx.is_causal = is_causal", "ctx.is_causal = False"),
            ("forward ignores is_causal", "flash_attention_forward(q, k, v, is_causal=is_causal)",
             "flash_attention_forward(q, k, v)"),
            ("output upcast to fp32", "        return o\n", "        return o.float()\n"),
        ],
        "ex5_gqa_window": [
            ("K/V head by modulo", "kv = bh // GROUP", "kv = bh % (tl.num_programs(1) // GROUP)"),
            ("K/V repeated in memory", "    q3, k3, v3 = _as_heads(q), _as_heads(k), _as_heads(v)\n",
             "    k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)\n    hkv = hq\n"
             "    q3, k3, v3 = _as_heads(q), _as_heads(k), _as_heads(v)\n"),
            ("window tiles not skipped", "lo = tl.maximum(start_m + (N_K - N_Q) - WINDOW, 0) // BLOCK_N * BLOCK_N",
             "lo = 0 * WINDOW"),
            ("right side of a non-causal window ignored", "right = 0 if CAUSAL else WINDOW",
             "right = 0 if CAUSAL else N_K"),
        ],
    },
}


@pytest.fixture(scope="module")
def graded():
    """assignment -> grade_id -> {"solution", "blank", mutant name: outcome}, computed once per notebook."""
    cache = {}

    def grade(assignment: str) -> dict:
        if assignment not in cache:
            runner, items = NotebookRunner(), exercises(assignment)
            for source in setup_cells(assignment, SETUP[assignment]) + [e.answer for e in items]:
                runner.run(source)
            cache[assignment] = {e.grade_id: {"solution": runner.grade(e, e.answer),
                                              "blank": runner.grade(e, e.blank),
                                              **{name: runner.grade(e, e.mutate(old, new))
                                                 for name, old, new in MUTANTS[assignment].get(e.grade_id, [])}}
                                 for e in items}
        return cache[assignment]

    return grade


@pytest.mark.parametrize("assignment", list(MUTANTS))
def test_every_exercise_has_two_mutants(assignment):
    ids = [e.grade_id for e in exercises(assignment)]
    assert ids and set(MUTANTS[assignment]) == set(ids), f"{assignment}: exercises {ids}"
    assert all(len(m) >= 2 for m in MUTANTS[assignment].values())


@pytest.mark.parametrize("assignment", list(MUTANTS))
def test_solution_passes_blank_and_mutants_fail(graded, assignment):
    outcomes = graded(assignment)
    for grade_id, result in outcomes.items():
        assert result["solution"] == "passed", f"{assignment}:{grade_id}: the solution fails its own tests"
        assert result["blank"] == "visible", f"{assignment}:{grade_id}: the blank answer passes the visible tests"
        survivors = [name for name, outcome in result.items() if outcome == "passed" and name != "solution"]
        assert not survivors, f"{assignment}:{grade_id}: wrong answers that pass every test: {survivors}"


@pytest.mark.parametrize("assignment", list(MUTANTS))
def test_hidden_tests_catch_what_visible_tests_miss(graded, assignment):
    """Every exercise has a wrong answer that a student tuning to the visible tests would submit."""
    for grade_id, result in graded(assignment).items():
        assert "hidden" in result.values(), f"{assignment}:{grade_id}: no wrong answer is caught only by hidden tests"


def test_report_table(graded):
    """Per notebook: wrong answers tried / caught by the visible tests / caught only by the hidden tests."""
    lines = [f"{'notebook':<28}{'tried':>6}{'visible':>9}{'hidden only':>13}{'missed':>8}"]
    for assignment in MUTANTS:
        counts = collections.Counter(outcome for result in graded(assignment).values()
                                     for name, outcome in result.items() if name not in ("solution", "blank"))
        lines.append(f"{assignment:<28}{sum(counts.values()):>6}{counts['visible']:>9}{counts['hidden']:>13}"
                     f"{counts['passed']:>8}")
    print("\n".join(["", "wrong answers per notebook:", *lines]))
    assert all(line.split()[-1] == "0" for line in lines[1:])
