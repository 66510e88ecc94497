"""The speed-of-light board: ``python -m labkit board ASSIGNMENT --submitted DIR`` (instructors, on a GPU).

Ranks each student's kernels as a fraction of this GPU's measured limit, with correctness re-checked and
cheating flagged. ``DIR`` is nbgrader's layout, ``DIR/<student>/<ASSIGNMENT>/<ASSIGNMENT>.ipynb``
(``submitted/`` or ``autograded/``). Per student, in its own process (:mod:`labkit.board.worker`), one at a time per
GPU (timings must not share one; ``--gpus``: several GPUs of the host, a student on each), concurrently with ``jobs``
on a CPU; ``--shard K/N`` runs a machine's share of the class and ``--merge`` joins the shards' boards
(:mod:`labkit.board.shards`):

- which cells run (:func:`cells_to_run`): never the test cells (nbgrader ``grade`` without ``solution``), and
  nothing after the last cell that defines a graded name (the measurement sections come after the kernels).
  Before it: the first code cell whole (imports, device, profile), the answer cells (nbgrader ``solution``)
  whole, and of every other code cell only its top-level ``import``, ``def`` and ``class`` statements and its
  assignments to UPPER_CASE names (the constants kernels read: ``FWD_CONFIGS``, ``PROGRAMS_PER_SM``): the
  demos, prints and measurements between the exercises never run. Lines starting with ``%`` or ``!``
  (IPython magics) are dropped.
- statuses: ``ok``; ``wrong`` (a result off at the check's shapes or after the timing); ``flagged`` (library
  attention, softmax or labkit reached; none of the notebook's own Triton kernels launched; 10: no FP8 MMA in
  the sm90 compile; a timer, torch or the reference monkey-patched); ``error`` (its last line); ``timeout`` (the
  process group killed).
- score (GPU): :mod:`labkit.board.specs` (06: TFLOP/s over the matmul peak; 08: GB/s over the read ceiling;
  09: TFLOP/s of the work the mask keeps over the matmul peak; 10: TFLOP/s over the measured FP8 GEMM ceiling;
  geometric means over fixed shapes), the best library kernel's score from the same run beside it.
  ``--cpu`` (or no GPU): Triton's interpreter, every status but no score.

Output: ``OUT/board.csv`` (student, status, detail, score, ...), ``OUT/board.html`` (the ranked table and a bar
chart with the library kernels as lines), ``OUT/timings.json`` (per student, every timed shape and kernel),
``OUT/info.json`` (assignment, seed, devices, shard, students: what a merge checks), ``OUT/logs/<student>.log`` (what the student's run printed, each cell's output, the traceback of an error, and the
board's verdict). Before any student, :func:`probe` runs the solution's setup cell under the same limits: a limit
too small for the runtime itself is the board's error (:class:`BoardSetupError`), not every student's.

Used by: ``python -m labkit board`` (``make board ASSIGNMENT=...``).
"""
from __future__ import annotations

import ast
import concurrent.futures
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pandas as pd

from labkit.board import report as boardreport
from labkit.board import shards
from labkit.board.specs import SPECS

ASSIGNMENTS = tuple(SPECS)
STATUSES = ("ok", "wrong", "flagged", "error", "timeout")
ROOT = Path(__file__).resolve().parents[2]   # the folder holding labkit, for the workers' PYTHONPATH


def submissions(submitted: Path, assignment: str) -> dict[str, Path]:
    """student -> notebook, for every ``submitted/<student>/<assignment>/<assignment>.ipynb``, sorted."""
    return {p.parents[1].name: p for p in sorted(Path(submitted).glob(f"*/{assignment}/{assignment}.ipynb"))}


def _kept(node: ast.stmt) -> bool:
    """A statement of a cell that is not an answer: imports, defs, classes and UPPER_CASE constants."""
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return True
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    names = [n for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    return bool(names) and all(n.id.isupper() for n in names)


def _statements(source: str) -> str:
    """The kept statements of ``source`` (:func:`_kept`), decorators included, each at its own lines."""
    lines = source.splitlines(True)
    parts = []
    for node in _parse(source).body:
        if _kept(node):
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            parts.append("".join(lines[first - 1:node.end_lineno]))
    return "\n".join(parts)


def _no_magics(source: str) -> str:
    return "".join(line if not line.lstrip().startswith(("%", "!")) else
                   line[:len(line) - len(line.lstrip())] + "pass\n" for line in source.splitlines(True))


# Students are read in a thread pool; CPython 3.11 before 3.11.8 can raise a spurious "AST constructor recursion
# depth mismatch" SystemError when two threads parse at once (python/cpython#106905). One parse at a time.
_PARSING = threading.Lock()


def _parse(source: str) -> ast.Module:
    with _PARSING:
        return ast.parse(source)


def cells_to_run(notebook: dict, graded: tuple[str, ...]) -> list[dict]:
    """The code cells the worker runs, as ``[{"index", "source"}]`` (the rule: module docstring)."""
    cells, last = [], -1
    for i, cell in enumerate(notebook.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if meta.get("grade") and not meta.get("solution"):
            continue                                                     # a test cell
        source = _no_magics("".join(cell.get("source", "")))
        whole = not cells or meta.get("solution")
        if not whole:
            try:
                source = _statements(source)
            except SyntaxError:
                continue
        try:
            tree = _parse(source)
        except SyntaxError:
            tree = None                                                   # an answer that does not parse: its error
        if tree and {n.name for n in tree.body if hasattr(n, "name")} & set(graded):
            last = len(cells)
        cells.append({"index": i, "source": source})
    return cells[:last + 1] if last >= 0 else cells


def _env(tmp: Path, gpu: bool, gpu_id: str | None = None) -> dict[str, str]:
    """The worker's environment: only what it needs (the compilers' and CUDA's variables, no tokens or keys of
    yours), HOME and caches in its own folder; on a GPU, pinned to ``gpu_id`` (its only visible device)."""
    keep = ("PATH", "LANG", "LC_ALL", "OMP_NUM_THREADS", "LIBRARY_PATH", "CC", "CXX")
    env = {k: v for k, v in os.environ.items() if k in keep or k.startswith(("CUDA_", "NVIDIA_", "TRITON_", "LD_"))}
    env.update(HOME=str(tmp), TMPDIR=str(tmp), XDG_CACHE_HOME=str(tmp / ".cache"), MPLBACKEND="Agg",
               TRITON_CACHE_DIR=str(tmp / ".triton"), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT),
               PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")   # prints and tracebacks in order
    if not gpu:
        env.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", LABKIT_PROFILE="cpu")
    else:
        env.pop("TRITON_INTERPRET", None)                                 # compiled kernels: they are timed
        if gpu_id is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu_id
    return env


class BoardSetupError(RuntimeError):
    """The runtime itself fails under the board's limits (:func:`probe`): no student is run or ranked."""


def run_student(assignment: str, notebook: Path, *, seed: int, timeout: float, gpu: bool, logs: Path,
                student: str, target_ms: float = 30.0, memory_gb: float | None = None,
                gpu_id: str | None = None) -> dict:
    """One submission through :mod:`labkit.board.worker` in its own process group, cwd a fresh temporary folder
    (on a GPU: ``gpu_id``'s, the only device it sees).

    Returns {"status", "detail", "timing", "seconds"}; a crash, a missing result or the time limit
    (the process group killed) is reported here, never raised. ``logs/<student>.log``: what the run printed
    (each cell's output, the traceback of an error), then the result's status and detail."""
    started = time.monotonic()
    try:
        nb = json.loads(Path(notebook).read_text(encoding="utf-8"))
        cells = cells_to_run(nb, SPECS[assignment].graded)
    except (OSError, ValueError) as err:
        result = {"status": "error", "detail": f"notebook unreadable: {err}", "timing": None, "seconds": 0.0}
    else:
        job = dict(assignment=assignment, cells=cells, seed=seed, time=gpu, target_ms=target_ms, memory_gb=memory_gb)
        result = _work(job, timeout=timeout, gpu=gpu, log=logs / f"{student}.log", started=started, gpu_id=gpu_id)
    with open(logs / f"{student}.log", "a", encoding="utf-8") as log:
        log.write(f"--- board: {result['status']}{': ' + result['detail'] if result.get('detail') else ''}\n")
    return result


def _work(job: dict, *, timeout: float, gpu: bool, log: Path, started: float, gpu_id: str | None = None) -> dict:
    """Run ``job`` through the worker (output to ``log``); its result, or the timeout's or the crash's."""
    tmp = Path(tempfile.mkdtemp(prefix="labkit-board-"))
    try:
        (tmp / "job.json").write_text(json.dumps({**job, "result": str(tmp / "result.json")}), encoding="utf-8")
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "labkit.board.worker", str(tmp / "job.json")], cwd=tmp,
                                    env=_env(tmp, gpu, gpu_id), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return {"status": "timeout", "detail": f"past the {timeout:g} s limit", "timing": None,
                        "seconds": round(time.monotonic() - started, 1)}
        try:
            return json.loads((tmp / "result.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            tail = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
            return {"status": "error", "detail": f"the process ended (exit status {proc.returncode}) without a result: "
                    f"{tail[-1][:200] if tail else 'no output'}", "timing": None,
                    "seconds": round(time.monotonic() - started, 1)}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # anything the submission left running
        except (NameError, ProcessLookupError, PermissionError):
            pass
        shutil.rmtree(tmp, ignore_errors=True)


def probe(assignment: str, *, timeout: float, gpu: bool, logs: Path, memory_gb: float | None = None) -> None:
    """Run the solution's first code cell (imports, ``lk.tritonmode.setup()``, the doctor) in a worker under the
    students' limits; raises :class:`BoardSetupError` naming the limit when it fails (``logs/_probe.log``)."""
    solution = ROOT / "solutions" / assignment / f"{assignment}.ipynb"
    cells = cells_to_run(json.loads(solution.read_text(encoding="utf-8")), SPECS[assignment].graded)[:1]
    job = dict(assignment=assignment, cells=cells, seed=0, time=False, memory_gb=memory_gb, probe=True)
    result = _work(job, timeout=timeout, gpu=gpu, log=logs / "_probe.log", started=time.monotonic())
    if result["status"] != "ok":
        limit = f"--memory-gb {memory_gb:g}" if memory_gb else "the default limits"
        hint = "; give a larger --memory-gb" if memory_gb else ""
        raise BoardSetupError(f"the solution's setup cell does not run under {limit} ({result['detail']}): no student "
                              f"was run{hint} (log: {logs / '_probe.log'})")


def _row(student: str, result: dict) -> dict:
    """One board row: status, detail, the scores of the student and the best library kernel of the same run."""
    row = dict(student=student, status=result["status"], detail=result.get("detail", ""), score=None,
               seconds=result.get("seconds"))
    timing = result.get("timing") or {}
    mine = timing.get("student") or {}
    row.update({f"score_{k}" if k != "score" else k: v for k, v in mine.items()})
    library = boardreport.library_scores(timing)
    if library and row["score"] is not None:
        best = max(library, key=library.get)
        row.update(best_library=best, best_library_score=library[best], vs_best_library=row["score"] / library[best])
    return row


def anonymous(student: str, seed: int) -> str:
    """A stable pseudonym for one board run (salted with the seed, so the roster cannot reverse it)."""
    return "anon-" + hashlib.sha256(f"{seed}:{student}".encode()).hexdigest()[:8]


def board(assignment: str, submitted: Path, out: Path, *, seed: int, timeout: float, gpu: bool,
          anonymize: bool = False, jobs: int = 1, memory_gb: float | None = None, gpus: int | None = None,
          shard: tuple[int, int] | None = None) -> pd.DataFrame:
    """Run every submission (of ``shard``, :func:`labkit.board.shards.pick`), write ``out/board.csv``,
    ``board.html`` and ``info.json``; returns the ranked rows. On a GPU, one student per GPU at once over ``gpus``
    of them (default: every visible one), each worker pinned to its GPU; on a CPU, ``jobs`` at once.

    Raises :class:`BoardSetupError` (nothing written but ``out/logs/_probe.log``) when :func:`probe` fails."""
    from tqdm.auto import tqdm

    found = shards.pick(submissions(submitted, assignment), shard)
    logs = Path(out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    slots = shards.GpuSlots(shards.visible_gpus(gpus) if gpu else [None] * max(1, jobs))
    probe(assignment, timeout=timeout, gpu=gpu, logs=logs, memory_gb=memory_gb)
    names = {s: anonymous(s, seed) if anonymize else s for s in found}

    def one(student: str, notebook: Path) -> dict:
        with slots.hold() as gpu_id:
            return run_student(assignment, notebook, seed=seed, timeout=timeout, gpu=gpu, logs=logs,
                               student=names[student], memory_gb=memory_gb, gpu_id=gpu_id)

    results = {}
    with concurrent.futures.ThreadPoolExecutor(slots.size) as pool, \
            tqdm(total=len(found), desc=f"board {assignment} ({slots.size} at once)", unit="student") as bar:
        futures = {pool.submit(one, s, nb): s for s, nb in found.items()}
        for future in concurrent.futures.as_completed(futures):
            results[futures[future]] = future.result()
            bar.update(1)
    timings = {names[s]: results[s].get("timing") for s in found}
    shards.write_info(out, assignment=assignment, seed=seed, gpu=gpu, gpu_ids=[g for g in slots.ids if g],
                      shard=shard, students=sorted(names.values()))
    return write(pd.DataFrame([_row(names[s], results[s]) for s in found]), timings, out, assignment=assignment,
                 gpu=gpu)


def write(rows: pd.DataFrame, timings: dict, out: Path, *, assignment: str, gpu: bool) -> pd.DataFrame:
    """Rank ``rows`` and write ``out/board.csv``, ``timings.json`` and ``board.html``; returns the ranked rows."""
    table = boardreport.ranked(rows)
    table.to_csv(Path(out) / "board.csv", index=False)
    (Path(out) / "timings.json").write_text(json.dumps(timings, default=str), encoding="utf-8")
    boardreport.write_html(table, list(timings.values()), Path(out) / "board.html", assignment=assignment, gpu=gpu)
    return table
