"""Tests for the command line: ``python -m labkit doctor`` and ``python -m labkit bench``."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
    line = bad_command(["bench", "--backends", "sdpa_math,flash3", "--out", str(out)], capsys)
    assert "unknown backend(s) ['flash3']" in line and "sdpa_math" in line and "auto" in line
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
    line = bad_command(["bench", "--modes", modes, "--out", str(out)], capsys)
    assert "argument --modes" in line and "choose from fwd, fwd_bwd" in line
    assert not out.exists(), "nothing is written for a bad command"


# ----------------------------------------------------------------------------- bad input, as a new user types it

ROOT = Path(__file__).resolve().parents[2]
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the rule holds on a machine without CUDA")


def bad_command(argv: list[str], capsys) -> str:
    """Run ``python -m labkit *argv`` in this process; it must stop before any work with exit status 2
    and one error line (argparse's, under the usage), which is returned."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert "Traceback" not in err and err.startswith("usage: "), err
    lines = err.strip().splitlines()
    assert ": error: " in lines[-1] and not any(": error: " in line for line in lines[:-1]), err
    return lines[-1]


# argv ("FILE", "FOLDER", "MISSING", "EXECUTED" stand for paths the test makes) and what the one line says:
# the option, the rule and a valid value.
BAD_INPUT = [
    (["bench", "--seq-lens", "0"], ["argument --seq-lens", "integers >= 1", "e.g. 512,1024", "got '0'"]),
    (["bench", "--seq-lens", "-5"], ["argument --seq-lens", "integers >= 1", "got '-5'"]),
    (["bench", "--seq-lens", ","], ["argument --seq-lens", "e.g. 512,1024"]),
    (["bench", "--head-dims", "0"], ["argument --head-dims", "integers >= 1", "e.g. 64,128"]),
    (["bench", "--tokens", "0"], ["argument --tokens", "integer >= 1", "e.g. 16384"]),
    (["bench", "--width", "-1"], ["argument --width", "integer >= 1", "e.g. 2048"]),
    (["bench", "--target-ms", "0"], ["argument --target-ms", "number > 0", "e.g. 100"]),
    (["bench", "--target-ms", "nan"], ["argument --target-ms", "number > 0"]),
    (["bench", "--vs-direct", "--rounds", "0"], ["argument --rounds", "integer >= 1", "e.g. 60"]),
    (["bench", "--vs-direct", "--rep-ms", "-1"], ["argument --rep-ms", "number > 0", "e.g. 10"]),
    (["bench", "--backends", ""], ["argument --backends", "no backend", "choose from reference, sdpa_math"]),
    pytest.param(["bench", "--backends", "fa4,sdpa_cudnn"], ["argument --backends: none runs here (fa4: needs a",
                                                            "these do: reference, sdpa_math, sdpa_flash, auto"],
                 marks=CPU_ONLY),
    (["bench", "--out", "FILE"], ["argument --out", "a file, not a folder", "e.g. build/bench"]),
    (["execute", "--only", "99"], ["argument --only", "no solution notebook starts with 99", "01_setup_and_comparison",
                                   "e.g. --only 01"]),
    (["execute", "--only", "01,99"], ["argument --only", "starts with 99;"]),
    (["execute", "--only", ","], ["argument --only", "e.g. 01,03"]),
    (["execute", "--root", "MISSING"], ["argument --root", "no folder", "the course folder (it holds solutions/)"]),
    (["execute", "--root", "FOLDER"], ["argument --root", "holds no solutions", "the course folder"]),
    (["execute", "--timeout", "0"], ["argument --timeout", "integer >= 1", "e.g. 1800"]),
    (["execute", "--out", "FILE"], ["argument --out", "a file, not a folder", "e.g. build/execute"]),
    (["reference", "--from", "MISSING"], ["argument --from", "no folder", "e.g. build/execute"]),
    (["reference", "--from", "FOLDER"], ["argument --from", "holds no", "the folder make execute wrote"]),
    pytest.param(["reference", "--from", "EXECUTED"], ["a CUDA GPU"], marks=CPU_ONLY),
    (["bundle", "--root", "MISSING"], ["argument --root", "the course folder"]),
    (["bundle", "--out", "MISSING"], ["argument --out", "neither a file name ending in .zip nor an existing folder",
                                      "e.g. build/student-bundle.zip or build"]),
    (["bundle", "--out", "FILE"], ["argument --out", "a file' is neither", "e.g. build/student-bundle.zip"]),
    (["longctx", "compare", "--seq-len", "-1"], ["argument --seq-lens", "integers >= 2", "got '-1'"]),
    (["longctx", "compare", "--seq-lens", "1"], ["argument --seq-lens", "integers >= 2"]),
    (["longctx", "compare", "--implementations", "sdpa,foo"], ["argument --implementations", "'foo'", "'sdpa'"]),
    (["longctx", "compare", "--implementations", "labkit:flash3"], ["unknown labkit backend 'flash3'", "fa4"]),
    (["longctx", "compare", "--rounds", "0"], ["argument --rounds", "integer >= 1"]),
    (["longctx", "compare", "--config", "rope+ckpt+chunked+mlp+offload"], ["RoPE", "give labkit"]),
    (["longctx", "compare", "--out", "FILE"], ["argument --out", "a file"]),
    (["longctx", "search", "--configs", "nope", "--max-len", "64"], ["unknown config(s) ['nope']", "flash+ckpt"]),
    (["longctx", "search", "--start", "0", "--max-len", "64"], ["argument --start", "integer >= 2"]),
    (["longctx", "search", "--start", "64", "--max-len", "32"], ["argument --max-len", "at least --start (64)",
                                                                  "got 32", "e.g. 128"]),
    (["longctx", "search", "--attention", "sdpa", "--max-len", "64"], ["RoPE", "labkit:<backend>"]),
    (["longctx", "search", "--max-step-s", "0", "--max-len", "64"], ["argument --max-step-s", "number > 0"]),
    (["longctx", "search", "--chunk-size", "0", "--max-len", "64"], ["argument --chunk-size", "integer >= 1"]),
    pytest.param(["longctx", "search", "--start", "32"], ["argument --max-len", "a CPU needs one", "e.g. 64"],
                 marks=CPU_ONLY),
    (["cp-train", "--seq-len", "0", "--single"], ["argument --seq-len", "integer >= 2", "got 0"]),
    (["cp-train", "--seq-len", "513", "--nproc", "2", "--cpu"], ["argument --seq-len", "multiple of 2*2 = 4", "got 513",
                                                                 "e.g. 512"]),
    (["cp-train", "--seq-len", "-5", "--nproc", "2"], ["argument --seq-len", "integer >= 2", "got -5"]),
    (["cp-train", "--seq-len", "16", "--nproc", "3", "--cpu"], ["multiple of 2*3 = 6", "e.g. 12"]),
    (["cp-train", "--seq-len", "64", "--nproc", "0"], ["argument --nproc", "integer >= 1"]),
    (["cp-train", "--seq-len", "64", "--single", "--steps", "0"], ["argument --steps", "integer >= 1"]),
    (["cp-train", "--seq-len", "64", "--single", "--chunk-size", "0"], ["argument --chunk-size", "integer >= 1"]),
    (["cp-train", "--seq-len", "64", "--check"], ["--check", "--nproc 2 or more"]),
    (["cp-train", "--seq-len", "64", "--check", "--nproc", "2", "--single"], ["--check", "without --single"]),
    (["cp-train", "--seq-len", "64", "--single", "--json", "FOLDER"], ["argument --json", "is a folder",
                                                                      "e.g. build/cp.json"]),
    (["cp-train", "--seq-len", "64", "--size", "huge"], ["argument --size", "invalid choice", "'tiny'"]),
    (["board", "08_decode_attention", "--submitted", "MISSING"], ["argument --submitted", "no folder",
                                                                   "e.g. submitted"]),
    (["board", "08_decode_attention", "--submitted", "FOLDER"], ["argument --submitted", "<student>/08_decode_attention/"
                                                                  "08_decode_attention.ipynb", "e.g. --submitted"]),
    (["board", "07_context_parallel", "--submitted", "FOLDER"], ["argument assignment", "invalid choice",
                                                                  "'08_decode_attention'"]),
    (["board", "08_decode_attention", "--submitted", "FOLDER", "--timeout", "0"], ["argument --timeout",
                                                                                    "integer >= 1", "e.g. 900"]),
    (["board", "08_decode_attention", "--submitted", "FOLDER", "--seed", "-1"], ["argument --seed", "integer >= 0"]),
    (["board", "08_decode_attention", "--submitted", "FOLDER", "--jobs", "0"], ["argument --jobs", "integer >= 1"]),
    (["board", "08_decode_attention", "--submitted", "FOLDER", "--memory-gb", "0"], ["argument --memory-gb",
                                                                                      "number > 0", "e.g. 16"]),
    (["board", "08_decode_attention", "--submitted", "FOLDER", "--out", "FILE"], ["argument --out", "a file",
                                                                                   "e.g. build/board"]),
]


@pytest.mark.parametrize("argv, says", BAD_INPUT, ids=lambda v: " ".join(v) if isinstance(v[0], str) and
                         v[0] in ("bench", "execute", "reference", "bundle", "longctx", "cp-train", "board") else "")
def test_bad_input_answers_one_line_with_exit_status_2(argv, says, tmp_path, monkeypatch, capsys):
    """Every command checks its arguments before it starts any work: one line names the option, the rule and a
    valid value, exit status 2, as argparse answers (no traceback, nothing written, no process started)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("LOCAL_RANK", raising=False)  # cp-train as a user starts it, not as a torchrun worker
    (tmp_path / "a file").write_text("x")
    (tmp_path / "executed").mkdir()
    (tmp_path / "executed" / "01_a.ipynb").write_text("{}")
    paths = {"FILE": tmp_path / "a file", "FOLDER": tmp_path, "MISSING": tmp_path / "missing",
             "EXECUTED": tmp_path / "executed"}
    before = sorted(tmp_path.rglob("*"))
    line = bad_command([str(paths.get(a, a)) for a in argv], capsys)
    missing = [s for s in says if s not in line]
    assert not missing, f"{missing} not in {line!r}"
    assert sorted(tmp_path.rglob("*")) == before, "nothing is written for a bad command"


def test_the_board_offers_every_assignment_it_ranks():
    """The command line names the board's assignments itself (the board is not in the student bundle, so the
    parser cannot import it): they must be the board's registry, 10_fp8_attention included."""
    from labkit.__main__ import _parser
    from labkit.board.specs import SPECS

    choices = next(a.choices for a in _parser().commands["board"]._actions if a.dest == "assignment")
    assert list(choices) == list(SPECS) and "10_fp8_attention" in choices


@pytest.mark.parametrize("command", [["doctor"], ["bench"], ["execute"], ["reference"], ["bundle"],
                                     ["longctx", "compare"], ["longctx", "search"], ["cp-train"],
                                     ["board"]])
def test_help_shows_every_option(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"])
    assert info.value.code == 0
    assert "usage: python -m labkit " + command[0] in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["cp-train", "--seq-len", "513", "--nproc", "2", "--cpu"],
                                  ["bench", "--seq-lens", "0"], ["execute", "--only", "99"]])
def test_python_m_labkit_exits_2_with_one_error_line(argv):
    """The cases first reported, as a user runs them: no traceback, no torchrun, no gloo abort."""
    proc = subprocess.run([sys.executable, "-m", "labkit", *argv], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.strip().splitlines()[-1].count(": error: ") == 1
