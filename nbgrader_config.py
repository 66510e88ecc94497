"""nbgrader settings for the course: the instructor edits solutions/, students get notebooks/."""
c = get_config()  # noqa: F821 (provided by nbgrader)

c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "notebooks"
c.CourseDirectory.db_url = "sqlite:///gradebook.db"

# Generous per-cell limit: the cpu profile keeps every cell to seconds.
c.Execute.timeout = 120
c.ClearSolutions.code_stub = {
    "python": "# YOUR CODE HERE\nraise NotImplementedError()",
}
c.ClearSolutions.text_stub = "請在此作答（YOUR ANSWER HERE）"
