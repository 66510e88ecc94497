"""Numerical precision: error metrics, float formats, FlashAttention dtype rules, fp32-statistics LayerNorm.

- :func:`error_metrics`, :func:`error_vs_baseline`: errors that stay meaningful near zero
  (no element-wise division by the reference), and the "2x rule" ratio against an eager
  baseline run in the same low precision.
- :func:`format_table`: FP32, TF32, FP16, BF16 and FP8 read from ``torch.finfo``.
- :func:`check_flash_dtypes`, :func:`safe_flash_attention`: FlashAttention's dtype rules and a
  wrapper that makes every cast explicit (a warning per cast, or an error), never silent.
- :func:`attention_error_row`: the 2x rule for one attention backend.
- :class:`LayerNormFP32`: LayerNorm whose statistics are computed in fp32 for any input dtype.

Training with AMP and watching gradients/activations live in :mod:`labkit.amp`.

Used in: 02_gpt2_integration, 05_precision_analysis.
"""
from __future__ import annotations

import math
import warnings

import pandas as pd
import torch
import torch.nn as nn

from . import attention as attn

HALF = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- error metrics

def error_metrics(candidate: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """Errors of ``candidate`` against ``reference`` (same shape, any dtypes), computed in fp64.

    Returns max_abs, mean_abs, rel_l2 = ||c - r||_2 / ||r||_2, cosine = <c, r> / (||c|| ||r||)
    and nonfinite (count of NaN/Inf in candidate). None divides element by element, so values of
    the reference near zero do not blow the error up (seed 000's mean(|d| / (|r| + 1e-8)) did).
    """
    if not isinstance(candidate, torch.Tensor) or not isinstance(reference, torch.Tensor):
        raise TypeError("error_metrics needs two tensors; wrap numbers with torch.tensor(...).")
    if candidate.shape != reference.shape:
        raise ValueError(f"shapes differ: {tuple(candidate.shape)} vs {tuple(reference.shape)}; "
                         "compare like with like (same layout, same slice).")
    c, r = candidate.detach().double().cpu().flatten(), reference.detach().double().cpu().flatten()
    r_norm = float(r.norm())
    if r_norm == 0.0:
        raise ValueError("reference is all zeros: relative errors are undefined; use max_abs / mean_abs.")
    diff = c - r
    c_norm = float(c.norm())
    return {"max_abs": float(diff.abs().max()), "mean_abs": float(diff.abs().mean()),
            "rel_l2": float(diff.norm()) / r_norm,
            "cosine": float(c @ r) / (c_norm * r_norm) if c_norm > 0 else 0.0,
            "nonfinite": int((~torch.isfinite(c)).sum())}


def error_vs_baseline(candidate: torch.Tensor, baseline: torch.Tensor, reference: torch.Tensor,
                      metric: str = "max_abs") -> float:
    """err(candidate vs reference) / err(baseline vs reference).

    ``reference`` is the fp32 (or fp64) result, ``baseline`` the plain eager computation in the
    candidate's own low precision. FlashAttention's test suite accepts a kernel when this ratio is
    at most 2 ("the 2x rule"): a magic absolute tolerance would ignore what the dtype can do.
    """
    err_c = error_metrics(candidate, reference)[metric]
    err_b = error_metrics(baseline, reference)[metric]
    if err_b == 0.0:
        return 1.0 if err_c == 0.0 else math.inf
    return err_c / err_b


# ----------------------------------------------------------------------------- float formats

def _format_row(name: str, finfo: torch.finfo, note: str, *, bits: int | None = None,
                mantissa: int | None = None) -> dict:
    mantissa = round(-math.log2(finfo.eps)) if mantissa is None else mantissa
    bits = finfo.bits if bits is None else bits
    eps = 2.0 ** -mantissa
    return {"format": name, "bits": bits, "exponent_bits": bits - 1 - mantissa, "mantissa_bits": mantissa,
            "max": finfo.max, "smallest_normal": finfo.smallest_normal,
            "smallest_subnormal": finfo.smallest_normal * eps, "epsilon": eps,
            "decimal_digits": round((mantissa + 1) * math.log10(2), 1), "note": note}


def format_table() -> pd.DataFrame:
    """One row per float format, read from ``torch.finfo`` (FP8 rows where torch has them).

    Columns: format, bits, exponent_bits, mantissa_bits, max, smallest_normal,
    smallest_subnormal (= smallest_normal * epsilon), epsilon (gap above 1.0), decimal_digits
    ((mantissa + 1) * log10 2), note. TF32 is not a storage dtype: it is how tensor cores round
    fp32 matmul inputs (fp32's range, fp16's 10 mantissa bits), enabled by
    ``torch.set_float32_matmul_precision("high")``.
    """
    f32, f16, bf16 = (torch.finfo(d) for d in (torch.float32, torch.float16, torch.bfloat16))
    rows = [_format_row("fp32", f32, "default dtype; optimizer states and master weights"),
            _format_row("tf32", f32, "fp32 matmul mode on tensor cores (sm80+), not a dtype", bits=19,
                        mantissa=round(-math.log2(f16.eps))),
            _format_row("fp16", f16, "small range: needs loss scaling for gradients"),
            _format_row("bf16", bf16, "fp32's range, 8 significant bits")]
    for name, note in (("float8_e4m3fn", "FP8 forward (no inf)"), ("float8_e5m2", "FP8 gradients")):
        if hasattr(torch, name):
            rows.append(_format_row(name.replace("float8_", "fp8_"), torch.finfo(getattr(torch, name)), note))
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- FlashAttention dtype rules

class CastWarning(UserWarning):
    """Issued by :func:`safe_flash_attention` for every dtype cast it makes."""


def check_flash_dtypes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[str]:
    """FlashAttention's dtype rules; returns the broken ones (an empty list means q, k, v pass).

    Rules: q, k, v share one dtype, and it is float16 or bfloat16 (FlashAttention has no fp32
    kernel, so there is no "fp32 tolerance" to speak of).
    """
    problems = []
    dtypes = [t.dtype for t in (q, k, v)]
    if len(set(dtypes)) > 1:
        problems.append(f"q, k, v dtypes differ {tuple(str(d) for d in dtypes)}: cast all three to one half dtype.")
    for name, d in zip("qkv", dtypes):
        if d not in HALF:
            problems.append(f"{name} is {d}: FlashAttention takes only float16/bfloat16 (no fp32 path).")
    return problems


def safe_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                         compute_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
                         on_cast: str = "warn", **attention_kwargs) -> torch.Tensor:
    """FlashAttention-style attention whose every cast is explicit.

    Args:
        q, k, v: as for :func:`labkit.attention.attention` (layout in ``attention_kwargs``).
        compute_dtype: float16 or bfloat16 to run in. Required when q, k, v are not already one
            half dtype; never guessed (seed 001's "auto fix" silently picked fp16).
        out_dtype: cast the output to this dtype (e.g. back to float32); reported like any cast.
        on_cast: "warn" issues a :class:`CastWarning` per cast; "raise" refuses to cast.
        attention_kwargs: causal, scale, backend, layout, nan_policy for ``lk.attention.attention``.

    Returns:
        o in ``out_dtype`` if given, else in ``compute_dtype``.
    """
    if on_cast not in ("warn", "raise"):
        raise ValueError(f"on_cast must be 'warn' or 'raise', got {on_cast!r}.")
    if compute_dtype is not None and compute_dtype not in HALF:
        raise ValueError(f"compute_dtype={compute_dtype}: FlashAttention has no fp32 path; use torch.bfloat16 "
                         "or torch.float16 (or lk.attention.attention(..., backend='sdpa_math') for fp32).")
    target = compute_dtype
    if target is None:
        if check_flash_dtypes(q, k, v):
            raise ValueError("; ".join(check_flash_dtypes(q, k, v)) + " Pass compute_dtype=torch.bfloat16 "
                             "(or torch.float16) to let safe_flash_attention cast explicitly.")
        target = q.dtype
    q, k, v = (_explicit_cast(t, name, target, on_cast) for name, t in zip("qkv", (q, k, v)))
    o = attn.attention(q, k, v, **attention_kwargs)
    return o if out_dtype is None else _explicit_cast(o, "output", out_dtype, on_cast)


def _explicit_cast(t: torch.Tensor, name: str, dtype: torch.dtype, on_cast: str) -> torch.Tensor:
    if t.dtype == dtype:
        return t
    what = f"{name} {tuple(t.shape)} {t.dtype} -> {dtype}"
    if on_cast == "raise":
        raise ValueError(f"cast needed ({what}) but on_cast='raise'; cast it yourself before the call.")
    if dtype == torch.float16 and bool((t.detach().abs() > torch.finfo(torch.float16).max).any()):
        raise ValueError(f"casting {what} would overflow to inf (|values| > 65504); use torch.bfloat16.")
    warnings.warn(f"safe_flash_attention cast {what}", CastWarning, stacklevel=3)
    return t.to(dtype)


def attention_error_row(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        causal: bool = False) -> dict:
    """The 2x rule for one backend on bhnd half inputs [B, H, N, D].

    Returns err_backend (max |o - fp32 reference|), err_eager (same for the eager reference run in
    q's dtype), ratio = err_backend / err_eager, and passes (ratio <= 2).
    """
    ref = attn.reference_attention(q.float(), k.float(), v.float(), causal=causal)[0]
    eager = attn.reference_attention(q, k, v, causal=causal)[0]
    o = attn.attention(q, k, v, causal=causal, backend=backend, nan_policy="ignore")
    e_b, e_e = error_metrics(o, ref)["max_abs"], error_metrics(eager, ref)["max_abs"]
    ratio = e_b / e_e if e_e > 0 else (1.0 if e_b == 0 else math.inf)  # as error_vs_baseline
    return {"backend": backend, "dtype": str(q.dtype).replace("torch.", ""), "N": q.shape[2], "causal": causal,
            "err_backend": e_b, "err_eager": e_e, "ratio": ratio, "passes": ratio <= 2.0}


# ----------------------------------------------------------------------------- LayerNorm

class LayerNormFP32(nn.Module):
    """LayerNorm over the last dim whose mean and variance are computed in fp32 for any input
    dtype; the output is cast back to the input's dtype. x: [..., C] -> [..., C]."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(normalized_shape, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(normalized_shape, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.weight.shape[0]:
            raise ValueError(f"last dim {x.shape[-1]} != normalized_shape {self.weight.shape[0]}.")
        x32 = x.float()                                    # explicit: statistics in fp32
        mean = x32.mean(-1, keepdim=True)
        var = (x32 - mean).pow(2).mean(-1, keepdim=True)   # two-pass: no E[x^2] - E[x]^2 cancellation
        y = (x32 - mean) * torch.rsqrt(var + self.eps) * self.weight.float() + self.bias.float()
        return y.to(x.dtype)                               # explicit: back to the caller's dtype


__all__ = ["CastWarning", "LayerNormFP32", "attention_error_row", "check_flash_dtypes", "error_metrics",
           "error_vs_baseline", "format_table", "safe_flash_attention"]
