"""Execute every solution notebook on this machine: executed copies, plots and one summary page.

``python -m labkit execute`` (``make execute``) runs ``solutions/NN_slug/NN_slug.ipynb`` top to
bottom in a fresh kernel each, in the profile this device picks (``gpu`` on CUDA, else ``cpu``)
unless one is forced, and writes under ``build/execute/``:

- ``NN_slug.ipynb`` and ``NN_slug.html``: the executed notebook with its outputs and plots;
- ``summary.md``: the device, each notebook's time, errors and GPU-only notices, then the outputs
  (text and figures) of the cells tagged ``summary`` -- the measured results the prose relies on;
- ``summary.json``: the same facts for scripts; ``figures/``: the summary's images.

Each kernel runs with ``HF_HUB_OFFLINE=1`` under :mod:`labkit.course.runguard` (no network, no
deprecation warnings from torch, transformers, labkit or the notebook), in "report" mode by
default (violations are listed in the summary) or "raise" mode (``strict``: they fail the cell).
A failing cell does not stop the run: its error is recorded and the next cell runs, and the
summary is rewritten after every notebook, so a long run that is cut short loses nothing. A cell
past its time limit (``--timeout``) is interrupted and recorded as a :data:`TIMEOUT` error (the
cell, the limit, how long it ran); the rest of that notebook is skipped and the next notebook runs.

Used in: the Makefile (``execute``), the GPU verification of the course, ``tests/labkit/course/test_execute.py``.
"""
from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from unittest import mock

from labkit.core.env import GPU_ONLY_PREFIX
from labkit.course.runguard import REPORT_PREFIX

SUMMARY_TAG = "summary"
_OBJECT_REPR = re.compile(r"^<[^\n]*(size|at 0x)[^\n]*>$")
TIMEOUT = "CellTimeout"  # the ename recorded for a cell interrupted at its time limit
GUARD_STARTUP = "import os\nimport labkit.course.runguard\nlabkit.course.runguard.install(os.environ.get('LABKIT_RUNGUARD', 'raise'))\n"


class _NotebookStopped(Exception):
    """Raised from a cell hook to end one notebook's run (its kernel is idle again, so it shuts down cleanly)."""


@dataclass
class CellError:
    cell_id: str
    ename: str
    evalue: str


@dataclass
class NotebookRun:
    """What one executed notebook measured and how the run went."""
    name: str
    seconds: float
    code_cells: int
    errors: list[CellError] = field(default_factory=list)
    gpu_only_cells: list[str] = field(default_factory=list)
    guard_reports: list[str] = field(default_factory=list)  # "cell-id: message" from labkit.course.runguard
    results: list[dict] = field(default_factory=list)  # {"cell_id", "text", "figures": [relative paths]}


def solution_notebooks(root: Path, only: list[str] | None = None) -> list[Path]:
    """``root/solutions/NN_slug/NN_slug.ipynb``, sorted; ``only`` keeps names starting with any prefix."""
    paths = sorted(p / f"{p.name}.ipynb" for p in (root / "solutions").iterdir() if (p / f"{p.name}.ipynb").exists())
    if only:
        paths = [p for p in paths if any(p.stem.startswith(prefix) for prefix in only)]
        if not paths:
            raise ValueError(f"no solution notebook starts with {only}; have {[p.stem for p in solution_notebooks(root)]}")
    return paths


@contextlib.contextmanager
def guard_startup_dir():
    """A temporary IPYTHONDIR whose startup file installs :mod:`labkit.course.runguard` in every kernel."""
    with tempfile.TemporaryDirectory(prefix="labkit-ipython-") as ipython_dir:
        startup = Path(ipython_dir) / "profile_default" / "startup"
        startup.mkdir(parents=True)
        (startup / "00-labkit-runguard.py").write_text(GUARD_STARTUP, encoding="utf-8")
        yield ipython_dir


@contextlib.contextmanager
def guarded_kernel_env(profile: str | None, artifacts: Path, *, strict: bool = False):
    """Environment for the kernels started inside the block: offline, guarded, profile forced."""
    with guard_startup_dir() as ipython_dir:
        updates = {"IPYTHONDIR": ipython_dir, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                   "LABKIT_RUNGUARD": "raise" if strict else "report",
                   "LABKIT_OUT": str(artifacts), "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
        if profile:
            updates["LABKIT_PROFILE"] = profile
        with mock.patch.dict(os.environ, updates):  # restored on exit, also after an error
            yield


def _text_of(output: dict) -> str:
    """Printed text and plain-text results; not stderr (progress bars) and not object reprs."""
    if output["output_type"] == "stream":
        return "".join(output["text"]) if output["name"] == "stdout" else ""
    if output["output_type"] not in ("execute_result", "display_data"):
        return ""
    text = "".join(output.get("data", {}).get("text/plain", ""))
    return "" if _OBJECT_REPR.match(text) else text + "\n"  # e.g. "<Figure size ...>", a Styler


def collect(nb, name: str, seconds: float, figures_dir: Path) -> NotebookRun:
    """Read errors, GPU-only notices and the ``summary`` cells' outputs off an executed notebook."""
    run = NotebookRun(name, seconds, sum(c.cell_type == "code" for c in nb.cells))
    for cell in (c for c in nb.cells if c.cell_type == "code"):
        texts, figures, reports = [], [], []
        is_summary = SUMMARY_TAG in cell.metadata.get("tags", [])
        for output in cell.get("outputs", []):
            if output["output_type"] == "error":
                run.errors.append(CellError(cell.id, output["ename"], output["evalue"][:500]))
            texts.append(_text_of(output))
            if output["output_type"] == "stream" and output["name"] == "stderr":
                reports += [line for line in output["text"].splitlines() if line.startswith(REPORT_PREFIX)]
            png = output.get("data", {}).get("image/png") if is_summary else None
            if png:
                path = figures_dir / f"{name}_{cell.id}_{len(figures)}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(base64.b64decode(png))
                figures.append(f"{figures_dir.name}/{path.name}")
        text = "".join(texts).strip()
        run.guard_reports += [f"{cell.id}: {line[len(REPORT_PREFIX):].strip()}" for line in reports]
        if GPU_ONLY_PREFIX in text:  # printed by lk.env.gpu_only
            run.gpu_only_cells.append(cell.id)
        if is_summary:
            run.results.append({"cell_id": cell.id, "text": text, "figures": figures})
    return run


def _timed_out(cell, execute_reply: dict, *, seconds: float, timeout: int) -> bool:
    """Whether the cell was interrupted at its time limit; if so its KeyboardInterrupt becomes a :data:`TIMEOUT` error."""
    content = execute_reply.get("content", {})
    if not (content.get("status") == "error" and content.get("ename") == "KeyboardInterrupt" and seconds >= timeout):
        return False
    message = (f"cell ran past its {timeout} s limit (--timeout) and was interrupted after {seconds:.1f} s; "
               "the notebook's remaining cells were not run")
    cell.outputs = [o for o in cell.outputs if o["output_type"] != "error"]
    cell.outputs.append(_error_output(TIMEOUT, message))
    return True


def _error_output(ename: str, evalue: str):
    """An ``error`` output as nbformat writes it (no traceback)."""
    from nbformat.v4 import new_output

    return new_output("error", ename=ename, evalue=evalue, traceback=[f"{ename}: {evalue}"])


def _quiet_client_log():
    """nbclient's logger, its own and silent below CRITICAL: its "Timeout waiting for execute reply" lines are
    said once by the summary. Not traitlets' shared logger, which other jupyter parts of the process log to."""
    log = logging.getLogger("labkit.course.execute.nbclient")
    log.setLevel(logging.CRITICAL)
    return log


def execute_one(path: Path, out: Path, *, timeout: int, progress: bool = True) -> NotebookRun:
    """Execute one notebook in a fresh kernel (cwd = its folder); write the .ipynb and .html copies.

    A cell past ``timeout`` seconds is interrupted, recorded as a :data:`TIMEOUT` error, and ends this notebook.
    """
    import nbformat
    from nbclient import NotebookClient
    from tqdm.auto import tqdm

    nb = nbformat.read(path, as_version=4)
    bar = tqdm(total=sum(c.cell_type == "code" for c in nb.cells), desc=path.stem, unit="cell", disable=not progress)
    target = out / path.name
    started = [0.0]

    def cell_start(**_):
        started[0] = time.perf_counter()

    def cell_done(cell, execute_reply, **_):  # save after every cell: a run that is killed keeps what it measured
        bar.update()
        stop = _timed_out(cell, execute_reply, seconds=time.perf_counter() - started[0], timeout=timeout)
        nbformat.write(nb, target)
        if stop:
            raise _NotebookStopped(cell.id)

    client = NotebookClient(nb, timeout=timeout, allow_errors=True, kernel_name="python3", interrupt_on_timeout=True,
                            resources={"metadata": {"path": str(path.parent)}}, on_cell_execute=cell_start,
                            on_cell_executed=cell_done, log=_quiet_client_log())
    start = time.perf_counter()
    try:
        client.execute()
    except _NotebookStopped:
        pass
    finally:
        bar.close()
        seconds = time.perf_counter() - start
        nbformat.write(nb, target)
    _write_html(nb, out / f"{path.stem}.html")
    return collect(nb, path.stem, seconds, out / "figures")


def _write_html(nb, target: Path) -> None:
    try:
        from nbconvert import HTMLExporter
    except ImportError:  # nbconvert comes with the `lab` extra; the .ipynb copy is enough without it
        return
    body, _ = HTMLExporter().from_notebook_node(nb)
    target.write_text(body, encoding="utf-8")


def execute_all(root: Path, out: Path, *, only: list[str] | None = None, profile: str | None = None,
                timeout: int = 1800, strict: bool = False, progress: bool = True) -> list[NotebookRun]:
    """Execute the solution notebooks (all, or those named in ``only``); write copies and the summary.

    ``strict``: a run-guard violation fails its cell instead of being reported in the summary.
    """
    from labkit.core import profiles

    if profile is not None and profile not in profiles.PROFILES:
        raise ValueError(f"profile {profile!r} is not one of {profiles.PROFILES}")
    paths = solution_notebooks(root, only)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    with guarded_kernel_env(profile, out / "artifacts", strict=strict):
        effective = profiles.current()
        for path in paths:
            runs.append(execute_one(path, out, timeout=timeout, progress=progress))
            write_summary(runs, out, profile=effective)
    return runs


def write_summary(runs: list[NotebookRun], out: Path, *, profile: str) -> Path:
    """``summary.md`` and ``summary.json`` from the runs; returns the Markdown path."""
    import torch

    from labkit.core import env

    info = env.device_info()
    device = f"{info.name} (sm{info.sm}, {info.memory_gib:.0f} GiB)" if info.device == "cuda" else f"CPU ({info.name})"
    if info.device == "cuda" and os.environ.get("LABKIT_GPU_MEMORY_GB"):
        device += f", capped at {os.environ['LABKIT_GPU_MEMORY_GB']} GB (LABKIT_GPU_MEMORY_GB)"
    total = sum(r.seconds for r in runs)
    lines = ["# Lab-1.5: executed notebooks", "",
             f"- device: {device}; torch {torch.__version__}, CUDA {torch.version.cuda or '-'}; profile: {profile}",
             f"- finished {time.strftime('%Y-%m-%d %H:%M:%S')}; total {total / 60:.1f} min", "",
             "| notebook | minutes | code cells | cells with errors | GPU-only notices | run-guard reports |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| [{r.name}]({r.name}.html) | {r.seconds / 60:.1f} | {r.code_cells} | "
                     f"{', '.join(sorted({e.cell_id for e in r.errors})) or '-'} | {', '.join(r.gpu_only_cells) or '-'} | "
                     f"{len(r.guard_reports)} |")
    for r in runs:
        lines += ["", f"## {r.name}", ""]
        lines += [f"- **error** in `{e.cell_id}`: {e.ename}: {e.evalue}" for e in r.errors]
        lines += [f"- **run guard** in `{report}`" for report in r.guard_reports]
        for result in r.results:
            lines += [f"`{result['cell_id']}`:", ""]
            if result["text"]:
                lines += ["```", result["text"], "```", ""]
            lines += [f"![{result['cell_id']}]({fig})" for fig in result["figures"]] + [""]
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    facts = dict(device=device, profile=profile, total_seconds=total, notebooks=[asdict(r) for r in runs])
    (out / "summary.json").write_text(json.dumps(facts, indent=1, ensure_ascii=False), encoding="utf-8")
    return path
