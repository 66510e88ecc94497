"""labkit.determinism.reduce: atomics give several sums over program orders, fixed slots one; both near the float64
sum; the bit comparison and the distinct list."""
from __future__ import annotations

import numpy as np
import torch

import labkit as lk  # before triton: sets TRITON_INTERPRET=1 here (no CUDA in CI)

lk.tritonmode.setup()
from labkit.determinism import reduce  # noqa: E402


def spread_values(n=1000, seed=0):
    """Values of six orders of magnitude: fp32 additions round differently in every order."""
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * torch.logspace(0, 6, n)


def test_atomics_vary_over_orders_and_slots_do_not():
    x = spread_values()
    atomic = reduce.distinct_over_orders(lambda: reduce.atomic_sum(x, 32), 8)
    slots = reduce.distinct_over_orders(lambda: reduce.slot_sum(x, 32), 8)
    assert len(atomic) >= 2 and len(slots) == 1
    exact = float(x.double().sum())
    for total in atomic + slots:
        assert total.dtype == torch.float32 and total.shape == ()
        assert abs(float(total) - exact) <= 1e-6 * float(x.double().abs().sum())


def test_slots_add_in_index_order():
    x = spread_values(300, seed=2)
    blocks = torch.nn.functional.pad(x, (0, 320 - 300)).view(5, 64).numpy()
    parts = [np.float32(b.sum()) for b in blocks]          # each program's tl.sum: numpy's, over its zero-padded block
    total = parts[0]
    for p in parts[1:]:
        total = np.float32(total + p)
    assert float(reduce.slot_sum(x, 64)) == float(total)


def test_the_first_order_is_the_loops_own():
    x = spread_values(200, seed=3)
    assert torch.equal(reduce.outputs_over_orders(lambda: reduce.atomic_sum(x, 16), 1)[0], reduce.atomic_sum(x, 16))


def test_same_bits_compares_bits_dtypes_and_tuples():
    a = torch.tensor([0.0, float("nan"), 1.0])
    assert reduce.same_bits(a, a.clone()) and not reduce.same_bits(a, torch.tensor([-0.0, float("nan"), 1.0]))
    assert not reduce.same_bits(a, a.double()) and not reduce.same_bits((a, a), (a,))
    assert reduce.same_bits(torch.tensor(2.0), torch.tensor(2.0))
    assert len(reduce.distinct([a, a.clone(), a + 1, a.clone()])) == 2
