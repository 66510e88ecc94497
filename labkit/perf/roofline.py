"""The IO / roofline model: where a measured attention forward sits under this machine's roofs.

The counts that 04_performance_analysis asks for (the FLOPs and bytes of standard attention's
phases, the bytes of FlashAttention's tiled schedule, the roof min(peak, I * bandwidth)) are
the reader's own functions, passed in; this module adds the floor every forward moves
(:func:`compulsory_bytes`), assembles the phase table (:func:`io_table`), places measured times
on the roofline and flags the points above their roof (:func:`roofline_points`; fused kernels
only: :func:`fused_points`), and draws it
(:func:`roofline_plot`). The peaks come from measurements (:mod:`labkit.engine.bench`).

Used in: 04_performance_analysis, 06_triton_flashattention.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import pandas as pd

from labkit.engine import attention as attn
from labkit.perf.memory import kind

Roof = Callable[[np.ndarray], np.ndarray]  # intensity (FLOP/byte) -> attainable TFLOP/s
PhaseCounts = Callable[..., dict]  # (B, H, N, D, elem_bytes=) -> {"QK^T"|"softmax"|"PV": (flop, bytes)}
TiledBytes = Callable[..., float]  # (B, H, N, D, elem_bytes=, block_m=) -> bytes of the non-causal tiled schedule


def compulsory_bytes(B: int, H: int, N: int, D: int, *, elem_bytes: int = 2) -> int:
    """HBM bytes every attention forward moves at least: q, k, v read and o written once
    ([B, H, N, D] each, ``elem_bytes`` per element) plus the fp32 log-sum-exp [B, H, N].

    Any schedule moves at least this much (the K/V re-reads of a tiled kernel only add), so the
    intensity FLOP / compulsory_bytes is the highest a fused kernel can have.
    """
    for name, val in dict(B=B, H=H, N=N, D=D, elem_bytes=elem_bytes).items():
        if int(val) != val or val < 1:
            raise ValueError(f"{name} must be a positive integer, got {val!r}.")
    return elem_bytes * 4 * B * H * N * D + 4 * B * H * N


def io_table(B: int, H: int, N: int, D: int, *, standard: PhaseCounts, flash: TiledBytes,
             elem_bytes: int = 2, block_m: int = 128) -> pd.DataFrame:
    """FLOPs, HBM bytes and intensity of one non-causal forward, phase by phase.

    Args:
        standard: the phase counts of standard attention (notebook 04, exercise 1).
        flash: the bytes of FlashAttention-2's tiled schedule (exercise 2): K, V re-read per Q tile.

    Returns:
        DataFrame with columns algorithm, phase, flop, bytes, intensity (FLOP per byte); rows: the
        three standard phases and their "total", then "fused (tiled)" and "fused (compulsory)"
        (:func:`compulsory_bytes`), both with the standard total's FLOPs (the same arithmetic, fused).
    """
    phases = standard(B, H, N, D, elem_bytes=elem_bytes)
    rows = [("standard", name, *phases[name]) for name in ("QK^T", "softmax", "PV")]
    flop = sum(r[2] for r in rows)
    rows += [("standard", "total", flop, sum(r[3] for r in rows)),
             ("flash", "fused (tiled)", flop, flash(B, H, N, D, elem_bytes=elem_bytes, block_m=block_m)),
             ("flash", "fused (compulsory)", flop, compulsory_bytes(B, H, N, D, elem_bytes=elem_bytes))]
    df = pd.DataFrame(rows, columns=["algorithm", "phase", "flop", "bytes"]).astype({"flop": float, "bytes": float})
    df["intensity"] = df["flop"] / df["bytes"]
    return df


def roofline_points(timings: pd.DataFrame, *, roof: Roof, standard: PhaseCounts, flash: TiledBytes,
                    elem_bytes: int = 2, block_m: int = 128) -> pd.DataFrame:
    """Place measured forward times on the roofline, each at the highest intensity it can have.

    x is FLOP / the fewest bytes the backend's algorithm moves: standard attention's "total" of
    :func:`io_table` (Algorithm 0), a fused kernel's :func:`compulsory_bytes`. Fewer bytes mean a
    higher intensity and a higher roof, so with the measured peaks a point lies above its roof
    only when the measurement or a peak is off (or, for standard attention, the scores stayed in
    a cache): ``above_roof`` flags those. FLOPs are :func:`labkit.engine.attention.flops` (4*B*H*N^2*D,
    halved if causal), the matmul work the matmul peak bounds and the sweeps' ``tflops`` use.

    Args:
        timings: rows with backend, B, H, N, D, causal, ms (e.g. from :func:`labkit.perf.predictor.time_grid`).
        roof: intensity -> attainable TFLOP/s on this machine.
        standard, flash: as in :func:`io_table`.

    Returns:
        ``timings`` plus kind, flop, bytes, intensity, intensity_tiled (fused non-causal rows: the
        tiled schedule's count, as if every K/V re-read came from HBM; else NaN), achieved_tflops,
        roof_tflops (at intensity) and above_roof (achieved_tflops > roof_tflops).
    """
    rows = []
    for r in timings.itertuples():
        model = io_table(r.B, r.H, r.N, r.D, standard=standard, flash=flash, elem_bytes=elem_bytes,
                         block_m=block_m).set_index("phase")["bytes"]
        flop, k = attn.flops(r.B, r.H, r.N, r.D, causal=bool(r.causal)), kind(r.backend)
        tiled = model["fused (tiled)"] if k == "flash" and not r.causal else np.nan
        rows.append(dict(kind=k, flop=flop, bytes=model["fused (compulsory)" if k == "flash" else "total"],
                         intensity_tiled=flop / tiled))
    out = timings.copy()
    for name, values in pd.DataFrame(rows, index=timings.index).items():
        out[name] = values
    return _place_on_roof(out, roof)


def fused_points(timings: pd.DataFrame, *, roof: Roof, elem_bytes: int = 2) -> pd.DataFrame:
    """Place measured forward times of fused kernels (every row) at FLOP / :func:`compulsory_bytes`.

    :func:`roofline_points` without the IO model of standard attention: for notebooks whose rows
    are all fused kernels. Returns ``timings`` plus flop, bytes, intensity, intensity_tiled (NaN),
    achieved_tflops, roof_tflops and above_roof, as :func:`roofline_points` does.
    """
    out = timings.copy()
    out["flop"] = [attn.flops(r.B, r.H, r.N, r.D, causal=bool(r.causal)) for r in out.itertuples()]
    out["bytes"] = [compulsory_bytes(r.B, r.H, r.N, r.D, elem_bytes=elem_bytes) for r in out.itertuples()]
    out["intensity_tiled"] = np.nan
    return _place_on_roof(out, roof)


def _place_on_roof(out: pd.DataFrame, roof: Roof) -> pd.DataFrame:
    """Add intensity, achieved_tflops, roof_tflops and above_roof to rows with flop, bytes and ms."""
    out["intensity"] = out["flop"] / out["bytes"]
    out["achieved_tflops"] = out["flop"] / (out["ms"] * 1e-3) / 1e12
    out["roof_tflops"] = np.asarray(roof(out["intensity"].to_numpy()), dtype=float)
    out["above_roof"] = out["achieved_tflops"] > out["roof_tflops"]
    return out


def roofline_plot(points: pd.DataFrame, *, roof: Roof, ridge: float, ax=None, label_col: str = "backend"):
    """Log-log roofline: the roof (``roof`` drawn around the ``ridge`` point, FLOP/byte), one
    filled marker per row of ``points`` (:func:`roofline_points`) at its intensity, a hollow one
    at intensity_tiled joined by a line (the real traffic lies in between), a red cross on
    points above their roof. Returns the Axes."""
    import matplotlib.pyplot as plt

    from labkit.core.plots import label

    ax = ax or plt.subplots(figsize=(6.4, 4.2))[1]
    xs = pd.concat([points["intensity"], points["intensity_tiled"]]).dropna()
    x = np.geomspace(min(xs.min(), ridge) / 4, max(xs.max(), ridge) * 4, 200)
    ax.plot(x, roof(x), color="black", lw=1.5, label=label("量測的屋頂線", "measured roofline"))
    ax.axvline(ridge, color="gray", ls=":", lw=1)
    for name, g in points.groupby(label_col, sort=False):
        dots = ax.scatter(g["intensity"], g["achieved_tflops"], s=45, label=str(name), zorder=3)
        tiled = g.dropna(subset=["intensity_tiled"])
        ax.scatter(tiled["intensity_tiled"], tiled["achieved_tflops"], s=45, facecolors="none",
                   edgecolors=dots.get_facecolor(), zorder=3)
        ax.hlines(tiled["achieved_tflops"], tiled["intensity_tiled"], tiled["intensity"],
                  colors=dots.get_facecolor(), lw=0.8, alpha=0.6)
    if points["intensity_tiled"].notna().any():
        ax.scatter([], [], s=45, facecolors="none", edgecolors="gray",
                   label=label("空心：tiled 排程的位元組數", "hollow: tiled schedule's bytes"))
    above = points[points["above_roof"]]
    if len(above):
        ax.scatter(above["intensity"], above["achieved_tflops"], marker="x", color="red", s=60, zorder=4,
                   label=label("高於屋頂", "above the roof"))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(label("算術強度 (FLOP/byte)", "arithmetic intensity (FLOP/byte)"))
    ax.set_ylabel(label("達成 TFLOP/s", "achieved TFLOP/s"))
    ax.legend(fontsize=8)
    return ax
