"""Notebook 10's answers to exercises 1, 2 and 4 as a namespace, beside a given ``fp8_attention`` (a torch stand-in
of exercise 3's kernel: the checks of ex1, ex2 and ex4 then run in a second, not through Triton's interpreter).
``replace`` = (grade_id, old, new) substitutes one mistake of tests/mutants/nb10.py in that exercise's answer."""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from mutants import load
from notebook_grader import exercises

SPEC = load("nb10")
ANSWERED = ("ex1_quantizers", "ex2_rotation", "ex4_pipeline")


def answers(fp8_attention: Callable, replace: tuple[str, str, str] | None = None) -> dict:
    """The namespace the answer cells of ex1, ex2 and ex4 define, with ``fp8_attention`` given."""
    namespace = {"__name__": "__main__", "fp8_attention": fp8_attention, "torch": torch, "F": F, "math": math}
    for e in exercises(SPEC.ASSIGNMENT):
        if e.grade_id in ANSWERED:
            source = e.mutate(*replace[1:]) if replace and replace[0] == e.grade_id else e.answer
            exec(compile(source, e.grade_id, "exec"), namespace)  # noqa: S102 - the course's own answer cell
    return namespace
