"""nbgrader preprocessors the course configures in nbgrader_config.py: hidden tests stay hidden.

nbgrader 0.9.6 keeps a test cell's hidden tests in the gradebook and strips them from the release.
Two consequences this module handles:

- ``FeedbackWithoutHiddenTests`` (``GenerateFeedback``): nbgrader's feedback HTML shows each autograded
  cell as it ran, hidden tests included. This removes the hidden-test regions from every cell's source
  (nbgrader's ``ClearHiddenTests``) and cuts each error in a test cell down to its last line
  (``AssertionError: <the check's message>``): an IPython traceback quotes the lines around the
  failing one, hidden tests among them. Scores are read before it runs and stay as graded.
- ``RestoreHiddenTests`` (``Autograde``, in place of ``OverwriteCells``): autograde puts the hidden
  tests back by restoring each locked cell from the gradebook, and nbgrader reports every such cell as
  ``Attribute 'checksum' for cell ... has changed!``, for untouched notebooks too. This puts them back
  first when the submitted source is exactly the release's (the gradebook source with its hidden-test
  regions removed), so the warning is left for cells a student really edited.

Used in: nbgrader_config.py; tests/course/test_nbgrader_term.py runs both through nbgrader.
"""
from __future__ import annotations

import copy

from nbgrader import utils
from nbgrader.api import MissingEntry
from nbgrader.preprocessors import ClearHiddenTests, OverwriteCells


def _is_test_cell(cell) -> bool:
    return utils.is_grade(cell) and not utils.is_solution(cell)


class FeedbackWithoutHiddenTests(ClearHiddenTests):
    """Remove hidden-test regions from sources and the tracebacks of test cells (a cell in, a cell out)."""

    def preprocess_cell(self, cell, resources, cell_index):
        cell, resources = super().preprocess_cell(cell, resources, cell_index)
        if cell.cell_type == "code" and _is_test_cell(cell):
            for output in cell.get("outputs", []):
                if output.get("output_type") == "error":
                    output["traceback"] = [f"{output['ename']}: {output['evalue']}"]
        return cell, resources


class RestoreHiddenTests(OverwriteCells):
    """``OverwriteCells`` that restores the hidden tests of an unedited locked cell without a warning."""

    def preprocess_cell(self, cell, resources, cell_index):
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id is not None and utils.is_locked(cell):
            try:
                source_cell = self.gradebook.find_source_cell(grade_id, self.notebook_id, self.assignment_id)
            except MissingEntry:
                source_cell = None          # OverwriteCells reports it
            if source_cell is not None and cell.source == self._released_source(cell, source_cell.source):
                cell.source = source_cell.source
        return super().preprocess_cell(cell, resources, cell_index)

    def _released_source(self, cell, source: str) -> str:
        """``source`` (the gradebook's, hidden tests included) as the release shows it."""
        released = copy.deepcopy(cell)
        released.source = source
        ClearHiddenTests(parent=self)._remove_hidden_test_region(released)
        return released.source
