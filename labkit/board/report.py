"""The board's report: rows ranked, and ``board.html`` (the table and a bar chart, library kernels as lines).

- :func:`ranked`: ``ok`` rows by score (highest first), then ``wrong``, ``flagged``, ``error``, ``timeout``;
  a ``rank`` column for the scored rows.
- :func:`library_scores`: the library kernels' scores in one student's timing (timed in the same process).
- :func:`write_html`: one self-contained page: the chart (an inline SVG drawn by matplotlib) and the table.
  Each library kernel's line is its median score over the students' runs (every run times the library
  kernels beside the student's, in the same process).

Used by: :mod:`labkit.board.rank`.
"""
from __future__ import annotations

import html
import io
import statistics
from pathlib import Path

import pandas as pd

ORDER = {"ok": 0, "wrong": 1, "flagged": 2, "error": 3, "timeout": 4}
WHAT = {"06_triton_flashattention": "TFLOP/s over the measured matmul peak (bf16), geometric mean over "
                                    "N = 1K/4K/16K, d = 64/128, causal and not; forward and forward+backward",
        "08_decode_attention": "GB/s over the measured read ceiling (bf16, H_q 32, H_kv 8, d 128), geometric mean "
                               "over (B, N) = (1, 4K), (1, 16K), (1, 64K), (8, 8K), split-KV contiguous and paged",
        "09_flex_attention": "TFLOP/s of the work the mask keeps over the measured matmul peak (bf16, H 16, d 128), "
                             "forward, geometric mean over N = 4K/8K/16K and masks causal, window 1024, 16 documents",
        "10_fp8_attention": "TFLOP/s (causal counted at half) over the measured FP8 GEMM ceiling (the fastest "
                            "torch._scaled_mm, e4m3, 8192^3; never the bf16 matmul's), forward on e4m3 inputs with "
                            "per-tensor descales, 128 x 64 tiles, geometric mean over d = 128/64, N = 4K/8K/16K "
                            "(B*N = 16K tokens, H*d = 2048), causal and not"}


def ranked(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` sorted: scored ok rows by score, then the other statuses in :data:`ORDER`; ``rank`` first."""
    if table.empty:
        return table.assign(rank=pd.Series(dtype="Int64"))
    score = pd.to_numeric(table["score"], errors="coerce")
    order = table["status"].map(ORDER).fillna(len(ORDER))
    table = table.assign(_o=order, _s=-score.fillna(-float("inf"))).sort_values(["_o", "_s", "student"])
    table = table.drop(columns=["_o", "_s"]).reset_index(drop=True)
    scored = pd.to_numeric(table["score"], errors="coerce").notna() & (table["status"] == "ok")
    table.insert(0, "rank", pd.Series(range(1, len(table) + 1), dtype="Int64").where(scored))
    return table


def library_scores(timing: dict) -> dict[str, float]:
    """Library kernel -> its score in one student's timing (06: forward+backward and forward's geometric mean)."""
    found = {}
    for name, value in timing.items():
        if name in ("student", "rows", "failed", "peak_tflops", "read_bw") or name.startswith("student"):
            continue
        score = value.get("score") if isinstance(value, dict) else value
        if isinstance(score, (int, float)) and score == score and name != "read only":
            found[name] = float(score)
    return found


def library_lines(timings: list[dict | None]) -> dict[str, float]:
    """Library kernel -> its median score over the runs that timed it."""
    scores: dict[str, list[float]] = {}
    for timing in timings:
        for name, value in library_scores(timing or {}).items():
            scores.setdefault(name, []).append(value)
    return {name: statistics.median(values) for name, values in scores.items()}


def _chart(table: pd.DataFrame, lines: dict[str, float]) -> str:
    """An inline SVG: one bar per scored student, a vertical line per library kernel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scored = table[pd.to_numeric(table["score"], errors="coerce").notna()]
    fig, ax = plt.subplots(figsize=(7, 0.4 * max(3, len(scored)) + 1))
    ax.barh(scored["student"].astype(str)[::-1], scored["score"].astype(float)[::-1], color="#4c72b0")
    for i, (name, value) in enumerate(sorted(lines.items(), key=lambda kv: -kv[1])):
        ax.axvline(value, ls="--", color=f"C{i + 1}", label=f"{name} ({value:.0%})")
    ax.set_xlabel("score: fraction of the measured hardware limit")
    ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    if lines:
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    svg = io.StringIO()
    fig.savefig(svg, format="svg")
    plt.close(fig)
    return svg.getvalue()[svg.getvalue().index("<svg"):]


def _cell(value) -> str:
    """One table cell: empty for a missing value (None, NaN, pandas' NA: an unranked student), floats to 3 places."""
    if value is None or value is pd.NA or (isinstance(value, float) and value != value):
        return ""
    return f"{value:.3f}" if isinstance(value, float) else html.escape(str(value))


def write_html(table: pd.DataFrame, timings: list[dict | None], path: Path, *, assignment: str, gpu: bool) -> Path:
    """``path``: the ranked table and, when anything was timed, the chart. Returns ``path``."""
    lines = library_lines(timings)
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in table.columns)
    body = "".join("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in row) + "</tr>"
                   for row in table.itertuples(index=False))
    what = WHAT.get(assignment, "") if gpu else ("correctness only (--cpu or no GPU: Triton's interpreter); "
                                                  "no score")
    chart = _chart(table, lines) if gpu and pd.to_numeric(table["score"], errors="coerce").notna().any() else ""
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>board: {html.escape(assignment)}</title>"
            "<style>body{font-family:sans-serif}td,th{padding:2px 8px;border-bottom:1px solid #ddd}"
            "th{text-align:left}</style></head><body>"
            f"<h1>Speed-of-light board: {html.escape(assignment)}</h1><p>Score: {html.escape(what)}.</p>"
            + "".join(f"<p>{html.escape(n)}: {v:.1%} (median over the runs)</p>" for n, v in lines.items())
            + chart + f"<table><tr>{head}</tr>{body}</table></body></html>")
    Path(path).write_text(page, encoding="utf-8")
    return Path(path)
