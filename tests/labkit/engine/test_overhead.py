"""Tests for labkit.engine.overhead: the table of auto and labkit against the kernels called directly (CPU run)."""
from __future__ import annotations

import gc
import random
import statistics

import pandas as pd
import pytest
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


def test_paired_ratio_cancels_what_drifts_between_rounds():
    slow_host = [1.0, 2.0, 1.5, 3.0, 1.2]  # a call whose time follows the host's speed round by round
    same_kernel = [t * 1.01 for t in slow_host]
    assert O.paired_ratio(slow_host, same_kernel) == pytest.approx(1 / 1.01)
    assert statistics.median(slow_host) / statistics.median([1.1, 2.2, 1.4, 3.1, 1.3]) != pytest.approx(1 / 1.01)
    with pytest.raises(ValueError):
        O.paired_ratio([1.0, 2.0], [1.0])  # rounds that do not pair up


def test_take_turns_stops_timing_clearly_slower_direct_calls():
    names = ["direct:fast", "direct:close", "direct:slow", "direct:picked_slow", "auto", "labkit:picked_slow",
             "control"]
    ms = {"direct:fast": 1.0, "direct:close": 1.2, "direct:slow": 2.0, "direct:picked_slow": 2.5}
    calls = {name: (lambda name=name: name) for name in names}
    measured = O._take_turns(calls, 12, lambda fn: ms.get(fn(), 1.0), order=random.Random(0),
                             keep="direct:picked_slow")
    rounds = {name: len(v) for name, v in measured.items()}
    assert rounds["direct:slow"] == O.SCREEN_ROUNDS, "over the cutoff: timed in the screening rounds only"
    assert all(rounds[n] == 12 for n in names if n != "direct:slow"), "within the cutoff, auto's pick, and the rest"
    assert gc.isenabled(), "the garbage collector is back on after timing"
