"""What the board's per-assignment modules share (:mod:`labkit.board.specs` is the registry).

:class:`Spec`: one assignment's graded names and its board steps (``own``, ``calls``, ``check``, ``time``, and
where it has them ``allow`` and ``audit``: see :mod:`labkit.board.specs`); :func:`forbidden`: the library functions
no graded function may reach; :func:`geomean`; :func:`randn` (inputs from a generator of the board's seed);
:func:`compare` (fp32: an absolute tolerance; bf16/fp16: the course's 2x rule); :data:`CHECK_DTYPES`; :data:`PEAK_N`
(the compute peak's matmul).

Used by: :mod:`labkit.board.nb06`, :mod:`labkit.board.nb08`, :mod:`labkit.board.nb09`, :mod:`labkit.board.nb10`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from labkit.core import grading


@dataclass(frozen=True)
class Spec:
    """One assignment's graded names (the notebook must define them) and its board steps."""

    graded: tuple[str, ...]
    own: Callable[[dict], dict[str, Callable]]
    calls: Callable[[dict, torch.device], dict[str, Callable[[], object]]]   # tiny calls: must launch kernels
    check: Callable[[dict, int, torch.device], None]
    time: Callable[[dict, int, torch.device, float], dict]
    allow: tuple = ()   # labkit modules the graded code may call (check_own_code's allow): 10's lk.fp8cast
    audit: Callable[[dict, torch.device], str | None] | None = None   # why to flag (10: no FP8 MMA), or None


def forbidden() -> tuple:
    """Library functions a graded function may not reach: SDPA and the softmaxes."""
    return (F.scaled_dot_product_attention, torch.softmax, torch.Tensor.softmax, F.softmax)


def geomean(values: list[float]) -> float:
    """Geometric mean of positive values (NaN if any is missing or not positive)."""
    if not values or any(not (v > 0) for v in values):
        return math.nan
    return math.exp(sum(math.log(v) for v in values) / len(values))


def randn(gen: torch.Generator, *shape: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def compare(name: str, actual: torch.Tensor, exact: torch.Tensor, plain: torch.Tensor | None, dtype,
             atol: float) -> None:
    """fp32: |actual - exact| <= atol. bf16/fp16: the 2x rule against ``plain`` (the same math in that dtype)."""
    if dtype == torch.float32 or plain is None:
        grading.check_tensor(actual, exact, name=name, atol=atol)
    else:
        floor = 1e-2 * float(exact.detach().abs().max())   # lenient: the tests grade precision, not the board
        grading.check_within_2x(actual, exact, plain, name=name, rule="statistics and accumulators in fp32",
                                floor=floor)


CHECK_DTYPES = {"cpu": [torch.float32], "cuda": [torch.float32, torch.bfloat16]}   # bf16: the 2x rule




PEAK_N = 8192   # the matmul of the compute peak: n x n x n, bf16
