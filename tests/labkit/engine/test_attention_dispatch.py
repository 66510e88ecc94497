"""labkit's attention under real training features, and what its dispatch costs.

"auto" must behave the same whether or not it has tuned yet: the call that times the candidates
runs inside activation checkpointing (non-reentrant and reentrant), torch.compile, no_grad,
inference_mode or autocast, and must save, return and record what a cached call does. On a CPU
only one fused kernel runs, so the fixture below gives auto a real choice (three candidates that
all run on a CPU) and empty caches, so the first call of each test tunes.
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

import labkit as lk

A = lk.attention
# fp32 on a CPU: the candidates (flash, math, reference) agree to ~1e-7 on O(1) outputs; a
# gradient through a 2-layer block sums a few hundred such terms: 1e-5 leaves a wide margin while a
# wrong mask, scale or a dropped term (O(0.1)) fails.
ATOL = 1e-5


@pytest.fixture
def fresh_auto(monkeypatch):
    """Empty caches and three CPU candidates; returns the list of candidate sets auto timed."""
    monkeypatch.setattr(A, "_AUTO_CACHE", {})
    monkeypatch.setattr(A, "_PLANS", {})
    monkeypatch.setattr(A, "auto_candidates", lambda *a, **kw: ["sdpa_flash", "sdpa_math", "reference"])
    tuned = []
    real = A._fastest
    monkeypatch.setattr(A, "_fastest", lambda names, *a: tuned.append(list(names)) or real(names, *a))
    return tuned


class Block(nn.Module):
    """x [B, N, C] -> x + attention(x): one causal self-attention layer through lk.attention."""

    def __init__(self, width: int = 32, heads: int = 2, backend: str = "auto"):
        super().__init__()
        self.heads, self.backend = heads, backend
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, C // self.heads).unbind(2)  # each [B, N, H, D]
        o = A.attention(q, k, v, causal=True, backend=self.backend, layout="bnhd", nan_policy="ignore")
        return x + self.proj(o.reshape(B, N, C))


def _block_and_input(seed: int = 0, n: int = 48):
    torch.manual_seed(seed)
    return Block(), torch.randn(2, n, 32, requires_grad=True)


def _saved(fn) -> list[tuple]:
    """Shapes of the tensors autograd saves while ``fn()`` runs, in order."""
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        fn()
    return shapes


def _grads(block: Block, x: torch.Tensor, forward) -> list[torch.Tensor]:
    block.zero_grad(set_to_none=True)
    x.grad = None
    forward(x).square().sum().backward()
    return [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]


def test_the_call_that_tunes_saves_what_a_cached_call_saves(fresh_auto):
    block, x = _block_and_input()
    first = _saved(lambda: block(x))
    assert fresh_auto, "the first call timed the candidates"
    second = _saved(lambda: block(x))
    assert len(fresh_auto) == 1, "the second call found the choice cached"
    assert first == second, "tuning must not add saved tensors to the caller's graph"


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointing_a_block_whose_first_call_tunes(fresh_auto, reentrant):
    block, x = _block_and_input(seed=1)
    with_ckpt = _grads(block, x, lambda t: checkpoint(block, t, use_reentrant=reentrant))
    assert fresh_auto, "auto tuned inside the checkpointed forward"
    plain = _grads(block, x, block)
    for got, want in zip(with_ckpt, plain):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_gpt2_with_checkpointing_trains_from_the_first_step(fresh_auto):
    model = lk.gpt2.build_model("tiny", attn_implementation="labkit").train()
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    lk.gpt2.enable_checkpointing(model)
    loss_ckpt, grads_ckpt = loss_and_grads()  # the step in which auto tunes (the CheckpointError)
    assert fresh_auto
    model.activation_checkpointing_disable()
    loss, grads = loss_and_grads()
    torch.testing.assert_close(loss_ckpt, loss, atol=ATOL, rtol=0)
    for got, want in zip(grads_ckpt, grads):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", ["auto", "sdpa_flash"])
def test_torch_compile_trains_through_labkit(fresh_auto, backend):
    torch._dynamo.reset()
    block, x = _block_and_input(seed=2)
    block.backend = backend
    compiled = torch.compile(block, backend="aot_eager", fullgraph=backend != "auto")
    got = _grads(block, x, compiled)  # auto tunes on its first call, outside the graph
    want = _grads(block, x, block)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    assert bool(fresh_auto) == (backend == "auto")


def test_import_leaves_torch_dynamo_unloaded():
    """torch.compile's auto path loads torch._dynamo when it traces (above); `import labkit` alone does not: every
    notebook kernel and worker imports labkit, and torch._dynamo costs each ~1.2 s of CPU."""
    probe = "import sys, labkit; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", out


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_first_call_without_autograd_matches_the_cached_call(fresh_auto, mode):
    block, x = _block_and_input(seed=3)
    with mode():
        first = block(x)
        assert fresh_auto
        second = block(x)
    assert torch.equal(first, second)
    assert first.grad_fn is None


def test_autocast_runs_fp32_inputs_in_the_autocast_dtype_like_sdpa(fresh_auto):
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = A.attention(q, k, v, causal=True, backend="sdpa_flash")
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        first = A.attention(q, k, v, causal=True, backend="auto")  # tunes under autocast
        again = A.attention(q, k, v, causal=True, backend="auto")
    assert o.dtype == want.dtype == first.dtype == torch.bfloat16
    assert torch.equal(o, want), "the same kernel on the same bf16 inputs"
    assert torch.equal(first, again)
    assert A.attention(q, k, v, causal=True, backend="sdpa_flash").dtype == torch.float32, "autocast off: fp32"


# ----------------------------------------------------------------------------- dispatch cost

def _median_us(fn, calls: int = 1000) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def _direct_sdpa_flash(q, k, v, layout):
    """The direct call labkit is measured against: SDPA pinned to its flash kernel by the
    documented context manager, with the caller's own transposes for bnhd."""
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        if layout == "bhnd":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return o.transpose(1, 2)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("backend", ["sdpa_flash", "auto"])
def test_labkit_adds_at_most_5_us_per_call_over_the_direct_kernel_call(backend, layout):
    """Goal of the dispatch design: <= 5 us of CPU time over calling the kernel directly, with
    tiny tensors so that the kernel itself costs little. Direct and labkit calls take turns over
    9 rounds of 1000 calls; the median of the per-round differences is compared."""
    torch.set_num_threads(1)
    shape = (1, 2, 16, 16) if layout == "bhnd" else (1, 16, 2, 16)
    q, k, v = (torch.randn(shape) for _ in range(3))

    def labkit():
        return A.attention(q, k, v, causal=True, backend=backend, layout=layout, nan_policy="ignore")

    torch.testing.assert_close(labkit(), _direct_sdpa_flash(q, k, v, layout), atol=1e-6, rtol=0)
    extra = sorted(_median_us(labkit) - _median_us(lambda: _direct_sdpa_flash(q, k, v, layout)) for _ in range(9))
    assert extra[4] <= 5.0, f"labkit adds {extra[4]:.1f} us per call over the direct call (rounds: {extra})"


# ----------------------------------------------------------------------------- on the GPU, with the real candidates

@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["labkit", "labkit:fa4"])
def test_gpt2_small_checkpointed_step_on_the_gpu(monkeypatch, implementation):
    """GPT-2 small, bf16 autocast, checkpointing: the first step (auto tunes the real candidates
    inside it) trains, with the loss and gradients of the same step without checkpointing."""
    if implementation.endswith("fa4") and lk.kernels.why_not("fa4", device="cuda", dtype=torch.bfloat16):
        pytest.skip("fa4 does not run here")
    monkeypatch.setattr(A, "_AUTO_CACHE", {})
    monkeypatch.setattr(A, "_PLANS", {})
    model = lk.gpt2.build_model("small", attn_implementation=implementation, device="cuda").train()
    ids = torch.randint(0, 50257, (2, 1024), generator=torch.Generator().manual_seed(0)).cuda()

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach().float(), torch.cat([p.grad.float().flatten() for p in model.parameters()])

    lk.gpt2.enable_checkpointing(model)
    loss_ckpt, grad_ckpt = step()
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    loss, grad = step()
    # bf16 activations recomputed by the same kernels: the same values up to reduction order
    torch.testing.assert_close(loss_ckpt, loss, rtol=1e-3, atol=0)
    assert float((grad_ckpt - grad).norm() / grad.norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "fa4", "sdpa_cudnn"])
def test_torch_compile_with_inductor_on_the_gpu(monkeypatch, backend):
    if backend != "auto" and lk.kernels.why_not(backend, device="cuda", dtype=torch.bfloat16):
        pytest.skip(f"{backend} does not run here")
    monkeypatch.setattr(A, "_AUTO_CACHE", {})
    monkeypatch.setattr(A, "_PLANS", {})
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = Block(width=1024, heads=16, backend=backend).cuda().to(torch.bfloat16)
    x = torch.randn(2, 2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    got = _grads(block, x, torch.compile(block))
    want = _grads(block, x, block)
    for g, w in zip(got, want):
        assert float((g.float() - w.float()).norm() / w.float().norm()) < 2e-2
