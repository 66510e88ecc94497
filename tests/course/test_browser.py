"""`make lab` serves the course, and JupyterLab opens every student notebook in a real (headless) browser.

One JupyterLab server, started with the command ``make lab`` runs (asked of make with ``make -n``, so
as root it carries ``--allow-root``), on a copy of ``notebooks/`` (throw-away HOME / config / runtime
dirs, 127.0.0.1, random token, checkpoints outside the tree), and one headless Chromium, driven over
the DevTools protocol. The server must list every notebook. Every notebook is opened in a tab of its own, in turn:
the test waits until JupyterLab has drawn its cells, then checks the DOM (cell count, the Chinese title) and a
screenshot (not a blank page); then, with autosave on every few seconds and every tab still open, it waits once for
all the kernels and for autosave, and checks that merely opening each notebook left its file and folder as they
were. A control notebook with incomplete kernel metadata, opened with them, shows that autosave did run in that
time, and what JupyterLab writes.

The server and the browser come from tests/support/headless_browser.py (shared with test_formgrader.py).
The browser tests skip where no Chromium is installed (``.ci/run`` installs Debian's ``chromium``).
Chinese text needs a CJK font on the machine (Debian ``fonts-noto-cjk``) to show as characters
rather than boxes; look at the saved screenshots (paths are printed, ``pytest -s``) to check.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from headless_browser import (READY_TIMEOUT, assert_drawn, chromium, get_json, jupyter_server,  # noqa: F401
                              open_page, throwaway_jupyter_dirs)

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(ROOT.glob("notebooks/[0-9]*/[0-9]*.ipynb"))
pytestmark = pytest.mark.slow

AUTOSAVE_S = 2  # JupyterLab's autosave interval for the test server (seconds; JupyterLab's default is 120)
AUTOSAVE_WAIT = 4 * AUTOSAVE_S  # after the kernel is idle: long enough for JupyterLab to save a changed notebook
# JupyterLab user settings for the test server: autosave every AUTOSAVE_S, no news pop-up over the notebook,
# every cell in the DOM.
SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": True, "autosaveInterval": AUTOSAVE_S},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false"},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}


def make_lab_command() -> list[str]:
    """The command ``make lab`` runs to start JupyterLab, for this interpreter's environment."""
    venv = Path(sys.prefix)
    out = subprocess.run(["make", "-s", "-n", "--no-print-directory", "-o", f"{venv}/.installed", "lab", f"VENV={venv}"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert len(out.splitlines()) == 1, f"`make -n lab` should print one command:\n{out}"
    return shlex.split(out)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """``make lab``'s server on a copy of notebooks/: yields (base URL, token, served root, checkpoint dir)."""
    tmp = tmp_path_factory.mktemp("jupyterlab")
    dirs = throwaway_jupyter_dirs(tmp, SETTINGS)
    course = tmp / "course"  # `make lab` serves ./notebooks: a copy, so autosave cannot touch the repo
    shutil.copytree(ROOT / "notebooks", course / "notebooks")
    cmd = [*make_lab_command(),
           f"--FileCheckpoints.checkpoint_dir={dirs['checkpoints']}",  # absolute: no .ipynb_checkpoints in the tree
           "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           "--LabApp.extension_manager=readonly"]
    with jupyter_server(cmd, course, dirs, tmp / "server.log") as (base, token):
        yield base, token, course / "notebooks", dirs["checkpoints"]


def notebook_title(nb: dict) -> str:
    """Text of the first markdown heading, e.g. 'Lab-1.5 · 01：環境設置與注意力機制對比（Setup and Comparison）'."""
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    raise AssertionError("the notebook has no markdown heading")


# Count the open notebook's cells and read its text once JupyterLab has drawn it.
PROBE = """(() => {
  const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
  return {cells: nb ? nb.querySelectorAll('.jp-Cell').length : 0, text: nb ? nb.innerText : '',
          fonts: document.fonts.status, spinner: !!document.querySelector('#jupyterlab-splash')};
})()"""


def wait_kernels_then_autosave(base: str, token: str, rels: list[str]) -> None:
    """Wait until the kernel of every notebook in ``rels`` is idle (its kernel_info is in), then for autosave to run."""
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        idle = {s["path"] for s in get_json(f"{base}/api/sessions?token={token}")
                if s["kernel"]["execution_state"] == "idle"}
        waiting = sorted(set(rels) - idle)
        if not waiting:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"the kernels of {waiting} did not start in {READY_TIMEOUT} s")
        time.sleep(0.5)
    time.sleep(AUTOSAVE_WAIT)


def open_all_in_lab(lab, chromium, paths: list[Path]) -> dict[Path, tuple[dict, bytes]]:
    """Open every notebook of ``paths`` (under the served root) in JupyterLab, a tab each, left open: each is drawn
    and pictured in turn, then all wait together for their kernels and for autosave (one wait, not one per notebook:
    most of these tests' time was waiting). Returns {path: (the page probe, a screenshot as PNG bytes)}; the kernels
    are shut down afterwards."""
    base, token, served, _ = lab
    seen = {}
    try:
        with contextlib.ExitStack() as tabs:
            for path in paths:
                nb = json.loads(path.read_bytes())
                title, n_cells = notebook_title(nb), len(nb["cells"])
                # A workspace per notebook, so tabs restored from an earlier notebook do not open too.
                url = f"{base}/lab/workspaces/test-{path.stem}/tree/{path.relative_to(served).as_posix()}?token={token}"
                page = tabs.enter_context(open_page(chromium, url))
                state = page.wait_for(PROBE, lambda s: s.get("cells", 0) >= n_cells and title in s.get("text", "")
                                      and s.get("fonts") == "loaded" and not s.get("spinner"))
                time.sleep(1.0)  # let MathJax and the layout settle before the picture
                seen[path] = (state, page.screenshot())
            wait_kernels_then_autosave(base, token, [p.relative_to(served).as_posix() for p in paths])
    finally:
        for session in get_json(f"{base}/api/sessions?token={token}"):  # shut the kernels down
            get_json(f"{base}/api/sessions/{session['id']}?token={token}", method="DELETE")
    return seen


def listed_notebooks(base: str, token: str, folder: str = "") -> list[str]:
    """Paths of every notebook the server's contents API lists under ``folder`` (recursively)."""
    found = []
    for item in get_json(f"{base}/api/contents/{folder}?token={token}")["content"]:
        if item["type"] == "directory":
            found += listed_notebooks(base, token, item["path"])
        elif item["type"] == "notebook":
            found.append(item["path"])
    return sorted(found)


def test_make_lab_serves_every_student_notebook(lab):
    base, token, _, _ = lab
    if os.geteuid() == 0:  # the server above started, as root, only because of this flag
        assert "--allow-root" in make_lab_command()
    assert listed_notebooks(base, token) == [p.relative_to(ROOT / "notebooks").as_posix() for p in NOTEBOOKS]


@pytest.fixture(scope="module")
def opened(lab, chromium):
    """Every student notebook and a control notebook with incomplete language_info, opened together: the control's
    file as autosave left it, and per notebook (its bytes, mtime and folder before opening, probe, screenshot)."""
    served = lab[2]
    paths = [served / p.relative_to(ROOT / "notebooks") for p in NOTEBOOKS]
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns, sorted(q.name for q in p.parent.iterdir())) for p in paths}
    control = json.loads(NOTEBOOKS[0].read_bytes())
    control["metadata"]["language_info"] = {"name": "python"}
    control_path = served / "control-incomplete-metadata.ipynb"
    control_path.write_text(json.dumps(control, indent=1, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")
    try:
        seen = open_all_in_lab(lab, chromium, [control_path, *paths])
        saved = json.loads(control_path.read_bytes())
    finally:
        control_path.unlink()  # the served tree holds the course's notebooks only
    return SimpleNamespace(control=control, saved=saved,
                           notebooks={p.stem: (p, *before[p], *seen[p]) for p in paths})


def test_autosave_rewrites_incomplete_kernel_metadata(opened):
    """Control: a notebook with incomplete language_info is saved with the kernel's, in the time the test waits."""
    from ipykernel.ipkernel import IPythonKernel  # the kernel_info reply's language_info

    assert opened.saved["metadata"]["language_info"] == IPythonKernel.language_info, "autosave did not run in time"
    assert opened.saved["cells"] == opened.control["cells"]
    assert opened.saved["metadata"]["kernelspec"] == opened.control["metadata"]["kernelspec"]


@pytest.mark.parametrize("name", [p.stem for p in NOTEBOOKS])
def test_notebook_renders_in_jupyterlab(name, opened, lab, tmp_path):
    checkpoints = lab[3]
    path, nb_bytes, mtime, folder_before, state, png = opened.notebooks[name]
    nb = json.loads(nb_bytes)
    title, n_cells = notebook_title(nb), len(nb["cells"])
    shot = tmp_path / f"{path.stem}.png"
    shot.write_bytes(png)
    print(f"screenshot: {shot}")

    assert state.get("cells") == n_cells, f"JupyterLab drew {state.get('cells')} of {n_cells} cells ({shot})"
    assert title in state["text"], f"title {title!r} not on the page ({shot})"
    assert_drawn(png, shot)
    assert_opening_changed_nothing(path, nb_bytes, mtime)
    assert sorted(p.name for p in path.parent.iterdir()) == folder_before, "opening created files beside it"
    assert any(checkpoints.rglob(f"{path.stem}-checkpoint.ipynb")), "checkpoint was not redirected out of the tree"


def assert_opening_changed_nothing(path: Path, before: bytes, mtime: int) -> None:
    """The notebook file is as it was after autosave had its chance: same bytes, not even saved again.

    The kernel (this interpreter) reports its Python's version in language_info; where that differs from
    the notebook's, JupyterLab rewrites that one field (tests/course/test_notebook_metadata.py says why), and
    nothing else may change.
    """
    nb = json.loads(before)
    python, recorded = platform.python_version(), nb["metadata"].get("language_info", {}).get("version")
    if recorded is not None and recorded != python:
        nb["metadata"]["language_info"]["version"] = python
        assert json.loads(path.read_bytes()) == nb, "opening the notebook changed more than the Python version"
        return
    assert path.read_bytes() == before, "opening the notebook modified it (incomplete kernel metadata?)"
    assert path.stat().st_mtime_ns == mtime, "opening the notebook saved it again"
