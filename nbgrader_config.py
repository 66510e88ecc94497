"""nbgrader settings for the course: the instructor edits solutions/, students get notebooks/."""
import importlib.util
from pathlib import Path

from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor
from nbgrader.preprocessors import CheckCellMetadata, ClearOutput, DeduplicateIds, GetGrades, OverwriteKernelspec

# The course's preprocessors, loaded from labkit's file without importing labkit: `import labkit` would load torch
# (seconds of CPU) in every nbgrader command, and they need only nbgrader. find_spec locates, it runs nothing.
_labkit = Path(importlib.util.find_spec("labkit").submodule_search_locations[0])
_spec = importlib.util.spec_from_file_location("labkit_nbgrader_plugins", _labkit / "course" / "nbgrader_plugins.py")
_plugins = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_plugins)
FeedbackWithoutHiddenTests, RestoreHiddenTests = _plugins.FeedbackWithoutHiddenTests, _plugins.RestoreHiddenTests

c = get_config()  # noqa: F821 (provided by nbgrader)

c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "notebooks"
c.CourseDirectory.db_url = "sqlite:///gradebook.db"
# nbgrader's exchange (release_assignment, fetch_assignment, submit, collect, release_feedback, fetch_feedback):
# this course's name in it, and where it is. The default root is exchange/ beside this file, for one account;
# on a shared server point it at a directory every student can reach (README, Instructor workflow) and give
# the students the same two settings. release_assignment makes the root world-writable (0o777) if it is not.
c.CourseDirectory.course_id = "lab-1.5-flashattention"
c.Exchange.root = str(Path(__file__).resolve().parent / "exchange")
# Files a solution run leaves beside its notebook (notebook 04's profiler traces) stay out of the release.
c.CourseDirectory.ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "feedback", "traces"]

# Generous per-cell limit: the cpu profile keeps every cell to seconds.
c.Execute.timeout = 120
# Late work (submitted/<student>/<assignment>/timestamp.txt after the due date set with
# `nbgrader db assignment add ID --duedate=...`) is flagged, not penalised: autograde logs how many
# seconds late it is and `nbgrader export` lists the timestamp next to the due date. Use "zero" to
# give late submissions 0 points.
c.LateSubmissionPlugin.penalty_method = "none"
# A deleted test cell is not put back: it scores 0 and is left needing manual grading. nbgrader
# 0.9.6 can re-add it (True), but then crashes on a submission whose answer cell is deleted too.
c.OverwriteCells.add_missing_cells = False
c.ClearSolutions.code_stub = {
    "python": "# YOUR CODE HERE\nraise NotImplementedError()",
}
c.ClearSolutions.text_stub = "請在此作答（YOUR ANSWER HERE）"

# Hidden tests stay hidden (labkit/course/nbgrader_plugins.py): the feedback HTML shows no hidden test,
# in a cell's source or in a traceback, and autograde puts them back into an unedited test cell without
# reporting "checksum has changed" (left for test cells a student edited).
c.GenerateFeedback.preprocessors = [GetGrades, CSSHTMLHeaderPreprocessor, FeedbackWithoutHiddenTests]
# nbgrader 0.9.6's sanitize list with OverwriteCells replaced:
c.Autograde.sanitize_preprocessors = [ClearOutput, DeduplicateIds, OverwriteKernelspec, RestoreHiddenTests,
                                      CheckCellMetadata]
