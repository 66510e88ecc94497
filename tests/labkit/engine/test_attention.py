"""Tests for labkit.engine.attention: numerics of every backend, layouts, "auto", and errors on bad input.

Precision rule (FlashAttention's tests): a backend's error against a float64 reference, in a
low-precision dtype, may be at most 2x the error of plain PyTorch attention (labkit's "reference"
backend) run in the same dtype. fp32 runs are compared with float64 directly.

On a CPU the backends that run are reference, sdpa_math and sdpa_flash; the same tests run every
backend on CUDA (marked ``gpu``), skipping those that ``why_not`` says do not run there.
"""
from __future__ import annotations

import itertools

import pytest
import torch

import labkit as lk
from labkit.engine.attention import AttentionInputError, attention

A = lk.attention
CPU_BACKENDS = ("reference", "sdpa_math", "sdpa_flash")
SDPA = ("sdpa_math", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (B, H, N, Nk, D): equal lengths; N < Nk (a KV cache); N > Nk (causal rows that see no key).
SHAPES = {"64x64": (2, 3, 64, 64, 32), "33x77": (1, 2, 33, 77, 40), "80x48": (1, 2, 80, 48, 64)}

# fp32 vs float64: observed max error <= 2e-6 (forward and gradients, |values| <= 7). 2e-5 is
# ~170 fp32 ulps at |o| ~ 1, so accumulation-order noise passes, while any bf16/fp16 rounding
# inside (>= 5e-4), a wrong scale or a wrong mask (O(0.1)) fails.
FP32_ATOL = 2e-5


# ----------------------------------------------------------------------------- helpers

def textbook_attention(q, k, v, *, causal=False, scale=None):
    """softmax(q k^T * scale) v on [..., N, D] tensors, in their own dtype, written without labkit.

    The causal mask is built explicitly with ``tril(diagonal=Nk - N)`` (bottom-right aligned);
    a query that sees no key gets output 0. In float64 this is the exact reference; in fp16/bf16 it
    is attention computed entirely in low precision (scores, softmax and output).
    """
    n, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    s = (q @ k.transpose(-2, -1)) * (d**-0.5 if scale is None else scale)  # [..., N, Nk]
    if not causal:
        return torch.softmax(s, dim=-1) @ v
    keep = torch.ones(n, nk, dtype=torch.bool, device=q.device).tril(diagonal=nk - n)
    seen = keep.any(-1, keepdim=True)  # [N, 1]: the query sees at least one key
    s = s.masked_fill(~keep, float("-inf")).masked_fill(~seen, 0.0)  # empty rows finite, zeroed next
    return (torch.softmax(s, dim=-1) * seen) @ v


def in_bhnd(fn, layout: str):
    """Wrap a bhnd attention function so it takes and returns tensors in ``layout``."""
    if layout == "bhnd":
        return fn
    return lambda q, k, v, **kw: fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw).transpose(1, 2)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double().cpu() - b.detach().double().cpu()).abs().max())


def grads(fn, q, k, v, do):
    """(o, dq, dk, dv) of ``fn(q, k, v)`` with upstream gradient ``do``, on fresh leaf copies."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def tiny_floor(exact: torch.Tensor) -> float:
    """A few fp32 ulps at the result's magnitude: every backend accumulates in fp32, and this is
    >= 1000x below one fp16/bf16 ulp, so it only matters when the baseline error is ~0."""
    return 4 * torch.finfo(torch.float32).eps * float(exact.abs().max())


def rounding_floor(exact: torch.Tensor, dtype: torch.dtype) -> float:
    """The error of a perfect kernel: rounding the exact result to ``dtype`` (<= half an ulp)."""
    return max_err(exact.to(dtype), exact)


def skip_unless_runs(backend: str, device: str, dtype, head_dim: int, causal: bool, backward: bool) -> None:
    """On CUDA, skip backends that ``why_not`` says do not run (package missing, GPU too old, ...).
    On CPU never skip: reference, sdpa_math and sdpa_flash must run, so a failure is a failure."""
    if device == "cpu":
        return
    reason = A.why_not(backend, device=device, dtype=dtype, head_dim=head_dim, causal=causal, backward=backward)
    if reason:
        pytest.skip(f"{backend} does not run here: {reason}")


def _numeric_cases():
    cases = []
    for device, backends in (("cpu", CPU_BACKENDS), ("cuda", A.BACKENDS)):
        for backend, dname, sname, causal, layout in itertools.product(
                backends, DTYPES, SHAPES, (False, True), A.LAYOUTS):
            _, _, n, nk, _ = SHAPES[sname]
            if causal and n != nk and backend in SDPA:
                continue  # SDPA aligns the mask top-left: labkit refuses it (test_bad_input_names_the_fix)
            cases.append(pytest.param(
                device, backend, DTYPES[dname], SHAPES[sname], causal, layout,
                marks=[pytest.mark.gpu] if device == "cuda" else [],
                id=f"{device}-{backend}-{dname}-{sname}-{'causal' if causal else 'full'}-{layout}"))
    return cases


NUMERIC_CASES = _numeric_cases()
NUMERIC_ARGS = "device,backend,dtype,shape,causal,layout"


# ----------------------------------------------------------------------------- numerics

@pytest.mark.parametrize(NUMERIC_ARGS, NUMERIC_CASES)
def test_forward_matches_float64(device, backend, dtype, shape, causal, layout, make_qkv):
    B, H, N, Nk, D = shape
    skip_unless_runs(backend, device, dtype, D, causal, backward=False)
    q, k, v = make_qkv(B, H, N, D, Nk=Nk, dtype=dtype, device=device, layout=layout)

    o = attention(q, k, v, causal=causal, backend=backend, layout=layout)

    assert o.shape == q.shape and o.dtype == dtype and o.device == q.device, \
        f"output {tuple(o.shape)} {o.dtype} should keep q's {layout} layout {tuple(q.shape)} and dtype {dtype}"
    exact = in_bhnd(textbook_attention, layout)(*(t.double().cpu() for t in (q, k, v)), causal=causal)
    err = max_err(o, exact)
    if dtype == torch.float32:
        assert err <= FP32_ATOL, f"{backend} fp32 max error vs float64 {err:.3g} > {FP32_ATOL}"
        return
    if backend == "reference":  # the baseline itself: held to the rule against all-low-precision attention
        base = in_bhnd(textbook_attention, layout)(q, k, v, causal=causal)
    else:
        base = attention(q, k, v, causal=causal, backend="reference", layout=layout)
    bound = 2 * max_err(base, exact) + tiny_floor(exact)
    assert err <= bound, f"{backend} {dtype} max error {err:.3g} > 2x baseline + floor = {bound:.3g}"


@pytest.mark.parametrize(NUMERIC_ARGS, NUMERIC_CASES)
def test_backward_matches_float64(device, backend, dtype, shape, causal, layout, make_qkv, randn):
    B, H, N, Nk, D = shape
    skip_unless_runs(backend, device, dtype, D, causal, backward=True)
    q, k, v = make_qkv(B, H, N, D, Nk=Nk, dtype=dtype, device=device, layout=layout)
    do = randn(*q.shape, seed=99, dtype=dtype, device=device)

    got = grads(lambda *t: attention(*t, causal=causal, backend=backend, layout=layout), q, k, v, do)

    exact_fn = in_bhnd(textbook_attention, layout)
    exact = grads(lambda *t: exact_fn(*t, causal=causal), *(t.double().cpu() for t in (q, k, v, do)))
    if backend == "reference":
        base = grads(lambda *t: exact_fn(*t, causal=causal), q, k, v, do)
    else:
        base = grads(lambda *t: attention(*t, causal=causal, backend="reference", layout=layout), q, k, v, do)
    for name, g, e, b, x in zip(("dq", "dk", "dv"), got[1:], exact[1:], base[1:], (q, k, v)):
        assert g.shape == x.shape and g.dtype == dtype, f"{name} {tuple(g.shape)} {g.dtype}"
        err = max_err(g, e)
        if dtype == torch.float32:
            tol = FP32_ATOL * max(1.0, float(e.abs().max()))
            assert err <= tol, f"{backend} fp32 {name} max error vs float64 {err:.3g} > {tol:.3g}"
            continue
        # Floor: the reference backend's gradients (autograd over an fp32 softmax) are often
        # rounded almost perfectly, and 2x a half-ulp error would demand <= 1 ulp. PyTorch's CPU
        # flash backward reaches ~1.2 ulp at the largest dV in fp16 (seen over several seeds), so
        # the rule is applied on top of the unavoidable final rounding of the result.
        bound = 2 * max_err(b, e) + rounding_floor(e, dtype)
        assert err <= bound, f"{backend} {dtype} {name} max error {err:.3g} > 2x baseline + floor = {bound:.3g}"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("layout", A.LAYOUTS)
def test_scale_argument(backend, layout, make_qkv):
    q, k, v = make_qkv(1, 2, 24, 16, layout=layout, seed=3)
    o = attention(q, k, v, causal=True, scale=0.3, backend=backend, layout=layout)
    exact = in_bhnd(textbook_attention, layout)(q.double(), k.double(), v.double(), causal=True, scale=0.3)
    assert max_err(o, exact) <= FP32_ATOL
    default = attention(q, k, v, causal=True, backend=backend, layout=layout)
    assert max_err(o, default) > 1e-3, "scale=0.3 must differ from the default 1/sqrt(16)"


@pytest.mark.parametrize("n,nk", [(5, 5), (3, 8), (8, 3), (1, 6)])
def test_causal_mask_is_bottom_right(n, nk):
    expected = torch.tensor([[j <= i + (nk - n) for j in range(nk)] for i in range(n)])
    assert torch.equal(A.causal_mask(n, nk), expected)


@pytest.mark.parametrize("n,nk", [(16, 16), (8, 24), (24, 8)])
def test_reference_attention_lse_and_rows_without_keys(n, nk, randn):
    q, k, v = randn(2, 3, n, 16, seed=1), randn(2, 3, nk, 16, seed=2), randn(2, 3, nk, 16, seed=3)
    o, lse = A.reference_attention(q, k, v, causal=True)

    keep = torch.ones(n, nk, dtype=torch.bool).tril(diagonal=nk - n)
    s = (q.double() @ k.double().transpose(-2, -1)) * 16**-0.5
    exact_lse = torch.logsumexp(s.masked_fill(~keep, float("-inf")), dim=-1)  # -inf where no key is seen
    empty = ~keep.any(-1)  # [N]
    assert lse.shape == (2, 3, n) and lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse), empty.expand_as(lse))
    torch.testing.assert_close(lse[..., ~empty].double(), exact_lse[..., ~empty], atol=FP32_ATOL, rtol=0)
    assert (o[..., empty, :] == 0).all(), "a query that sees no key must output 0"
    assert max_err(o, textbook_attention(q.double(), k.double(), v.double(), causal=True)) <= FP32_ATOL
    o_mask, _ = A.reference_attention(q, k, v, mask=keep)  # an explicit mask gives the same result
    torch.testing.assert_close(o_mask, o)


@pytest.mark.parametrize("layout", A.LAYOUTS)
def test_max_error_vs_fp32(layout, make_qkv):
    q, k, v = make_qkv(1, 2, 32, 16, layout=layout, dtype=torch.bfloat16, seed=4)
    o = attention(q, k, v, backend="reference", layout=layout)
    exact = in_bhnd(textbook_attention, layout)(q.double(), k.double(), v.double())
    err = A.max_error_vs_fp32(o, q, k, v, layout=layout)
    assert err == pytest.approx(max_err(o, exact), abs=1e-5) and err > 1e-4  # bf16 output is not exact
    o32 = attention(q.float(), k.float(), v.float(), backend="reference", layout=layout)
    assert A.max_error_vs_fp32(o32, q, k, v, layout=layout) <= 1e-6


def test_native_layout():
    assert [A.native_layout(b) for b in A.BACKENDS] == ["bhnd"] * 5 + ["bnhd"] * 2


# ----------------------------------------------------------------------------- why_not and auto

@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
def test_why_not_on_cpu(dtype):
    for backend in A.BACKENDS:
        reason = A.why_not(backend, device="cpu", dtype=dtype)
        if backend in CPU_BACKENDS:
            assert reason is None, f"{backend} should run on CPU in {dtype}: {reason}"
        else:
            assert "CUDA" in reason and "sdpa_math" in reason, reason


def test_auto_runs_and_is_correct(make_qkv):
    q, k, v = make_qkv(2, 2, 48, 32, seed=5)
    o = attention(q, k, v, causal=True, backend="auto")
    assert max_err(o, textbook_attention(q.double(), k.double(), v.double(), causal=True)) <= FP32_ATOL
    chosen = A.auto_choice(q, k, v, causal=True)
    assert chosen in A.BACKENDS
    assert A.why_not(chosen, device=q.device, dtype=q.dtype, head_dim=32, causal=True, backward=False) is None


def test_auto_is_tuned_once_per_key(monkeypatch, make_qkv):
    monkeypatch.setattr(A, "_AUTO_CACHE", {})
    monkeypatch.setattr(A, "auto_candidates", lambda *a, **kw: ["sdpa_flash", "sdpa_math"])
    tuned = []
    real = A._fastest
    monkeypatch.setattr(A, "_fastest", lambda names, *a: tuned.append(names) or real(names, *a))

    first = A.auto_choice(*make_qkv(1, 2, 32, 16))
    assert tuned == [["sdpa_flash", "sdpa_math"]] and first in tuned[0]
    assert A.auto_choice(*make_qkv(1, 2, 32, 16, seed=7)) == first  # same shape, new values: cached
    assert len(tuned) == 1
    A.auto_choice(*make_qkv(1, 2, 40, 16))  # a new shape is timed again
    A.auto_choice(*make_qkv(1, 2, 40, 16), causal=True)  # so is causal
    A.auto_choice(*make_qkv(1, 2, 40, 16), layout="bnhd")  # and the other layout
    A.auto_choice(*(t.requires_grad_() for t in make_qkv(1, 2, 40, 16)))  # and forward+backward
    assert len(tuned) == 5


def test_auto_takes_a_single_candidate_without_timing_it(monkeypatch, make_qkv):
    monkeypatch.setattr(A, "_AUTO_CACHE", {})
    monkeypatch.setattr(A, "_fastest", lambda *a: pytest.fail("one candidate needs no timing"))
    assert A.auto_choice(*make_qkv(1, 2, 32, 16)) == "sdpa_flash", \
        "on CPU the fused SDPA kernel is the only candidate (math only as fallback)"


def test_auto_falls_back_to_math_when_no_fused_kernel_runs(monkeypatch, make_qkv):
    monkeypatch.setattr(A, "_AUTO_CACHE", {})
    q, k, v = make_qkv(1, 2, 16, 16, Nk=24)  # SDPA's fused kernels are refused for causal N != Nk ...
    assert A.auto_choice(q, k, v, causal=False) == "sdpa_flash"
    real = A.static_problem
    monkeypatch.setattr(A, "static_problem",  # ... and now every fused one
                        lambda name, *a, **kw: None if name == "sdpa_math" else "refused")
    monkeypatch.setattr(A, "_AUTO_CACHE", {})
    assert A.auto_choice(q, k, v, causal=False) == "sdpa_math"
    monkeypatch.setattr(A, "static_problem", real)
    assert A.auto_choice(q, k, v, causal=True) == "reference"  # nothing else aligns bottom-right here


def test_auto_picks_the_fastest_and_drops_a_failing_candidate(monkeypatch, make_qkv):
    monkeypatch.setattr(A, "_AUTO_CACHE", {})
    monkeypatch.setattr(A, "auto_candidates", lambda *a, **kw: ["sdpa_flash", "reference", "fa4"])
    # fa4 cannot run on a CPU: it fails on its first call and drops out; the reference
    # (materialized scores, a Python-level softmax) is slower than the fused kernel at N=256.
    assert A.auto_choice(*make_qkv(1, 4, 256, 32), causal=True) == "sdpa_flash"


@pytest.mark.parametrize("requires_grad,host_time", [(False, True), (True, False)])
def test_auto_counts_host_time_for_inference_and_gpu_time_for_training(monkeypatch, make_qkv, requires_grad,
                                                                        host_time):
    """Inference at short N is host-bound: a launch slower than its kernels costs the model; a training
    step queues its launches behind GPU work, which hides them (do_bench's view)."""
    seen = []
    real = A.time_interleaved
    monkeypatch.setattr(A, "time_interleaved", lambda *a, **kw: seen.append(kw["host_time"]) or real(*a, **kw))
    monkeypatch.setattr(A, "_AUTO_CACHE", {})
    monkeypatch.setattr(A, "auto_candidates", lambda *a, **kw: ["sdpa_flash", "reference"])
    q, k, v = (t.requires_grad_(requires_grad) for t in make_qkv(1, 2, 64, 16))
    A.auto_choice(q, k, v, causal=True)
    with torch.no_grad():
        A.auto_choice(q.detach(), k.detach(), v.detach(), causal=False)
    assert seen == [host_time, True]


def test_auto_with_causal_unequal_lengths_keeps_bottom_right(make_qkv):
    q, k, v = make_qkv(1, 2, 16, 16, Nk=40, seed=6)
    o = attention(q, k, v, causal=True, backend="auto")
    assert max_err(o, textbook_attention(q.double(), k.double(), v.double(), causal=True)) <= FP32_ATOL
    chosen = A.auto_choice(q, k, v, causal=True)
    assert chosen not in SDPA, f"auto chose {chosen}, whose causal mask is top-left for N != Nk"


@pytest.mark.gpu
@pytest.mark.parametrize("n,d,causal", [(1024, 64, False), (2048, 128, True), (4096, 64, True)])
def test_auto_within_5_percent_of_fastest(n, d, causal, make_qkv, monkeypatch):
    monkeypatch.setattr(A, "_AUTO_CACHE", {})
    dtype, dev = torch.bfloat16, "cuda"
    q, k, v = make_qkv(max(1, 16384 // n), 2048 // d, n, d, dtype=dtype, device=dev)
    # "reference" is not an auto candidate by design (it materializes N x N scores).
    runs = [b for b in A.BACKENDS[1:]
            if A.why_not(b, device=dev, dtype=dtype, head_dim=d, causal=causal, backward=False) is None]
    with torch.no_grad():
        chosen = A.auto_choice(q, k, v, causal=causal)
        assert chosen in runs
        calls = {b: (lambda b=b: A.attention(q, k, v, causal=causal, backend=b, nan_policy="ignore")) for b in runs}
        timings, _ = lk.bench.time_interleaved(calls, device=dev, warmup=3, target_ms=200)
    ms = {b: t.median_ms for b, t in timings.items()}
    fastest = min(ms, key=ms.get)
    assert ms[chosen] <= 1.05 * ms[fastest], \
        f"auto chose {chosen} ({ms[chosen]:.3f} ms); {fastest}: {ms[fastest]:.3f} ms; all: {ms}"


# ----------------------------------------------------------------------------- bad input

def _qkv(r, q_shape, kv_shape=None, dtype=torch.float32, k_dtype=None):
    kv_shape = kv_shape or q_shape
    return (r(*q_shape, seed=0, dtype=dtype), r(*kv_shape, seed=1, dtype=k_dtype or dtype),
            r(*kv_shape, seed=2, dtype=k_dtype or dtype))


# (id, inputs from the randn builder, keyword arguments, substrings the message must contain)
BAD_INPUTS = [
    ("rank3", lambda r: _qkv(r, (2, 16, 64)), {}, ["4-D", ".unsqueeze(0)", ".view(B, N, H, D)"]),
    ("rank5", lambda r: _qkv(r, (1, 2, 2, 16, 8)), {}, ["4-D"]),
    ("bnhd_passed_as_bhnd", lambda r: _qkv(r, (1, 512, 4, 32)), dict(layout="bhnd"),
     ["looks like [B, N, H, D]", "layout='bnhd'", ".transpose(1, 2)"]),
    ("bhnd_passed_as_bnhd", lambda r: _qkv(r, (1, 4, 512, 32)), dict(layout="bnhd"),
     ["looks like [B, H, N, D]", "layout='bhnd'"]),
    ("dtype_mismatch", lambda r: _qkv(r, (1, 2, 16, 32), k_dtype=torch.float16), {},
     ["dtypes differ", "k.to(q.dtype)"]),
    ("head_dim_not_multiple_of_8", lambda r: _qkv(r, (1, 2, 16, 12)), dict(backend="sdpa_flash"),
     ["head dim 12", "multiple of 8", "'sdpa_math'"]),
    ("head_dim_over_256", lambda r: _qkv(r, (1, 2, 16, 264)), dict(backend="sdpa_flash"),
     ["head dim 264", "up to 256", "'sdpa_math'"]),
    ("batch_mismatch", lambda r: _qkv(r, (2, 2, 16, 32), (1, 2, 16, 32)), {}, ["batch size (2 vs 1)"]),
    ("heads_mismatch", lambda r: _qkv(r, (1, 4, 16, 32), (1, 2, 16, 32)), {},
     ["number of heads (4 vs 2)", ".repeat_interleave(H // Hkv, dim=1)"]),
    ("heads_mismatch_bnhd", lambda r: _qkv(r, (1, 16, 4, 32), (1, 16, 2, 32)), dict(layout="bnhd"),
     ["number of heads (4 vs 2)"]),
    ("head_dim_mismatch", lambda r: _qkv(r, (1, 2, 16, 32), (1, 2, 16, 16)), {}, ["head dim (32 vs 16)"]),
    ("k_v_shape_mismatch", lambda r: (r(1, 2, 16, 32, seed=0), r(1, 2, 16, 32, seed=1), r(1, 2, 8, 32, seed=2)),
     {}, ["k (1, 2, 16, 32) and v (1, 2, 8, 32) must have the same shape"]),
    *[(f"causal_unequal_{b}", lambda r: _qkv(r, (1, 2, 16, 32), (1, 2, 32, 32)), dict(backend=b, causal=True),
       ["N=16 != Nk=32", "bottom-right", "backend='reference'"]) for b in SDPA],
    ("cuda_only_backend_on_cpu", lambda r: _qkv(r, (1, 2, 16, 32)), dict(backend="sdpa_efficient"),
     ["needs a CUDA GPU", "'sdpa_math'"]),
    ("empty", lambda r: _qkv(r, (1, 2, 0, 32)), {}, ["empty", "every dimension must be >= 1"]),
    ("unknown_backend", lambda r: _qkv(r, (1, 2, 16, 32)), dict(backend="sdpa_flsh"),
     ["unknown backend 'sdpa_flsh'", "Did you mean 'sdpa_flash'?"]),
    ("unknown_backend_2", lambda r: _qkv(r, (1, 2, 16, 32)), dict(backend="falsh_attn"),
     ["Did you mean 'flash_attn'?"]),
    ("integer_dtype", lambda r: tuple(t.long() for t in _qkv(r, (1, 2, 16, 32))), {},
     ["torch.int64", "floating point", ".float()"]),
    ("bool_dtype", lambda r: tuple(t > 0 for t in _qkv(r, (1, 2, 16, 32))), {}, ["torch.bool", "floating point"]),
    ("unknown_layout", lambda r: _qkv(r, (1, 2, 16, 32)), dict(layout="bshd"),
     ["unknown layout 'bshd'", "bhnd, bnhd"]),
    ("unknown_nan_policy", lambda r: _qkv(r, (1, 2, 16, 32)), dict(nan_policy="skip"),
     ["unknown nan_policy 'skip'", "raise, ignore"]),
    ("not_a_tensor", lambda r: ([[1.0]], *_qkv(r, (1, 2, 16, 32))[1:]), {}, ["q must be a torch.Tensor", "list"]),
]


@pytest.mark.parametrize("make,kwargs,fix", [pytest.param(*c[1:], id=c[0]) for c in BAD_INPUTS])
def test_bad_input_names_the_fix(make, kwargs, fix, randn):
    q, k, v = make(randn)
    with pytest.raises(AttentionInputError) as info:
        attention(q, k, v, **kwargs)
    assert isinstance(info.value, ValueError)
    for text in fix:
        assert text in str(info.value), f"message should contain {text!r}: {info.value}"
    with pytest.raises(AttentionInputError) as again:  # the public validate() says the same
        A.validate(q, k, v, **kwargs)
    assert str(again.value) == str(info.value)


def test_validate_accepts_good_input(make_qkv):
    q, k, v = make_qkv(1, 2, 16, 32)
    assert A.validate(q, k, v, causal=True, backend="sdpa_math") is None
    assert A.validate(*make_qkv(1, 16, 2, 32, layout="bnhd"), layout="bnhd") is None
    # A legitimately wide bhnd problem (many heads, longer sequence) is not mistaken for bnhd.
    assert A.validate(*make_qkv(1, 300, 512, 8)) is None


def test_device_mismatch(make_qkv):
    q, k, v = make_qkv(1, 2, 16, 32)
    try:
        k_meta = torch.empty_like(k, device="meta")
    except (RuntimeError, NotImplementedError):
        pytest.skip("this torch build has no meta device")
    with pytest.raises(AttentionInputError, match=r"different devices.*move them with \.to\(q\.device\)"):
        attention(q, k_meta, v, backend="reference")


@pytest.mark.gpu
def test_device_mismatch_cpu_cuda(make_qkv):
    q, k, v = make_qkv(1, 2, 16, 32)
    with pytest.raises(AttentionInputError, match=r"different devices.*\.to\(q\.device\)"):
        attention(q.cuda(), k, v.cuda())


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_nan_policy(where, value, make_qkv):
    qkv = dict(zip("qkv", make_qkv(1, 2, 16, 32)))
    qkv[where][0, 1, 3, 5] = value
    with pytest.raises(AttentionInputError) as info:
        attention(**qkv, backend="reference")
    assert "NaN or Inf" in str(info.value) and "nan_policy='ignore'" in str(info.value)
    o = attention(**qkv, backend="reference", nan_policy="ignore")  # no check: the value propagates
    assert o.shape == (1, 2, 16, 32) and not torch.isfinite(o).all()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sdpa_flash", "sdpa_cudnn", "flash_attn", "fa4"])
def test_fp32_into_half_only_kernel(backend, make_qkv):
    # Only reachable on CUDA: on a CPU these backends fail the "needs a CUDA GPU" check first
    # (and sdpa_flash takes fp32 there). The check is static: no flash package is needed.
    q, k, v = make_qkv(1, 2, 64, 64, dtype=torch.float32, device="cuda")
    for call in (A.validate, attention):
        with pytest.raises(AttentionInputError) as info:
            call(q, k, v, backend=backend)
        msg = str(info.value)
        assert "float16/bfloat16" in msg and ".to(torch.bfloat16)" in msg and "torch.autocast" in msg, msg


# ----------------------------------------------------------------------------- causal, scale, flops: no silent misreading

@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("causal", ["False", "True", 0, 1, None, [True]], ids=repr)
def test_causal_must_be_a_bool(backend, causal, make_qkv):
    q, k, v = make_qkv(1, 2, 16, 32)
    for flag in (False, True):  # plans cached under causal False and True: 0 and 1 must not find them
        attention(q, k, v, causal=flag, backend=backend)
    with pytest.raises(TypeError, match=r"causal must be a bool \(True or False\), got "):
        attention(q, k, v, causal=causal, backend=backend)
    with pytest.raises(TypeError, match="causal must be a bool"):
        A.validate(q, k, v, causal=causal)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_causal_accepts_numpy_bools(backend, make_qkv):
    import numpy as np

    q, k, v = make_qkv(1, 2, 16, 32)
    for flag in (False, True):
        expected = attention(q, k, v, causal=flag, backend=backend)
        assert torch.equal(attention(q, k, v, causal=np.bool_(flag), backend=backend), expected)
    assert max_err(attention(q, k, v, causal=np.True_, backend=backend),
                   attention(q, k, v, causal=False, backend=backend)) > 1e-3, "np.True_ masks"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("scale, error", [(float("nan"), ValueError), (float("inf"), ValueError), (0.0, ValueError),
                                          (-0.125, ValueError), ("0.125", TypeError), (True, TypeError)], ids=repr)
def test_scale_must_be_finite_and_positive(backend, scale, error, make_qkv):
    q, k, v = make_qkv(1, 2, 16, 32)
    for _ in range(2):  # the first call builds the plan, the second finds it cached: both check
        with pytest.raises(error, match=r"scale must be None \(1/sqrt\(D\)\) or a"):
            attention(q, k, v, scale=scale, backend=backend)
    with pytest.raises(error, match="scale must be None"):
        A.validate(q, k, v, scale=scale)
    import numpy as np

    assert torch.equal(attention(q, k, v, scale=np.float32(0.25), backend=backend),
                       attention(q, k, v, scale=0.25, backend=backend))


@pytest.mark.parametrize("args, kwargs, error, text", [
    ((-1, 3, 128, 64), {}, ValueError, "batch must be an int >= 0, got -1"),
    ((2, -3, 128, 64), {}, ValueError, "heads must be an int >= 0, got -3"),
    ((2, 3, -128, 64), {}, ValueError, "n must be an int >= 0, got -128"),
    ((2, 3, 128, -64), {}, ValueError, "head_dim must be an int >= 0, got -64"),
    ((2, 3, 128, 64), dict(nk=-1), ValueError, "nk must be an int >= 0, got -1"),
    ((2, 3, 128.5, 64), {}, TypeError, "n must be an int >= 0, got float 128.5"),
    ((2, 3, 128, 64), dict(causal="False"), TypeError, "causal must be a bool"),
], ids=["batch", "heads", "n", "head_dim", "nk", "float", "causal"])
def test_flops_sizes_are_non_negative_ints(args, kwargs, error, text):
    with pytest.raises(error) as info:
        A.flops(*args, **kwargs)
    assert text in str(info.value)


def test_flops_takes_numpy_ints_and_zero():
    import numpy as np

    assert A.flops(np.int64(2), 3, 128, 64, nk=np.int32(256)) == 4 * 2 * 3 * 128 * 256 * 64
    assert A.flops(0, 3, 128, 64) == 0


@pytest.mark.parametrize("flop, ms", [(-1.0, 1.0), (1e9, 0.0), (1e9, -2.0), (float("nan"), 1.0), (1e9, float("inf"))])
def test_tflops_refuses_negative_or_non_finite(flop, ms):
    with pytest.raises(ValueError, match="tflops needs flop >= 0 and ms > 0, both finite"):
        lk.bench.tflops(flop, ms)
