"""Measurement primitives: timing that is right on a GPU and honest on a CPU, and peak memory.

The bottom floor of labkit: it imports no other labkit module, so the kernels' entry point
(:mod:`labkit.engine.attention`, whose ``"auto"`` times its candidates) and the benchmarks
(:mod:`labkit.engine.bench`) can both build on it.

- :func:`time_fn`: CUDA events after warm-up (optional L2 flush) on a GPU, perf_counter on a
  CPU; median and 20/80% quantiles. :func:`time_interleaved` times several calls taking turns.
- :func:`l2_flusher`: the call that evicts L2 between timed calls, by writing (as do_bench) or reading.
- :func:`call_ms`: one call of work that runs once (a training step).
- :func:`peak_memory`: extra GPU memory a call allocates (peak minus what was there before).

Used in: 01_setup_and_comparison, 03_long_sequence_training, 04_performance_analysis (as ``lk.bench.*``).
"""
from __future__ import annotations

import functools
import gc
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch


def as_device(device=None) -> torch.device:
    """``device`` as a torch.device; by default CUDA when available, else CPU."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


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


@contextmanager
def gc_paused():
    """Python's cyclic garbage collector off inside the block, as ``timeit`` does: a collection
    would otherwise be charged to whichever timed call allocates when it is due. No collection
    first (with transformers loaded one takes about 0.2 s on a CPU). On an H100 it did not steady
    FlashAttention-4's host-bound forward+backward at N = 1024, whose spread follows the host's
    speed; it removes one cause that is not the kernel's. Also a decorator: ``@gc_paused()``."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def time_fn(fn: Callable[[], object], *, device=None, warmup: int = 2, target_ms: float = 100.0,
            min_reps: int = 5, max_reps: int = 100, flush_l2: bool = False) -> Timing:
    """Time ``fn()`` the right way for the device (:func:`time_interleaved` with one call)."""
    timings, _ = time_interleaved({"fn": fn}, device=device, warmup=warmup, target_ms=target_ms,
                                  min_reps=min_reps, max_reps=max_reps, flush_l2=flush_l2)
    return timings["fn"]


@gc_paused()
def time_interleaved(fns: dict[str, Callable[[], object]], *, device=None, warmup: int = 2,
                     target_ms: float = 100.0, min_reps: int = 5, max_reps: int = 100, flush_l2: bool = False,
                     flush_by: str = "write", errors: tuple[type[BaseException], ...] = (), host_time: bool = True,
                     ) -> tuple[dict[str, Timing], dict[str, BaseException]]:
    """Time several calls against each other, taking turns, so that they share the GPU's conditions.

    GPU: a start and an end CUDA event around each call, the calls of a turn queued back to back,
    read after one synchronize per phase (as ``triton.testing.do_bench`` does). The functions take turns (A B C,
    B C A, C A B, C B A, ...: :func:`turn_order`, each as often after each other one; one that needs fewer
    reps is spread evenly over the turns), so a clock that drifts with boost, power or temperature while
    they are measured, or that a heavy call leaves low for the next one, shifts all of them alike;
    timed one after another, one kernel measured twice differed by 9% on an H100 (0.82 vs 0.89 ms).
    In the timed phase a turn is a block of consecutive calls of one function, about
    ``BLOCK_MS`` long and at least ``MIN_BLOCK`` calls. Every turn starts on an idle GPU (a
    synchronize), then an untimed lead-in call: a function that launches faster than its kernels
    run queues ahead and is timed by its kernels; one whose host side is slower than its kernels
    is timed by its launches, as in a loop of that call alone (what a caller pays; each call's time
    is the longer of its event time and its host time, so a flush queued before it hides nothing).
    Without the synchronize the backlog of a slower function timed just before
    hides that launch cost: on an H100, FA4's forward+backward at B=16 H=16 N=1024 D=128, causal
    (0.71 ms of kernels, about 1 ms of Python launches) timed 0.71 ms here but 1.0 ms in a loop
    of its own, and ``auto`` picked it over cuDNN's 0.75 ms.
    Phases: ``warmup`` calls each (the last one, synchronized, tells which calls are fast enough
    for blocks); ``min_reps`` timed calls each (the estimate; a call so slow that they fill
    ``target_ms`` is timed by them alone); a warm-up of about ``target_ms / 4``
    (GPU clocks run high after a pause); then reps that fill about ``target_ms`` per function.
    ``flush_l2`` overwrites a 256 MiB buffer before each call so no input is served from L2, as
    do_bench does. That leaves L2 full of dirty lines (50 MB on an H100), which the timed call must
    first write back to memory: nothing next to a compute-bound call, but a memory-bound call of tens
    of microseconds pays it in full. ``flush_by="read"`` reads the buffer instead (L2 is left holding
    clean lines, dropped for free): a plain read of 33.6 MB on an H100 took 18.9 us after a read and
    23.6 us after a write (H100, one CUDA graph replay each).
    ``host_time=False`` takes the event time alone, as ``triton.testing.do_bench`` does (the host's
    launch is then hidden up to the flush's length): for work whose launches a caller hides behind
    a queue of GPU work, as a training step's are.
    CPU: ``time.perf_counter`` around each call, in the same turns. The garbage collector is
    paused throughout (:func:`gc_paused`).

    Returns ({name: Timing}, {name: exception}): a call that raises one of ``errors`` is dropped
    and its exception returned; any other exception propagates.
    """
    device = as_device(device)
    flush = l2_flusher(device, flush_by) if flush_l2 else None
    failures: dict[str, BaseException] = {}

    def timed(reps: dict[str, int], block: dict[str, int] | None = None) -> dict[str, list[float]]:
        return _turns_ms(fns, reps, block=block, device=device, flush=flush, errors=errors, failures=failures,
                         host_time=host_time)

    probe = {}  # the last warm-up call, synchronized: which calls are fast enough for blocks
    for name in fns:
        try:
            for _ in range(warmup):
                read = _timed_call(fns[name], device, None, host_time)
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


def l2_flusher(device, by: str = "write") -> Callable[[], object] | None:
    """A call that evicts L2 by touching a 256 MiB buffer: ``by="write"`` overwrites it (as
    ``triton.testing.do_bench``; L2 is left dirty), ``by="read"`` sums it (L2 is left clean).
    None off a GPU, where there is nothing to flush."""
    if by not in ("write", "read"):
        raise ValueError(f"flush_by must be 'write' or 'read', not {by!r}")
    device = as_device(device)
    if device.type != "cuda":
        return None
    buffer = torch.empty(256 * 2**20, dtype=torch.int8, device=device)
    return buffer.zero_ if by == "write" else functools.partial(torch.sum, buffer, dtype=torch.int32)


BLOCK_MS = 2.0  # a turn of time_interleaved: short next to the tens of ms over which GPU clocks drift
MIN_BLOCK = 3   # a lead-in and at least two timed calls


def turn_order(n: int, turn: int) -> list[int]:
    """The order of n names in turn ``turn`` of :func:`time_interleaved`: a row of a Williams design.

    Rows shift one sequence 0, 1, n-1, 2, n-2, ... by the turn; for odd n the next n rows are the first n
    reversed. Over n turns (2n for odd n) every name is first once (twice) and follows every other name
    equally often. A plain rotation (0 1 2, 1 2 0, ...) keeps each name's predecessor fixed: on an H200,
    a 40-45 ms kernel always timed right after FA4 (the hottest call) read 14% slower than the same kernel
    with one more term always timed after it (45.8 vs 40.3 ms; balanced, 42.9 vs 43.1).
    """
    base = [0] + [(k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n)]
    row = [(x + turn) % n for x in base]
    return row[::-1] if n % 2 and (turn // n) % 2 else row


def balanced_turns(n: int) -> int:
    """Turns after which :func:`turn_order` has put each of n names right after every other one equally
    often: n, or 2n for odd n."""
    return n if n % 2 == 0 else 2 * n


def _turns_ms(fns: dict[str, Callable[[], object]], reps: dict[str, int], *, block: dict[str, int] | None,
              device: torch.device, flush: Callable[[], object] | None, errors: tuple[type[BaseException], ...],
              failures: dict[str, BaseException], host_time: bool = True) -> dict[str, list[float]]:
    """Milliseconds of ``reps[name]`` calls of each function, taking turns.

    A turn of ``name`` is ``block[name]`` consecutive calls (1 when ``block`` is None or there is
    only one name: nothing else runs between its calls); in a block of more than one the first
    call is a lead-in, run but not timed; each turn starts after a synchronize. The names run in
    the order of :func:`turn_order` (turn i), so every name is as often first as last and follows
    each other name as often; a name that needs b of the T = max blocks runs in the turns where
    i * b // T steps up (evenly spread). A name that raises one of ``errors`` is added to
    ``failures`` and dropped.
    """
    names = [name for name in reps if name not in failures]
    size = {name: (block or {}).get(name, 1) if len(names) > 1 else 1 for name in names}
    per_block = {name: max(1, size[name] - 1) for name in names}  # timed calls in one block
    blocks = {name: math.ceil(reps[name] / per_block[name]) for name in names}
    turns = max(blocks.values(), default=0)
    pending: dict[str, list[Callable[[], float]]] = {name: [] for name in names}
    for i in range(turns):
        for j in turn_order(len(names), i):
            name = names[j]
            if name in failures or (i + 1) * blocks[name] // turns == i * blocks[name] // turns:
                continue
            _sync(device)  # an idle GPU: no backlog of the previous function hides this one's launches
            try:
                if size[name] > 1:
                    fns[name]()  # lead-in: may wait for the GPU queue to refill
                for _ in range(min(per_block[name], reps[name] - len(pending[name]))):
                    pending[name].append(_timed_call(fns[name], device, flush, host_time))
            except errors as err:
                failures[name] = err
    _sync(device)
    return {name: [read() for read in reads] for name, reads in pending.items() if name not in failures}


def _timed_call(fn: Callable[[], object], device: torch.device, flush: Callable[[], object] | None,
                host_time: bool = True) -> Callable[[], float]:
    """Call ``fn`` once; returns a reader of its milliseconds (valid after a synchronize on a GPU).

    On a GPU a call takes the longer of its CUDA-event time and its host time (``fn``'s Python and
    launches), or with ``host_time=False`` its event time: the flush queued just before it keeps the
    GPU busy while the host launches, so the events alone let a launch up to the flush's length go
    free, though a caller whose GPU is waiting pays it. On an H200, FA4's forward at GPT-2 small's
    inference shape (B=4, H=12, N=512-1024, D=64) won auto's timing by its events alone and made the
    model 1.2-1.3x slower than with SDPA.
    """
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1e3
        return lambda: ms
    if flush is not None:
        flush()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    fn()
    host_ms = (time.perf_counter() - t0) * 1e3
    end.record()
    return lambda: max(start.elapsed_time(end), host_ms) if host_time else start.elapsed_time(end)


def _timing(ms: list[float]) -> Timing:
    """Median and 20/80% quantiles of the times of one call."""
    times = sorted(ms)
    pick = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return Timing(pick(0.5), pick(0.2), pick(0.8), len(times))


def call_ms(fn: Callable[[], object], *, device=None) -> float:
    """Milliseconds of one call of ``fn`` (CUDA events and a synchronize on a GPU).

    For work that runs once, such as one training step; use :func:`time_fn` to time repeats.
    """
    device = as_device(device)
    read = _timed_call(fn, device, None)
    _sync(device)
    return read()


def allocated_bytes(device=None) -> float:
    """Bytes of live tensors on ``device`` now (the caching allocator's count); NaN on a CPU.

    A training step's peak is this after the model and its optimizer state exist, minus the same
    before they were built, plus :func:`peak_memory` of the step: what the rest of the process
    still holds (tensors of earlier notebook cells, say) is not the step's.
    """
    device = as_device(device)
    return float(torch.cuda.memory_allocated(device)) if device.type == "cuda" else float("nan")


def peak_memory(fn: Callable[[], object], *, device=None) -> float:
    """Extra GPU bytes allocated at the peak of ``fn()``, above what was allocated before.

    The peak counter is reset *before* the call (read before the reset, it reports memory from an
    earlier cell). Returns NaN on a CPU, where PyTorch keeps no
    allocator statistics.
    """
    device = as_device(device)
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
