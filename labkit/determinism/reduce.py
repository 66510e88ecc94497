"""A sum over many programs by floating-point atomics (the order the programs run decides the bits), and the tools
that show it.

Each program of a launch sums its own block of ``x`` in fp32. :func:`atomic_sum` adds that partial into one fp32 cell
with ``tl.atomic_add``: every addition rounds, so the total depends on the order the programs arrive in (notebook 11's
exercise 1 writes the other way: fixed slots added in a fixed order).
:func:`distinct_over_orders` runs a function under several program orders of the interpreter
(:func:`labkit.tritonlab.order.program_order`), or several times on a GPU, and keeps the distinct results.

Used in: 11_determinism.
"""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from labkit.tritonlab import mode as tritonmode, order as tritonorder


@triton.jit
def _atomic_sum_kernel(x_ptr, total_ptr, n, BLOCK: tl.constexpr):
    """One program per block of x: its fp32 partial added into total[0] by an atomic."""
    start = tl.program_id(0) * BLOCK
    lanes = start + tl.arange(0, BLOCK)
    part = tl.sum(tl.load(x_ptr + lanes, mask=lanes < n, other=0.0).to(tl.float32), axis=0)
    tl.atomic_add(total_ptr, part)


def atomic_sum(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """x [n] (any float dtype) -> fp32 0-dim sum, each program's partial added by ``tl.atomic_add``."""
    total = torch.zeros(1, dtype=torch.float32, device=x.device)
    _atomic_sum_kernel[(triton.cdiv(x.numel(), block),)](x.contiguous(), total, x.numel(), BLOCK=block)
    return total[0]


def outputs_over_orders(fn: Callable[[], object], orders: int = 8, first_seed: int = 0) -> list:
    """``fn()``'s result under ``orders`` program orders: the interpreter's programs shuffled (seeds ``first_seed``,
    ``first_seed + 1000``, ...; the first run in the loop's own order), or ``orders`` plain runs on a GPU."""
    if tritonmode.current() != "interpreter":
        return [fn() for _ in range(orders)]
    results = []
    for i in range(orders):
        with tritonorder.program_order(None if i == 0 else first_seed + 1000 * i):
            results.append(fn())
    return results


def _flat(result) -> list[torch.Tensor]:
    """A result (a tensor, or a tuple or list of them) as a list of tensors."""
    return [result] if isinstance(result, torch.Tensor) else [t for t in result]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """t's raw bytes, flat (uint8), on the CPU."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a, b) -> bool:
    """Two results (tensors, or tuples of them) hold the same bits: same dtypes, shapes and ``torch.equal`` values
    (NaN where NaN: compared as raw bytes)."""
    fa, fb = _flat(a), _flat(b)
    return len(fa) == len(fb) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bytes(x), _bytes(y))
        for x, y in zip(fa, fb))


def distinct(results: list) -> list:
    """The distinct entries of ``results`` (bit for bit, :func:`same_bits`), in the order first seen."""
    kept: list = []
    for result in results:
        if not any(same_bits(result, seen) for seen in kept):
            kept.append(result)
    return kept


def distinct_over_orders(fn: Callable[[], object], orders: int = 8, first_seed: int = 0) -> list:
    """The distinct results of ``fn()`` over ``orders`` program orders (:func:`outputs_over_orders`): one entry for
    an order-independent computation."""
    return distinct(outputs_over_orders(fn, orders, first_seed))
