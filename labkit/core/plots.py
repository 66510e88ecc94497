"""One plotting theme for the course; Chinese labels only where a CJK font exists.

:func:`use_theme` looks for a CJK font (the ``mplfonts`` package from the ``lab`` extra,
Debian's ``fonts-noto-cjk``, or a system font such as Microsoft JhengHei / PingFang TC) and
sets it; :func:`label` then returns the Chinese text, otherwise the English one, so a plot
never shows "Glyph missing" boxes. A font installed after matplotlib cached its font list is
found too: the list is refreshed when it holds no CJK font.

Used in: every notebook.
"""
from __future__ import annotations

import functools
from pathlib import Path

import matplotlib

CJK_FAMILIES = ("Noto Sans CJK TC", "Noto Sans CJK JP", "Noto Sans CJK SC", "Source Han Sans TW",
                "Source Han Sans SC", "Microsoft JhengHei", "PingFang TC", "Heiti TC",
                "WenQuanYi Zen Hei", "Noto Sans TC", "Noto Sans SC")


@functools.cache
def cjk_font() -> str | None:
    """Name of an installed font family that draws Chinese, or None.

    matplotlib lists fonts from a cache it built on its first run, so a font installed later is
    missing from that list. When the list has no CJK family, the font files on the system now
    (``fc-list`` and the usual font folders) that it lacks are added, and the search runs again.
    """
    from matplotlib import font_manager

    manager = font_manager.fontManager
    _add_fonts(manager, _mplfonts_files())
    font = _find_cjk(manager)
    if font is None and _add_fonts(manager, font_manager.findSystemFonts()):
        font = _find_cjk(manager)
    return font


def _find_cjk(manager) -> str | None:
    """The first of :data:`CJK_FAMILIES` that ``manager`` (a matplotlib FontManager) lists."""
    available = {f.name for f in manager.ttflist}
    return next((name for name in CJK_FAMILIES if name in available), None)


def _mplfonts_files() -> list[str]:
    """The Noto Sans CJK files the ``mplfonts`` package ships (registered without its CLI)."""
    try:
        import mplfonts
    except ImportError:
        return []
    return [str(p) for p in sorted((Path(mplfonts.__file__).parent / "fonts").glob("NotoSansCJK*"))]


def _add_fonts(manager, paths) -> int:
    """Add the font files among ``paths`` that ``manager`` does not list yet; returns how many."""
    known = {f.fname for f in manager.ttflist}
    added = 0
    for path in dict.fromkeys(map(str, paths)):
        if path in known:
            continue
        try:
            manager.addfont(path)
        except Exception:  # noqa: BLE001 - an unreadable font file is skipped, as matplotlib's own scan does
            continue
        added += 1
    return added


def use_theme() -> None:
    """Apply the course style: white grid, readable sizes, a CJK font when there is one."""
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook")
    font = cjk_font()
    matplotlib.rcParams["font.sans-serif"] = ([font] if font else []) + ["DejaVu Sans"]
    matplotlib.rcParams["axes.unicode_minus"] = False
    matplotlib.rcParams["figure.dpi"] = 110


def label(zh: str, en: str) -> str:
    """``zh`` if Chinese can be drawn, else ``en``."""
    return zh if cjk_font() else en


def sweep_plot(df, *, metric: str = "tflops", path: str | Path | None = None):
    """Line plot of an attention sweep: ``metric`` vs N per backend, one panel per
    (mode, causal, D). ``df`` is :func:`labkit.engine.bench.attention_sweep`'s output.

    Returns the matplotlib Figure (also saved to ``path`` when given).
    """
    import matplotlib.pyplot as plt

    use_theme()
    ok = df[df["status"] == "ok"]
    panels = sorted(ok.groupby(["mode", "causal", "D"]).groups)
    cols = min(4, len(panels)) or 1
    rows = -(-len(panels) // cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False, sharey=False)
    names = {"tflops": label("TFLOP/s", "TFLOP/s"), "ms": label("時間 (ms)", "time (ms)"),
             "extra_mib": label("額外記憶體 (MiB)", "extra memory (MiB)")}
    for ax, (mode, causal, d) in zip(axes.flat, panels):
        part = ok[(ok["mode"] == mode) & (ok["causal"] == causal) & (ok["D"] == d)]
        for backend, g in part.groupby("backend"):
            ax.plot(g["N"], g[metric], marker="o", label=backend)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{mode}, {'causal' if causal else 'non-causal'}, D={d}", fontsize=10)
        ax.set_xlabel(label("序列長度 N", "sequence length N"))
        ax.set_ylabel(names.get(metric, metric))
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    if panels:  # no "ok" row: an empty figure, without matplotlib's empty-legend warning
        axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, bbox_inches="tight")
    return fig
