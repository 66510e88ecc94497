"""Notebook 10's GPU measurements: the reader's FP8 attention forward against bf16 kernels and FP8 library paths.

:func:`sweep` times, per shape (B*N = 16K tokens, H*d = 2048, as the FlashAttention papers and 01, 06 do) and
causal or not, the forwards of

- ``fp8_mine``: the notebook's ``fp8_attention`` on e4m3 inputs quantized once, outside the timing;
- ``bf16_mine``: the notebook's own bf16 forward from 06 (``flash_attention_forward``);
- ``sdpa_cudnn``, ``fa4``: cuDNN's attention and FlashAttention-4 in bf16, through labkit's kernels
  (:func:`labkit.engine.attention.attention` in each one's native layout);
- ``flex_fp8``: ``torch.compile(flex_attention)`` on the same e4m3 inputs, the q and k descales folded into a
  ``score_mod`` and the v descale applied to the output (:func:`flex_fp8_attention`);
- ``sdpa_fp8``: torch's prototype FP8 SDPA (FlashAttention-3 through
  ``torch.nn.attention.activate_flash_attention_impl("FA3")``) where this torch has it and the FA3 library is
  installed (:func:`sdpa_fp8_problem` says why not).

Every call runs once before timing: one that cannot run here gets ``unavailable: <why>`` or its error in
``status`` and the rest go on. The calls of one (shape, causal) take turns
(:func:`labkit.core.measure.time_interleaved`): median, p20 and p80. TFLOP/s counts the engine's FLOPs
(:func:`labkit.engine.attention.flops`: causal at half), beside the share of the FP8 datasheet peak and of the
measured FP8 GEMM (:mod:`labkit.fp8.ceilings`). :func:`goal_rows` judges the issue's goals;
:mod:`labkit.fp8.benchview` draws and reports.

Used in: 10_fp8_attention.
"""
from __future__ import annotations

import importlib.util
import time
from typing import Callable

import pandas as pd
import torch

from labkit.core import measure
from labkit.engine import attention as attn
from labkit.engine import kernels
from labkit.engine.bench import attention_inputs, failure_status, fixed_token_configs, recompile_room, tflops
from labkit.fp8.ceilings import FP8_DENSE_PEAK_TFLOPS, fp8_ceiling

SEQ_LENS = (4096, 8192, 16384, 32768)
HEAD_DIMS = (128, 64)
BF16_LIBRARY = ("sdpa_cudnn", "fa4")
LIBRARY = (*BF16_LIBRARY, "flex_fp8", "sdpa_fp8")
FP8_INPUTS = ("fp8_mine", "flex_fp8", "sdpa_fp8")
COLUMNS = ["d", "N", "B", "H", "causal", "backend", "inputs", "status", "ms", "p20_ms", "p80_ms", "tflops",
           "pct_peak", "pct_fp8_gemm", "first_call_s"]
GOAL_SPEEDUP, GOAL_TFLOPS, GOAL_D, GOAL_MIN_N = 1.4, 600.0, 128, 8192


def default_shapes(seq_lens: dict[int, list[int]] | None = None) -> list[dict]:
    """B, H, N, D of the sweep, B*N = 16K tokens, H = 2048 / d: for {d: lengths N} (default: N in
    :data:`SEQ_LENS` for d in :data:`HEAD_DIMS`), in that order (the goals' d = 128 first)."""
    seq_lens = seq_lens or {d: SEQ_LENS for d in HEAD_DIMS}
    return [cfg for d, ns in seq_lens.items() for cfg in fixed_token_configs(ns, [d], tokens=16384, width=2048)]


def causal_block_mask(n: int, device):
    """FlexAttention's block mask of causal attention over n queries and n keys (block 128)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, i, j: i >= j, None, None, n, n, device=device)


def flex_fp8_attention(q8, k8, v8, q_descale, k_descale, v_descale, causal: bool, *, flex=None, block_mask=None):
    """FlexAttention on quantized inputs: o = softmax(D^-0.5 q8 k8^T * q_descale * k_descale) v8 * v_descale.

    Args:
        q8, k8, v8: [B, H, N, D] (e4m3 on a GPU); descales: fp32 0-dim tensors (per tensor).
        flex: the flex_attention to call (default: torch's, eager); the sweep passes it compiled.
        block_mask: when causal, :func:`causal_block_mask` (built here when not given; the sweep builds it once,
            outside the timing).

    Returns:
        o [B, H, N, D] bf16.
    """
    from torch.nn.attention.flex_attention import flex_attention

    qk = (q_descale * k_descale).float()

    def descaled(score, b, h, q_idx, kv_idx):
        return score * qk

    if causal and block_mask is None:
        block_mask = causal_block_mask(q8.shape[-2], q8.device)
    o = (flex or flex_attention)(q8, k8, v8, score_mod=descaled, block_mask=block_mask if causal else None)
    return (o.float() * v_descale).to(torch.bfloat16)


def sdpa_fp8_problem() -> str | None:
    """Why torch's prototype FP8 SDPA cannot run here (None: it can, once FA3 is activated)."""
    nn_attention = torch.nn.attention
    if not hasattr(nn_attention, "activate_flash_attention_impl") or not hasattr(nn_attention, "_fa3"):
        return f"torch {torch.__version__} has no FA3 prototype (torch.nn.attention._fa3)"
    if "quantized" not in torch.ops.aten._scaled_dot_product_flash_attention.overloads():
        return f"torch {torch.__version__} has no _scaled_dot_product_flash_attention.quantized"
    if importlib.util.find_spec("flash_attn_interface") is None:
        return ("torch has the FA3 prototype, but its library (flash_attn_interface, FlashAttention-3's hopper "
                "build) is not installed")
    return None


def _sdpa_fp8_call(q8, k8, v8, q_descale, k_descale, v_descale, causal: bool) -> Callable:
    """torch's FP8 SDPA as a call, FA3 activated first (for the process); descales as FA3 wants them:
    fp32 [B, Hkv], one per (batch, head)."""
    torch.nn.attention.activate_flash_attention_impl("FA3")
    per_head = [d.float().expand(q8.shape[0], k8.shape[1]).contiguous() for d in (q_descale, k_descale, v_descale)]
    op = torch.ops.aten._scaled_dot_product_flash_attention.quantized
    return lambda: op(q8, k8, v8, *per_head, 0.0, causal, False)[0]


def _library_calls(q, k, v, fp8: tuple, causal: bool, device: torch.device, names) -> tuple[dict, dict]:
    """{name: call} of the library backends that can run here and {name: status} of those that cannot."""
    calls, refused = {}, {}
    for name in names:
        if name in BF16_LIBRARY:
            problem = kernels.static_problem(name, q, k, causal=causal) or kernels.package_problem(name)
            if problem is None:
                layout = kernels.native_layout(name)
                x = tuple(t.transpose(1, 2).contiguous() for t in (q, k, v)) if layout == "bnhd" else (q, k, v)
                calls[name] = (lambda x, name, layout: lambda: attn.attention(
                    *x, causal=causal, backend=name, layout=layout, nan_policy="ignore"))(x, name, layout)
        elif name == "flex_fp8":
            from torch.nn.attention.flex_attention import flex_attention

            problem = None
            flex = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention
            mask = causal_block_mask(q.shape[-2], device) if causal else None
            calls[name] = lambda: flex_fp8_attention(*fp8, causal, flex=flex, block_mask=mask)
        elif name == "sdpa_fp8":
            problem = sdpa_fp8_problem()
            if problem is None:
                try:
                    calls[name] = _sdpa_fp8_call(*fp8, causal)
                except (ImportError, RuntimeError) as err:    # the FA3 library found but not loadable
                    problem = failure_status(err)
        else:
            raise ValueError(f"unknown library backend {name!r}; allowed: {', '.join(LIBRARY)}")
        if problem is not None:
            refused[name] = f"unavailable: {problem}"
    return calls, refused


def _first_call(fn: Callable, device: torch.device) -> tuple[str, float]:
    """Run ``fn`` once (compiles, autotunes): ("ok" or the failure, seconds)."""
    start = time.perf_counter()
    try:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return "ok", time.perf_counter() - start
    except Exception as err:  # noqa: BLE001 - one backend's failure is a row's status, not the sweep's end
        measure.free_memory()
        status = f"error: {type(err).__name__}: {str(err).splitlines()[0][:120]}" \
            if isinstance(err, NotImplementedError) else failure_status(err)   # which op has no fp8 kernel
        return status, time.perf_counter() - start


def sweep(fp8_attention: Callable, quantize: Callable, *, bf16_forward: Callable | None,
          shapes: list[dict] | dict[int, list[int]] | None = None, causal=(False, True), library=LIBRARY,
          kernel_kwargs: dict | None = None, ceilings: dict | None = None, target_ms: float = 100.0, device=None,
          on_row: Callable[[dict], None] | None = None) -> pd.DataFrame:
    """Forward time and TFLOP/s of each kernel per shape and causal: a tidy DataFrame, one row per kernel.

    Args:
        fp8_attention: ``fp8_attention(q8, k8, v8, q_descale, k_descale, v_descale, causal, **kernel_kwargs)
            -> (o, lse)`` (the notebook's exercise 3).
        quantize: ``quantize(x) -> (x8, descale)`` applied to q, k and v once per shape (e.g. the notebook's
            ``quantize_per_tensor``; a per-block quantizer's block must be the kernel's tiles).
        bf16_forward: ``bf16_forward(q, k, v, causal) -> o or (o, lse)`` on bf16 [B, H, N, D] (06's forward);
            None: no ``bf16_mine`` rows.
        shapes: dicts B, H, N, D, or {d: lengths N} (the notebook's profile) for :func:`default_shapes`.
        library: which of :data:`LIBRARY` to measure too.
        kernel_kwargs: keyword arguments of ``fp8_attention`` (e.g. its tiles: block_m, block_n).
        ceilings: :func:`labkit.fp8.ceilings.gemm_ceiling`'s result, for ``pct_fp8_gemm`` (NaN without it).
        device: "cuda" (default where there is one); "cpu" only to test the sweep itself.
        on_row: called with each row as soon as it is measured (a script writes it to disk).

    Returns:
        DataFrame with :data:`COLUMNS`: ``inputs`` "e4m3" or "bf16"; ``status`` "ok", "unavailable: <why>" or
        the error; ms (median), p20_ms, p80_ms; tflops; ``pct_peak`` (of :data:`FP8_DENSE_PEAK_TFLOPS`) and
        ``pct_fp8_gemm`` (of the fastest measured FP8 GEMM), percent; ``first_call_s``: the first call (compile,
        autotune), not part of ms.
    """
    device = measure.as_device(device)
    kernel_kwargs = kernel_kwargs or {}
    recompile_room()
    roof = fp8_ceiling(ceilings)
    rows = []
    for cfg in shapes if isinstance(shapes, list) else default_shapes(shapes):
        q, k, v = attention_inputs(cfg["B"], cfg["H"], cfg["N"], cfg["D"], device=device)
        fp8 = tuple(x for t in (q, k, v) for x in quantize(t))           # q8, qd, k8, kd, v8, vd
        fp8 = fp8[0::2] + fp8[1::2]                                         # q8, k8, v8, qd, kd, vd
        for c in causal:
            calls = {"fp8_mine": lambda c=c: fp8_attention(*fp8, c, **kernel_kwargs)}
            if bf16_forward is not None:
                calls["bf16_mine"] = lambda c=c: bf16_forward(q, k, v, c)
            more, refused = _library_calls(q, k, v, fp8, c, device, library)
            calls.update(more)
            first = {name: _first_call(fn, device) for name, fn in calls.items()}
            first.update({name: (status, 0.0) for name, status in refused.items()})
            ok = {name: fn for name, fn in calls.items() if first[name][0] == "ok"}
            timings, errors = measure.time_interleaved(ok, device=device, target_ms=target_ms,
                                                       min_reps=max(5, measure.balanced_turns(len(ok))),
                                                       errors=(RuntimeError,))
            flop = attn.flops(cfg["B"], cfg["H"], cfg["N"], cfg["D"], causal=c)
            for name, (status, seconds) in first.items():
                t = timings.get(name)
                rate = tflops(flop, t.median_ms) if t else float("nan")
                row = dict(d=cfg["D"], N=cfg["N"], B=cfg["B"], H=cfg["H"], causal=c, backend=name,
                           inputs="e4m3" if name in FP8_INPUTS else "bf16",
                           status=failure_status(errors[name]) if name in errors else status,
                           ms=t.median_ms if t else float("nan"), p20_ms=t.p20_ms if t else float("nan"),
                           p80_ms=t.p80_ms if t else float("nan"), tflops=rate,
                           pct_peak=100 * rate / FP8_DENSE_PEAK_TFLOPS, pct_fp8_gemm=100 * rate / roof,
                           first_call_s=seconds)
                rows.append(row)
                if on_row is not None:
                    on_row(row)
            del calls, ok
            measure.free_memory()
    return pd.DataFrame(rows, columns=COLUMNS)


def _verdict(median_meets: bool, spread_meets: bool) -> str:
    return "ok" if median_meets else "ok within the timing spread" if spread_meets else "below goal"


def goal_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The rows that test the goals: d = 128, N >= 8K, non-causal; fp8_mine >= 1.4x bf16_mine and >= 600 TFLOP/s.

    The spread as :func:`labkit.flex.bench.variant_cost` reads it: ``speedup`` = bf16 median / fp8 median,
    ``speedup_low`` = bf16 p20 / fp8 p80, ``speedup_high`` = bf16 p80 / fp8 p20; ``tflops_high`` is the FP8
    kernel's TFLOP/s at its p20 time. A verdict is "ok" when the median meets the goal, "ok within the timing
    spread" when only the favourable end does, "below goal" else, "not measured" when a kernel has no "ok" row.

    Returns:
        One row per N: d, N, fp8_tflops, tflops_high, bf16_tflops, speedup, speedup_low, speedup_high,
        speedup_verdict, tflops_verdict.
    """
    part = df[(df["d"] == GOAL_D) & (df["N"] >= GOAL_MIN_N) & ~df["causal"].astype(bool) & (df["status"] == "ok")]
    rows = []
    for n in sorted(df.loc[(df["d"] == GOAL_D) & (df["N"] >= GOAL_MIN_N), "N"].unique()):
        mine = part[(part["N"] == n) & (part["backend"] == "fp8_mine")]
        bf16 = part[(part["N"] == n) & (part["backend"] == "bf16_mine")]
        row = dict(d=GOAL_D, N=int(n), fp8_tflops=float("nan"), tflops_high=float("nan"), bf16_tflops=float("nan"),
                   speedup=float("nan"), speedup_low=float("nan"), speedup_high=float("nan"),
                   speedup_verdict="not measured", tflops_verdict="not measured")
        if len(mine):
            m = mine.iloc[0]
            high = m["tflops"] * m["ms"] / m["p20_ms"]
            row.update(fp8_tflops=m["tflops"], tflops_high=high,
                       tflops_verdict=_verdict(m["tflops"] >= GOAL_TFLOPS, high >= GOAL_TFLOPS))
        if len(mine) and len(bf16):
            m, b = mine.iloc[0], bf16.iloc[0]
            row.update(bf16_tflops=b["tflops"], speedup=b["ms"] / m["ms"], speedup_low=b["p20_ms"] / m["p80_ms"],
                       speedup_high=b["p80_ms"] / m["p20_ms"])
            row["speedup_verdict"] = _verdict(row["speedup"] >= GOAL_SPEEDUP, row["speedup_high"] >= GOAL_SPEEDUP)
        rows.append(row)
    return pd.DataFrame(rows)
