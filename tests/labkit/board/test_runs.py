"""labkit.board.runs: what a submission's graded calls ran, however the code named it."""
from __future__ import annotations

import importlib

import torch

from labkit.board import runs


def _sdpa_by_built_name(q):
    attend = getattr(importlib.import_module("torch.nn." + "functional"), "scaled_dot_" + "product_" + "attention")
    return attend(q, q, q)


def test_the_operators_a_call_reaches_are_recorded_by_name():
    q = torch.randn(1, 2, 8, 4)
    with runs.OpLog() as log:
        _sdpa_by_built_name(q)
    assert any("softmax" in op or "attention" in op for op in log.ops), log.ops
    with runs.OpLog() as log:
        torch.matmul(q, q.transpose(-1, -2))
    assert set(log.ops) & runs.MATMULS, log.ops


def test_watch_wraps_functions_and_a_functions_forward_and_backward_then_restores_them():
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    def plain(x):
        return x @ x.T

    ns = {"Square": Square, "plain": plain}
    x = torch.randn(3, 3, requires_grad=True)
    with runs.watch(ns, ("Square", "plain")) as calls:
        ns["Square"].apply(x).sum().backward()
        ns["plain"](x.detach())
    assert ns == {"Square": Square, "plain": plain}
    assert [c.label for c in calls] == ["Square.forward", "Square.backward", "plain"]
    torch.testing.assert_close(x.grad, 2 * x.detach())
    assert "mul" in calls[0].ops and calls[2].ops["mm"] == 1 and all(c.launches == 0 for c in calls)


def test_verdict_names_library_work_then_torch_products_then_calls_without_a_kernel():
    call = runs.Call
    assert runs.verdict([call("f", launches=2)]) is None
    library = call("f", launches=1)
    library.ops.update(["mul", "_safe_softmax"])
    product = call("g", launches=1)
    product.ops.update(["bmm"])
    assert "f ran _safe_softmax" in runs.verdict([product, library])       # library work is named first
    assert "g ran torch's bmm" in runs.verdict([product, call("h")])
    assert "h launched none of the notebook's own Triton kernels" in runs.verdict([call("f", launches=1), call("h")])
