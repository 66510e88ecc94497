"""labkit.course.nbgrader_plugins on single cells; tests/course/test_nbgrader_term.py runs them through nbgrader."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import nbformat
from labkit.course.nbgrader_plugins import FeedbackWithoutHiddenTests, RestoreHiddenTests
from nbgrader.api import MissingEntry
from nbgrader.utils import compute_checksum

VISIBLE = "check(f)"
FULL = f"{VISIBLE}\n### BEGIN HIDDEN TESTS\nassert f(7) == 49\n### END HIDDEN TESTS\npassed()"
RELEASED = f"{VISIBLE}\npassed()"


def _cell(source: str, **nbgrader) -> nbformat.NotebookNode:
    meta = dict(grade=True, solution=False, locked=True, grade_id="ex_tests", points=1.0, schema_version=3)
    cell = nbformat.v4.new_code_cell(source, metadata={"nbgrader": dict(meta, **nbgrader)})
    cell.outputs = [nbformat.v4.new_output("error", ename="AssertionError", evalue="[f(7)] should be 49",
                                           traceback=["----> 3 assert f(7) == 49", "AssertionError: [f(7)] should be 49"])]
    return cell


def test_feedback_drops_hidden_tests_from_source_and_traceback():
    cell, _ = FeedbackWithoutHiddenTests().preprocess_cell(_cell(FULL), {}, 0)
    assert cell.source == RELEASED
    assert cell.outputs[0]["traceback"] == ["AssertionError: [f(7)] should be 49"]


def test_feedback_keeps_an_answer_cells_traceback():
    answer = _cell("def f(x):\n    return x", solution=True, grade=False, locked=False, grade_id="ex")
    cell, _ = FeedbackWithoutHiddenTests().preprocess_cell(answer, {}, 0)
    assert cell.outputs[0]["traceback"][0] == "----> 3 assert f(7) == 49"


class _Gradebook:
    """What OverwriteCells asks of the gradebook for one locked test cell."""

    def __init__(self, source: str | None):
        self.source = source

    def find_source_cell(self, grade_id, notebook_id, assignment_id):
        if self.source is None:
            raise MissingEntry()
        probe = _cell(self.source)
        return SimpleNamespace(source=self.source, cell_type="code", locked=True, checksum=compute_checksum(probe))

    def find_graded_cell(self, grade_id, notebook_id, assignment_id):
        return SimpleNamespace(max_score=1.0)


def _restore(submitted: str, gradebook_source: str | None) -> tuple[nbformat.NotebookNode, str]:
    """The cell RestoreHiddenTests hands on, and what it logged. It logs to a logger of this test's own: by
    default a preprocessor logs to the running traitlets application's logger, which an nbgrader application
    started earlier in this process may have disabled or raised above WARNING."""
    records = []
    log = logging.getLogger(f"{__name__}.restore")
    log.setLevel(logging.WARNING)
    log.propagate, log.disabled = False, False
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    log.addHandler(handler)
    pre = RestoreHiddenTests(log=log)
    pre.gradebook, pre.notebook_id, pre.assignment_id = _Gradebook(gradebook_source), "nb", "a"
    try:
        cell, _ = pre.preprocess_cell(_cell(submitted), {}, 0)
    finally:
        log.removeHandler(handler)
    return cell, "\n".join(record.getMessage() for record in records)


def test_unedited_test_cell_gets_its_hidden_tests_without_a_warning():
    cell, logged = _restore(RELEASED, FULL)
    assert cell.source == FULL
    assert "has changed" not in logged


def test_edited_test_cell_is_restored_and_reported():
    cell, logged = _restore("pass", FULL)
    assert cell.source == FULL
    assert "Attribute 'checksum' for cell ex_tests has changed!" in logged


def test_cell_missing_from_the_gradebook_is_left_to_overwritecells():
    cell, logged = _restore(RELEASED, None)
    assert cell.source == RELEASED and "grade_id" not in cell.metadata.nbgrader
    assert "Cell 'ex_tests' does not exist in the database" in logged
