"""Why ``backend="auto"`` runs the kernel it runs: every backend, its role in the choice and the reason.

:func:`auto` makes (or looks up) the choice :func:`labkit.engine.attention.auto_choice` makes for tensors
like the ones given, and returns one row per backend:

- ``chosen``: the kernel auto runs (the fastest timed candidate, or the only one);
- ``timed``: a candidate that lost, with its time as a multiple of the chosen one's;
- ``failed while timing``: a candidate dropped because its call raised (the error's first line);
- ``not a candidate``: ``sdpa_math`` where a fused kernel runs, ``reference`` where anything else does;
- ``cannot run here``: what stops the backend, known without running it (device, dtype, shape,
  package).

``df.attrs`` holds ``chosen`` and ``situation`` (device, the dtype the kernel sees, forward or
forward+backward, how the candidates were timed).

Used in: 02_gpt2_integration, ``python -m labkit doctor`` (:func:`labkit.engine.doctor.auto_report`).
"""
from __future__ import annotations

import torch

from labkit.engine import attention as attn
from labkit.engine.kernels import BACKENDS, package_problem, static_problem

ROLES = ("chosen", "timed", "failed while timing", "not a candidate", "cannot run here")


def auto(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, layout: str = "bhnd"):
    """Auto's choice for q, k, v and the reason for every backend, as a DataFrame.

    Args:
        q: [B, H, N, D] ("bhnd") or [B, N, H, D] ("bnhd"); k, v: the same layout with Nk keys.
            Their dtype, ``requires_grad`` and the autocast state define the situation timed, as in
            :func:`labkit.engine.attention.attention`.
        causal: bottom-right causal mask.
        layout: "bhnd" or "bnhd".

    Returns:
        DataFrame with columns backend, role (one of :data:`ROLES`), median_ms (timed candidates;
        NaN otherwise), vs_chosen (median_ms over the chosen kernel's), why.
    """
    import pandas as pd

    attn.validate(q, k, v, causal=causal, backend="auto", layout=layout, nan_policy="ignore")
    chosen = attn.auto_choice(q, k, v, causal=causal, layout=layout)
    seen = attn.auto_timings(q, k, v, causal=causal, layout=layout)
    dtype = attn.kernel_dtype(q)
    qb, kb = (q, k) if layout == "bhnd" else (q.transpose(1, 2), k.transpose(1, 2))
    chosen_ms = seen.get(chosen) if isinstance(seen.get(chosen), float) else None
    rows = []
    for name in BACKENDS:
        problem = static_problem(name, qb, kb, causal=causal, dtype=dtype) or package_problem(name)
        ms = seen.get(name)
        if name == chosen:
            row = dict(role="chosen", why="the fastest timed candidate" if chosen_ms is not None else
                       "the only candidate here: nothing to time it against")
        elif isinstance(ms, float):
            row = dict(role="timed", why=f"{ms / chosen_ms:.2f}x the chosen kernel's time" if chosen_ms else "timed")
        elif isinstance(ms, str):
            row = dict(role="failed while timing", why=ms)
        elif problem is not None:
            row = dict(role="cannot run here", why=problem)
        else:  # runs here, yet not timed: the fallbacks (auto_candidates)
            row = dict(role="not a candidate", why="the yardstick: auto runs it only where nothing else can"
                       if name == "reference" else "auto takes it only where no fused kernel runs")
        row.update(backend=name, median_ms=ms if isinstance(ms, float) else float("nan"))
        row["vs_chosen"] = row["median_ms"] / chosen_ms if chosen_ms else float("nan")
        rows.append(row)
    table = pd.DataFrame(rows, columns=["backend", "role", "median_ms", "vs_chosen", "why"])
    table.attrs["chosen"] = chosen
    table.attrs["situation"] = _situation(q, k, v, dtype, timed=chosen_ms is not None)
    return table


def _situation(q, k, v, dtype: torch.dtype, *, timed: bool) -> str:
    """One line: what auto's choice was made for, and how the candidates were timed."""
    training = attn.grad_needed(q, k, v)
    mode = "forward+backward (autograd needs gradients)" if training else "forward only"
    cost = ("a call's time its GPU time (a training step queues its launches behind GPU work)" if training else
            "a call's time the longer of its GPU and its host (launch) time (a forward at short N is host-bound)")
    how = ("each candidate timed in turns" + (", L2 flushed before each call, every turn started on an idle GPU, " + cost
                                               if q.device.type == "cuda" else " (CPU clock)")) if timed else "no timing"
    return f"{q.device.type}, {str(dtype).replace('torch.', '')}, {mode}; {how}"


__all__ = ["ROLES", "auto"]
