"""Tests for the speed-of-light board (``labkit.board.rank``, ``boardrun``, ``boardshapes``, ``boardreport``).

The boards run on a CPU through Triton's interpreter (correctness only): synthetic submissions made from the
solution notebooks (tests/support/board_fixture.py), one process per student; the 08, 06, 09 and 10 boards run at once,
each student in its own process (10's two at a time: each also compiles its kernel for sm90). The student that
sleeps past the limit is an 08 board of its own, run beside them with a short limit (the limit is what it tests): it
no longer holds a worker for the others' generous one.
"""
from __future__ import annotations

import concurrent.futures
import json
import math

import pandas as pd
import pytest

from board_fixture import ROOT, variant, write_submitted
from labkit.board import rank as board, report as boardreport, specs as boardshapes

LIMIT = 90   # s per student: the 15 students run at once on CI's 2 cores; beside other work, one of them once
#              passed 60 s (an ok worker alone takes about 18 s)
SLEEPER_LIMIT = 30   # s, the sleeper's board: its probe (the setup cell, ~5 s alone) must pass within it
CHEATS = ("lookup", "matmul", "small")   # 08's decode_split: SDPA by a built name, torch.matmul, a kernel for small inputs
STUDENTS = {"08_decode_attention": ["ok", "wrong", "flagged", "error", "tamper", *CHEATS],
            "06_triton_flashattention": ["ok", "wrong", "flagged", "pytorch"],
            "09_flex_attention": ["ok", "wrong", "flagged"],
            "10_fp8_attention": ["ok", "wrong", "bf16", "flagged"]}
JOBS = {"10_fp8_attention": 2}   # students at once (default: all of a board's)
FLAGGED = ("tamper", "pytorch", "bf16", *CHEATS)   # students whose status is flagged, besides "flagged"
LIBRARY = {"08_decode_attention": "scaled_dot_product_attention",
           "06_triton_flashattention": "scaled_dot_product_attention", "09_flex_attention": "flex_attention",
           "10_fp8_attention": "scaled_dot_product_attention"}
TAMPER = ("class PageAllocator:\n", "import labkit.core.measure\n\nlabkit.core.measure.time_interleaved = "
                                    "lambda fns, **kwargs: ({}, {})\n\n\nclass PageAllocator:\n")


@pytest.fixture(scope="module")
def boards(tmp_path_factory):
    """assignment -> (the board's rows, its output folder), and "sleeper" -> the same of the sleeper's 08 board; the
    four boards run at once."""
    root = tmp_path_factory.mktemp("board")
    for assignment, students in STUDENTS.items():
        write_submitted(root / "submitted" / assignment, assignment, [s for s in students if s != "tamper"])
    write_submitted(root / "sleeper", "08_decode_attention", ["timeout"])
    tamper = variant("08_decode_attention", "ok")
    cell = next(c for c in tamper["cells"] if TAMPER[0] in "".join(c["source"]))
    cell["source"] = "".join(cell["source"]).replace(*TAMPER)
    folder = root / "submitted" / "08_decode_attention" / "tamper" / "08_decode_attention"
    folder.mkdir(parents=True)
    (folder / "08_decode_attention.ipynb").write_text(json.dumps(tamper), encoding="utf-8")
    with concurrent.futures.ThreadPoolExecutor(len(STUDENTS) + 1) as pool:
        runs = {a: pool.submit(board.board, a, root / "submitted" / a, root / a, seed=7, timeout=LIMIT, gpu=False,
                               jobs=JOBS.get(a, len(STUDENTS[a]))) for a in STUDENTS}
        runs["sleeper"] = pool.submit(board.board, "08_decode_attention", root / "sleeper", root / "sleeper_board",
                                      seed=7, timeout=SLEEPER_LIMIT, gpu=False)
        return {a: (run.result().set_index("student"), root / ("sleeper_board" if a == "sleeper" else a))
                for a, run in runs.items()}


@pytest.mark.parametrize("assignment", list(STUDENTS))
def test_each_submission_gets_its_status(boards, assignment):
    table, out = boards[assignment]
    expected = {s: ("flagged" if s in FLAGGED else s) for s in STUDENTS[assignment]}
    assert table["status"].to_dict() == expected, table[["status", "detail"]].to_string()
    assert table.loc["ok", "detail"] == ""
    assert LIBRARY[assignment] in table.loc["flagged", "detail"]
    assert table["score"].isna().all(), "a CPU board checks correctness only: no score"
    csv = pd.read_csv(out / "board.csv")
    assert {"student", "status", "detail", "score"} <= set(csv.columns) and len(csv) == len(expected)
    assert list(csv["status"]) == sorted(csv["status"], key=boardreport.ORDER.get), "ranked: ok first"
    page = (out / "board.html").read_text(encoding="utf-8")
    assert all(s in page for s in expected) and "correctness only" in page
    assert "NA&gt;" not in page and "<NA>" not in page, "an unranked student's rank is an empty cell"
    ok_log = (out / "logs" / "ok.log").read_text(encoding="utf-8")
    assert "--- cell " in ok_log and "Traceback" not in ok_log and ok_log.endswith("--- board: ok\n")
    assert (out / "logs" / "_probe.log").read_text(encoding="utf-8").startswith("--- cell ")


def test_06_a_forward_without_triton_is_flagged(boards):
    table, _ = boards["06_triton_flashattention"]
    assert "launched none of the notebook's own Triton kernels" in table.loc["pytorch", "detail"]


def test_08_statuses_name_their_cause(boards):
    table, _ = boards["08_decode_attention"]
    assert "NameError" in table.loc["error", "detail"] and "cell" in table.loc["error", "detail"]
    sleeper, _ = boards["sleeper"]
    assert sleeper["status"].to_dict() == {"timeout": "timeout"}
    assert f"past the {SLEEPER_LIMIT} s limit" in sleeper.loc["timeout", "detail"]
    assert "labkit.core.measure.time_interleaved" in table.loc["tamper", "detail"]
    assert "lens=" in table.loc["wrong", "detail"], "the wrong answer is named with the shape that showed it"


def test_08_cheats_are_flagged_by_what_their_calls_ran(boards):
    """Names built at run time, torch.matmul with a hand softmax, a kernel launched only for the tiny call: the name
    checks see none of them; what the board's check ran does (labkit.board.runs)."""
    detail = boards["08_decode_attention"][0]["detail"]
    assert "decode_split ran " in detail["lookup"] and "softmax or attention" in detail["lookup"], detail["lookup"]
    assert "decode_split ran torch's " in detail["matmul"] and "matrix products" in detail["matmul"], detail["matmul"]
    assert "decode_split launched none of the notebook's own Triton kernels on the board's inputs" in detail["small"]


def test_08_each_log_holds_its_own_run(boards):
    _, out = boards["08_decode_attention"]
    logs = {s: (out / "logs" / f"{s}.log").read_text(encoding="utf-8") for s in STUDENTS["08_decode_attention"]}
    logs["timeout"] = (boards["sleeper"][1] / "logs" / "timeout.log").read_text(encoding="utf-8")
    error = logs["error"]
    assert "Traceback (most recent call last)" in error and 'File "<cell-' in error, error[-2000:]
    assert "BLOCK_SPLIT = block_size_for(64)" in error and "NameError: name 'block_size_for'" in error
    assert error.rstrip().splitlines()[-1].startswith("--- board: error: cell ")
    assert logs["wrong"].rstrip().splitlines()[-1].startswith("--- board: wrong: ")
    assert logs["timeout"].rstrip().splitlines()[-1] == f"--- board: timeout: past the {SLEEPER_LIMIT} s limit"
    assert len(set(logs.values())) == len(logs), "no two students' logs are the same"


def test_10_statuses_name_their_cause(boards):
    detail = boards["10_fp8_attention"][0]["detail"]
    assert detail["bf16"].startswith("fp8_attention: no FP8 MMA") and ".bf16.bf16" in detail["bf16"], detail["bf16"]
    assert "e4m3 bound" in detail["wrong"] and "per-tile descales" in detail["wrong"], detail["wrong"]


def _namespace(assignment: str, student: str) -> dict:
    from labkit.board import worker as boardrun

    ns = {"__name__": "__main__", "display": lambda *args, **kwargs: None}
    boardrun._run_cells(board.cells_to_run(variant(assignment, student), boardshapes.SPECS[assignment].graded), ns)
    return ns


def test_10_a_kernel_widened_to_bf16_is_right_and_flagged_by_its_compile_alone():
    """The bf16 variant passes the board's check (bf16 holds every e4m3 value); only the sm90 compile tells it from
    FP8 attention: the audit names the bf16 MMA it found, and finds nothing to say of the solution."""
    import torch

    spec, cpu = boardshapes.SPECS["10_fp8_attention"], torch.device("cpu")
    widened = _namespace("10_fp8_attention", "bf16")   # one at a time: the cells' source is read from linecache
    spec.check(widened, 11, cpu)
    assert ".bf16.bf16" in (spec.audit(widened, cpu) or "")
    assert spec.audit(_namespace("10_fp8_attention", "ok"), cpu) is None


def test_10_runs_the_kernel_and_its_helpers_not_the_sweep():
    nb = json.loads((ROOT / "solutions/10_fp8_attention/10_fp8_attention.ipynb").read_text(encoding="utf-8"))
    sources = "\n".join(c["source"] for c in board.cells_to_run(nb, boardshapes.SPECS["10_fp8_attention"].graded))
    assert "def fp8_attention" in sources and "def _fp8_fwd_kernel" in sources and "def quantize_per_tensor" in sources
    assert "fp8bench.sweep" not in sources and "gemm_ceiling" not in sources and "fp8study.run" not in sources


def test_10_timing_on_a_cpu_scores_against_the_fp8_gemm_ceiling(monkeypatch):
    """The 10 board's timing end to end at a toy size (the interpreter, no library kernel): TFLOP/s of the student's
    rows over the FP8 GEMM ceiling (the fastest FP8 variant, never the bf16 matmul), then the recheck."""
    import torch

    from labkit.board import nb10 as b10
    from labkit.fp8 import bench as fp8bench, ceilings

    roofs = {"n": 256, "device": "cpu", "tflops": {ceilings.BF16: 1e-2, "fp8_tensorwise": 2e-3, "fp8_rowwise": 1e-3,
                                                  "fp8_tensorwise_fast_accum": None, "fp8_rowwise_fast_accum": None},
             "status": {}}
    monkeypatch.setattr(ceilings, "gemm_ceiling", lambda *args, **kwargs: roofs)
    monkeypatch.setattr(fp8bench, "LIBRARY", ())
    monkeypatch.setattr(b10, "TIMED", [dict(B=1, H=2, N=80, D=32)])     # 128 x 64 tiles: N not a multiple
    timing = b10.SPEC.time(_namespace("10_fp8_attention", "ok"), 7, torch.device("cpu"), 1.0)
    rows = pd.DataFrame(timing["rows"])
    assert sorted(rows["causal"]) == [False, True] and set(rows["backend"]) == {"fp8_mine"}
    assert (rows["tflops"] > 0).all()
    assert timing["peak_tflops"] == 2e-3, "the fastest FP8 GEMM, not bf16's"
    assert timing["student"]["score"] == pytest.approx(math.sqrt((rows["tflops"] / 2e-3).prod()))
    assert boardreport.library_scores(timing) == {}, "the ceilings are no library kernel"


def test_cells_to_run_skip_tests_demos_and_everything_after_the_kernels():
    nb = json.loads((ROOT / "solutions/08_decode_attention/08_decode_attention.ipynb").read_text(encoding="utf-8"))
    cells = board.cells_to_run(nb, boardshapes.SPECS["08_decode_attention"].graded)
    sources = "\n".join(c["source"] for c in cells)
    graded = [i for i, c in enumerate(nb["cells"]) if c["metadata"].get("nbgrader", {}).get("grade")
              and not c["metadata"]["nbgrader"].get("solution")]
    assert not set(graded) & {c["index"] for c in cells}, "no test cell runs"
    assert "def paged_decode" in sources and cells[-1]["source"].count("def paged_decode") == 1, "stops at the last"
    assert "sdpa_decode_sweep" not in sources and "matmul_peak_tflops" not in sources, "no measurement runs"
    assert "PROGRAMS_PER_SM = 4" in sources and "if lk.grading.answered" not in sources.split("def paged_decode")[0]
    assert "MODE = lk.tritonmode.setup()" in sources, "the first code cell runs whole"
    assert "tiny_llama" not in sources


def test_09_runs_the_kernels_and_their_helpers_not_the_sweep():
    nb = json.loads((ROOT / "solutions/09_flex_attention/09_flex_attention.ipynb").read_text(encoding="utf-8"))
    sources = "\n".join(c["source"] for c in board.cells_to_run(nb, boardshapes.SPECS["09_flex_attention"].graded))
    assert "def sparse_attention_backward" in sources and "MASKS = {" in sources and "def _online_tile" in sources
    assert "flexbench.sweep" not in sources and "loaded_elements" not in sources


def test_09_kept_work_counts_the_visible_scores():
    from labkit.board import nb09 as b09

    ids = b09.documents([3, 5])
    assert b09.kept_scores(b09.rule("causal"), 8, "cpu", chunk=3) == 36
    assert b09.kept_scores(b09.rule("window", 2), 8, "cpu") == 1 + 2 + 3 * 6
    assert b09.kept_scores(b09.rule("document", document_id=ids), 8, "cpu", chunk=5) == 6 + 15


def test_09_scores_both_passes_over_every_shape():
    from labkit.board import nb09 as b09

    work = {(4096, "causal"): 1.0, (8192, "causal"): 1.0}
    rows = [("mine", p, n, t) for p, ts in (("fwd", (0.25, 0.64)), ("fwd+bwd", (0.16, 0.36))) for n, t in zip((4096, 8192), ts)]
    rows += [("flex_triton", "fwd", 4096, 0.5), ("flex_triton", "fwd", 8192, 0.5), ("flex_triton", "fwd+bwd", 4096, 0.5)]
    ok = pd.DataFrame(rows, columns=["backend", "pass", "N", "tflops"]).assign(mask="causal")
    got = b09.scores(ok, work, peak=1.0)
    assert got["student"]["fwd"] == pytest.approx(0.4) and got["student"]["fwd_bwd"] == pytest.approx(0.24)
    assert got["student"]["score"] == pytest.approx(math.sqrt(0.4 * 0.24)), "the geometric mean of the two passes"
    assert got["flex_triton"]["fwd"] == pytest.approx(0.5) and math.isnan(got["flex_triton"]["fwd_bwd"])
    assert math.isnan(got["flex_triton"]["score"]), "a backend that missed a shape of a pass gets no score"


def test_09_timing_on_a_cpu_times_the_solution_forward_and_backward(monkeypatch):
    """The 09 board's timing end to end at a toy size (the interpreter; flex_attention eager, not compiled)."""
    import torch

    from board_fixture import variant
    from labkit.board import common as boardcommon, worker as boardrun
    from labkit.board import nb09 as b09

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    monkeypatch.setattr(b09, "TIMED", dict(seq_lens=[256], H=2, d=32))   # two blocks of 128
    monkeypatch.setattr(boardcommon, "PEAK_N", 256)
    ns = {"__name__": "__main__", "display": lambda *args, **kwargs: None}
    boardrun._run_cells(board.cells_to_run(variant("09_flex_attention", "ok"), b09.SPEC.graded), ns)
    timing = b09.SPEC.time(ns, 7, torch.device("cpu"), 1.0)
    rows = pd.DataFrame(timing["rows"])
    mine = rows[rows["backend"] == "mine"]
    assert sorted(set(zip(mine["pass"], mine["mask"]))) == sorted(
        (p, c["name"]) for p in ("fwd", "fwd+bwd") for c in b09.CASES)
    assert (mine["tflops"] > 0).all() and set(timing["student"]) == {"fwd", "fwd_bwd", "score"}
    assert timing["student"]["score"] == pytest.approx(
        math.sqrt(timing["student"]["fwd"] * timing["student"]["fwd_bwd"]))


def test_magics_and_unparsable_cells():
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "source": "import torch\n%matplotlib inline\n"},
                    {"cell_type": "code", "metadata": {}, "source": "x = f(\nX = 1\n"},
                    {"cell_type": "code", "metadata": {"nbgrader": {"solution": True}},
                     "source": "!pip install foo\ndef decode_split():\n    pass\n"},
                    {"cell_type": "code", "metadata": {}, "source": "def later():\n    pass\n"}]}
    cells = board.cells_to_run(nb, ("decode_split",))
    assert [c["index"] for c in cells] == [0, 2]
    assert "%" not in cells[0]["source"] and "pip" not in cells[1]["source"]


def _timing(student: float, library: dict[str, float]) -> dict:
    return {"student": {"fwd": student, "fwd_bwd": student, "score": student}, "peak_tflops": 900.0, "rows": [],
            "failed": {}, **{name: {"fwd": v, "fwd_bwd": v, "score": v} for name, v in library.items()}}


def test_report_ranks_scores_and_draws_the_library_as_lines(tmp_path):
    results = {"b": {"status": "ok", "timing": _timing(0.30, {"sdpa_flash": 0.40, "fa4": 0.60})},
               "a": {"status": "ok", "timing": _timing(0.45, {"sdpa_flash": 0.42, "fa4": 0.58})},
               "c": {"status": "wrong", "detail": "o off", "timing": None},
               "d": {"status": "timeout", "detail": "past", "timing": None}}
    table = boardreport.ranked(pd.DataFrame([board._row(s, r) for s, r in results.items()]))
    assert list(table["student"]) == ["a", "b", "c", "d"] and list(table["rank"][:2]) == [1, 2]
    assert table["rank"][2:].isna().all() and table.loc[0, "best_library"] == "fa4"
    assert math.isclose(table.loc[0, "vs_best_library"], 0.45 / 0.58)
    assert {"score_fwd", "score_fwd_bwd"} <= set(table.columns)
    lines = boardreport.library_lines([r["timing"] for r in results.values()])
    assert lines == pytest.approx({"sdpa_flash": 0.41, "fa4": 0.59})
    page = boardreport.write_html(table, [r["timing"] for r in results.values()], tmp_path / "b.html",
                                  assignment="06_triton_flashattention", gpu=True)
    text = page.read_text(encoding="utf-8")
    assert "<svg" in text and "fa4 (59%)" in text and "TFLOP/s" in text
    assert "NA&gt;" not in text and text.count("<tr><td></td><td>") == 2, "the unranked rows: an empty rank cell"


def test_anonymous_names_are_stable_per_seed_and_hide_the_id():
    assert board.anonymous("s1120001", 3) == board.anonymous("s1120001", 3) != board.anonymous("s1120001", 4)
    assert "1120001" not in board.anonymous("s1120001", 3)


def test_geomean_and_exact_references():
    import torch

    assert boardshapes.geomean([0.25, 1.0]) == pytest.approx(0.5) and math.isnan(boardshapes.geomean([0.5, 0.0]))
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for n in (5, 9, 9))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    mask = torch.ones(5, 9, dtype=torch.bool).tril(diagonal=4)                      # bottom-right causal
    assert torch.allclose(boardshapes.attention_exact(q, k, v, True), sdpa(q, k, v, attn_mask=mask))
    kp, vp, table = boardshapes.paged_copy(k[0].transpose(0, 1)[None].expand(2, -1, -1, -1), v[0].transpose(0, 1)[None]
                                           .expand(2, -1, -1, -1), 4, torch.Generator().manual_seed(0))
    assert kp.shape == (6, 4, 2, 8) and sorted(table.flatten().tolist()) == list(range(6))
    assert torch.equal(kp[table[1, 2]][0], k[0, :, 8])                              # token 8: page 2, slot 0


def test_a_worker_sees_no_secrets_and_its_own_home(tmp_path, monkeypatch):
    monkeypatch.setenv("GITHUB_TOKEN", "secret")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu, gpu = board._env(tmp_path, gpu=False), board._env(tmp_path, gpu=True)
    assert "GITHUB_TOKEN" not in cpu and cpu["HOME"] == str(tmp_path) and cpu["TRITON_INTERPRET"] == "1"
    assert "TRITON_INTERPRET" not in gpu and gpu["TRITON_CACHE_DIR"].startswith(str(tmp_path))


@pytest.mark.parametrize("body, reached", [
    ("return torch.ops.aten._scaled_dot_product_flash_attention(q, q, q)[0]", "._scaled_dot_product_flash_attention"),
    ("return flex_attention(q, q, q)", "flex_attention"),
    ("return q * 2", None)])
def test_library_attention_beyond_sdpa_is_found(body, reached):
    from labkit.board.worker import library_reached

    ns = {"__name__": "__main__"}
    exec("import torch\nfrom torch.nn.attention.flex_attention import flex_attention\n\n\n"  # noqa: S102
         f"def helper(q):\n    {body}\n\n\ndef decode_split(q):\n    return helper(q)\n", ns)
    found = library_reached(ns["decode_split"])
    assert (found is None) if reached is None else (found and found.endswith(reached)), found


def test_command_line_anonymizes_and_writes_the_board(tmp_path, capsys):
    from labkit.__main__ import main

    write_submitted(tmp_path / "submitted", "06_triton_flashattention", ["flagged"])
    argv = ["board", "06_triton_flashattention", "--submitted", str(tmp_path / "submitted"), "--out",
            str(tmp_path / "out"), "--cpu", "--seed", "1", "--anonymize", "--timeout", str(LIMIT)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    alias = board.anonymous("flagged", 1)
    assert alias in printed and "flagged" in printed and "correctness only" in printed
    csv = pd.read_csv(tmp_path / "out" / "board.csv")
    assert list(csv["student"]) == [alias] and (tmp_path / "out" / "logs" / f"{alias}.log").exists()


def test_a_memory_limit_too_small_for_the_runtime_is_the_boards_own_error(tmp_path, capsys):
    from labkit.__main__ import main

    write_submitted(tmp_path / "submitted", "08_decode_attention", ["ok"])
    argv = ["board", "08_decode_attention", "--submitted", str(tmp_path / "submitted"), "--out",
            str(tmp_path / "out"), "--cpu", "--seed", "1", "--memory-gb", "0.5", "--timeout", str(LIMIT)]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m labkit board: error: "), err
    assert "--memory-gb 0.5" in err[0] and "no student was run" in err[0]
    assert sorted(p.name for p in (tmp_path / "out" / "logs").iterdir()) == ["_probe.log"], "no student ran"
    assert not (tmp_path / "out" / "board.csv").exists() and not (tmp_path / "out" / "board.html").exists()
