"""The input checks of :func:`labkit.engine.attention.attention`: what it refuses, with an error that names the fix.

Run once per new shape (the plan cache skips them after), and by ``lk.attention.validate`` directly.
Shapes: q [B, H, N, D] ("bhnd") or [B, N, H, D] ("bnhd"); k, v the same layout with Nk keys.

Used in: 01_setup_and_comparison (through ``lk.attention``).
"""
from __future__ import annotations

import difflib
import math
import numbers

import numpy as np
import torch

from labkit.engine.kernels import BACKENDS, AttentionInputError, static_problem

LAYOUTS = ("bhnd", "bnhd")
NAN_POLICIES = ("raise", "ignore")


def _cast_dtype(q) -> torch.dtype | None:
    """The dtype autocast runs attention in for q's device, or None (autocast off or q not fp32)."""
    device = q.device.type
    if q.dtype == torch.float32 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return None


def _check_finite(q, k, v) -> None:
    if not all(bool(torch.isfinite(t).all()) for t in (q, k, v)):
        raise AttentionInputError("q, k or v contains NaN or Inf. Find where it first appears (e.g. "
                                  "lk.precision's NaN monitor), or pass nan_policy='ignore' to skip this check.")


def check_causal(causal) -> bool:
    """``causal`` as a Python bool; TypeError unless it is one (or a numpy bool): ``"False"`` is not False."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool (True or False), got {type(causal).__name__} {causal!r}")
    return bool(causal)


def check_scale(scale) -> None:
    """``scale`` is None (1/sqrt(D)) or a finite positive number: TypeError for another type, ValueError else."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be None (1/sqrt(D)) or a number, got {type(scale).__name__} {scale!r}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be None (1/sqrt(D)) or a finite number > 0, e.g. 0.125; got {scale!r}")


def check_count(name: str, value) -> int:
    """A size that is counted (a batch, a length): a non-negative int (numpy ints too), as ``int``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 0, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value}")
    return int(value)


def validate(q, k, v, *, causal: bool = False, backend: str = "auto", layout: str = "bhnd",
             nan_policy: str = "raise", scale: float | None = None) -> None:
    """Raise AttentionInputError, naming the fix, if ``attention`` cannot take these inputs (TypeError for a
    ``causal`` that is not a bool or a ``scale`` that is not a number, ValueError for a NaN, infinite or
    non-positive ``scale``)."""
    check_causal(causal)
    check_scale(scale)
    _check_choice("backend", backend, BACKENDS + ("auto",))
    _check_choice("layout", layout, LAYOUTS)
    _check_choice("nan_policy", nan_policy, NAN_POLICIES)
    for name, t in zip("qkv", (q, k, v)):
        if not isinstance(t, torch.Tensor):
            raise AttentionInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dim() != 4:
            raise AttentionInputError(
                f"{name} has {t.dim()} dims {tuple(t.shape)}; attention expects 4-D {_shape_name(layout)}. "
                "Add missing batch/head dims with .unsqueeze(0), or reshape [B, N, H*D] with "
                ".view(B, N, H, D).")
        if not t.is_floating_point():
            raise AttentionInputError(f"{name} has dtype {t.dtype}; attention needs floating point. "
                                      "Convert with .to(torch.bfloat16) (GPU) or .float().")
        if t.numel() == 0:
            raise AttentionInputError(f"{name} is empty {tuple(t.shape)}: every dimension must be >= 1.")
    if len({q.dtype, k.dtype, v.dtype}) > 1:
        raise AttentionInputError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); "
                                  "cast them to one with k.to(q.dtype), v.to(q.dtype).")
    if len({q.device, k.device, v.device}) > 1:
        raise AttentionInputError(f"q, k, v are on different devices ({q.device}, {k.device}, {v.device}); "
                                  "move them with .to(q.device).")
    _check_shapes(q, k, v, layout)
    if nan_policy == "raise":
        _check_finite(q, k, v)
    if backend not in ("auto", "reference"):
        problem = static_problem(backend, *_as_bhnd(q, k, layout=layout), causal=causal, dtype=_cast_dtype(q))
        if problem:
            raise AttentionInputError(f"backend {backend!r}: {problem}")


def _as_bhnd(*tensors, layout: str):
    return tensors if layout == "bhnd" else tuple(t.transpose(1, 2) for t in tensors)


def _check_choice(what: str, value, allowed) -> None:
    if value not in allowed:
        close = difflib.get_close_matches(str(value), allowed, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise AttentionInputError(f"unknown {what} {value!r}; choose one of {', '.join(allowed)}.{hint}")


def _shape_name(layout: str) -> str:
    return "[B, H, N, D]" if layout == "bhnd" else "[B, N, H, D]"


def _check_shapes(q, k, v, layout: str) -> None:
    """Batch, heads and head dim must agree; catch a tensor passed in the other layout."""
    h_axis, n_axis = (1, 2) if layout == "bhnd" else (2, 1)
    other = "bnhd" if layout == "bhnd" else "bhnd"
    if q.shape[h_axis] > 256 and q.shape[n_axis] <= 256 and q.shape[h_axis] > q.shape[n_axis]:
        raise AttentionInputError(
            f"q {tuple(q.shape)} read as {_shape_name(layout)} has {q.shape[h_axis]} heads and sequence "
            f"length {q.shape[n_axis]}: it looks like {_shape_name(other)}. Pass layout={other!r} "
            "or .transpose(1, 2) the tensors.")
    if k.shape != v.shape:
        raise AttentionInputError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape.")
    for axis, what in ((0, "batch size"), (h_axis, "number of heads"), (3, "head dim")):
        if q.shape[axis] != k.shape[axis]:
            raise AttentionInputError(
                f"q and k differ in {what} ({q.shape[axis]} vs {k.shape[axis]}) for layout {layout!r} "
                f"{_shape_name(layout)}. Check the layout and the .view/.transpose that built them; for "
                "grouped-query attention repeat k, v heads with .repeat_interleave(H // Hkv, dim=1).")
