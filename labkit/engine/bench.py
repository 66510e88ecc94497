"""Benchmarks of attention: the sweep, this device's peaks, and how close "auto" came.

- :func:`attention_sweep`: the attention benchmark as a tidy DataFrame, one row per
  configuration and backend, out-of-memory rows recorded instead of fatal.
- :func:`matmul_peak_tflops`, :func:`copy_bandwidth`: this device's measured peaks.
- :func:`auto_vs_best`: per configuration, "auto" against the fastest named backend.
- :func:`recompile_room`: room for torch.compile's graphs in sweeps of compiled functions (09, 10).
- The measurement primitives live in :mod:`labkit.core.measure` and are re-exported here
  (``lk.bench.time_fn``, ``lk.bench.peak_memory``, ...), the names the notebooks use.

Used in: 01_setup_and_comparison, 04_performance_analysis.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable, Iterable

import pandas as pd
import torch

from labkit.engine import attention as attn
from labkit.core.env import device_info
from labkit.core.measure import (Timing, as_device, call_ms, free_memory, is_oom, peak_memory, time_fn,  # noqa: F401
                      time_interleaved)


def tflops(flop: float, ms: float) -> float:
    """TFLOP/s of ``flop`` operations (finite, >= 0) done in ``ms`` milliseconds (finite, > 0); ValueError else."""
    if not (math.isfinite(flop) and flop >= 0 and math.isfinite(ms) and ms > 0):
        raise ValueError(f"tflops needs flop >= 0 and ms > 0, both finite; got flop={flop!r}, ms={ms!r}")
    return flop / (ms * 1e-3) / 1e12


def fixed_token_configs(seq_lens: Iterable[int], head_dims: Iterable[int], *, tokens: int = 16384,
                        width: int = 2048) -> list[dict]:
    """The FlashAttention papers' sweep: B*N = ``tokens`` and H*D = ``width`` for each (N, D)."""
    return [dict(B=max(1, tokens // n), H=max(1, width // d), N=n, D=d)
            for d in head_dims for n in seq_lens]


def attention_inputs(B: int, H: int, N: int, D: int, *, layout: str = "bhnd", dtype=torch.bfloat16,
                     device="cpu", requires_grad: bool = False, seed: int = 0):
    """Seeded random q, k, v of shape [B, H, N, D] (or [B, N, H, D] for "bnhd")."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = (B, H, N, D) if layout == "bhnd" else (B, N, H, D)
    return tuple(torch.randn(shape, generator=gen).to(device=device, dtype=dtype).requires_grad_(requires_grad)
                 for _ in range(3))


def _attention_call(backend: str, cfg: dict, *, causal: bool, mode: str, dtype, device,
                    fn: Callable | None = None):
    """Fresh inputs and one call for a benchmark row: (call, q, k, v, layout).

    ``fn(q, k, v, causal) -> o`` on [B, H, N, D] tensors stands in for a labkit backend
    (e.g. a student's implementation measured under the name ``backend``). Every backend gets
    its native layout (:func:`labkit.engine.attention.native_layout`); "auto" that of the backend it picks.
    """
    needs_grad = mode == "fwd_bwd"
    layout = "bhnd" if fn is not None else attn.native_layout(backend)
    if backend == "auto" and fn is None:  # like every backend, read in the layout of the kernel that runs
        q, k, v = attention_inputs(**cfg, dtype=dtype, device=device, requires_grad=needs_grad)
        with torch.set_grad_enabled(needs_grad):
            layout = attn.native_layout(attn.auto_choice(q, k, v, causal=causal))
        del q, k, v
    q, k, v = attention_inputs(**cfg, layout=layout, dtype=dtype, device=device, requires_grad=needs_grad)
    grad_out = torch.ones_like(q) if needs_grad else None  # o has q's shape; filled once, not per call

    def call():
        o = (fn(q, k, v, causal) if fn is not None else
             attn.attention(q, k, v, causal=causal, backend=backend, layout=layout, nan_policy="ignore"))
        if needs_grad:  # autograd.grad: the gradients alone, no accumulation into .grad timed with them
            torch.autograd.grad(o, (q, k, v), grad_out)
        return o

    return call, q, k, v, layout


def failure_status(err: BaseException) -> str:
    """The status column for a row that raised ``err``: "unsupported: ...", "not implemented", "oom" or "error: ..."."""
    if isinstance(err, (attn.AttentionInputError, ImportError)):  # ImportError: flash package missing
        return f"unsupported: {err}"
    if isinstance(err, NotImplementedError):
        return "not implemented"
    return "oom" if is_oom(err) else f"error: {str(err).splitlines()[0][:120]}"


_ROW_ERRORS = (attn.AttentionInputError, ImportError, NotImplementedError, RuntimeError, MemoryError)


MIN_REPS = 5


def _measure_group(rows: dict[str, dict], cfg: dict, *, causal: bool, mode: str, dtype, device,
                   target_ms: float, custom: dict[str, Callable]) -> None:
    """Fill ``rows`` (one per backend, same configuration): the first call's seconds, error and extra
    memory per backend, then their times, taken in turns of short blocks (:func:`time_interleaved`) so
    that a GPU clock drifting during the group favours no backend."""
    calls = {}
    with torch.set_grad_enabled(mode == "fwd_bwd"):
        for name, row in rows.items():
            try:
                call, q, k, v, layout = _attention_call(name, cfg, causal=causal, mode=mode, dtype=dtype,
                                                        device=device, fn=custom.get(name))
                o, row["first_call_s"] = _first_call(call, device)
                row["max_err"] = _sampled_error(o, q, k, v, causal=causal, layout=layout)
                row["extra_mib"] = peak_memory(call, device=device) / 2**20
                calls[name], row["status"] = call, "ok"
            except _ROW_ERRORS as err:
                row["status"] = failure_status(err)
        timings, failures = time_interleaved(calls, device=device, target_ms=target_ms, min_reps=MIN_REPS,
                                             errors=_ROW_ERRORS)
    for name, err in failures.items():
        rows[name]["status"] = failure_status(err)
    flop = attn.flops(cfg["B"], cfg["H"], cfg["N"], cfg["D"], causal=causal, mode=mode)
    for name, t in timings.items():
        rows[name].update(ms=t.median_ms, ms_p20=t.p20_ms, ms_p80=t.p80_ms, tflops=tflops(flop, t.median_ms))


def _first_call(call: Callable[[], torch.Tensor], device: torch.device) -> tuple[torch.Tensor, float]:
    """(output, seconds) of a backend's first call on a configuration, synchronized: what a new shape costs
    before it is timed (a JIT compile such as FA4's, a cuDNN plan, the allocator growing)."""
    start = time.perf_counter()
    out = call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def _sampled_error(o, q, k, v, *, causal: bool, layout: str, heads: int = 2) -> float:
    """Max error vs an fp32 reference on batch 0 and the first ``heads`` heads (keeps the
    reference's N x N scores small at long N)."""
    sl = (slice(0, 1), slice(0, heads)) if layout == "bhnd" else (slice(0, 1), slice(None), slice(0, heads))
    return attn.max_error_vs_fp32(o[sl], q[sl], k[sl], v[sl], causal=causal, layout=layout)


SWEEP_COLUMNS = ["backend", "B", "H", "N", "D", "causal", "mode", "status", "ms", "ms_p20", "ms_p80",
                 "tflops", "extra_mib", "max_err", "first_call_s", "device", "dtype"]


def attention_sweep(configs: list[dict], *, backends: Iterable[str] | None = None,
                    causal: Iterable[bool] = (False, True), modes: Iterable[str] = attn.MODES,
                    dtype=torch.bfloat16, device=None, target_ms: float = 100.0,
                    custom: dict[str, Callable] | None = None, custom_max_n: int | None = None,
                    progress: bool = True, partial_csv: str | Path | None = None) -> pd.DataFrame:
    """Benchmark backends over configurations; one row per (config, causal, mode, backend).

    Args:
        configs: dicts with B, H, N, D (see :func:`fixed_token_configs`).
        backends: names from ``labkit.engine.attention.BACKENDS`` or "auto"; default: every one that
            runs here, plus "auto".
        dtype, device: input dtype and device (default: CUDA if available).
        custom: extra implementations ``{name: fn(q, k, v, causal) -> o}`` on bhnd tensors, measured
            like the backends at every N <= ``custom_max_n`` (slow Python loops: keep N small).
        target_ms: timing budget per row; the backends of one configuration take turns in short
            blocks of calls (:func:`time_interleaved`), so clock drift favours none of them.
        partial_csv: rewritten with the rows so far after every configuration, so a sweep that is
            cut short keeps what it measured.

    Returns:
        DataFrame with columns backend, B, H, N, D, causal, mode, status ("ok", "oom" or the
        error), ms, ms_p20, ms_p80, tflops, extra_mib, max_err, first_call_s (the first call on the
        configuration, synchronized: compilation and allocation included; not part of ms), device, dtype.
    """
    from tqdm.auto import tqdm

    device = as_device(device)
    if backends is None:
        backends = [b for b in attn.BACKENDS
                    if attn.why_not(b, device=device, dtype=dtype, head_dim=configs[0]["D"]) is None] + ["auto"]
    custom = custom or {}
    names = list(backends) + list(custom)
    info = device_info(device)
    groups = [(cfg, c, m, [b for b in names if b not in custom or custom_max_n is None or cfg["N"] <= custom_max_n])
              for cfg in configs for c in causal for m in modes]
    rows = []
    with tqdm(total=sum(len(g[3]) for g in groups), desc="attention sweep", disable=not progress) as bar:
        for cfg, c, m, group in groups:
            group_rows = {b: dict(backend=b, **cfg, causal=c, mode=m, device=info.name,
                                  dtype=str(dtype).replace("torch.", "")) for b in group}
            _measure_group(group_rows, cfg, causal=c, mode=m, dtype=dtype, device=device, target_ms=target_ms,
                           custom=custom)
            rows.extend(group_rows.values())
            if partial_csv is not None:
                pd.DataFrame(rows, columns=SWEEP_COLUMNS).to_csv(partial_csv, index=False)
            if device.type == "cuda" or any(r["status"] != "ok" for r in group_rows.values()):
                free_memory()  # gc.collect costs ~0.2 s: skipped on CPU when nothing failed
            bar.update(len(group))
    return pd.DataFrame(rows, columns=SWEEP_COLUMNS)  # every column even when no row ran


def recompile_room(limit: int = 256) -> None:
    """Let torch.compile keep one graph per benchmarked shape (a sweep's N, mask, causal) instead of falling back
    to eager past its default limit of 8."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))


def matmul_peak_tflops(*, device=None, dtype=torch.bfloat16, n: int = 8192) -> float:
    """Measured dense-matmul TFLOP/s of an n x n x n product (the compute roof)."""
    device = as_device(device)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    timing = time_fn(lambda: a @ b, device=device)
    return tflops(2.0 * n**3, timing.median_ms)


def copy_bandwidth(*, device=None, mib: int = 1024) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (read + write counted)."""
    device = as_device(device)
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timing = time_fn(lambda: dst.copy_(src), device=device)
    return 2 * src.numel() / (timing.median_ms * 1e-3)


def auto_vs_best(df: pd.DataFrame) -> pd.DataFrame:
    """Per (D, causal, N, mode) of a sweep: the fastest named backend and how close "auto" came.

    Returns columns D, causal, N, mode, best, best_tflops, auto_tflops, auto_over_best (1.0 means
    auto matched the fastest backend; below 0.95 it missed by more than 5%).
    """
    ok = df[df["status"] == "ok"]
    rows = []
    for key, g in ok.groupby(["D", "causal", "N", "mode"]):
        named, auto = g[g["backend"] != "auto"], g[g["backend"] == "auto"]
        if named.empty or auto.empty:
            continue
        best = named.loc[named["tflops"].idxmax()]
        rows.append(dict(zip(["D", "causal", "N", "mode"], key), best=best["backend"],
                         best_tflops=best["tflops"], auto_tflops=float(auto["tflops"].iloc[0]),
                         auto_over_best=float(auto["tflops"].iloc[0]) / best["tflops"]))
    return pd.DataFrame(rows)
