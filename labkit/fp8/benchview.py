"""Notebook 10's GPU sweep shown: TFLOP/s against N under the measured GEMM ceilings, and the report a cell prints.

- :func:`plot`: one panel per (d, causal), TFLOP/s against N per kernel, the bf16 and FP8 GEMM ceilings of
  :func:`labkit.fp8.ceilings.gemm_ceiling` as horizontal lines.
- :func:`tflops_table`: TFLOP/s per (d, causal, N) and kernel, the notebook's table.
- :func:`report`: everything the GPU cell shows (ceilings, table, what did not run, the goals, the figure) as a
  list of outputs in :mod:`labkit.course.reference`'s stored form (``{"text": ...}``, ``{"text/html": ...}``,
  ``{"image/png": base64}``): the notebook displays it with ``lk.reference.display_outputs``, and the course's
  reference run stores the same list under the cell's id, so a reader without a GPU sees what a GPU reader sees.

Used in: 10_fp8_attention.
"""
from __future__ import annotations

import base64
import io

import pandas as pd

from labkit.core import plots
from labkit.fp8.bench import GOAL_SPEEDUP, GOAL_TFLOPS, goal_rows
from labkit.fp8.ceilings import BF16, FP8_DENSE_PEAK_TFLOPS, FP8_VARIANTS, bf16_ceiling, fp8_ceiling


def plot(df: pd.DataFrame, ceilings: dict | None = None):
    """TFLOP/s against N, one line per kernel ("ok" rows), one panel per (d, causal); the measured bf16 and FP8
    GEMM ceilings as dashed lines (absent without ``ceilings``). Returns the matplotlib Figure."""
    import matplotlib.pyplot as plt

    plots.use_theme()
    ok = df[df["status"] == "ok"]
    panels = sorted(ok.groupby(["d", "causal"]).groups) or [(None, None)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False)
    roofs = {plots.label("bf16 GEMM 上限", "bf16 GEMM ceiling"): (bf16_ceiling(ceilings), "--"),
             plots.label("FP8 GEMM 上限", "FP8 GEMM ceiling"): (fp8_ceiling(ceilings), "-.")}
    for ax, (d, causal) in zip(axes.flat, panels):
        part = ok[(ok["d"] == d) & (ok["causal"] == causal)]
        for backend, g in part.groupby("backend"):
            g = g.sort_values("N")
            ax.plot(g["N"], g["tflops"], marker="o", label=backend)
        for name, (value, style) in roofs.items():
            if value == value:
                ax.axhline(value, color="gray", linestyle=style, linewidth=1, label=f"{name} {value:.0f}")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_title(f"d={d}, {'causal' if causal else 'non-causal'}, forward", fontsize=10)
        ax.set_xlabel(plots.label("序列長度 N", "sequence length N"))
        ax.set_ylabel("TFLOP/s")
    if len(ok):
        axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def tflops_table(df: pd.DataFrame) -> pd.DataFrame:
    """TFLOP/s of the "ok" rows: index (d, causal, N), one column per kernel (NaN where it did not run)."""
    ok = df[df["status"] == "ok"]
    return ok.pivot_table(index=["d", "causal", "N"], columns="backend", values="tflops")


def ceiling_text(ceilings: dict | None) -> str:
    """One paragraph: the measured GEMM TFLOP/s (or why not) beside the datasheet's FP8 peak."""
    if not ceilings:
        return f"GEMM ceilings: not measured; FP8 dense peak (datasheet) {FP8_DENSE_PEAK_TFLOPS:,.0f} TFLOP/s"
    parts = []
    for name in (BF16, *FP8_VARIANTS):
        value = ceilings["tflops"].get(name)
        parts.append(f"{name} {value:.0f}" if value is not None else f"{name} -- {ceilings['status'].get(name)}")
    return (f"GEMM ceilings, {ceilings['n']}^3 on {ceilings['device']} (TFLOP/s): " + "; ".join(parts)
            + f"\nFP8 dense peak (datasheet): {FP8_DENSE_PEAK_TFLOPS:,.0f} TFLOP/s")


def goal_text(goals: pd.DataFrame) -> str:
    """One line per goal row: the FP8 kernel's TFLOP/s and speed-up over the bf16 forward, each with its verdict."""
    lines = [f"goals (d=128, non-causal, N >= 8K): fp8_mine / bf16_mine >= {GOAL_SPEEDUP}x, "
             f"fp8_mine >= {GOAL_TFLOPS:.0f} TFLOP/s"]
    for _, r in goals.iterrows():
        lines.append(f"N={r['N']:>5}: {r['fp8_tflops']:.0f} TFLOP/s (up to {r['tflops_high']:.0f} at p20) "
                     f"[{r['tflops_verdict']}]; {r['speedup']:.2f}x the bf16 forward "
                     f"({r['speedup_low']:.2f}x to {r['speedup_high']:.2f}x, p20/p80) [{r['speedup_verdict']}]")
    return "\n".join(lines) + "\n"


def _png(fig) -> str:
    """The figure as base64 PNG text (what a notebook stores for ``image/png``)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def report(df: pd.DataFrame, ceilings: dict | None = None) -> list[dict]:
    """The GPU cell's outputs, in :mod:`labkit.course.reference`'s stored form, in order: the ceilings (text),
    the TFLOP/s table (HTML), what did not run and why (text), the goal rows (HTML) and verdicts (text), the
    figure (PNG)."""
    import matplotlib.pyplot as plt

    failed = df[df["status"] != "ok"].drop_duplicates(["backend", "status"])
    missing = "".join(f"{r['backend']}: {r['status']} (first at d={r['d']} N={r['N']}"
                      f"{' causal' if r['causal'] else ''})\n" for _, r in failed.iterrows())
    goals = goal_rows(df)
    fig = plot(df, ceilings)
    png = _png(fig)
    plt.close(fig)
    outputs = [{"text": ceiling_text(ceilings) + "\nforward TFLOP/s (causal FLOPs counted at half):\n"},
               {"text/html": tflops_table(df).style.format("{:.0f}", na_rep="-").to_html()}]
    if missing:
        outputs.append({"text": "did not run:\n" + missing})
    outputs += [{"text/html": goals.style.format(precision=2).to_html()}, {"text": goal_text(goals)},
                {"image/png": png}]
    return outputs
