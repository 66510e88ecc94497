"""labkit.tritonlab.order: the interpreter's programs run in the permutation asked for, every program once; the loop's
order when seed is None; other patches (load counters) still work inside; refused in the compiled mode."""
from __future__ import annotations

import pytest
import torch

import labkit as lk  # before triton: sets TRITON_INTERPRET=1 here (no CUDA in CI)

MODE = lk.tritonmode.setup()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from labkit.determinism import reduce as detreduce  # noqa: E402
from labkit.tritonlab import order  # noqa: E402


@triton.jit
def _stamp_kernel(log_ptr, counter_ptr, NY: tl.constexpr, NZ: tl.constexpr):
    """Each program writes the turn it ran in (a shared counter) at its linear id (x outermost)."""
    turn = tl.atomic_add(counter_ptr, 1)
    pid = (tl.program_id(0) * NY + tl.program_id(1)) * NZ + tl.program_id(2)
    tl.store(log_ptr + pid, turn)


def turns(grid, seed):
    log = torch.full((grid[0] * grid[1] * grid[2],), -1, dtype=torch.int32)
    counter = torch.zeros(1, dtype=torch.int32)
    with order.program_order(seed) as orders:
        _stamp_kernel[grid](log, counter, NY=grid[1], NZ=grid[2])
    return log, orders


@pytest.mark.parametrize("grid", [(7, 1, 1), (3, 4, 1), (2, 3, 5)])
def test_programs_run_in_the_drawn_order_each_once(grid):
    log, orders = turns(grid, seed=4)
    assert len(orders) == 1 and sorted(orders[0]) == list(range(log.numel()))
    assert log[torch.tensor(orders[0])].tolist() == list(range(log.numel())), "program orders[0][t] ran at turn t"
    assert orders[0] != list(range(log.numel()))


def test_none_keeps_the_loop_order_and_minus_one_reverses():
    assert turns((2, 3, 1), None)[0].tolist() == list(range(6))
    assert turns((2, 3, 1), -1)[0].tolist() == list(range(5, -1, -1))


def test_seeds_repeat_and_launches_differ():
    assert turns((9, 1, 1), 2)[1] == turns((9, 1, 1), 2)[1]
    log = torch.zeros(9, dtype=torch.int32)
    with order.program_order(2) as orders:
        for _ in range(2):
            _stamp_kernel[(9,)](log, torch.zeros(1, dtype=torch.int32), NY=1, NZ=1)
    assert len(orders) == 2 and orders[0] != orders[1]


def test_the_builder_is_restored_and_the_mode_probes_still_count():
    from triton.runtime.interpreter import interpreter_builder
    x = torch.arange(100, dtype=torch.float32)
    with lk.tritonmode.loaded_elements() as counts, lk.tritonmode.launches(__name__) as launched, order.program_order(1):
        _stamp_kernel[(4,)](torch.zeros(4, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), NY=1, NZ=1)
        total = detreduce.atomic_sum(x, 32)
    assert launched["_stamp_kernel"] == 1 and counts["elements"] == 100, "x read once"
    assert float(total) == 4950.0
    assert "set_grid_idx" not in vars(interpreter_builder) and "set_grid_dim" not in vars(interpreter_builder)
    assert turns((5, 1, 1), None)[0].tolist() == list(range(5))


def test_refused_when_compiled(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="interpreter"):
        with order.program_order(0):
            pass
