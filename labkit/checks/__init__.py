"""The visible tests of the notebooks' exercises: a module per notebook (``nbNN``), or a few by exercise where one would
pass 320 lines (``nbNN_<part>``: nb06_forward, nb06_backward, ...).

A notebook's test cell calls them by name (``lk.checks.nb07.merge_equals_full_attention(merge_partials)``) and then
holds its hidden block. They check what the prose states, with messages in lk.grading's style, and never hold an answer
(labkit ships to students): the references they use compute another way (float64, the naive formula).
The board's speed checks live apart (instructors only).

Each module is imported on first use (below).

Used in: every notebook's test cells; tests/course/test_grader_strength.py tries them on tests/mutants' wrong answers.
"""
import importlib


def __getattr__(name: str):
    """``lk.checks.nb06`` imports labkit/checks/nb06.py on first use: ``import labkit`` (every notebook kernel, every
    board worker) does not pay for the checks of ten notebooks."""
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"labkit.checks has no module {name!r}") from None
