"""Tests for the command line: ``python -m labkit doctor`` and ``python -m labkit bench``."""
from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest
import torch

import labkit as lk
from labkit.__main__ import main


def test_doctor_in_process(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "backend" in out and "runs here" in out and "reason" in out
    assert all(b in out for b in lk.attention.BACKENDS)


def test_doctor_subprocess():
    proc = subprocess.run([sys.executable, "-m", "labkit", "doctor"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"torch {torch.__version__}" in proc.stdout and "runs here" in proc.stdout
    backends_table, _, auto_tables = proc.stdout.partition("auto for ")
    first_words = [line.split()[0] for line in backends_table.splitlines() if line.split()]
    table_lines = [w for w in first_words if w in lk.attention.BACKENDS]
    assert len(table_lines) == len(lk.attention.BACKENDS), proc.stdout
    assert proc.stdout.count("auto for ") == 2 and "chosen" in auto_tables, proc.stdout   # training, then inference


def test_bench_writes_csv_and_png(tmp_path, capsys):
    out = tmp_path / "bench"
    argv = ["bench", "--seq-lens", "64,128", "--head-dims", "32", "--tokens", "256", "--width", "64",
            "--out", str(out), "--target-ms", "2", "--dtype", "fp32"]  # fp32: the CPU default, also on a GPU
    assert main(argv) == 0
    df = pd.read_csv(out / "attention_sweep.csv")
    png = out / "attention_sweep.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    device = lk.env.default_device()
    backends = {b for b in lk.attention.BACKENDS  # every backend that runs here, plus auto
                if lk.attention.why_not(b, device=device, dtype=torch.float32, head_dim=32) is None} | {"auto"}
    if device.type == "cpu":
        assert backends == {"reference", "sdpa_math", "sdpa_flash", "auto"}
    assert set(df["backend"]) == backends
    assert len(df) == 2 * 2 * 2 * len(backends), "2 configs x causal/non-causal x fwd/fwd_bwd x backends"
    assert not df.duplicated(["N", "causal", "mode", "backend"]).any()
    assert (df["status"] == "ok").all() and (df["dtype"] == "float32").all()
    configs = df[["B", "H", "N", "D"]].drop_duplicates().sort_values("N").values.tolist()
    assert configs == [[4, 2, 64, 32], [2, 2, 128, 32]], "B*N = --tokens, H*D = --width"
    printed = capsys.readouterr().out
    assert f"wrote {out / 'attention_sweep.csv'}" in printed and "sdpa_math" in printed


def test_bench_options_select_rows(tmp_path):
    out = tmp_path / "b"
    argv = ["bench", "--seq-lens", "32", "--head-dims", "16", "--tokens", "64", "--width", "32", "--out", str(out),
            "--backends", "sdpa_math,reference", "--causal", "yes", "--modes", "fwd", "--dtype", "fp32",
            "--target-ms", "1"]
    assert main(argv) == 0
    df = pd.read_csv(out / "attention_sweep.csv")
    assert sorted(df["backend"]) == ["reference", "sdpa_math"]
    assert df["causal"].tolist() == [True, True] and set(df["mode"]) == {"fwd"}


def test_bench_unknown_backend_exits_2(tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["bench", "--backends", "sdpa_math,flash3", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "unknown backend(s) ['flash3']" in err and "sdpa_math" in err and "auto" in err
    assert not out.exists(), "nothing is written for a bad command"


@pytest.mark.parametrize("argv", [["bench", "--seq-lens", "64,abc"], ["bench", "--dtype", "fp8"], ["nonsense"], []])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "usage:" in capsys.readouterr().err


@pytest.mark.parametrize("modes", ["bwd", "fwd,backward", ","])
def test_bench_unknown_mode_exits_2(tmp_path, capsys, modes):
    out = tmp_path / "never"
    assert main(["bench", "--modes", modes, "--out", str(out)]) == 2
    assert "--modes takes fwd, fwd_bwd or fwd,fwd_bwd" in capsys.readouterr().err
    assert not out.exists(), "nothing is written for a bad command"
