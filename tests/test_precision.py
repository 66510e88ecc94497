"""Tests for labkit.precision: error metrics, float formats, FlashAttention dtype rules, LayerNorm."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from labkit import attention as attn
from labkit import bench, precision

CUDA = torch.cuda.is_available()


def _seeded(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ----------------------------------------------------------------------------- error metrics

def test_error_metrics_hand_computed():
    m = precision.error_metrics(torch.tensor([3.0, 5.0]), torch.tensor([3.0, 4.0]))
    assert m["max_abs"] == 1.0 and m["mean_abs"] == 0.5
    assert m["rel_l2"] == pytest.approx(1 / 5)
    assert m["cosine"] == pytest.approx(29 / (5 * math.sqrt(34)))
    assert m["nonfinite"] == 0


def test_error_metrics_stay_meaningful_near_zero():
    ref = _seeded(1000).double()
    ref[0] = 1e-12                      # one value near zero
    cand = ref + 1e-4 * _seeded(1000, seed=1).double()
    m = precision.error_metrics(cand, ref)
    elementwise = float(((cand - ref).abs() / (ref.abs() + 1e-8)).mean())  # seed 000's metric
    assert m["rel_l2"] < 1e-3, "relative L2 must not blow up because of one tiny reference value"
    assert elementwise > 1.0, "the element-wise relative error does blow up (why the metric exists)"


def test_error_metrics_half_inputs_do_not_overflow():
    ref = torch.full((100_000,), 300.0, dtype=torch.float16)    # ||ref|| = 94868 > fp16 max
    m = precision.error_metrics(ref, ref.float())
    assert m["rel_l2"] == 0.0 and m["cosine"] == pytest.approx(1.0)


def test_error_metrics_counts_nonfinite():
    m = precision.error_metrics(torch.tensor([1.0, float("nan"), float("inf")]), torch.ones(3))
    assert m["nonfinite"] == 2


@pytest.mark.parametrize("bad, error", [
    ((torch.ones(3), torch.zeros(3)), ValueError),
    ((torch.ones(3), torch.ones(4)), ValueError),
    ((torch.ones(3), [1.0, 1.0, 1.0]), TypeError),
])
def test_error_metrics_bad_input(bad, error):
    with pytest.raises(error):
        precision.error_metrics(*bad)


def test_error_vs_baseline():
    ref = torch.tensor([1.0, 2.0, 3.0])
    assert precision.error_vs_baseline(ref + 0.2, ref + 0.1, ref) == pytest.approx(2.0)
    assert precision.error_vs_baseline(ref, ref, ref) == 1.0
    assert precision.error_vs_baseline(ref + 0.1, ref, ref) == math.inf


# ----------------------------------------------------------------------------- formats

def test_format_table_matches_finfo():
    t = precision.format_table().set_index("format")
    assert {"fp32", "tf32", "fp16", "bf16"} <= set(t.index)
    assert t.loc["fp16", "max"] == 65504.0 and t.loc["fp16", "mantissa_bits"] == 10
    assert t.loc["bf16", "mantissa_bits"] == 7 and t.loc["bf16", "exponent_bits"] == 8
    assert t.loc["tf32", "bits"] == 19 and t.loc["tf32", "max"] == torch.finfo(torch.float32).max
    for name, dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
        assert t.loc[name, "epsilon"] == torch.finfo(dtype).eps
        sub = t.loc[name, "smallest_subnormal"]
        assert torch.tensor(sub, dtype=dtype).item() == sub, "smallest subnormal is representable"
        assert torch.tensor(sub / 4, dtype=dtype).item() == 0.0, "below it rounds to zero"
    if hasattr(torch, "float8_e4m3fn"):
        assert t.loc["fp8_e4m3fn", "max"] == 448.0


# ----------------------------------------------------------------------------- FlashAttention dtype rules

@pytest.mark.parametrize("dtypes, n_problems", [
    ((torch.bfloat16,) * 3, 0), ((torch.float16,) * 3, 0), ((torch.float32,) * 3, 3),
    ((torch.float16, torch.bfloat16, torch.bfloat16), 1), ((torch.float32, torch.float16, torch.float16), 2),
])
def test_check_flash_dtypes(dtypes, n_problems):
    q, k, v = (torch.zeros(1, 1, 4, 8, dtype=d) for d in dtypes)
    assert len(precision.check_flash_dtypes(q, k, v)) == n_problems


def test_safe_flash_attention_warns_every_cast():
    q, k, v = bench.attention_inputs(1, 2, 64, 32, dtype=torch.float32)
    with pytest.warns(precision.CastWarning) as record:
        o = precision.safe_flash_attention(q, k, v, compute_dtype=torch.bfloat16, out_dtype=torch.float32,
                                           backend="sdpa_math", causal=True)
    assert len(record) == 4 and all("->" in str(w.message) for w in record)
    assert o.dtype == torch.float32
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    eager = attn.reference_attention(qb, kb, vb, causal=True)[0]
    ref = attn.reference_attention(q, k, v, causal=True)[0]
    assert precision.error_vs_baseline(o, eager, ref) <= 2.0


def test_safe_flash_attention_no_cast_is_silent():
    q, k, v = bench.attention_inputs(1, 2, 64, 32, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o = precision.safe_flash_attention(q, k, v, backend="sdpa_math")
    assert o.dtype == torch.bfloat16


def test_safe_flash_attention_refuses():
    q, k, v = bench.attention_inputs(1, 2, 16, 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="no fp32 path"):
        precision.safe_flash_attention(q, k, v, compute_dtype=torch.float32)
    with pytest.raises(ValueError, match="compute_dtype"):
        precision.safe_flash_attention(q, k, v)                 # fp32 and no compute_dtype: never guessed
    with pytest.raises(ValueError, match="on_cast='raise'"):
        precision.safe_flash_attention(q, k, v, compute_dtype=torch.bfloat16, on_cast="raise")
    with pytest.raises(ValueError, match="overflow"):
        precision.safe_flash_attention(q * 1e5, k, v, compute_dtype=torch.float16)
    with pytest.raises(ValueError, match="on_cast"):
        precision.safe_flash_attention(q, k, v, compute_dtype=torch.bfloat16, on_cast="silent")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_error_row_cpu(dtype):
    q, k, v = bench.attention_inputs(1, 2, 128, 64, dtype=dtype)
    row = precision.attention_error_row("reference", q, k, v, causal=True)
    assert row["ratio"] == 1.0 and row["passes"]
    row = precision.attention_error_row("sdpa_math", q, k, v, causal=False)
    assert row["passes"], row
    assert 0 < row["err_eager"] < 0.05


# ----------------------------------------------------------------------------- LayerNorm

# Tolerances: the output is rounded to `dtype` (relative eps/2: 5e-4 fp16, 4e-3 bf16, |y| <= ~5), and
# the input mean 1000 over std 0.5 amplifies fp32 rounding of the mean by ~2000x (2000 * 6e-8 ~ 1e-4).
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-3), (torch.float16, 4e-3), (torch.bfloat16, 3e-2)])
def test_layernorm_fp32_matches_fp64(dtype, tol):
    x = (_seeded(4, 32, 256) * 0.5 + 1000.0).to(dtype)   # large mean, small variance
    ln = precision.LayerNormFP32(256)
    with torch.no_grad():
        ln.weight.copy_(1 + 0.1 * _seeded(256, seed=1))
        ln.bias.copy_(0.1 * _seeded(256, seed=2))
    y = ln(x)
    ref = F.layer_norm(x.double(), (256,), ln.weight.double(), ln.bias.double(), 1e-5)
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), ref, atol=tol, rtol=tol)


def test_layernorm_fp32_beats_naive_half_statistics():
    x = (_seeded(8, 256) * 0.5 + 1000.0).half()
    naive_var = (x * x).mean(-1) - x.mean(-1) ** 2          # E[x^2] overflows in fp16
    assert not torch.isfinite(naive_var).all()
    assert torch.isfinite(precision.LayerNormFP32(256)(x)).all()


def test_layernorm_fp32_grad_and_shape_error():
    ln = precision.LayerNormFP32(16)
    x = _seeded(2, 16).requires_grad_()
    ln(x).pow(2).sum().backward()
    assert x.grad is not None and ln.weight.grad is not None
    with pytest.raises(ValueError, match="normalized_shape"):
        ln(torch.ones(2, 8))


# ----------------------------------------------------------------------------- CUDA only

@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_flash_backends_meet_2x_rule(dtype):
    q, k, v = bench.attention_inputs(2, 4, 512, 64, dtype=dtype, device="cuda")
    backends = [b for b in attn.BACKENDS[1:] if attn.why_not(b, device="cuda", dtype=dtype) is None]
    assert "sdpa_flash" in backends or torch.cuda.get_device_capability()[0] < 8
    for b in backends:
        row = precision.attention_error_row(b, q, k, v, causal=True)
        assert row["passes"], row


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_safe_wrapper():
    q, k, v = bench.attention_inputs(1, 2, 128, 64, dtype=torch.float32, device="cuda")
    with pytest.raises(attn.AttentionInputError, match="float16/bfloat16"):
        attn.attention(q, k, v, backend="sdpa_flash")
    with pytest.warns(precision.CastWarning):
        o = precision.safe_flash_attention(q, k, v, compute_dtype=torch.bfloat16, backend="sdpa_flash")
    assert o.dtype == torch.bfloat16 and o.is_cuda
