"""Tests for labkit.perf.roofline: the compulsory bytes, the phase table, roofline points and their
above-the-roof flag (with an H100's measured figures), the plot.

The byte counts that notebook 04 asks students for are computed here another way (tensor by
tensor, tile by tile) and passed in, as the notebook passes the student's functions.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import pandas as pd
import pytest

import labkit as lk

RL = lk.roofline

# Measured on an H100 (bf16): matmul peak, device-copy bandwidth (read + write)
H100_PEAK_TFLOPS, H100_BANDWIDTH = 748.0, 3.0e12


def standard_phases(B, H, N, D, elem_bytes=2):
    """Algorithm 0 of the FlashAttention paper, tensor by tensor: [B, H, N, D] q, k, v, o and
    [B, H, N, N] S, P, each read or written once per phase that touches it."""
    token, score = B * H * N * D * elem_bytes, B * H * N * N * elem_bytes
    matmul = 2 * B * H * N * N * D
    return {"QK^T": (matmul, 2 * token + score), "softmax": (5 * B * H * N * N, 2 * score), "PV": (matmul, score + 2 * token)}


def schedule_bytes(B, H, N, D, *, causal=False, elem_bytes=2, block_m=128):
    """HBM bytes of FlashAttention's tile schedule when no K/V re-read hits a cache: each Q tile of
    block_m rows reads its Q rows and the K, V rows it needs (causal: keys up to the tile's end,
    i.e. only the tiles at or below the diagonal), writes its O rows and their fp32 lse."""
    per_head = 0
    for start in range(0, N, block_m):
        rows = min(block_m, N - start)
        keys = min(N, start + block_m) if causal else N
        per_head += elem_bytes * D * (2 * rows + 2 * keys) + 4 * rows
    return B * H * per_head


tiled_bytes = functools.partial(schedule_bytes, causal=False)  # what exercise 2 counts


def h100_roof(intensity):
    return np.minimum(H100_PEAK_TFLOPS, np.asarray(intensity, dtype=float) * H100_BANDWIDTH / 1e12)


def points(rows, roof=h100_roof, **kw):
    return RL.roofline_points(pd.DataFrame(rows), roof=roof, standard=standard_phases, flash=tiled_bytes, **kw)


def at_tflops(backend, B, H, N, D, causal, tflops):
    """A timing row whose forward ran at ``tflops`` (4*B*H*N^2*D FLOPs, halved if causal)."""
    return dict(backend=backend, B=B, H=H, N=N, D=D, causal=causal,
                ms=lk.attention.flops(B, H, N, D, causal=causal) / (tflops * 1e12) * 1e3)


# ----------------------------------------------------------------------------- bytes

def test_compulsory_bytes_by_hand():
    # B=H=1, N=4, D=2, 2-byte elements: q, k, v, o of 8 elements each, lse of 4 fp32
    assert RL.compulsory_bytes(1, 1, 4, 2, elem_bytes=2) == 2 * 4 * 8 + 4 * 4
    assert RL.compulsory_bytes(2, 3, 4, 2, elem_bytes=4) == 6 * (4 * 4 * 8 + 4 * 4)
    for bad in (dict(N=0), dict(D=-1), dict(elem_bytes=1.5)):
        args = dict(B=1, H=1, N=64, D=16, elem_bytes=2) | bad
        with pytest.raises(ValueError, match="positive integer"):
            RL.compulsory_bytes(args.pop("B"), args.pop("H"), args.pop("N"), args.pop("D"), **args)


@pytest.mark.parametrize("N", [64, 100, 128, 300, 1024])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("elem_bytes", [2, 4])
def test_compulsory_bytes_lower_bound_of_the_schedule(N, causal, block_m, elem_bytes):
    """Fewer bytes than any tile schedule, so the plotted intensity is the highest the kernel can have."""
    floor = RL.compulsory_bytes(2, 3, N, 64, elem_bytes=elem_bytes)
    sched = schedule_bytes(2, 3, N, 64, causal=causal, elem_bytes=elem_bytes, block_m=block_m)
    assert floor <= sched
    assert (floor == sched) == (N <= block_m), "equal exactly when one Q tile reads K and V once"


# ----------------------------------------------------------------------------- phase table

def test_io_table_assembles_the_given_counts():
    df = RL.io_table(2, 4, 300, 64, standard=standard_phases, flash=tiled_bytes, elem_bytes=2, block_m=128)
    assert df["phase"].tolist() == ["QK^T", "softmax", "PV", "total", "fused (tiled)", "fused (compulsory)"]
    df = df.set_index("phase")
    phases = standard_phases(2, 4, 300, 64)
    assert df.loc["total", "flop"] == sum(f for f, _ in phases.values())
    assert df.loc["total", "bytes"] == sum(b for _, b in phases.values())
    assert (df.loc[["fused (tiled)", "fused (compulsory)"], "flop"] == df.loc["total", "flop"]).all()
    assert df.loc["fused (tiled)", "bytes"] == schedule_bytes(2, 4, 300, 64, block_m=128)
    assert df.loc["fused (compulsory)", "bytes"] == RL.compulsory_bytes(2, 4, 300, 64)
    np.testing.assert_allclose(df["intensity"], df["flop"] / df["bytes"])
    assert df.loc["total", "bytes"] > df.loc["fused (tiled)", "bytes"] > df.loc["fused (compulsory)", "bytes"]


def test_io_table_passes_sizes_to_the_given_functions():
    seen = []

    def flash(B, H, N, D, elem_bytes=2, block_m=128):
        seen.append((B, H, N, D, elem_bytes, block_m))
        return 1.0

    RL.io_table(1, 2, 32, 8, standard=standard_phases, flash=flash, elem_bytes=4, block_m=16)
    assert seen == [(1, 2, 32, 8, 4, 16)]


# ----------------------------------------------------------------------------- roofline points

def test_roofline_points_columns():
    rows = [dict(backend="reference", B=1, H=2, N=256, D=64, causal=False, ms=2.0),
            dict(backend="sdpa_flash", B=1, H=2, N=256, D=64, causal=False, ms=1.0),
            dict(backend="sdpa_flash", B=1, H=2, N=256, D=64, causal=True, ms=1.0)]
    pts = points(rows)
    flop = lk.attention.flops(1, 2, 256, 64)
    assert pts["kind"].tolist() == ["standard", "flash", "flash"]
    assert pts["flop"].tolist() == [flop, flop, flop / 2]
    assert pts.loc[0, "bytes"] == sum(b for _, b in standard_phases(1, 2, 256, 64).values())
    assert pts.loc[1, "bytes"] == pts.loc[2, "bytes"] == RL.compulsory_bytes(1, 2, 256, 64)
    assert pts.loc[1, "intensity_tiled"] == pytest.approx(flop / schedule_bytes(1, 2, 256, 64))
    assert math.isnan(pts.loc[0, "intensity_tiled"]) and math.isnan(pts.loc[2, "intensity_tiled"])
    assert pts.loc[1, "achieved_tflops"] == pytest.approx(flop / 1e-3 / 1e12)
    np.testing.assert_allclose(pts["roof_tflops"], h100_roof(pts["intensity"]))


def test_above_roof_flags_exactly_the_points_above_their_roof():
    rng = np.random.default_rng(0)
    rows = [dict(backend=b, B=1, H=4, N=n, D=64, causal=c, ms=float(ms))
            for b in ("reference", "fa4") for n in (128, 1024) for c in (False, True) for ms in 10 ** rng.uniform(-6, 0, 4)]
    pts = points(rows, roof=lambda i: np.minimum(50.0, np.asarray(i) * 1e11 / 1e12))
    assert pts["above_roof"].any() and not pts["above_roof"].all()
    assert (pts["above_roof"] == (pts["achieved_tflops"] > pts["roof_tflops"])).all()


H100_MEASURED = [("fa4", 1, 16, 16384, 128, False, 710.0), ("sdpa_cudnn", 1, 16, 16384, 128, False, 641.0),
                 ("fa4", 16, 32, 1024, 64, True, 254.0), ("sdpa_cudnn", 16, 32, 1024, 64, True, 335.0)]


def test_h100_kernels_sit_under_their_roof():
    """fa4 and cuDNN forwards measured on an H100: under the roof at the compulsory intensity;
    the tile schedule's count (every K/V re-read from HBM) would put three of them above it."""
    pts = points([at_tflops(*m) for m in H100_MEASURED])
    np.testing.assert_allclose(pts["achieved_tflops"], [m[-1] for m in H100_MEASURED])
    assert not pts["above_roof"].any(), pts[["backend", "N", "achieved_tflops", "roof_tflops"]]
    assert (pts["achieved_tflops"] <= H100_PEAK_TFLOPS).all()
    sched = [schedule_bytes(*m[1:5], causal=m[5]) for m in H100_MEASURED]
    over = pts["achieved_tflops"] / h100_roof(pts["flop"] / sched)
    np.testing.assert_array_less([1.5, 1.5, 0.0, 1.1], over)  # fa4, cuDNN non-causal; cuDNN causal
    assert over[2] < 1, "fa4 causal at D=64 is under even the schedule's roof"


def test_a_point_beyond_the_peak_is_flagged():
    pts = points([at_tflops("fa4", 1, 16, 16384, 128, False, 800.0),
                  at_tflops("reference", 1, 16, 1024, 64, False, 200.0)])
    assert pts["above_roof"].tolist() == [True, True], "800 > 748 peak; materialized scores at 200 TFLOP/s"


def test_roofline_plot_draws():
    import matplotlib

    matplotlib.use("Agg")
    rows = [dict(backend=b, B=1, H=2, N=n, D=64, causal=False, ms=ms)
            for b in ("reference", "sdpa_flash") for n in (128, 256) for ms in (1.0, 1e-9)]
    pts = points(rows, roof=lambda i: np.minimum(1.0, np.asarray(i) * 1e11 / 1e12))
    ax = RL.roofline_plot(pts, roof=lambda i: np.minimum(1.0, np.asarray(i) * 1e11 / 1e12), ridge=10.0)
    assert ax.get_xscale() == "log" and pts["above_roof"].any()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "reference" in labels and "sdpa_flash" in labels and any("roof" in t or "屋頂" in t for t in labels)
    assert any("tiled" in t for t in labels), "a legend entry says what the hollow markers are"
    matplotlib.pyplot.close("all")
