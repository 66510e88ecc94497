"""Tests for labkit.numerics.precision: float formats, FlashAttention dtype rules, the 2x rule."""
from __future__ import annotations

import warnings

import pytest
import torch

from labkit.engine import attention as attn
from labkit.engine import bench
from labkit.numerics import precision

CUDA = torch.cuda.is_available()


def _seeded(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


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
    assert (o - ref).abs().max() <= 2 * (eager.float() - ref).abs().max()  # the 2x rule


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


def test_attention_error_row_reads_oom(monkeypatch):
    """A GPU that cannot hold the fp32 reference's scores gives a row with status "oom", not an exception."""
    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 768.00 MiB.")

    q, k, v = bench.attention_inputs(1, 2, 64, 16, dtype=torch.bfloat16)
    monkeypatch.setattr(attn, "reference_attention", no_memory)
    row = precision.attention_error_row("sdpa_math", q, k, v, causal=True)
    assert row["status"] == "oom" and row["N"] == 64 and row["ratio"] != row["ratio"] and not row["passes"]


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
