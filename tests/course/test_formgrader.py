"""nbgrader's formgrader, where the instructor grades the written answers, works in a real (headless) browser.

A temporary course (tests/support/nbgrader_course.py) holds one assignment, 04 (performance analysis), cut to
its markdown cells: its title, the written question and the manually graded written answer. Its code cells
are left out because autograde would execute them (half a minute on a busy 2-core machine) and the
formgrader's pages do not depend on them. generate_assignment, one perfect submission, autograde; then a
Jupyter server (``jupyter server`` in the course directory, as README's instructor workflow step 8 says; the
formgrader is nbgrader's server extension, enabled in the environment) and one headless Chromium
(tests/support/headless_browser.py, as test_browser.py). In the browser: ``/formgrader`` opens the manage
assignments page, which lists the assignment with its one submission; the manual grading page of that
submission shows the student's written answer, its score box marked as needing a manual grade. Each page
must also look drawn in a screenshot (paths printed, ``pytest -s``). Skips where no Chromium is installed.
"""
from __future__ import annotations

import json
import os
import sys
import time

import pytest
from headless_browser import assert_drawn, chromium, jupyter_server, open_page, throwaway_jupyter_dirs  # noqa: F401
from nbgrader_course import load, make_course, nbgrader_cells, perfect_submission, run_nbgrader, submit

pytestmark = pytest.mark.slow
A, STUDENT = "04_performance_analysis", "s1120001"

# The formgrader's pages draw their content with Backbone after the page loads: poll the DOM.
ASSIGNMENTS_PROBE = """(() => {
  const row = [...document.querySelectorAll('tr')].find(r => r.querySelector('.name')?.innerText.trim() === %s);
  return {text: document.body ? document.body.innerText : '',
          submissions: row ? row.querySelector('.num-submissions').innerText.trim() : null};
})()"""
SUBMISSION_PROBE = """(() => {
  const score = document.getElementById(%s);
  return {text: document.body ? document.body.innerText : '', score: !!score,
          needs_manual_grade: !!score && score.classList.contains('needs_manual_grade')};
})()"""
LOADED = "({path: location.pathname, ready: document.readyState})"  # for a page the server draws itself


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """The graded course: (course dir, the written answer's grade_id, its text as submitted)."""
    course = make_course(tmp_path_factory.mktemp("formgrader"), A)
    source = course / "solutions" / A / f"{A}.ipynb"
    solution = load(source)
    solution["cells"] = [c for c in solution["cells"] if c["cell_type"] == "markdown"]
    source.write_text(json.dumps(solution), encoding="utf-8")
    (course / "exchange").mkdir()  # nbgrader_config.py's exchange root, set up as README says (else a warning)
    (course / "exchange").chmod(0o1777)
    run_nbgrader(course, "generate_assignment", A)
    filled = perfect_submission(load(course / "notebooks" / A / f"{A}.ipynb"), solution)
    submit(course, STUDENT, A, filled)
    run_nbgrader(course, "autograde", A)
    [written] = nbgrader_cells(filled, solution=True, grade=True)
    return course, written["metadata"]["nbgrader"]["grade_id"], "".join(written["source"])


@pytest.fixture(scope="module")
def formgrader(chromium, course, tmp_path_factory):  # chromium first: without it, no nbgrader runs
    """``jupyter server`` in the course directory, Chromium logged in to it: yields the base URL.

    The browser logs in as an instructor does, on a server page (the token in the URL sets the login cookie
    for the whole server). A formgrader page is no place for it: nbgrader's handlers drop base_url's trailing
    slash, so the cookie they set is for the page's own folder, and the grading page's API calls would be
    redirected to the login page.
    """
    tmp = tmp_path_factory.mktemp("formgrader-server")
    cmd = [sys.executable, "-m", "jupyter_server", *(["--allow-root"] if os.geteuid() == 0 else [])]
    with jupyter_server(cmd, course[0], throwaway_jupyter_dirs(tmp), tmp / "server.log") as (base, token):
        with open_page(chromium, f"{base}/api/status?token={token}") as page:
            page.wait_for(LOADED, lambda s: s.get("path") == "/api/status" and s.get("ready") == "complete")
        yield base


def submission_id(course) -> str:
    """The gradebook's id of the student's submitted notebook (the manual grading page's URL names it)."""
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        return gb.find_submission_notebook(A, A, STUDENT).id


def test_formgrader_lists_the_assignment(formgrader, chromium, tmp_path):
    with open_page(chromium, f"{formgrader}/formgrader") as page:
        state = page.wait_for(ASSIGNMENTS_PROBE % json.dumps(A), lambda s: s.get("submissions") == "1")
        time.sleep(1.0)  # let the table's layout settle before the picture
        png, path = page.screenshot(), page.evaluate("location.pathname")
    shot = tmp_path / "manage_assignments.png"
    shot.write_bytes(png)
    print(f"screenshot: {shot}")
    assert path == "/formgrader/manage_assignments", path
    assert state["submissions"] == "1", f"{A} is not listed with 1 submission ({shot}):\n{state['text'][:1000]}"
    assert "Manage Assignments" in state["text"] and "exchange directory" not in state["text"], state["text"][:1000]
    assert_drawn(png, shot)


def test_manual_grading_shows_the_written_answer(formgrader, course, chromium, tmp_path):
    path, grade_id, answer = course
    first_line = answer.strip().splitlines()[0]
    with open_page(chromium, f"{formgrader}/formgrader/submissions/{submission_id(path)}/") as page:
        state = page.wait_for(SUBMISSION_PROBE % json.dumps(grade_id),
                              lambda s: s.get("needs_manual_grade") and first_line in s.get("text", ""))
        page.evaluate(f"document.getElementById({json.dumps(grade_id)})?.scrollIntoView({{block: 'center'}})")
        time.sleep(1.0)  # let the scroll and the layout settle before the picture
        png = page.screenshot()
    shot = tmp_path / "manual_grading.png"
    shot.write_bytes(png)
    print(f"screenshot: {shot}")
    assert state.get("score"), f"no score box for {grade_id} ({shot}):\n{state.get('text', '')[:1000]}"
    assert "Submission 1 / 1" in state["text"] and "Student's answer" in state["text"], state["text"][:1000]
    assert first_line in state["text"], f"the written answer is not on the page ({shot})"
    assert state["needs_manual_grade"], f"{grade_id} is not marked as needing a manual grade ({shot})"
    assert_drawn(png, shot)
