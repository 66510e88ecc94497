"""Notebook 09's solution backward on GPUs with little shared memory: the tuned tiles, then ones that fit.

The solution's ``sparse_attention_backward`` launches ``_sparse_bwd_kernel`` with the tiles tuned on an H200
and, when that launch raises Triton's ``OutOfResources`` (a GPU with 99 KiB of shared memory a block, sm86/sm89:
RTX 3090/4090, A10, L4), with the next ones. No such GPU here: the launch is made to fail as it would there, the
retry runs in the interpreter (its bf16 gradients against the same kernels in fp32), and both launches' tiles are
compiled for sm86 and sm90 on the CPU to show why (the first does not fit sm86, the second does).
"""
from __future__ import annotations

import pytest
import torch
from mutants import load
from notebook_grader import NotebookRunner, exercises, setup_cells

import labkit as lk
import labkit.flex.lib
import labkit.tritonlab.compile as tc
from triton.runtime import OutOfResources   # after labkit, which sets TRITON_INTERPRET=1 on a CPU

pytestmark = pytest.mark.slow
SPEC = load("nb09")
SM86_SHARED_LIMIT = 101376   # bytes a block may opt in to on sm86/sm89 (99 KiB)
SM90_SHARED_LIMIT = 232448   # on sm90 (227 KiB)


@pytest.fixture(scope="module")
def solution() -> dict:
    """The namespace after the solution notebook's first code cell and every answer cell (interpreter)."""
    runner = NotebookRunner()
    for source in setup_cells(SPEC.ASSIGNMENT, SPEC.SETUP) + [e.answer for e in exercises(SPEC.ASSIGNMENT)]:
        runner.run(source)
    assert runner.namespace["MODE"] == "interpreter"
    return runner.namespace


class FailsFirst:
    """Stands in for ``_sparse_bwd_kernel``: the first launch raises OutOfResources, later ones run the kernel."""

    def __init__(self, kernel):
        self.kernel, self.tiles = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.tiles.append({k: kwargs[k] for k in ("DKDV_SPLIT", "DQ_SPLIT", "num_warps", "num_stages")})
            if len(self.tiles) == 1:
                raise OutOfResources(116224, SM86_SHARED_LIMIT, "shared memory")
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_backward_retries_with_tiles_that_fit_99_kib(solution, monkeypatch):
    ns = solution
    torch.manual_seed(0)
    N, d, block = 128, 128, 128
    q, k, v, do = (torch.randn(1, 1, N, d).to(torch.bfloat16) for _ in range(4))
    lists = lk.flexlib.torch_lists(ns["causal"], N, N, block)
    o, lse = ns["sparse_attention"](q, k, v, lists, block)
    want = ns["sparse_attention_backward"](q.float(), k.float(), v.float(), o.float(), lse, do.float(), lists, block)
    fake = FailsFirst(ns["_sparse_bwd_kernel"])
    monkeypatch.setitem(ns, "_sparse_bwd_kernel", fake)
    with tc.recorded() as launches:
        got = ns["sparse_attention_backward"](q, k, v, o, lse, do, lists, block)
    assert len(fake.tiles) == 2 and fake.tiles[0] != fake.tiles[1], fake.tiles
    for g, w in zip(got, want):   # bf16 gradients of the retried launch vs the same kernels in fp32: one bf16 rounding
        assert g.dtype == torch.bfloat16 and torch.allclose(g.float(), w, atol=5e-2, rtol=2e-2)
    retried = [launch for launch in launches if launch.kernel == "_sparse_bwd_kernel"]
    assert retried, "the retry launched _sparse_bwd_kernel"
    by_tiles = {}
    for tiles in fake.tiles:
        for r in tc.compile_launches(retried[:1], (86, 90), dict(tiles, BLOCK_M=block, BLOCK_N=block)):
            assert r.ok, r.error
            by_tiles[(tuple(tiles.values()), r.arch)] = r.shared_bytes
    first, second = (tuple(t.values()) for t in fake.tiles)
    assert by_tiles[(first, 86)] > SM86_SHARED_LIMIT >= by_tiles[(second, 86)], by_tiles
    assert by_tiles[(first, 90)] <= SM90_SHARED_LIMIT, by_tiles
