"""CUDA-graph timing: calls captured in graphs and replayed, as a serving engine runs a decode step.

A timing primitive beside :mod:`labkit.core.measure` (which it uses for the turns and the L2 flush):

- :func:`graphed`: each call (or list of calls) captured in a CUDA graph of its own; a replay launches
  the captured kernels with one driver call, so what is compared is the GPU's time, not whose Python
  launch path is lighter.
- :func:`layered`: :data:`LAYERS` calls in one graph, as a model's decode step has one attention per layer,
  cycling :func:`caches_for` distinct caches so none is read from L2.
- :func:`time_per_call`: milliseconds per call of graphs of :data:`LAYERS` calls, L2 flushed by a read.

Memory: a failed call's error is kept without its traceback and context (their frames would hold the
graph, its private memory pool and the inputs alive through a reference cycle: 30 GiB survived a sweep
on an H200 until a ``gc.collect()``), and :func:`release` hands each shape's graphs back before the next.

Used in: 08_decode_attention (through ``lk.decode``), the SDPA decode sweep.
"""
from __future__ import annotations

import functools
import gc
from typing import Callable

import torch

from labkit.core import measure
from labkit.engine.kernels import RUN_ERRORS  # what a kernel that cannot take an input raises

LAYERS = 8   # attention calls per timed CUDA graph: a model's decode step runs one per layer in one graph


def _bare(err: BaseException) -> BaseException:
    """``err`` without traceback, cause or context: an error kept for a report must not keep the frames
    (and through them graphs, memory pools and input tensors) of the call that raised it."""
    err.__traceback__, err.__cause__, err.__context__ = None, None, None
    return err


def warm_up(fn: Callable[[], object]) -> None:
    """``fn`` run twice on a side stream before its capture (Triton compiles, libraries set up, the caching
    allocator warms up); its errors propagate. Twice: a library may finish its setup only on the second
    call (FA4's first call compiles and runs its kernel, the second is the first through its compiled-kernel
    cache): in the capture that setup invalidated it (``cudaErrorStreamCaptureInvalidated``, H100)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)


def _in_turn(calls: list[Callable[[], object]]):
    """Run ``calls`` one after another; returns the last one's output."""
    for call in calls:
        out = call()
    return out


def capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``fn``, warmed up (:func:`warm_up`), captured in a CUDA graph: (the graph, the output tensor each
    replay overwrites). ``fn`` must read its inputs from tensors that stay in place and must not
    synchronise with the host."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _replay(graph: torch.cuda.CUDAGraph, out):
    """Replay ``graph``; returns the output its capture wrote (overwritten in place)."""
    graph.replay()
    return out


def graphed(fns: dict[str, Callable[[], object]], device, *, errors: tuple[type[BaseException], ...] = RUN_ERRORS,
            ) -> tuple[dict[str, Callable[[], object]], dict[str, BaseException]]:
    """Each call captured in a CUDA graph of its own, to be timed as a serving engine runs a decode step.

    Args:
        fns: name -> a call without arguments that reads tensors that stay in place and never synchronises
            with the host (e.g. no ``int(seqlens.max())``); or a list of such calls, captured one after
            another in one graph (:func:`layered`: a replay runs them all, and its time is theirs together).
        device: a CUDA device; CUDA graphs exist only there.
        errors: what a call that cannot take its input raises when first run (it is reported, not raised).

    Returns:
        (name -> a call that replays the graph and returns the captured output, which every replay
        overwrites; name -> the error, without its traceback, of a call that failed when first run, or
        while it was captured, e.g. one that synchronises). A failed capture leaves CUDA's default
        random-number generator unusable in this process: a caller that goes on makes its inputs
        without it (a CPU generator), as notebook 08 does.
    """
    if torch.device(device).type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, not {device}: time the calls as they are there")
    replays, failed = {}, {}
    for name, fn in fns.items():
        calls = list(fn) if isinstance(fn, (list, tuple)) else [fn]
        try:
            for call in calls:
                warm_up(call)                        # a call that cannot run fails here, before any capture
            replays[name] = functools.partial(_replay, *capture(functools.partial(_in_turn, calls)))
        except (RuntimeError, *errors) as err:        # torch's AcceleratorError and FA4's CUDA errors among them
            failed[name] = _bare(err)
    return replays, failed


def release(device) -> None:
    """Hand graphs, their pools and inputs no longer referenced back to the GPU: a collection first (a
    reference cycle can hold them), then the caching allocator's free blocks. Call between shapes."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def caches_for(cache_bytes: int, device, *, layers: int = LAYERS) -> int:
    """How many distinct caches the ``layers`` calls of a timed graph cycle through (1 to ``layers``):
    enough that between two reads of one byte the calls read at least three times the GPU's L2, so each
    call reads its cache from memory, as each layer of a model does. 1 off a GPU.

    Example: an H100 (50 MB L2), batch 1, N = 8K, 8 KV heads, d = 128, bf16 (33.6 MB): 5 caches.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, min(layers, -(-3 * l2 // max(1, cache_bytes))))


def layered(per_cache: list[dict[str, Callable[[], object]]], layers: int = LAYERS) -> dict[str, list]:
    """name -> the ``layers`` calls of one timed graph (for :func:`graphed`), call i on cache
    ``i % len(per_cache)``: per_cache[c] holds the same names' calls on cache c. A name missing from a
    cache's calls is left out."""
    if not per_cache or layers < 1:
        raise ValueError(f"need at least one cache and one layer, got {len(per_cache)} caches, layers={layers}")
    names = [name for name in per_cache[0] if all(name in calls for calls in per_cache)]
    return {name: [per_cache[i % len(per_cache)][name] for i in range(layers)] for name in names}


def time_per_call(per_cache: list[dict[str, Callable[[], object]]], device, *, target_ms: float,
                  graph: bool | None = None, eager: dict[str, Callable[[], object]] | None = None,
                  errors: tuple[type[BaseException], ...] = RUN_ERRORS,
                  ) -> tuple[dict[str, float], dict[str, BaseException]]:
    """Median milliseconds per call of each name of ``per_cache`` (the same calls on each of several caches,
    :func:`caches_for` of them), timed in turns (:func:`labkit.core.measure.time_interleaved`).

    With ``graph`` (default: on a GPU): each name's :data:`LAYERS` calls cycling the caches captured in one CUDA
    graph (:func:`layered`, :func:`graphed`), L2 flushed by a read before each replay, a replay's time over
    ``LAYERS``. Without: the calls on the first cache launched from Python, one at a time. ``eager``: more calls
    timed in the same turns as they are, each doing what one replay does (``LAYERS`` calls; divided alike).

    Returns (name -> ms per call; name -> the error, without traceback, of a call that could not run or be
    captured). The graphs are dropped when it returns; :func:`release` gives their memory back.
    """
    device = torch.device(device)
    graph = device.type == "cuda" if graph is None else graph
    layers = LAYERS if graph else 1
    calls, failed = graphed(layered(per_cache, layers), device, errors=errors) if graph else (dict(per_cache[0]), {})
    calls.update(eager or {})
    timings, more = measure.time_interleaved(calls, device=device, target_ms=target_ms, flush_l2=True,
                                             flush_by="read", errors=errors)
    failed.update((name, _bare(err)) for name, err in more.items())
    return {name: t.median_ms / layers for name, t in timings.items()}, failed
