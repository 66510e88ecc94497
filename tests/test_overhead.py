"""Tests for labkit.overhead: the table of auto and labkit against the kernels called directly (CPU run)."""
from __future__ import annotations

import pandas as pd
import torch

import labkit as lk
from labkit.__main__ import main

O = lk.overhead


def test_direct_call_is_the_kernel_without_labkit():
    q, k, v = (torch.randn(1, 12, 2, 16) for _ in range(3))  # bnhd
    direct = O.direct_call("sdpa_flash", causal=True, layout="bnhd")(q, k, v)
    via = lk.attention.attention(q, k, v, causal=True, backend="sdpa_math", layout="bnhd")
    torch.testing.assert_close(direct, via, atol=1e-6, rtol=0)


def test_vs_direct_rows_and_columns(tmp_path):
    configs = lk.bench.fixed_token_configs([32], [16], tokens=64, width=32)
    df = O.vs_direct(configs, modes=("fwd", "fwd_bwd"), rounds=2, rep_ms=2, dtype=torch.float32, device="cpu",
                     progress=False, partial_csv=tmp_path / "t.csv")
    assert len(df) == 2 * 2 * 2, "one row per layout, causal flag and mode"
    assert (df["best"] == "sdpa_flash").all() and (df["pick"] == "sdpa_flash").all(), "the one CPU candidate"
    for col in ("auto_over_best", "labkit_over_direct", "control"):
        assert df[col].between(0.2, 5).all(), df[col]
    assert {"ms direct:sdpa_flash", "ms auto", "ms labkit:sdpa_flash", "ms control"} <= set(df.columns)
    assert len(pd.read_csv(tmp_path / "t.csv")) == len(df), "the partial CSV holds every row"


def test_cli_vs_direct_writes_the_table(tmp_path, capsys):
    code = main(["bench", "--vs-direct", "--seq-lens", "32", "--head-dims", "16", "--tokens", "64", "--width", "32",
                 "--dtype", "fp32", "--modes", "fwd", "--causal", "yes", "--rounds", "1", "--rep-ms", "2",
                 "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and (tmp_path / "vs_direct.csv").exists()
    assert "auto / best direct call: min" in out and "control (a kernel against itself)" in out


def test_slow_rows_tell_a_wrong_pick_from_timing_noise():
    df = pd.DataFrame(dict(N=[1024, 1024, 2048], best=["fa4", "sdpa_cudnn", "fa4"], pick=["fa4", "fa4", "fa4"],
                           auto_over_best=[0.95, 0.91, 0.99]))
    slow = O.slow_rows(df)
    assert list(slow["N"]) == [1024, 1024], "only rows below 0.97"
    assert list(slow["cause"]) == ["noise", "pick"]
    assert O.slow_rows(df, threshold=0.9).empty
