"""Tests for labkit.course.execute: executed copies, the summary page, and the guard inside real kernels.

A tiny course (one notebook) runs in a real ipykernel: its summary cell prints and plots, one cell
prints a GPU-only notice, one raises, one reaches for the network and one calls deprecated code.
The run must go on past each failure, record it, and write everything; in strict mode the guard
fails the offending cells, in the default report mode it lists them and lets the cells finish.
A cell that sleeps past the time limit is recorded with the limit and how long it ran, and the next
notebook still runs.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
import pytest
import traitlets.log
from nbformat.v4 import new_code_cell, new_notebook

from labkit.course import execute

CELLS = {
    "measure": ('import matplotlib.pyplot as plt\nprint("speedup 3.0x")\nplt.plot([1, 2]); plt.show()', ["summary"]),
    "notice": ("import labkit as lk\nlk.env.gpu_only('the memory plot needs a CUDA GPU')", []),
    "bug": ("raise ValueError('a bug in cell three')", []),
    "network": ("import urllib.request\ntry:\n    urllib.request.urlopen('http://example.com', timeout=2)\n"
                "except Exception as err:\n    print('swallowed', err)", []),
    "deprecated": ("import warnings\nwarnings.warn('old API', FutureWarning)", []),
    "slow": ("import time\ntime.sleep(60)", []),
    "after": ("import os\nprint('profile', os.environ['LABKIT_PROFILE'], 'offline', os.environ['HF_HUB_OFFLINE'])",
              ["summary"]),
}


def _course(root: Path, cell_ids, name: str = "01_tiny") -> Path:
    cells = []
    for cell_id in cell_ids:
        source, tags = CELLS[cell_id]
        cell = new_code_cell(source, id=cell_id)
        cell.metadata["tags"] = tags
        cells.append(cell)
    path = root / "solutions" / name / f"{name}.ipynb"
    path.parent.mkdir(parents=True)
    nbformat.write(new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                       "language": "python"}}), path)
    return root


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    root = _course(tmp_path_factory.mktemp("course"), [c for c in CELLS if c != "slow"])
    out = root / "build"
    before = dict(os.environ)
    runs = execute.execute_all(root, out, profile="cpu", timeout=120, strict=True, progress=False)
    assert dict(os.environ) == before, "execute_all must restore the environment it changed for the kernels"
    return runs, out


def test_every_cell_ran_and_the_copy_was_written(executed):
    runs, out = executed
    (run,) = runs
    assert run.name == "01_tiny" and run.code_cells == len(CELLS) - 1 and run.seconds > 0
    nb = nbformat.read(out / "01_tiny.ipynb", as_version=4)
    assert all(c.execution_count for c in nb.cells), "a failing cell must not stop the run"
    assert (out / "01_tiny.html").read_text(encoding="utf-8").count("speedup 3.0x") >= 1


def test_errors_include_guard_violations(executed):
    (run,) = executed[0]
    errors = {e.cell_id: e for e in run.errors}
    assert set(errors) == {"bug", "network", "deprecated"}
    assert errors["bug"].ename == "ValueError"
    assert errors["network"].ename == "RunGuardViolation" and "example.com" in errors["network"].evalue
    assert errors["deprecated"].ename == "RunGuardViolation" and "FutureWarning" in errors["deprecated"].evalue


def test_summary_lists_results_notices_and_errors(executed):
    (run,) = executed[0]
    out = executed[1]
    assert run.gpu_only_cells == ["notice"]
    assert [r["cell_id"] for r in run.results] == ["measure", "after"]
    measure, after = run.results
    assert measure["text"] == "speedup 3.0x" and len(measure["figures"]) == 1
    assert (out / measure["figures"][0]).read_bytes()[:4] == b"\x89PNG"
    assert after["text"] == "profile cpu offline 1"
    page = (out / "summary.md").read_text(encoding="utf-8")
    assert "profile: cpu" in page and "speedup 3.0x" in page and f"]({measure['figures'][0]})" in page
    assert "| bug, deprecated, network | notice | 0 |" in page and "a bug in cell three" in page
    facts = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert facts["profile"] == "cpu" and facts["notebooks"][0]["name"] == "01_tiny"


def test_report_mode_lists_violations_and_goes_on(tmp_path):
    root = _course(tmp_path, ["network", "deprecated", "after"])
    (run,) = execute.execute_all(root, tmp_path / "out", profile="cpu", timeout=120, progress=False)
    assert run.errors == []  # the network call failed like an offline one and was swallowed; the warning was shown
    assert [r.split(":")[0] for r in run.guard_reports] == ["network", "deprecated"]
    assert "example.com" in run.guard_reports[0] and "FutureWarning" in run.guard_reports[1]
    assert "**run guard** in `network: network access attempted" in (tmp_path / "out" / "summary.md").read_text()


def test_a_cell_past_its_limit_is_an_error_and_the_next_notebook_runs(tmp_path):
    _course(tmp_path, ["after", "slow", "notice"], name="01_slow")
    _course(tmp_path, ["after"], name="02_next")
    shared = traitlets.log.get_logger()
    level = shared.level
    slow, following = execute.execute_all(tmp_path, tmp_path / "out", profile="cpu", timeout=2, progress=False)
    assert shared.level == level, "execute silenced traitlets' shared logger: nbgrader's warnings in the process go too"
    (error,) = slow.errors
    assert (error.cell_id, error.ename) == ("slow", execute.TIMEOUT)
    ran = float(error.evalue.split("interrupted after ")[1].split(" s")[0])
    assert "its 2 s limit" in error.evalue and 2 <= ran < 30, error.evalue
    assert slow.gpu_only_cells == [], "the cells after the timed-out one must not run"
    assert following.errors == [] and following.results[0]["text"] == "profile cpu offline 1"
    page = (tmp_path / "out" / "summary.md").read_text(encoding="utf-8")
    assert "| 3 | slow | - | 0 |" in page
    assert f"**error** in `slow`: {execute.TIMEOUT}: cell ran past its 2 s limit" in page
    assert "[02_next](02_next.html)" in page


def test_bad_arguments_are_named(tmp_path):
    (tmp_path / "solutions" / "01_a").mkdir(parents=True)
    nbformat.write(new_notebook(), tmp_path / "solutions" / "01_a" / "01_a.ipynb")
    with pytest.raises(ValueError, match="no solution notebook starts with"):
        execute.solution_notebooks(tmp_path, ["07"])
    with pytest.raises(ValueError, match="profile 'tpu'"):
        execute.execute_all(tmp_path, tmp_path / "out", profile="tpu")


@pytest.mark.slow
def test_autograde_kernels_of_the_test_command_are_guarded(tmp_path):
    """tests/conftest.py guards the kernels `make test` starts, nbgrader's autograde included (it executes every
    solution notebook as a perfect submission): a cell's FutureWarning fails that cell."""
    from nbgrader_course import make_course, perfect_submission, run_nbgrader, submit
    from tiny_assignment import ASSIGNMENT, source_notebook

    source = source_notebook()
    warns = dict(source["cells"][1], id="warns", metadata={},
                 source="import warnings\nwarnings.warn('old API', FutureWarning)")
    source["cells"].insert(2, warns)
    course = make_course(tmp_path, ASSIGNMENT, source)
    run_nbgrader(course, "generate_assignment", ASSIGNMENT)
    release = json.loads((course / "notebooks" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb").read_text(encoding="utf-8"))
    submit(course, "perfect", ASSIGNMENT, perfect_submission(release, source))
    run_nbgrader(course, "autograde", ASSIGNMENT)
    graded = json.loads((course / "autograded" / "perfect" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb").read_text("utf-8"))
    errors = [o for c in graded["cells"] if c.get("id") == "warns" for o in c.get("outputs", [])
              if o["output_type"] == "error"]
    assert errors and errors[0]["ename"] == "RunGuardViolation" and "old API" in errors[0]["evalue"], errors