"""Tests for labkit.core.plots: Chinese labels only where a CJK font exists, never a missing glyph."""
from __future__ import annotations

import contextlib
import copy
import io
import logging
import sys
import warnings

import matplotlib
import matplotlib.pyplot as plt
import pandas as pd
import pytest
from matplotlib.figure import Figure

import labkit as lk

P = lk.plots


@contextlib.contextmanager
def glyph_problems(caplog):
    """Collect "Glyph ... missing" warnings (and log records) raised inside the block."""
    found = []
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, logger="matplotlib"):
        warnings.simplefilter("always")
        yield found
    found += [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    found[:] = [m for m in found if "Glyph" in m and "missing" in m]


def fake_sweep() -> pd.DataFrame:
    """A small attention_sweep-shaped frame: 2 backends x 2 N x (mode, causal) panels, plus oom rows."""
    rows = []
    for mode in ("fwd", "fwd_bwd"):
        for causal in (False, True):
            for n in (64, 128):
                for i, backend in enumerate(("reference", "sdpa_math")):
                    rows.append(dict(backend=backend, B=2, H=2, N=n, D=32, causal=causal, mode=mode, status="ok",
                                     ms=0.1 * n / (i + 1), tflops=1.0 + i + n / 100, extra_mib=float(n)))
                rows.append(dict(backend="flash_attn", B=2, H=2, N=n, D=32, causal=causal, mode=mode, status="oom",
                                 ms=float("nan"), tflops=float("nan"), extra_mib=float("nan")))
    return pd.DataFrame(rows)


def test_label_follows_cjk_font(monkeypatch):
    monkeypatch.setattr(P, "cjk_font", lambda: "Noto Sans CJK TC")
    assert P.label("時間", "time") == "時間"
    monkeypatch.setattr(P, "cjk_font", lambda: None)
    assert P.label("時間", "time") == "time"


def test_cjk_font_is_installed_or_none():
    from matplotlib import font_manager

    font = P.cjk_font()
    assert font is None or (font in P.CJK_FAMILIES and font in {f.name for f in font_manager.fontManager.ttflist})


@pytest.fixture
def fresh_cjk_lookup():
    """cjk_font() looked up again inside the test, and again after it (it is cached per process)."""
    P.cjk_font.cache_clear()
    yield
    P.cjk_font.cache_clear()


@pytest.mark.parametrize("installed", [True, False], ids=["font-installed-later", "no-font"])
def test_cjk_font_installed_after_matplotlib_cached_its_list(monkeypatch, tmp_path, fresh_cjk_lookup, installed):
    """A font list read from a cache built before the CJK font was installed is refreshed from the system."""
    from matplotlib import font_manager

    real = font_manager.fontManager
    cjk_files = sorted({f.fname for f in real.ttflist if f.name in P.CJK_FAMILIES})
    if not cjk_files:
        pytest.skip("no CJK font file here to install (pip install mplfonts, or Debian fonts-noto-cjk)")
    stale = copy.copy(real)  # the cached list: every font but the CJK ones
    stale.ttflist = [f for f in real.ttflist if f.fname not in cjk_files]
    broken = tmp_path / "broken.ttf"
    broken.write_bytes(b"not a font")
    system_now = [f.fname for f in stale.ttflist] + [str(broken)] + (cjk_files if installed else [])
    monkeypatch.setattr(font_manager, "fontManager", stale)
    monkeypatch.setattr(font_manager, "findSystemFonts", lambda *args, **kwargs: system_now)
    monkeypatch.setitem(sys.modules, "mplfonts", None)  # `import mplfonts` fails: only the system's fonts count

    cached, real_fonts = list(stale.ttflist), list(real.ttflist)
    font = P.cjk_font()
    assert real.ttflist == real_fonts, "the process's own font list is left alone"
    if not installed:
        assert font is None and stale.ttflist == cached, "nothing to add: the broken file is skipped"
        return
    assert font in P.CJK_FAMILIES, "the font installed after the cache was built is found"
    assert stale.findfont(font, fallback_to_default=False) in cjk_files, "matplotlib draws with its file"


def test_cjk_font_does_not_rescan_when_the_list_has_one(monkeypatch, fresh_cjk_lookup):
    from matplotlib import font_manager

    if not any(f.name in P.CJK_FAMILIES for f in font_manager.fontManager.ttflist):
        pytest.skip("no CJK font in matplotlib's list here")
    monkeypatch.setattr(font_manager, "findSystemFonts", lambda *args, **kwargs: pytest.fail("rescanned"))
    assert P.cjk_font() in P.CJK_FAMILIES


@pytest.mark.parametrize("font", [None, "Noto Sans CJK TC"])
def test_use_theme_sets_font(monkeypatch, font):
    monkeypatch.setattr(P, "cjk_font", lambda: font)
    with matplotlib.rc_context():
        P.use_theme()
        assert matplotlib.rcParams["font.sans-serif"] == ([font] if font else []) + ["DejaVu Sans"]
        assert matplotlib.rcParams["axes.unicode_minus"] is False


@pytest.mark.parametrize("font", ["installed", "none"])
def test_sweep_plot_figure_and_png(tmp_path, caplog, monkeypatch, font):
    if font == "none":  # as on a machine without any CJK font: English labels
        monkeypatch.setattr(P, "cjk_font", lambda: None)
    path = tmp_path / "sweep.png"
    with matplotlib.rc_context(), glyph_problems(caplog) as problems:
        fig = P.sweep_plot(fake_sweep(), metric="ms", path=path)
        fig.canvas.draw()
    try:
        assert isinstance(fig, Figure)
        visible = [ax for ax in fig.axes if ax.get_visible()]
        assert len(visible) == 4, "one panel per (mode, causal, D)"
        for ax in visible:
            assert sorted(line.get_label() for line in ax.get_lines()) == ["reference", "sdpa_math"]
            assert ax.get_ylabel() == P.label("時間 (ms)", "time (ms)")
            assert ax.get_xlabel() == P.label("序列長度 N", "sequence length N")
        assert {ax.get_title() for ax in visible} == {
            f"{m}, {c}, D=32" for m in ("fwd", "fwd_bwd") for c in ("causal", "non-causal")}
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
        assert problems == [], problems
    finally:
        plt.close(fig)


def test_sweep_plot_uses_chinese_labels_when_a_font_exists(monkeypatch):
    monkeypatch.setattr(P, "cjk_font", lambda: "Noto Sans CJK TC")
    with matplotlib.rc_context(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # this machine may lack the font: only the text is checked
        fig = P.sweep_plot(fake_sweep(), metric="extra_mib")
    plt.close(fig)
    assert fig.axes[0].get_xlabel() == "序列長度 N" and fig.axes[0].get_ylabel() == "額外記憶體 (MiB)"


def test_glyph_detector_works(caplog):
    # Without this the "no glyph warning" test above could pass by never seeing any warning.
    rc = {"font.family": ["sans-serif"], "font.sans-serif": ["DejaVu Sans"]}  # a font without CJK glyphs
    with matplotlib.rc_context(rc), glyph_problems(caplog) as problems:
        fig, ax = plt.subplots()
        ax.set_title("時間")
        fig.canvas.draw()
    plt.close(fig)
    assert problems, "drawing Chinese without a CJK font should report missing glyphs"


def test_sweep_plot_without_ok_rows(tmp_path):
    df = fake_sweep()
    df["status"] = "oom"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. matplotlib's "No artists with labels found" warning
        fig = P.sweep_plot(df, path=tmp_path / "empty.png")
    plt.close(fig)
    assert (tmp_path / "empty.png").exists()


def test_chinese_plot_has_no_missing_glyphs_where_a_cjk_font_exists(caplog):
    """With the font cjk_font() finds, Chinese titles, labels and legends draw without "Glyph missing"."""
    from matplotlib import font_manager

    font = P.cjk_font()
    if font is None:
        pytest.skip("no CJK font here (pip install mplfonts, or Debian fonts-noto-cjk)")
    with matplotlib.rc_context(), glyph_problems(caplog) as problems:
        P.use_theme()
        fig, ax = plt.subplots()
        ax.plot([1, 2, 4], [1, 3, 2], label=P.label("標準注意力", "standard attention"))
        ax.set_title(P.label("序列長度與記憶體（FlashAttention）", "sequence length vs memory"))
        ax.set_xlabel(P.label("序列長度 N", "sequence length N"))
        ax.set_ylabel(P.label("額外記憶體 (MiB)", "extra memory (MiB)"))
        ax.legend()
        fig.savefig(io.BytesIO(), format="png")
        used = font_manager.findfont(ax.title.get_fontproperties(), fallback_to_default=False)
    plt.close(fig)
    assert ax.get_title().startswith("序列長度"), "a CJK font exists, so the labels are Chinese"
    assert problems == [], problems
    assert font_manager.get_font(used).family_name in P.CJK_FAMILIES, (used, font)  # drawn with a CJK font
