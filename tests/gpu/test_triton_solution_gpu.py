"""Notebook 06's solution kernels on a GPU: Stanford CS336 assignment 2's Triton checks, and speed.

The kernels are not copied here: the solution notebook's answer cells (solutions/06_...) run in one
namespace after its first code cell, as in a kernel, compiled on the GPU.

(a) The checks of stanford-cs336/assignment2-systems ``tests/test_attention.py``
    (``test_flash_forward_pass_triton``, ``test_flash_backward_triton``), reproduced: inputs
    (4, 128, 64) fp32 on CUDA from seed 0; exactly one saved tensor of shape (batch, n) holding the
    log-sum-exp; output, log-sum-exp and gradients (``.backward(do)``) vs their einsum reference
    with a -1e6 causal fill, ``assert_close(rtol=1e-2, atol=1e-2)``; causal and not.
(b) Speed, bf16, fixed tokens (B*N = 16K, H*D = 2048), N = 4K..16K, d = 64 and 128, causal and
    not: the kernel and sdpa_flash, sdpa_cudnn, fa4 timed in turns in one sweep
    (``lk.bench.attention_sweep``: CUDA events, interleaved); prints the ratio table and asserts
    forward >= 1.1x and forward+backward >= 1.0x sdpa_flash.

Run on a GPU: ``python -m pytest -s -m gpu tests/gpu/test_triton_solution_gpu.py``.
"""
from __future__ import annotations

import pandas as pd
import pytest
import torch
from notebook_grader import NotebookRunner, exercises, setup_cells

import labkit as lk

pytestmark = pytest.mark.gpu
ASSIGNMENT = "06_triton_flashattention"


@pytest.fixture(scope="module")
def solution() -> dict:
    """The namespace after the solution notebook's first code cell and every answer cell."""
    runner = NotebookRunner()
    answers = [e.answer for e in exercises(ASSIGNMENT)]
    for source in setup_cells(ASSIGNMENT, ["MODE = lk.tritonmode.setup()"]) + answers:
        runner.run(source)
    assert runner.namespace["MODE"] == "compiled"
    return runner.namespace


def _cs336_reference(q, k, v, is_causal):
    """CS336's _attention_and_lse: scores with a -1e6 causal fill, softmax, logsumexp."""
    s = torch.einsum("...qd,...kd->...qk", q, k) / q.shape[-1] ** 0.5
    if is_causal:
        i, j = torch.arange(q.shape[-2], device=s.device), torch.arange(k.shape[-2], device=s.device)
        s = torch.where(i[None, :, None] >= j[None, None, :], s, -1e6)
    return torch.einsum("...qk,...kd->...qd", torch.softmax(s, dim=-1), v), torch.logsumexp(s, dim=-1)


def _cs336_inputs():
    """CS336's _make_attn_inputs on CUDA: batch 4, 128 queries and keys, D = 64, seed 0."""
    torch.random.manual_seed(0)
    q, k, v = (torch.randn(4, 128, 64, device="cuda", requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(4, 128, 64, device="cuda")


@pytest.mark.parametrize("is_causal", [False, True])
def test_cs336_flash_forward_pass_triton(solution, is_causal):
    q, k, v, _ = _cs336_inputs()
    o = solution["TritonFlashAttention"].apply(q, k, v, is_causal)
    maybe_ls = [t for t in o.grad_fn.saved_tensors if t.shape == (q.shape[0], q.shape[1])]
    assert len(maybe_ls) == 1, f"expected one saved tensor of shape {(q.shape[0], q.shape[1])}, found {len(maybe_ls)}"
    o_ref, l_ref = _cs336_reference(q, k, v, is_causal)
    torch.testing.assert_close(o, o_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(maybe_ls[0], l_ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("is_causal", [False, True])
def test_cs336_flash_backward_triton(solution, is_causal):
    q, k, v, do = _cs336_inputs()
    _cs336_reference(q, k, v, is_causal)[0].backward(do)
    expected = (q.grad, k.grad, v.grad)
    q, k, v, do = _cs336_inputs()
    solution["TritonFlashAttention"].apply(q, k, v, is_causal).backward(do)
    for e, g in zip(expected, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(e, g, rtol=1e-2, atol=1e-2)


@pytest.fixture(scope="module")
def speed(solution) -> pd.DataFrame:
    """The ratio table of the kernel over the library kernels (bf16, N >= 4K), printed."""
    fn = solution["TritonFlashAttention"]
    library = [b for b in ("sdpa_flash", "sdpa_cudnn", "fa4")
               if lk.attention.why_not(b, device="cuda", dtype=torch.bfloat16, head_dim=128) is None]
    configs = lk.bench.fixed_token_configs([4096, 8192, 16384], [64, 128], tokens=16384, width=2048)
    mine = {"triton_fa2": lambda q, k, v, causal: fn.apply(q, k, v, causal)}
    sweep = lk.bench.attention_sweep(configs, backends=library, custom=mine, dtype=torch.bfloat16, device="cuda",
                                     target_ms=100, progress=False)
    failed = sweep[sweep["status"] != "ok"]
    assert failed.empty, failed[["backend", "N", "D", "causal", "mode", "status"]]
    table = sweep.pivot_table(index=lk.tritonbench.KEYS, columns="backend", values="tflops")
    ratios = lk.tritonbench.ratio_table(sweep, "triton_fa2")
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(f"\n{torch.cuda.get_device_name()}: TFLOP/s and triton_fa2 / other (bf16)\n{table.join(ratios).round(2)}")
    return ratios


@pytest.mark.parametrize("mode, target", [("fwd", 1.1), ("fwd_bwd", 1.0)])
def test_speed_vs_sdpa_flash(speed, mode, target):
    part = speed.xs(mode, level="mode")["vs sdpa_flash"]
    assert part.min() >= target, f"{mode}: triton_fa2 / sdpa_flash below {target}x:\n{part[part < target]}"
