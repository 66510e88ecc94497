"""Measuring a Triton attention kernel against the library kernels: ratios, roofline, autotuning.

- :func:`notebook_functions`: the functions a notebook's code cells define (e.g. notebook 01's
  PyTorch FlashAttention2), to measure them beside a new kernel.
- :func:`ratio_table`: one implementation's TFLOP/s over every other's, per configuration, from a
  sweep of :func:`labkit.engine.bench.attention_sweep` (the implementations timed in turns, in one run).
- :func:`roofline_frame`: a sweep's forward rows placed at their compulsory-bytes intensity under
  measured roofs, ready for :func:`labkit.perf.roofline.roofline_plot`.
- :func:`config_table`: every config of an ``@triton.autotune`` kernel timed on one problem.

Used in: 06_triton_flashattention.
"""
from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from labkit.core.measure import time_interleaved
from labkit.perf.roofline import fused_points

KEYS = ["D", "causal", "mode", "N"]


def notebook_functions(path: str | Path, names: list[str], namespace: dict | None = None) -> dict:
    """Run the code cells of notebook ``path`` that define one of ``names`` (top-level ``def`` or
    ``class``), in order, in ``namespace`` (default: a fresh one); return ``{name: object}``.

    Cells that do not parse (IPython magics) are skipped. Raises KeyError naming what no cell defines.
    """
    namespace = {"__name__": "__main__"} if namespace is None else namespace
    cells = json.loads(Path(path).read_text(encoding="utf-8"))["cells"]
    for cell in cells:
        source = "".join(cell["source"]) if cell["cell_type"] == "code" else ""
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        if defined & set(names):
            exec(compile(tree, f"{path}:{cells.index(cell)}", "exec"), namespace)  # noqa: S102 - a notebook cell
    missing = [n for n in names if n not in namespace]
    if missing:
        raise KeyError(f"no code cell of {path} defines {missing}")
    return {n: namespace[n] for n in names}


def ratio_table(sweep: pd.DataFrame, numerator: str) -> pd.DataFrame:
    """TFLOP/s of ``numerator`` over each other backend of ``sweep``, per (D, causal, mode, N).

    Args:
        sweep: rows of :func:`labkit.engine.bench.attention_sweep` (backend, D, causal, mode, N, status, tflops).

    Returns:
        DataFrame indexed by D, causal, mode, N with one column "vs <backend>" per other backend
        (> 1: ``numerator`` is faster); NaN where either did not run.
    """
    ok = sweep[sweep["status"] == "ok"]
    table = ok.pivot_table(index=KEYS, columns="backend", values="tflops")
    if numerator not in table:
        raise KeyError(f"{numerator!r} has no successful row in the sweep")
    others = [b for b in table.columns if b != numerator]
    return pd.DataFrame({f"vs {b}": table[numerator] / table[b] for b in others}, index=table.index)


def roofline_frame(sweep: pd.DataFrame, *, roof: Callable[[np.ndarray], np.ndarray],
                   elem_bytes: int = 2) -> pd.DataFrame:
    """The "ok" forward rows of ``sweep`` on the roofline (:func:`labkit.perf.roofline.fused_points`).

    Args:
        roof: intensity (FLOP/byte) -> attainable TFLOP/s, from this machine's measured peaks.
    """
    return fused_points(sweep[(sweep["status"] == "ok") & (sweep["mode"] == "fwd")], roof=roof, elem_bytes=elem_bytes)


def config_table(kernel, grid: Callable[[dict], tuple], args: tuple, kwargs: dict, *, flop: float,
                 device=None, target_ms: float = 50.0) -> pd.DataFrame:
    """Time each config of an autotuned kernel on one problem, the configs taking turns.

    Args:
        kernel: an ``@triton.autotune`` kernel (its ``configs`` and the ``fn`` it wraps).
        grid: meta-parameters (a config's kwargs) -> launch grid.
        args, kwargs: the launch's arguments, without the tuned meta-parameters.
        flop: the work of one launch, for the TFLOP/s column.

    Returns:
        One row per config: its kwargs, num_warps, num_stages, status ("ok" or the error), ms, tflops.
    """
    from tqdm.auto import tqdm

    calls, rows = {}, {}
    for i, cfg in enumerate(tqdm(kernel.configs, desc="compile each config")):
        name = f"config {i}"
        rows[name] = dict(**cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages, status="ok")
        calls[name] = (lambda c: lambda: kernel.fn[grid(c.kwargs)](*args, **kwargs, **c.all_kwargs()))(cfg)
        try:
            calls[name]()                                         # compile; too much shared memory fails here
        except Exception as err:  # noqa: BLE001 - triton's OutOfResources and compilation errors alike
            rows[name]["status"] = f"error: {type(err).__name__}"
            del calls[name]
    timings, _ = time_interleaved(calls, device=device, target_ms=target_ms)
    for name, t in timings.items():
        rows[name].update(ms=t.median_ms, tflops=flop / (t.median_ms * 1e-3) / 1e12)
    return pd.DataFrame(rows.values())
