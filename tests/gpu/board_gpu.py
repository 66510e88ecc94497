"""The board's GPU check (H100 or H200): the ranking, and the solution's score beside the notebook's own measurement.

    python tests/gpu/board_gpu.py 08_decode_attention build/board-gpu smoke     # a minute: the GPU steps at tiny shapes
    python tests/gpu/board_gpu.py 08_decode_attention build/board-gpu board     # the board over GPU_STUDENTS
    python tests/gpu/board_gpu.py 08_decode_attention build/board-gpu compare   # the notebook's measurement, then ratios

``smoke``: in this process, the solution's check and timing steps with tiny timed shapes (a bug in the GPU-only
code shows in a minute, not after the whole board).
``board``: synthetic submissions (tests/support/board_fixture.py: the solution ``ok``, a weaker right one, and what must
be ``wrong`` or ``flagged``; a 4th argument picks some, e.g. ``ok,noskip``) into OUT/<assignment>/submitted, then
``python -m labkit board`` over them (seed 7): it prints the ranked board and writes board.csv, board.html and
timings.json.
``compare``: in this process, the solution's cells the board runs, then the notebook's own GPU measurement cell
(08: ``cell-028`` at the board's batch-1 contexts; 06: ``cell-023``, its sweep; 09: ``cell-035``, its flexbench
sweep, forward and forward+backward at d = 128, in ms: the ratio is the notebook's time over the board's; 10:
``cell-033``, its FP8 sweep at the board's shapes, TFLOP/s of ``fp8_mine``); per shape, the board's number for ``ok``
over the notebook's; the issue asks them to agree within 5%.

09: ``python tests/gpu/board_gpu.py 09_flex_attention build/board-gpu smoke|board|compare`` (students ok, dense (no
block skipped: slower), wrong, flagged).
10: ``python tests/gpu/board_gpu.py 10_fp8_attention build/board-gpu smoke|board|compare`` (students ok, noskip
(causal tiles masked, not skipped: slower), wrong, bf16 (flagged: no FP8 MMA in its sm90 compile), flagged);
``smoke`` also runs the sm90 audit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

from board_fixture import GPU_STUDENTS, ROOT, write_submitted


def smoke(assignment: str) -> None:
    import torch

    from board_fixture import variant
    from labkit.board import common as boardcommon, nb06 as boardshapes06, nb08 as boardshapes08, nb09 as boardshapes09, rank as board, specs as boardshapes, worker as boardrun
    from labkit.board import nb10 as boardshapes10

    boardshapes06.FA_TIMED = dict(seq_lens=[256], head_dims=[64], tokens=1024, width=256)
    boardshapes08.DECODE_TIMED, boardcommon.PEAK_N = [(1, 4096), (2, 1000)], 2048
    boardshapes09.TIMED = dict(seq_lens=[1024, 2048], H=4, d=128)
    boardshapes10.TIMED = [dict(B=2, H=8, N=2048, D=128), dict(B=2, H=16, N=1024, D=64)]
    spec, ns = boardshapes.SPECS[assignment], {"__name__": "__main__", "display": lambda *args, **kwargs: None}
    boardrun._run_cells(board.cells_to_run(variant(assignment, "ok"), spec.graded), ns)
    device = torch.device("cuda")
    if spec.audit:
        print(f"audit: {spec.audit(ns, device)}")
    spec.check(ns, 7, device)
    timing = spec.time(ns, 7, device, 5.0)
    print({k: v for k, v in timing.items() if k != "rows"})
    print(f"{assignment}: smoke passed")


def run_board(assignment: str, out: Path, students: list[str]) -> int:
    submitted = write_submitted(out / "submitted", assignment, students)
    return subprocess.call([sys.executable, "-m", "labkit", "board", assignment, "--submitted", str(submitted),
                            "--out", str(out), "--seed", "7"], cwd=ROOT)


def notebook_measurement(assignment: str, out: Path) -> pd.DataFrame:
    """The notebook's own GPU cell on the solution: rows (key columns, notebook) in its units."""
    from labkit.board import nb08 as boardshapes08, nb10 as boardshapes10, rank as board, specs as boardshapes, worker as boardrun

    nb = json.loads((ROOT / "solutions" / assignment / f"{assignment}.ipynb").read_text(encoding="utf-8"))
    by_id = {c.get("id"): "".join(c["source"]) for c in nb["cells"]}
    ns = {"__name__": "__main__", "display": lambda *args, **kwargs: None}
    boardrun._run_cells(board.cells_to_run(nb, boardshapes.SPECS[assignment].graded), ns)
    os.environ["LABKIT_OUT"] = str(out)
    if assignment == "08_decode_attention":
        ns["P"].kernel_contexts = [n for b, n in boardshapes08.DECODE_TIMED if b == 1]
        done = next(s for s in by_id.values() if "DONE = {" in s)            # the tiny inputs DONE's calls read
        boardrun._run_cells([{"index": "DONE", "source": done}, {"index": "cell-004", "source": by_id["cell-004"]},
                             {"index": "cell-028", "source": by_id["cell-028"]}], ns)
        table = ns["table"]
        return pd.DataFrame({"B": 1, "N": table.index, "notebook": table["split-KV"].values})
    if assignment == "10_fp8_attention":                  # the notebook's sweep at the board's shapes
        ns["P"].sweep = boardshapes10.TIMED
        boardrun._run_cells([{"index": "time", "source": "import time"}, {"index": "cell-025", "source": by_id["cell-025"]},
                             {"index": "cell-033", "source": by_id["cell-033"]}], ns)
        sweep = ns["fp8_sweep"]
        mine = sweep[(sweep["backend"] == "fp8_mine") & (sweep["status"] == "ok")]
        return mine[["N", "d", "causal", "tflops"]].rename(columns={"tflops": "notebook"})
    if assignment == "09_flex_attention":
        boardrun._run_cells([{"index": "cell-035", "source": by_id["cell-035"]}], ns)   # the notebook's sweep
        sweep = ns["flex_sweep"]
        mine = sweep[(sweep["backend"] == "mine") & (sweep["status"] == "ok") & (sweep["d"] == 128)]
        return mine[["N", "mask", "pass", "ms"]].rename(columns={"ms": "notebook"})
    boardrun._run_cells([{"index": "cell-023", "source": by_id["cell-023"]}], ns)
    sweep = ns["sweep"]
    mine = sweep[(sweep["backend"] == "triton_fa2") & (sweep["status"] == "ok")]
    return mine[["N", "D", "causal", "mode", "tflops"]].rename(columns={"tflops": "notebook"})


def compare(assignment: str, out: Path) -> None:
    timing = json.loads((out / "timings.json").read_text(encoding="utf-8"))["ok"]
    rows = pd.DataFrame(timing["rows"])
    if assignment == "08_decode_attention":
        board_rows = rows[rows["kernel"] == "student contiguous"][["B", "N", "gb_per_s"]].rename(
            columns={"gb_per_s": "board"})
        keys = ["B", "N"]
    elif assignment == "10_fp8_attention":
        board_rows = rows[rows["backend"] == "fp8_mine"][["N", "d", "causal", "tflops"]].rename(
            columns={"tflops": "board"})
        keys = ["N", "d", "causal"]
    elif assignment == "09_flex_attention":     # milliseconds of one forward: the notebook's over the board's
        board_rows = rows[rows["backend"] == "mine"][["N", "mask", "pass", "ms"]].rename(columns={"ms": "board"})
        keys = ["N", "mask", "pass"]
    else:
        board_rows = rows[rows["backend"] == "student"].drop(columns="backend").rename(columns={"tflops": "board"})
        keys = ["N", "D", "causal", "mode"]
    both = notebook_measurement(assignment, out).merge(board_rows, on=keys)
    both["board / notebook"] = both["board"] / both["notebook"]
    if assignment == "09_flex_attention":                     # times: the board's speed over the notebook's
        both["board / notebook"] = both["notebook"] / both["board"]
    print(both.round(3).to_string(index=False))
    ratio = both["board / notebook"]
    print(f"{assignment}: board / notebook from {ratio.min():.3f} to {ratio.max():.3f}, "
          f"geometric mean {ratio.prod() ** (1 / len(ratio)):.3f} over {len(ratio)} shapes "
          f"({'within' if ((ratio - 1).abs() <= 0.05).all() else 'NOT within'} 5%)")


if __name__ == "__main__":
    assignment, out, step = sys.argv[1], Path(sys.argv[2]) / sys.argv[1], sys.argv[3]
    students = sys.argv[4].split(",") if len(sys.argv) > 4 else GPU_STUDENTS[assignment]   # e.g. ok,noskip
    if step == "smoke":
        smoke(assignment)
    sys.exit(run_board(assignment, out, students) if step == "board" else compare(assignment, out) if step == "compare"
             else 0)
