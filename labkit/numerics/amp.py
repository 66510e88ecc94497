"""Mixed-precision (AMP) training and watching a model: gradient statistics, NaN/Inf hooks.

- :func:`train_amp`: a small training loop with ``torch.autocast`` + ``torch.amp.GradScaler``
  (modes in :data:`AMP_MODES`), returning an :class:`AmpRun` (per-step history, peak memory).
- :func:`grad_stats`: per-parameter gradient statistics (norms, zeros, NaN/Inf, fp16 underflow).
- :class:`NaNMonitor`: forward hooks that record value ranges and NaN/Inf per module.
- :func:`capture_outputs`: every leaf module's output of one run, to compare two precisions.

Error metrics, float formats and FlashAttention's dtype rules live in :mod:`labkit.numerics.precision`.

Used in: 03_long_sequence_training, 05_precision_analysis.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable

import pandas as pd
import torch
import torch.nn as nn

from labkit.engine import bench

AMP_MODES = {"fp32": None, "tf32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


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
        # weak references: a monitor kept for its statistics does not keep the model (and its gradients) alive
        self.modules = {n: weakref.ref(names[n]) for n in chosen}
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
        modules = {n: ref() for n, ref in self.modules.items()}
        self._handles = [m.register_forward_hook(self._hook(n)) for n, m in modules.items() if m is not None]
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

        from labkit.core.plots import label
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
    module name in forward order, to compare two runs module by module (05_precision_analysis
    compares them with the reader's error report)."""
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


__all__ = ["AMP_MODES", "AmpRun", "NaNMonitor", "capture_outputs", "grad_stats", "train_amp"]
