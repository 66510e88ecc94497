"""The order Triton's interpreter runs a launch's programs in: shuffled, to show what depends on it.

On a GPU the programs of a grid run in whatever order the hardware schedules them; a kernel whose result depends on
that order (``tl.atomic_add`` of floating-point partials: each addition rounds, and rounding does not commute with
reordering) gives other bits on another run. Triton's interpreter runs the programs one after another in a loop
(``GridExecutor.__call__``: x outermost, then y, then z) and calls ``interpreter_builder.set_grid_idx(x, y, z)``
before each. :func:`program_order` wraps that call (and ``set_grid_dim``, called once per launch before the loop) on
the builder instance, so the i-th program the loop runs is the permutation's i-th program id: the same kernel, its
programs visited in another order, on a CPU. Like :func:`labkit.tritonlab.mode.loaded_elements`, it patches the
instance and restores the class's methods on exit; the other patches of :mod:`labkit.tritonlab.mode` stay as they are.

    with lk.tritonorder.program_order(seed=3) as perms:
        kernel[grid](...)              # programs run in a random order drawn from seed 3
    perms[0]                           # that launch's order: the linear program ids, first run first

Used in: 11_determinism.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from labkit.tritonlab import mode as tritonmode


def permutation(n: int, seed: int | None) -> list[int]:
    """The order to visit ``n`` programs in: ``seed=None`` the loop's own (0, 1, ..., n-1); ``seed=-1`` reversed;
    otherwise a random permutation from ``torch.Generator().manual_seed(seed)``."""
    if seed is None:
        return list(range(n))
    if seed == -1:
        return list(range(n - 1, -1, -1))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def unravel(index: int, grid: tuple[int, int, int]) -> tuple[int, int, int]:
    """Linear program index (in the interpreter's loop order: x outermost, z innermost) -> (x, y, z)."""
    _, ny, nz = grid
    return index // (ny * nz), (index // nz) % ny, index % nz


@contextlib.contextmanager
def program_order(seed: int | None = 0) -> Iterator[list[list[int]]]:
    """Run every interpreted launch inside the block with its programs in the order :func:`permutation` gives.

    Each launch draws its own permutation (the k-th launch from ``seed + k``, so two launches of a block differ and
    the same ``seed`` repeats the same orders). Yields the list of the launches' orders (linear program ids, first run
    first), filled as they run. ``seed=None`` keeps the loop's order (a control: results equal to no block at all).

    Raises:
        RuntimeError: in the compiled mode (a GPU schedules its programs itself; run twice to see its orders).
    """
    if tritonmode.current() != "interpreter":
        raise RuntimeError("program_order() reorders the interpreter's programs; set TRITON_INTERPRET=1 (on a GPU, "
                           "the hardware picks the order: run the kernel twice and compare).")
    from triton.runtime.interpreter import interpreter_builder

    orders: list[list[int]] = []
    state: dict = {}
    set_dim, set_idx = interpreter_builder.set_grid_dim, interpreter_builder.set_grid_idx

    def grid_dim(nx, ny, nz):
        launch_seed = None if seed is None else (seed if seed == -1 else seed + len(orders))
        state.update(grid=(nx, ny, nz), order=permutation(nx * ny * nz, launch_seed), next=0)
        orders.append(state["order"])
        return set_dim(nx, ny, nz)

    def grid_idx(x, y, z):
        index = state["order"][state["next"]]
        state["next"] += 1
        return set_idx(*unravel(index, state["grid"]))

    interpreter_builder.set_grid_dim, interpreter_builder.set_grid_idx = grid_dim, grid_idx
    try:
        yield orders
    finally:
        del interpreter_builder.set_grid_dim, interpreter_builder.set_grid_idx   # the class's methods again
