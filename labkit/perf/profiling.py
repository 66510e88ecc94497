"""Profiling: where the time goes, kernel by kernel.

- Profiler: :func:`profile_fn` (torch.profiler across versions: ``self_device_time_total`` in
  torch >= 2.4, ``self_cuda_time_total`` before), :func:`kernel_table` (kernels or, on a CPU,
  operators as a DataFrame), :func:`export_trace` / :func:`trace_counts` (Chrome/Perfetto JSON),
  :func:`memory_snapshot` / :func:`snapshot_allocations` (CUDA caching-allocator history).

The performance models live in :mod:`labkit.perf.roofline` (IO / roofline), :mod:`labkit.perf.predictor`
(time predictor) and :mod:`labkit.perf.memory` (training memory).

Used in: 04_performance_analysis.
"""
from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path
from typing import Callable

import pandas as pd
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

_DEVICE_TIME = ("self_device_time_total", "self_cuda_time_total", "device_time_total", "cuda_time_total")
_CATEGORIES = (  # first match wins; GPU kernel names and CPU operator names
    ("fused attention", r"flash|fmha|attention|attn|cudnn"),
    ("matmul", r"gemm|matmul|xmma|cutlass|nvjet|::bmm|::mm|::addmm|::baddbmm"),
    ("memory", r"copy|memcpy|memset|fill|::cat|contiguous|clone"),
    ("softmax & elementwise", r"softmax|logsumexp|elementwise|reduce|::exp|::sub|::mul|::div|::add|::amax|::max|::sum|"
                              r"::where|masked"))


# ----------------------------------------------------------------------------- profiler

def _device_us(evt) -> float:
    """Device time of a profiler event in microseconds, whatever this torch version calls it."""
    for name in _DEVICE_TIME:
        value = float(getattr(evt, name, 0.0) or 0.0)
        if value > 0:
            return value
    return 0.0


def _is_kernel(evt) -> bool:
    """A device-side event (kernel, memcpy, memset) rather than a CPU operator."""
    return getattr(evt, "device_type", DeviceType.CPU) != DeviceType.CPU and _device_us(evt) > 0


def sort_key(prof) -> str:
    """The ``key_averages().table(sort_by=...)`` key that exists here and has data."""
    events = prof.key_averages()
    if any(_is_kernel(e) for e in events):
        return next(a for a in _DEVICE_TIME if hasattr(events[0], a))
    return "self_cpu_time_total"


def profile_fn(fn: Callable[[], object], *, reps: int = 5, warmup: int = 2, device=None,
               label: str = "step", record_shapes: bool = False, profile_memory: bool = False):
    """Run ``fn()`` ``reps`` times under torch.profiler after ``warmup`` calls.

    CPU activity is always recorded; CUDA kernels too when ``device`` is a GPU. Each call sits in
    a ``record_function(label)`` range and the GPU is synchronized before the profiler stops.

    Returns:
        The finished ``torch.profiler.profile`` object (``prof.reps`` holds ``reps``).
    """
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}.")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no per-session "USDT: profiler_start" lines in notebooks
    for _ in range(warmup):
        fn()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, record_shapes=record_shapes, profile_memory=profile_memory) as prof:
        for _ in range(reps):
            with record_function(label):
                fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the kernels finish inside the profiled window
    prof.reps, prof.label = reps, label
    return prof


def category(name: str) -> str:
    """Coarse kind of a kernel or operator name: fused attention, matmul, memory, softmax &
    elementwise, other."""
    low = name.lower()
    return next((cat for cat, pattern in _CATEGORIES if re.search(pattern, low)), "other")


def kernel_table(prof, *, top: int | None = 12) -> pd.DataFrame:
    """Where the time went, one row per kernel (GPU) or operator (CPU), per profiled call.

    On a GPU the rows are device events (kernels, copies) with their device time, so the CPU
    operators that launched them are not counted twice; on a CPU they are the operators.

    Returns:
        DataFrame sorted by time with columns name, category, calls (per call of fn), self_ms
        (per call of fn), share (of the total self time); ``df.attrs`` holds ``source``
        ("device" or "cpu"), ``launches`` (kernels or operators per call) and ``total_ms``.
    """
    reps = getattr(prof, "reps", 1)
    events = [e for e in prof.key_averages()
              if not getattr(e, "is_user_annotation", False) and e.key != getattr(prof, "label", None)
              and not e.key.startswith("ProfilerStep")]
    on_device = any(_is_kernel(e) for e in events)
    rows = [dict(name=e.key, category=category(e.key), calls=e.count / reps,
                 self_ms=(_device_us(e) if on_device else e.self_cpu_time_total) / 1e3 / reps)
            for e in events if _is_kernel(e) or not on_device]
    df = pd.DataFrame(rows, columns=["name", "category", "calls", "self_ms"])
    df = df[df["self_ms"] > 0].sort_values("self_ms", ascending=False).reset_index(drop=True)
    total = float(df["self_ms"].sum())
    df["share"] = df["self_ms"] / total if total > 0 else 0.0
    attrs = dict(source="device" if on_device else "cpu", launches=float(df["calls"].sum()), total_ms=total)
    df = df.head(top) if top else df
    df.attrs.update(attrs)
    return df


def export_trace(prof, path: str | Path) -> Path:
    """Write the profile as Chrome-trace JSON (open it in https://ui.perfetto.dev).

    A relative ``path`` is taken from the working directory, which in Jupyter is the notebook's
    folder: ``"traces/x.json"`` lands beside the notebook, where a remote JupyterLab's file browser
    can download it (a file under /tmp it cannot reach). Returns the absolute path, to print.
    """
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return path


def trace_counts(path: str | Path) -> pd.DataFrame:
    """Events per category ("cpu_op", "kernel", "cuda_runtime", ...) in a Chrome-trace file."""
    events = json.loads(Path(path).read_text())
    events = events.get("traceEvents", []) if isinstance(events, dict) else events
    cats = pd.Series([e.get("cat", "?") for e in events if e.get("ph") == "X"], dtype=object)
    return cats.value_counts().rename_axis("category").reset_index(name="events")


SNAPSHOT_NEEDS_CUDA = ("memory snapshots record the CUDA caching allocator and need a GPU; on a CPU "
                       "PyTorch keeps no allocation history (see https://pytorch.org/docs/stable/torch_cuda_memory.html).")


def memory_snapshot(fn: Callable[[], object], path: str | Path, *, max_entries: int = 100_000) -> Path:
    """Record every CUDA allocation made by ``fn()`` and dump the snapshot (a pickle) to ``path``.

    Open the file at https://pytorch.org/memory_viz or read it with :func:`snapshot_allocations`.
    Raises RuntimeError on a machine without CUDA.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(SNAPSHOT_NEEDS_CUDA)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = torch.cuda.memory._record_memory_history
    try:
        record(enabled="all", stacks="python", max_entries=max_entries)
    except TypeError:  # torch < 2.1 took a bool
        record(True)
    try:
        fn()
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        record(enabled=None)
    return path


def snapshot_allocations(snapshot: dict | str | Path, *, top: int = 8) -> pd.DataFrame:
    """The largest allocations in a memory snapshot, with the Python line that made each.

    Args:
        snapshot: the dict from ``torch.cuda.memory._snapshot()`` or a path to a dumped pickle.

    Returns:
        DataFrame with size_mib, frame ("file:line function", the innermost frame outside
        torch) and count (allocations of that size from that line), largest first.
    """
    if not isinstance(snapshot, dict):
        snapshot = pickle.loads(Path(snapshot).read_bytes())
    allocs = [e for trace in snapshot.get("device_traces", []) for e in trace if e.get("action") == "alloc"]
    rows = [dict(size_mib=e["size"] / 2**20, frame=_user_frame(e.get("frames", []))) for e in allocs]
    df = pd.DataFrame(rows, columns=["size_mib", "frame"])
    df = df.groupby(["size_mib", "frame"]).size().rename("count").reset_index()
    return df.sort_values("size_mib", ascending=False).head(top).reset_index(drop=True)


def _user_frame(frames: list[dict]) -> str:
    for f in frames:
        name = str(f.get("filename", ""))
        if name and "/torch/" not in name and not name.startswith("??"):
            return f"{Path(name).name}:{f.get('line', '?')} {f.get('name', '')}"
    return "(no Python frame)"
