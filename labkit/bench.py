"""Timing and memory measurement that is right on a GPU and honest on a CPU.

- :func:`time_fn`: CUDA events after warm-up (optional L2 flush) on a GPU, perf_counter on a
  CPU; median and 20/80% quantiles. :func:`time_interleaved` times several calls taking turns.
- :func:`peak_memory`: extra GPU memory a call allocates (peak minus what was there before).
- :func:`attention_sweep`: the attention benchmark as a tidy DataFrame, one row per
  configuration and backend, out-of-memory rows recorded instead of fatal.
- :func:`matmul_peak_tflops`, :func:`copy_bandwidth`: this device's measured peaks.

Used in: 01_setup_and_comparison, 04_performance_analysis.
"""
from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import pandas as pd
import torch

from . import attention as attn
from .env import device_info


@dataclass(frozen=True)
class Timing:
    """Wall time of one call, in milliseconds."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], *, device=None, warmup: int = 2, target_ms: float = 100.0,
            min_reps: int = 5, max_reps: int = 100, flush_l2: bool = False) -> Timing:
    """Time ``fn()`` the right way for the device (:func:`time_interleaved` with one call)."""
    timings, _ = time_interleaved({"fn": fn}, device=device, warmup=warmup, target_ms=target_ms,
                                  min_reps=min_reps, max_reps=max_reps, flush_l2=flush_l2)
    return timings["fn"]


def time_interleaved(fns: dict[str, Callable[[], object]], *, device=None, warmup: int = 2,
                     target_ms: float = 100.0, min_reps: int = 5, max_reps: int = 100, flush_l2: bool = False,
                     errors: tuple[type[BaseException], ...] = ()) -> tuple[dict[str, Timing], dict[str, BaseException]]:
    """Time several calls against each other, taking turns, so that they share the GPU's conditions.

    GPU: a start and an end CUDA event around each call, the calls queued back to back and one
    synchronize per phase (as ``triton.testing.do_bench`` does). The functions take turns (A B C,
    B C A, C A B, ...; one that needs fewer reps is spread evenly over the turns), so a clock that
    drifts with boost, power or temperature while they are measured shifts all of them alike;
    timed one after another, one kernel measured twice differed by 9% on an H100 (0.82 vs 0.89 ms).
    In the timed phase a turn is a block of consecutive calls of one function, about
    ``BLOCK_MS`` long and at least ``MIN_BLOCK`` calls, whose first call is an untimed lead-in:
    after a function whose launches are slower than its kernels the GPU has run dry, and the
    next call would count its own launch as kernel time.
    Phases: ``warmup`` calls each (the last one, synchronized, tells which calls are fast enough
    for blocks); ``min_reps`` timed calls each (the estimate; a call so slow that they fill
    ``target_ms`` is timed by them alone); a warm-up of about ``target_ms / 4``
    (GPU clocks run high after a pause); then reps that fill about ``target_ms`` per function.
    ``flush_l2`` overwrites a 256 MiB buffer before each call so no input is served from L2.
    CPU: ``time.perf_counter`` around each call, in the same turns.

    Returns ({name: Timing}, {name: exception}): a call that raises one of ``errors`` is dropped
    and its exception returned; any other exception propagates.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device) if flush_l2 and device.type == "cuda" else None
    failures: dict[str, BaseException] = {}

    def timed(reps: dict[str, int], block: dict[str, int] | None = None) -> dict[str, list[float]]:
        return _turns_ms(fns, reps, block=block, device=device, flush=flush, errors=errors, failures=failures)

    probe = {}  # the last warm-up call, synchronized: which calls are fast enough for blocks
    for name in fns:
        try:
            for _ in range(warmup):
                read = _timed_call(fns[name], device, None)
            _sync(device)
            probe[name] = read() if warmup else math.inf
        except errors as err:
            failures[name] = err
    fast = {name: MIN_BLOCK for name, ms in probe.items() if ms * min_reps < target_ms}
    first = {name: _timing(ms) for name, ms in timed({name: min_reps for name in fns}, fast).items()}
    timings = {name: t for name, t in first.items() if t.median_ms * min_reps >= target_ms}  # slow: done
    estimate = {name: max(t.median_ms, 1e-3) for name, t in first.items() if name not in timings}
    if warmup:
        timed({name: int(min(max_reps, 0.25 * target_ms / est)) for name, est in estimate.items()})
    reps = {name: int(min(max_reps, max(min_reps, target_ms / est))) for name, est in estimate.items()}
    block = {name: max(MIN_BLOCK, math.ceil(BLOCK_MS / est)) for name, est in estimate.items()}
    timings.update((name, _timing(ms)) for name, ms in timed(reps, block).items())
    return timings, failures


BLOCK_MS = 2.0  # a turn of time_interleaved: short next to the tens of ms over which GPU clocks drift
MIN_BLOCK = 3   # a lead-in and at least two timed calls


def _turns_ms(fns: dict[str, Callable[[], object]], reps: dict[str, int], *, block: dict[str, int] | None,
              device: torch.device, flush: torch.Tensor | None, errors: tuple[type[BaseException], ...],
              failures: dict[str, BaseException]) -> dict[str, list[float]]:
    """Milliseconds of ``reps[name]`` calls of each function, taking turns.

    A turn of ``name`` is ``block[name]`` consecutive calls (1 when ``block`` is None or there is
    only one name: nothing else runs between its calls); in a block of more than one the first
    call is a lead-in, run but not timed. Turn i starts at
    name i (mod the count), so every name is as often first as last; a name that needs b of
    the T = max blocks runs in the turns where i * b // T steps up (evenly spread). A name that
    raises one of ``errors`` is added to ``failures`` and dropped.
    """
    names = [name for name in reps if name not in failures]
    size = {name: (block or {}).get(name, 1) if len(names) > 1 else 1 for name in names}
    per_block = {name: max(1, size[name] - 1) for name in names}  # timed calls in one block
    blocks = {name: math.ceil(reps[name] / per_block[name]) for name in names}
    turns = max(blocks.values(), default=0)
    pending: dict[str, list[Callable[[], float]]] = {name: [] for name in names}
    for i in range(turns):
        for j in range(len(names)):
            name = names[(i + j) % len(names)]
            if name in failures or (i + 1) * blocks[name] // turns == i * blocks[name] // turns:
                continue
            try:
                if size[name] > 1:
                    fns[name]()  # lead-in: may wait for the GPU queue to refill
                for _ in range(min(per_block[name], reps[name] - len(pending[name]))):
                    pending[name].append(_timed_call(fns[name], device, flush))
            except errors as err:
                failures[name] = err
    _sync(device)
    return {name: [read() for read in reads] for name, reads in pending.items() if name not in failures}


def _timed_call(fn: Callable[[], object], device: torch.device, flush: torch.Tensor | None) -> Callable[[], float]:
    """Call ``fn`` once; returns a reader of its milliseconds (valid after a synchronize on a GPU)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1e3
        return lambda: ms
    if flush is not None:
        flush.zero_()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    return lambda: start.elapsed_time(end)


def _timing(ms: list[float]) -> Timing:
    """Median and 20/80% quantiles of the times of one call."""
    times = sorted(ms)
    pick = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return Timing(pick(0.5), pick(0.2), pick(0.8), len(times))


def call_ms(fn: Callable[[], object], *, device=None) -> float:
    """Milliseconds of one call of ``fn`` (CUDA events and a synchronize on a GPU).

    For work that runs once, such as one training step; use :func:`time_fn` to time repeats.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    read = _timed_call(fn, device, None)
    _sync(device)
    return read()


def peak_memory(fn: Callable[[], object], *, device=None) -> float:
    """Extra GPU bytes allocated at the peak of ``fn()``, above what was allocated before.

    The peak counter is reset *before* the call (seed 002 read it before resetting and
    reported memory from an earlier cell). Returns NaN on a CPU, where PyTorch keeps no
    allocator statistics.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        fn()
        return float("nan")
    _sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device)
    del result
    return float(peak - before)


def free_memory() -> None:
    """Release cached blocks between benchmark rows."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def is_oom(err: BaseException) -> bool:
    """True for a GPU or CPU out-of-memory error."""
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def tflops(flop: float, ms: float) -> float:
    """TFLOP/s of ``flop`` operations done in ``ms`` milliseconds."""
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
    its native layout (:func:`labkit.attention.native_layout`); "auto" that of the backend it picks.
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


def _failure(err: BaseException) -> str:
    """The status column for a row that raised ``err``."""
    if isinstance(err, (attn.AttentionInputError, ImportError)):  # ImportError: flash package missing
        return f"unsupported: {err}"
    if isinstance(err, NotImplementedError):
        return "not implemented"
    return "oom" if is_oom(err) else f"error: {str(err).splitlines()[0][:120]}"


_ROW_ERRORS = (attn.AttentionInputError, ImportError, NotImplementedError, RuntimeError, MemoryError)


MIN_REPS = 5


def _measure_group(rows: dict[str, dict], cfg: dict, *, causal: bool, mode: str, dtype, device,
                   target_ms: float, custom: dict[str, Callable]) -> None:
    """Fill ``rows`` (one per backend, same configuration): error and extra memory per backend,
    then their times, taken in turns of short blocks (:func:`time_interleaved`) so that a GPU clock
    drifting during the group favours no backend."""
    calls = {}
    with torch.set_grad_enabled(mode == "fwd_bwd"):
        for name, row in rows.items():
            try:
                call, q, k, v, layout = _attention_call(name, cfg, causal=causal, mode=mode, dtype=dtype,
                                                        device=device, fn=custom.get(name))
                row["max_err"] = _sampled_error(call(), q, k, v, causal=causal, layout=layout)
                row["extra_mib"] = peak_memory(call, device=device) / 2**20
                calls[name], row["status"] = call, "ok"
            except _ROW_ERRORS as err:
                row["status"] = _failure(err)
        timings, failures = time_interleaved(calls, device=device, target_ms=target_ms, min_reps=MIN_REPS,
                                             errors=_ROW_ERRORS)
    for name, err in failures.items():
        rows[name]["status"] = _failure(err)
    flop = attn.flops(cfg["B"], cfg["H"], cfg["N"], cfg["D"], causal=causal, mode=mode)
    for name, t in timings.items():
        rows[name].update(ms=t.median_ms, ms_p20=t.p20_ms, ms_p80=t.p80_ms, tflops=tflops(flop, t.median_ms))


def _sampled_error(o, q, k, v, *, causal: bool, layout: str, heads: int = 2) -> float:
    """Max error vs an fp32 reference on batch 0 and the first ``heads`` heads (keeps the
    reference's N x N scores small at long N)."""
    sl = (slice(0, 1), slice(0, heads)) if layout == "bhnd" else (slice(0, 1), slice(None), slice(0, heads))
    return attn.max_error_vs_fp32(o[sl], q[sl], k[sl], v[sl], causal=causal, layout=layout)


SWEEP_COLUMNS = ["backend", "B", "H", "N", "D", "causal", "mode", "status", "ms", "ms_p20", "ms_p80",
                 "tflops", "extra_mib", "max_err", "device", "dtype"]


def attention_sweep(configs: list[dict], *, backends: Iterable[str] | None = None,
                    causal: Iterable[bool] = (False, True), modes: Iterable[str] = attn.MODES,
                    dtype=torch.bfloat16, device=None, target_ms: float = 100.0,
                    custom: dict[str, Callable] | None = None, custom_max_n: int | None = None,
                    progress: bool = True, partial_csv: str | Path | None = None) -> pd.DataFrame:
    """Benchmark backends over configurations; one row per (config, causal, mode, backend).

    Args:
        configs: dicts with B, H, N, D (see :func:`fixed_token_configs`).
        backends: names from ``labkit.attention.BACKENDS`` or "auto"; default: every one that
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
        error), ms, ms_p20, ms_p80, tflops, extra_mib, max_err, device, dtype.
    """
    from tqdm.auto import tqdm

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
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


def matmul_peak_tflops(*, device=None, dtype=torch.bfloat16, n: int = 8192) -> float:
    """Measured dense-matmul TFLOP/s of an n x n x n product (the compute roof)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    timing = time_fn(lambda: a @ b, device=device)
    return tflops(2.0 * n**3, timing.median_ms)


def copy_bandwidth(*, device=None, mib: int = 1024) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (read + write counted)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
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
