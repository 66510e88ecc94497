"""The two FP8 formats as torch defines them: the facts notebook 10's section 1 shows, read from ``torch.finfo`` and
from the bit patterns themselves, never typed in.

- :func:`fp8_facts`: e4m3fn and e5m2 (the two FP8 rows of :func:`labkit.numerics.precision.format_table`) with the
  spacing between neighbours near 1, near 256 and near max (the spacing doubles with every power of two: FP8 keeps
  3 or 2 significant bits at every magnitude, never a fixed step);
- :func:`e4m3_values`: every non-negative e4m3fn value, decoded from the 128 bit patterns 0x00-0x7F through a
  uint8 view (0x7F is NaN: e4m3fn has no infinity, the "fn" of its name);
- :func:`cast_table`: what torch's cast does with values past max, next to the clamped cast the quantizers use;
- :func:`grid_plot`: the e4m3 grid, spacing against value on log axes (a staircase: constant relative spacing).

Out-of-range casts depend on where torch runs. Measured: torch 2.11 on an H100 (CUDA) casts 500 to NaN for e4m3fn
(values from 464 up: past max plus half a spacing); torch 2.13 on a CPU (x86, AVX2) saturates to 448, infinities
included (NaN stays NaN), while e5m2 overflows to inf on both (61440 and up). A quantizer therefore clamps to
+-max before the cast: then every torch on every device gives the same bits.

Used in: 10_fp8_attention.
"""
from __future__ import annotations

import math

import pandas as pd
import torch

from labkit.core import plots
from labkit.numerics import precision

FORMATS = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def spacing(dtype: torch.dtype, value: float) -> float:
    """The gap from ``value`` (in (0, max]) up to the next value of ``dtype``: eps * 2^e in the binade [2^e, 2^(e+1))
    that holds it, and the subnormals' one step (eps * smallest_normal) below smallest_normal."""
    finfo = torch.finfo(dtype)
    if not 0 < value <= finfo.max:
        raise ValueError(f"value must be in (0, {finfo.max}] for {dtype}, got {value}")
    exponent = max(math.floor(math.log2(value)), math.floor(math.log2(finfo.smallest_normal)))
    return finfo.eps * 2.0 ** exponent


def fp8_facts() -> pd.DataFrame:
    """The FP8 rows of :func:`labkit.numerics.precision.format_table` (format, bits, exponent_bits, mantissa_bits,
    max, smallest_normal, smallest_subnormal, epsilon, decimal_digits, note) plus spacing_near_1, spacing_near_256
    and spacing_near_max: the gap between neighbours at those magnitudes (for e4m3fn: 0.125, 32, 32)."""
    table = precision.format_table()
    rows = table[table["format"].isin(list(FORMATS))].reset_index(drop=True)
    for column, at in (("spacing_near_1", lambda f: 1.0), ("spacing_near_256", lambda f: 256.0),
                       ("spacing_near_max", lambda f: f.max)):
        rows[column] = [spacing(FORMATS[name], at(torch.finfo(FORMATS[name]))) for name in rows["format"]]
    return rows


def e4m3_values() -> pd.DataFrame:
    """Every non-negative e4m3fn value: one row per bit pattern 0x00-0x7F (128 rows), decoded by torch through a
    uint8 view. Columns: bits ("0x3c"), exponent_field (4 bits, bias 7), mantissa_field (3 bits), kind ("zero",
    "subnormal", "normal", "nan"), value (float; NaN for 0x7F) and spacing (gap to the next value up; NaN for the
    last finite value, 448, and for NaN)."""
    patterns = torch.arange(128, dtype=torch.uint8)
    values = patterns.view(torch.float8_e4m3fn).float().tolist()
    rows = []
    for bits, value in zip(patterns.tolist(), values):
        exponent, mantissa = bits >> 3, bits & 7
        kind = ("nan" if math.isnan(value) else "zero" if bits == 0 else "subnormal" if exponent == 0 else "normal")
        rows.append({"bits": f"0x{bits:02x}", "exponent_field": exponent, "mantissa_field": mantissa, "kind": kind,
                     "value": value})
    table = pd.DataFrame(rows)
    table["spacing"] = table["value"].shift(-1) - table["value"]
    return table


def cast_table(values=(1.0, 300.0, 448.0, 460.0, 464.0, 500.0, 1e4, 60000.0, 61440.0, float("inf"))) -> pd.DataFrame:
    """How torch casts ``values`` (fp32) on this machine: one row per value with the plain cast to e4m3fn and to
    e5m2, and the clamped cast ``x.clamp(-max, max).to(dtype)`` the quantizers use (columns e4m3fn, e5m2,
    e4m3fn_clamped, e5m2_clamped; floats, NaN or inf where the cast gave them). See the module's note: the plain
    e4m3fn cast of 500 is 448 on torch 2.13's CPU path and NaN on torch 2.11's CUDA path."""
    x = torch.tensor(values, dtype=torch.float32)
    table = pd.DataFrame({"x": x.tolist()})
    for name, dtype in FORMATS.items():
        short, fmax = name.removeprefix("fp8_"), torch.finfo(dtype).max
        table[short] = x.to(dtype).float().tolist()
        table[f"{short}_clamped"] = x.clamp(-fmax, fmax).to(dtype).float().tolist()
    return table


def grid_plot(ax=None):
    """The positive e4m3fn values: spacing to the next value against the value, both axes log2. Subnormals share
    one step (2^-9), then each binade doubles it (relative spacing 2^-3 to 2^-4). Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    plots.use_theme()
    if ax is None:
        ax = plt.subplots(figsize=(6, 3.6))[1]
    grid = e4m3_values().dropna(subset=["spacing"])
    grid = grid[grid["value"] > 0]
    for kind, part in grid.groupby("kind"):
        ax.step(part["value"], part["spacing"], where="post", marker=".", label=kind)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel(plots.label("數值（value）", "value"))
    ax.set_ylabel(plots.label("到下一個值的間距", "spacing to the next value"))
    ax.set_title("float8_e4m3fn")
    ax.legend(fontsize=8)
    return ax
