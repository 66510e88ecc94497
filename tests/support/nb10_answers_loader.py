"""Notebook 10's reference answers (ex1, ex2, ex4) as a namespace, until the solution notebook holds them: the text
of tests/support/nb10_answers/solution_quant.py, with ``replace`` substitutions applied (a mistake of the mutants
draft), executed beside a given ``fp8_attention`` (a stand-in of exercise 3)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

SOLUTION = Path(__file__).parent / "nb10_answers" / "solution_quant.py"


def answers(fp8_attention: Callable, replace: tuple[str, str] | None = None) -> dict:
    """The namespace the answers define; ``replace`` = (old, new) must occur in the text."""
    text = SOLUTION.read_text()
    if replace is not None:
        old, new = replace
        assert text.count(old) == 1, f"the substitution's text occurs {text.count(old)} times: {old!r}"
        text = text.replace(old, new)
    namespace = {"fp8_attention": fp8_attention}
    exec(compile(text, str(SOLUTION), "exec"), namespace)   # noqa: S102 - the course's own answer text
    return namespace
