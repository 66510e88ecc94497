"""Numerical precision: error metrics, float formats, gradient and activation checks, AMP training.

- :func:`error_metrics`, :func:`error_vs_baseline`: errors that stay meaningful near zero
  (no element-wise division by the reference), and the "2x rule" ratio against an eager
  baseline run in the same low precision.
- :func:`format_table`: FP32, TF32, FP16, BF16 and FP8 read from ``torch.finfo``.
- :func:`grad_stats`, :class:`NaNMonitor`: per-parameter gradient statistics; forward hooks that
  record value ranges and NaN/Inf per module.
- :func:`check_flash_dtypes`, :func:`safe_flash_attention`: FlashAttention's dtype rules and a
  wrapper that makes every cast explicit (a warning per cast, or an error), never silent.
- :class:`LayerNormFP32`: LayerNorm whose statistics are computed in fp32 for any input dtype.
- :func:`train_amp`: a small training loop with ``torch.autocast`` + ``torch.amp.GradScaler``.

Used in: 05_precision_analysis.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable

import pandas as pd
import torch
import torch.nn as nn

from . import attention as attn
from . import bench

HALF = (torch.float16, torch.bfloat16)
AMP_MODES = {"fp32": None, "tf32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


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


# ----------------------------------------------------------------------------- gradients and activations

def grad_stats(model: nn.Module) -> pd.DataFrame:
    """Gradient statistics per parameter (after ``backward``; unscale first when using a scaler).

    Columns: param, dtype, numel, norm, max_abs, frac_zero, frac_nonfinite, frac_fp16_underflow
    (nonzero values below half fp16's smallest subnormal, i.e. that would round to 0 in fp16).
    """
    f16 = torch.finfo(torch.float16)
    tiniest = f16.smallest_normal * f16.eps / 2
    rows = []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.detach().float()
        finite = torch.isfinite(g)
        gf = torch.where(finite, g, torch.zeros_like(g)).abs()
        rows.append({"param": name, "dtype": str(p.grad.dtype).replace("torch.", ""), "numel": g.numel(),
                     "norm": float(gf.norm()), "max_abs": float(gf.max()),
                     "frac_zero": float((g == 0).float().mean()), "frac_nonfinite": float((~finite).float().mean()),
                     "frac_fp16_underflow": float(((gf > 0) & (gf < tiniest)).float().mean())})
    if not rows:
        raise ValueError("no parameter has a .grad: call loss.backward() before grad_stats(model).")
    return pd.DataFrame(rows)


class NaNMonitor:
    """Forward hooks that record each module output's range and NaN/Inf count.

    Use as a context manager: ``with NaNMonitor(model) as mon: ...``; set ``mon.step`` each
    training step (:func:`train_amp` does). Statistics stay on the device until read, so the hooks
    add no GPU synchronization. By default every leaf module is watched.
    """

    def __init__(self, model: nn.Module, *, modules: Iterable[str] | None = None, every: int = 1):
        names = dict(model.named_modules())
        chosen = list(modules) if modules is not None else [n for n, m in names.items()
                                                           if n and not list(m.children())]
        unknown = [n for n in chosen if n not in names]
        if unknown:
            raise ValueError(f"unknown module names {unknown[:3]}; see [n for n, _ in model.named_modules()].")
        self.modules = {n: names[n] for n in chosen}
        self.every, self.step, self._records, self._handles = every, 0, [], []

    def _hook(self, name: str):
        def hook(module, inputs, output):
            t = _first_tensor(output)
            if t is None or not t.is_floating_point() or self.step % self.every:
                return
            x = t.detach().float()
            finite = torch.isfinite(x)
            safe = torch.where(finite, x, torch.zeros_like(x))
            stats = torch.stack([safe.min(), safe.max(), torch.isnan(x).sum().float(), torch.isinf(x).sum().float()])
            self._records.append((self.step, name, type(module).__name__, str(t.dtype).replace("torch.", ""), stats))
        return hook

    def __enter__(self) -> "NaNMonitor":
        self._handles = [m.register_forward_hook(self._hook(n)) for n, m in self.modules.items()]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def history(self) -> pd.DataFrame:
        """One row per (step, module call): step, module, type, dtype, min, max, nan, inf."""
        cols = ["step", "module", "type", "dtype", "min", "max", "nan", "inf"]
        if not self._records:
            return pd.DataFrame(columns=cols)
        stats = torch.stack([r[4] for r in self._records]).cpu().tolist()  # one device->host copy
        return pd.DataFrame([(*r[:4], *st) for r, st in zip(self._records, stats)], columns=cols)

    def summary(self) -> pd.DataFrame:
        """One row per module in forward order: calls, dtype, min, max, absmax, nan_calls,
        inf_calls, first_bad_step (first step with a NaN/Inf output; -1 if none)."""
        h = self.history()
        if h.empty:
            return pd.DataFrame(columns=["module", "type", "dtype", "calls", "min", "max", "absmax",
                                         "nan_calls", "inf_calls", "first_bad_step"])
        h["bad"] = (h["nan"] > 0) | (h["inf"] > 0)
        g = h.groupby("module", sort=False)
        out = g.agg(type=("type", "first"), dtype=("dtype", "last"), calls=("step", "size"), min=("min", "min"),
                    max=("max", "max"), nan_calls=("nan", lambda s: int((s > 0).sum())),
                    inf_calls=("inf", lambda s: int((s > 0).sum())))
        out["absmax"] = out[["min", "max"]].abs().max(axis=1)
        first_bad = h[h["bad"]].groupby("module")["step"].min()
        out["first_bad_step"] = [int(first_bad.get(m, -1)) for m in out.index]
        return out.reset_index()

    def first_nonfinite(self) -> dict | None:
        """The first (step, module) whose output held NaN/Inf, in forward order; None if none did."""
        h = self.history()
        bad = h[(h["nan"] > 0) | (h["inf"] > 0)]
        return None if bad.empty else bad.iloc[0][["step", "module", "type", "dtype", "nan", "inf"]].to_dict()

    def plot(self, ax=None):
        """Bar chart of each module's largest |output| (log scale) with fp16's max as a line;
        modules that produced NaN/Inf are drawn red. Returns the Axes."""
        import matplotlib.pyplot as plt

        from .plots import label
        s = self.summary()
        if ax is None:
            _, ax = plt.subplots(figsize=(max(6, 0.28 * len(s)), 3.6))
        bad = (s["nan_calls"] + s["inf_calls"]) > 0
        ax.bar(range(len(s)), s["absmax"].clip(lower=1e-8), color=["tab:red" if b else "tab:blue" for b in bad])
        ax.axhline(torch.finfo(torch.float16).max, color="k", ls="--", lw=1, label=label("fp16 最大值", "fp16 max"))
        ax.set_yscale("log")
        ax.set_xticks(range(len(s)), s["module"], rotation=90, fontsize=7)
        ax.set_ylabel(label("最大 |輸出|", "max |output|"))
        ax.legend(fontsize=8)
        return ax


def capture_outputs(model: nn.Module, run: Callable[[], object]) -> dict[str, torch.Tensor]:
    """Call ``run()`` once and return every leaf module's output (detached, its own dtype), by
    module name in forward order; compare two runs with :func:`error_metrics` module by module."""
    outputs: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(module, inputs, output):
            t = _first_tensor(output)
            if t is not None and t.is_floating_point():
                outputs.setdefault(name, t.detach().clone())
        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in model.named_modules() if n and not list(m.children())]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return outputs


def _first_tensor(output) -> torch.Tensor | None:
    """A module's output tensor, or the first tensor of a tuple/list output."""
    if isinstance(output, torch.Tensor):
        return output
    return next((o for o in output if isinstance(o, torch.Tensor)), None) if isinstance(output, (tuple, list)) else None


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


# ----------------------------------------------------------------------------- AMP training

@dataclass
class AmpRun:
    """What :func:`train_amp` measured: one history row per step, and peak memory."""

    mode: str
    history: pd.DataFrame  # step, loss, scale (after the update), skipped, grad_norm, ms
    peak_mib: float  # parameters + peak extra allocation of the loop (CUDA; NaN on CPU)

    def summary(self, warmup: int = 2, last: int = 5) -> dict:
        """mode, median step ms (after ``warmup`` steps), peak MiB, mean loss of the ``last`` steps
        (final_loss), skipped steps."""
        h = self.history
        return {"mode": self.mode, "step_ms": float(h["ms"].iloc[warmup:].median()), "peak_mib": self.peak_mib,
                "final_loss": float(h["loss"].iloc[-last:].mean()), "skipped": int(h["skipped"].sum())}


@dataclass
class _AmpStep:
    """One optimizer step of :func:`train_amp`; ``__call__`` returns its history row."""

    model: nn.Module
    loss_fn: Callable
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    dtype: torch.dtype | None
    clip: float | None
    inject_overflow_at: int | None
    skip_nonfinite: bool

    def __call__(self, i: int, batch) -> dict:
        self.opt.zero_grad(set_to_none=True)
        device_type = next(self.model.parameters()).device.type
        with torch.autocast(device_type, dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None):
            loss = self.loss_fn(self.model, batch)
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        if i == self.inject_overflow_at:  # what an fp16 overflow leaves behind
            next(p for p in self.model.parameters() if p.grad is not None).grad.view(-1)[0] = math.inf
        if self.scaler:
            self.scaler.unscale_(self.opt)  # explicit: clip and inspect the true gradients
        norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.clip or math.inf)
        if self.scaler:
            before = self.scaler.get_scale()
            self.scaler.step(self.opt)  # skipped inside if unscale_ found inf/NaN
            self.scaler.update()        # x0.5 after an overflow, x2 after growth_interval good steps
            skipped = self.scaler.get_scale() < before
        else:
            skipped = self.skip_nonfinite and not bool(torch.isfinite(norm))
            if not skipped:
                self.opt.step()
        return {"step": i, "loss": loss.detach().item(), "skipped": skipped, "grad_norm": float(norm),
                "scale": self.scaler.get_scale() if self.scaler else float("nan")}


def train_amp(model: nn.Module, batches: Iterable, loss_fn: Callable[[nn.Module, object], torch.Tensor], *,
              mode: str = "fp32", lr: float = 1e-3, clip: float | None = 1.0, inject_overflow_at: int | None = None,
              skip_nonfinite: bool = False, monitor: NaNMonitor | None = None,
              scaler_kwargs: dict | None = None) -> AmpRun:
    """Train ``model`` (on its device) with AdamW for one pass over ``batches``.

    Modes: "fp32" (no autocast, TF32 off), "tf32" (fp32 with TF32 matmuls), "fp16" (autocast +
    ``torch.amp.GradScaler``), "bf16" (autocast, no scaler). ``loss_fn(model, batch)`` returns
    the loss; compute it in fp32. ``inject_overflow_at`` writes an inf into the first gradient
    after that step's backward, as an fp16 overflow would: the scaler skips the step and halves
    its scale; without a scaler the inf reaches the weights unless ``skip_nonfinite``.
    Each step is timed as lk.bench times calls (CUDA events on a GPU, perf_counter on a CPU).
    """
    if mode not in AMP_MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(AMP_MODES)}.")
    device = next(model.parameters()).device
    scaler = torch.amp.GradScaler(device.type, **(scaler_kwargs or {})) if mode == "fp16" else None
    step = _AmpStep(model, loss_fn, torch.optim.AdamW(model.parameters(), lr=lr), scaler, AMP_MODES[mode], clip,
                    inject_overflow_at, skip_nonfinite)
    rows: list[dict] = []

    def loop() -> None:
        model.train()
        for i, batch in enumerate(batches):
            if monitor is not None:
                monitor.step = i
            ms = bench.call_ms(lambda: rows.append(step(i, batch)), device=device)
            rows[-1]["ms"] = ms

    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if mode == "tf32" else "highest")
    try:
        extra = bench.peak_memory(loop, device=device)  # NaN on CPU
    finally:
        torch.set_float32_matmul_precision(previous)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return AmpRun(mode, pd.DataFrame(rows), (params + extra) / 2**20)


__all__ = ["AMP_MODES", "AmpRun", "CastWarning", "LayerNormFP32", "NaNMonitor", "attention_error_row",
           "capture_outputs", "check_flash_dtypes", "error_metrics", "error_vs_baseline", "format_table", "grad_stats",
           "safe_flash_attention", "train_amp"]
