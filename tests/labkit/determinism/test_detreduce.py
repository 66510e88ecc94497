"""labkit.determinism.reduce: atomics give several sums over program orders, fixed slots one; both near the float64
sum; the bit comparison and the distinct list."""
from __future__ import annotations

import torch

import labkit as lk  # before triton: sets TRITON_INTERPRET=1 here (no CUDA in CI)

lk.tritonmode.setup()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from labkit.determinism import reduce  # noqa: E402


def spread_values(n=1000, seed=0):
    """Values of six orders of magnitude: fp32 additions round differently in every order."""
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * torch.logspace(0, 6, n)


@triton.jit
def _slots_kernel(x_ptr, slots_ptr, n, BLOCK: tl.constexpr):
    """A fixed-slot partial per program (the control: no atomics)."""
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(slots_ptr + tl.program_id(0), tl.sum(tl.load(x_ptr + lanes, mask=lanes < n, other=0.0), axis=0))


def slots_then_sum(x, block=32):
    slots = torch.empty(triton.cdiv(x.numel(), block))
    _slots_kernel[(slots.numel(),)](x, slots, x.numel(), BLOCK=block)
    return slots.sum()


def test_atomics_vary_over_orders_and_fixed_slots_do_not():
    x = spread_values()
    atomic = reduce.distinct_over_orders(lambda: reduce.atomic_sum(x, 32), 8)
    assert len(atomic) >= 2 and len(reduce.distinct_over_orders(lambda: slots_then_sum(x), 8)) == 1
    exact = float(x.double().sum())
    for total in atomic:
        assert total.dtype == torch.float32 and total.shape == ()
        assert abs(float(total) - exact) <= 1e-6 * float(x.double().abs().sum())


def test_the_seed_repeats_the_orders():
    x = spread_values(3000, seed=4)
    first = reduce.outputs_over_orders(lambda: reduce.atomic_sum(x, 16), 6, first_seed=5)
    again = reduce.outputs_over_orders(lambda: reduce.atomic_sum(x, 16), 6, first_seed=5)
    assert all(reduce.same_bits(a, b) for a, b in zip(first, again))


def test_the_first_order_is_the_loops_own():
    x = spread_values(200, seed=3)
    assert torch.equal(reduce.outputs_over_orders(lambda: reduce.atomic_sum(x, 16), 1)[0], reduce.atomic_sum(x, 16))


def test_same_bits_compares_bits_dtypes_and_tuples():
    a = torch.tensor([0.0, float("nan"), 1.0])
    assert reduce.same_bits(a, a.clone()) and not reduce.same_bits(a, torch.tensor([-0.0, float("nan"), 1.0]))
    assert not reduce.same_bits(a, a.double()) and not reduce.same_bits((a, a), (a,))
    assert reduce.same_bits(torch.tensor(2.0), torch.tensor(2.0))
    assert len(reduce.distinct([a, a.clone(), a + 1, a.clone()])) == 2
