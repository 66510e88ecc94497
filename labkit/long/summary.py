"""The long-sequence search's tables: when to stop doubling N, and the longest N per configuration.

- :func:`summary`: per configuration of a ``lk.longctx.longest_sequence`` table, the longest N that trained
  and what stopped the search.
- ``_stop_before``: the search's rule for not trying the next N (``max_len``, or a step predicted too slow).

Used in: 03_long_sequence_training (through ``lk.longctx``, which re-exports both).
"""
from __future__ import annotations

import math

import pandas as pd


def _stop_before(done: list[dict], n: int, max_len: int | None, max_step_s: float) -> str:
    """Why not to try N: "max_len", or "time" when the step is predicted to exceed the limit."""
    if max_len is not None and n > max_len:
        return "max_len"
    if not done:
        return ""
    last = done[-1]
    power = 2.0  # attention's N^2 once it dominates; measured from the last two steps when there are two
    if len(done) > 1 and done[-2]["step_s"] > 0:
        power = min(2.0, max(1.0, math.log(last["step_s"] / done[-2]["step_s"]) / math.log(last["N"] / done[-2]["N"])))
    return "time" if last["step_s"] * (n / last["N"]) ** power > max_step_s else ""


def summary(search: pd.DataFrame) -> pd.DataFrame:
    """Per configuration of a :func:`longest_sequence` table: the longest N that trained, its step
    time and peak, and what stopped the search (at which N)."""
    rows = []
    for name, g in search.groupby("config", sort=False):
        ok, last = g[g.status == "ok"], g.iloc[-1]
        best = ok.iloc[-1] if len(ok) else None
        rows.append(dict(config=name, longest_N=int(best.N) if best is not None else 0,
                         step_s=best.step_s if best is not None else math.nan,
                         peak_gib=best.peak_gib if best is not None else math.nan,
                         stopped_by=last.stopped_by, at_N=int(last.N)))
    return pd.DataFrame(rows)


__all__ = ["summary"]
