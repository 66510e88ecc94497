"""Per notebook: the rules each exercise's prose states and the wrong answers that prove the tests check them.

One module per notebook (``nbNN.py``), each with the same names:

- ``ASSIGNMENT``: the notebook's slug; ``SETUP``: markers of the ungraded cells the exercises need.
- ``RULES``: grade_id -> the rules (in English) that its VISIBLE tests check; the README's instructor
  table is built from these.
- ``MISTAKES``: grade_id -> [(mistake, text in the answer, replacement)]: plausible student mistakes, at
  least three per exercise; each must fail a visible test.
- ``HIDDEN_ONLY``: {(grade_id, mistake): why no visible check can catch it}: at most one per notebook;
  those must fail the full test cell.
- ``FITTED``: grade_id -> [(name, text, replacement)]: answers fitted to the visible cases (a constant,
  a shape special-cased); they pass the visible tests and must fail the hidden ones, which vary the
  instances.
- ``ACCEPTED`` (optional): grade_id -> [(name, text, replacement)]: right answers written another way that the
  prose allows (e.g. 09's D from PyTorch instead of a preprocess kernel); each must pass the whole test cell.

Used in: tests/course/test_grader_strength.py.
"""
from importlib import import_module

NOTEBOOKS = ["nb01", "nb02", "nb03", "nb04", "nb05", "nb06", "nb07", "nb08", "nb09", "nb10", "nb11"]


def load(name: str):
    """The module ``tests/mutants/<name>.py``."""
    return import_module(f"mutants.{name}")
