"""Numerical precision: float formats, FlashAttention dtype rules, the 2x rule for attention kernels.

- :func:`format_table`: FP32, TF32, FP16, BF16 and FP8 read from ``torch.finfo``.
- :func:`check_flash_dtypes`, :func:`safe_flash_attention`: FlashAttention's dtype rules and a
  wrapper that makes every cast explicit (a warning per cast, or an error), never silent.
- :func:`attention_error_row`: the 2x rule for one attention backend (max |error| against fp32,
  over that of an eager run in the same low precision).

The error report (max_abs, mean_abs, rel_l2, cosine) and the fp32-statistics LayerNorm are the
reader's exercises in 05_precision_analysis, which passes them to the later cells.

Training with AMP and watching gradients/activations live in :mod:`labkit.numerics.amp`.

Used in: 02_gpt2_integration, 05_precision_analysis.
"""
from __future__ import annotations

import math
import warnings

import pandas as pd
import torch

from labkit.engine import attention as attn
from labkit.core.measure import is_oom

HALF = (torch.float16, torch.bfloat16)


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
        q, k, v: as for :func:`labkit.engine.attention.attention` (layout in ``attention_kwargs``).
        compute_dtype: float16 or bfloat16 to run in. Required when q, k, v are not already one
            half dtype; never guessed (an "auto fix" that silently picks fp16 hides the cast from the reader).
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

    Returns status ("ok", or "oom" when the GPU's memory does not hold the fp32 reference's N x N scores:
    the numbers are then NaN), err_backend (max |o - fp32 reference|), err_eager (same for the eager
    reference run in q's dtype), ratio = err_backend / err_eager, and passes (ratio <= 2).
    """
    row = {"backend": backend, "dtype": str(q.dtype).replace("torch.", ""), "N": q.shape[2], "causal": causal,
           "status": "ok"}
    try:
        ref = attn.reference_attention(q.float(), k.float(), v.float(), causal=causal)[0]
        e_e = _max_abs_error(attn.reference_attention(q, k, v, causal=causal)[0], ref)
        e_b = _max_abs_error(attn.attention(q, k, v, causal=causal, backend=backend, nan_policy="ignore"), ref)
    except (RuntimeError, MemoryError) as err:
        if not is_oom(err):
            raise
        return {**row, "status": "oom", "err_backend": math.nan, "err_eager": math.nan, "ratio": math.nan,
                "passes": False}
    ratio = e_b / e_e if e_e > 0 else (1.0 if e_b == 0 else math.inf)
    return {**row, "err_backend": e_b, "err_eager": e_e, "ratio": ratio, "passes": ratio <= 2.0}


def _max_abs_error(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """max |candidate - reference|, in fp64 (a half-precision difference could round or overflow)."""
    return float((candidate.detach().double() - reference.detach().double()).abs().max())


__all__ = ["CastWarning", "attention_error_row", "check_flash_dtypes", "format_table", "safe_flash_attention"]
