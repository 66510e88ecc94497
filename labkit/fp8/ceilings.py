"""The roofs an FP8 attention kernel is judged against: the datasheet's FP8 peak and this GPU's measured GEMMs.

- :data:`FP8_DENSE_PEAK_TFLOPS`: NVIDIA's H100 SXM datasheet, FP8 tensor core, dense (without sparsity): 1,979
  TFLOP/s (the H200 has the same tensor cores and the same figure). A ceiling no kernel reaches: the measured
  GEMMs say how close real work gets.
- :func:`gemm_ceiling`: TFLOP/s of an n x n x n bf16 ``torch.matmul`` and of FP8 ``torch._scaled_mm`` (e4m3 inputs,
  bf16 output) with tensor-wise and row-wise scales, each with and without ``use_fast_accum``, timed in turns.
  A CUDA GPU only: on a CPU it raises RuntimeError (a CPU has no FP8 tensor cores to measure; the notebook shows
  the course's reference run instead).
- :func:`fp8_ceiling`, :func:`bf16_ceiling`: the fastest FP8 variant and the bf16 matmul of such a result.

Used in: 10_fp8_attention.
"""
from __future__ import annotations

import torch

from labkit.core import measure
from labkit.engine.bench import failure_status, tflops

FP8_DENSE_PEAK_TFLOPS = 1979.0
BF16 = "bf16_matmul"
FP8_VARIANTS = ("fp8_tensorwise", "fp8_tensorwise_fast_accum", "fp8_rowwise", "fp8_rowwise_fast_accum")


def _gemm_calls(n: int, device: torch.device) -> dict:
    """{name: call} of the GEMMs measured: a [n, n] @ [n, n] product each, inputs made once.

    ``_scaled_mm`` wants its second operand column-major (the transpose of a row-major [n, n]); scales are fp32:
    0-dim (tensor-wise) or [n, 1] for a's rows and [1, n] for b's columns (row-wise).
    """
    gen = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(device) for _ in range(2))
    a16, b16 = a.bfloat16(), b.bfloat16()
    a8 = a.to(torch.float8_e4m3fn)                                       # |x| < 448: no clamp needed
    b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()                 # b's values, column-major
    one = torch.ones((), device=device)
    rows, cols = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)
    calls = {BF16: lambda: torch.matmul(a16, b16)}
    for name in FP8_VARIANTS:
        sa, sb = (rows, cols) if "rowwise" in name else (one, one)
        calls[name] = (lambda sa, sb, fast: lambda: torch._scaled_mm(a8, b8, sa, sb, out_dtype=torch.bfloat16,
                                                                     use_fast_accum=fast))(sa, sb, "fast" in name)
    return calls


def gemm_ceiling(n: int = 8192, *, device=None, target_ms: float = 100.0) -> dict:
    """Measured GEMM TFLOP/s on this CUDA GPU: the bf16 and FP8 roofs of the attention sweep.

    Args:
        n: the square problem's size (2 n^3 FLOPs per product); an int >= 16, multiple of 16 (FP8 GEMMs need it).
        device: a CUDA device (default: the current one).

    Returns:
        {"n": n, "device": the GPU's name, "tflops": {variant: TFLOP/s or None}, "status": {variant: "ok" or the
        error}}, variants :data:`BF16` and :data:`FP8_VARIANTS`.

    Raises:
        RuntimeError: not on a CUDA GPU. ValueError: a bad ``n``.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 16 or n % 16:
        raise ValueError(f"gemm_ceiling: n must be an int >= 16 and a multiple of 16, got {n!r}")
    device = measure.as_device(device)
    if device.type != "cuda":
        raise RuntimeError(f"gemm_ceiling measures a CUDA GPU's tensor cores; the device here is {device.type!r}: "
                           "run it on a GPU (sm89+ for FP8)")
    calls, status = {}, {}
    for name, call in _gemm_calls(n, device).items():
        try:
            call()
            calls[name], status[name] = call, "ok"
        except (RuntimeError, TypeError, ValueError) as err:    # e.g. row-wise scales need sm90
            status[name] = failure_status(err)
    timings, failed = measure.time_interleaved(calls, device=device, target_ms=target_ms,
                                               min_reps=max(5, measure.balanced_turns(len(calls))),
                                               errors=(RuntimeError,))
    status.update({name: failure_status(err) for name, err in failed.items()})
    result = {name: tflops(2.0 * n ** 3, timings[name].median_ms) if name in timings else None
              for name in (BF16, *FP8_VARIANTS)}
    return {"n": n, "device": torch.cuda.get_device_name(device), "tflops": result, "status": status}


def fp8_ceiling(ceilings: dict | None) -> float:
    """The fastest FP8 GEMM of a :func:`gemm_ceiling` result, TFLOP/s; NaN for None or when none ran."""
    values = [(ceilings or {}).get("tflops", {}).get(name) for name in FP8_VARIANTS]
    values = [v for v in values if v is not None]
    return max(values) if values else float("nan")


def bf16_ceiling(ceilings: dict | None) -> float:
    """The bf16 matmul's TFLOP/s of a :func:`gemm_ceiling` result; NaN for None or when it did not run."""
    value = (ceilings or {}).get("tflops", {}).get(BF16)
    return float("nan") if value is None else value
