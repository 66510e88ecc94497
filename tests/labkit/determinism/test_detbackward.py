"""labkit.determinism.backward: the given atomic-dQ backward matches float64 autograd (fp32, tails, N != N_K, causal
with rows that see no key, bf16 by the 2x rule); its dQ varies over program orders while dK and dV do not."""
from __future__ import annotations

import pytest
import torch

import labkit as lk  # before triton: sets TRITON_INTERPRET=1 here (no CUDA in CI)

lk.tritonmode.setup()
from labkit.checks.nb06_backward import gradients64  # noqa: E402
from labkit.determinism import backward, reduce  # noqa: E402
from labkit.engine.kernels import reference_attention  # noqa: E402


def case(B, H, N, n_k, D, causal, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(B, H, N, D, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, H, n_k, D, generator=g).to(dtype) for _ in range(2))
    o, lse, want = gradients64(q, k, v, do, causal)
    return (q, k, v, o.to(dtype), lse, do), want


@pytest.mark.parametrize("shape", [(1, 2, 40, 56, 32, False), (2, 1, 70, 45, 16, True), (1, 1, 100, 40, 16, True)])
def test_matches_float64_autograd(shape):
    args, want = case(*shape)
    for got, exact, x in zip(backward.atomic_backward(*args, shape[-1], block_n=32), want, args[:3]):
        assert got.shape == x.shape and got.dtype == x.dtype
        assert float((got.double() - exact).abs().max()) < 1e-4


def test_bf16_within_twice_plain_attention():
    args, want = case(1, 2, 70, 90, 32, True, torch.bfloat16, seed=3)
    q, k, v, _, _, do = args
    qp, kp, vp = (t.clone().requires_grad_() for t in (q, k, v))
    plain = torch.autograd.grad(reference_attention(qp, kp, vp, causal=True)[0], (qp, kp, vp), do)
    for got, exact, base in zip(backward.atomic_backward(*args, True), want, plain):
        assert float((got.double() - exact).abs().max()) <= 2 * float((base.double() - exact).abs().max()) + 2 ** -8


def test_only_dq_depends_on_the_program_order():
    args, _ = case(1, 2, 40, 56, 32, False, seed=5)
    runs = reduce.outputs_over_orders(lambda: backward.atomic_backward(*args), 5)
    assert [len(reduce.distinct([r[i] for r in runs])) for i in range(3)][1:] == [1, 1]
    assert len(reduce.distinct([r[0] for r in runs])) >= 2


def test_row_delta_is_fp32_rowsum():
    o, do = torch.randn(2, 3, 5, 8).bfloat16(), torch.randn(2, 3, 5, 8).bfloat16()
    assert torch.equal(backward.row_delta(o, do), (o.float() * do.float()).sum(-1))
