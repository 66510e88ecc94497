"""labkit.long.levers: each lever gives the same loss and gradients as training without it, and keeps
less for the backward (the amounts themselves: tests/labkit/long/test_longmem.py).

Tolerances: checkpointing recomputes the same ops on the same inputs (bitwise equal). Chunking
changes only matmul row counts and summation order: fp32 round-off (rtol 1e-5); in float64 1e-12.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.models import gpt2
from labkit.long import levers, memory as longmem


def tiny(attn="labkit:sdpa_math", **overrides):
    """A 2-layer byte-level GPT-2 in training mode (random init, no dropout)."""
    return gpt2.build_model("tiny", attn_implementation=attn, **overrides).train()


def loss_and_grads(model, ids, *, chunk_size=None, offload=False):
    model.zero_grad(set_to_none=True)
    hooks = levers.OffloadSaved(keep=model.parameters(), min_bytes=1) if offload else None
    if hooks:
        with hooks:
            loss = levers.lm_loss(model, ids, chunk_size=chunk_size)
    else:
        loss = levers.lm_loss(model, ids, chunk_size=chunk_size)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], hooks


IDS = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))


# ----------------------------------------------------------------------------- checkpointing

def _mlp_stack(wrap: bool) -> torch.nn.Sequential:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)) for _ in range(3)]
    return torch.nn.Sequential(*[levers.Checkpointed(b) if wrap else b for b in blocks])


def test_checkpointed_same_gradients_fewer_saved_bytes(randn):
    x = randn(8, 16, seed=1).requires_grad_()
    grads, saved = [], []
    for wrap in (False, True):
        model = _mlp_stack(wrap)
        saved.append(longmem.saved_tensor_bytes(lambda: model(x).square().sum().backward(),
                                                exclude=model.parameters()))
        grads.append([p.grad for p in model.parameters()] + [x.grad.clone()])
        x.grad = None
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # recomputation gives the same numbers
    assert saved[1] < saved[0] / 2


def test_checkpointed_is_plain_in_eval_and_no_grad(randn):
    model = _mlp_stack(True).eval()
    x = randn(4, 16, seed=2)
    torch.testing.assert_close(model(x), _mlp_stack(False)(x))


def test_hf_checkpointing_is_non_reentrant_and_gives_the_same_gradients():
    ref, model = loss_and_grads(tiny(), IDS), tiny()
    gpt2.enable_checkpointing(model)
    assert model.transformer._gradient_checkpointing_func.keywords == {"use_reentrant": False}
    got = loss_and_grads(model, IDS)
    assert torch.equal(got[0], ref[0]) and all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))


# ----------------------------------------------------------------------------- chunked MLP

@pytest.mark.parametrize("chunk", [1, 7, 48, 100])
def test_chunked_mlp_same_loss_and_gradients(chunk):
    ref = loss_and_grads(tiny(), IDS)
    model = tiny()
    gpt2.enable_checkpointing(model)
    levers.chunk_mlp(model, chunk)
    got = loss_and_grads(model, IDS)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=0)
    for a, b in zip(got[1], ref[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_chunked_mlp_keeps_parameters_and_is_plain_in_eval():
    model, ref = tiny(), tiny()
    params = list(model.parameters())
    levers.chunk_mlp(model, 8)
    levers.chunk_mlp(model, 16)  # again: only the chunk size changes
    assert list(model.parameters()) == params and model.transformer.h[0].mlp.chunk_size == 16
    torch.testing.assert_close(gpt2.forward_logits(model.eval(), IDS), gpt2.forward_logits(ref.eval(), IDS))
    with pytest.raises(ValueError, match="chunk_size"):
        levers.ChunkedMLP(torch.nn.Identity(), torch.nn.Identity(), 0)


# ----------------------------------------------------------------------------- offloading saved tensors

def test_offload_same_loss_and_gradients_and_counts_what_moves():
    ref = loss_and_grads(tiny(), IDS, chunk_size=16)
    model = tiny()
    gpt2.enable_checkpointing(model)
    loss, grads, hooks = loss_and_grads(model, IDS, chunk_size=16, offload=True)
    assert torch.equal(loss, ref[0]) and all(torch.equal(a, b) for a, b in zip(grads, ref[1]))
    assert hooks.host_bytes > 0  # the amount: tests/labkit/long/test_longmem.py


@pytest.mark.gpu
def test_offload_on_gpu_moves_checkpoints_to_pinned_memory_same_numbers():
    torch.manual_seed(0)
    x = torch.randn(4, 1024, 256, device="cuda", requires_grad=True)
    layer = levers.Checkpointed(torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                                                    torch.nn.Linear(1024, 256))).cuda().train()
    ref = torch.autograd.grad(layer(layer(x)).sum(), [x, *layer.parameters()])
    hooks = levers.OffloadSaved(keep=layer.parameters())
    before = torch.cuda.memory_allocated()
    with hooks:  # (sum saves nothing: only the checkpoints save)
        out = layer(layer(x)).sum()
    kept = torch.cuda.memory_allocated() - before
    got = torch.autograd.grad(out, [x, *layer.parameters()])
    assert hooks.host_bytes == 2 * x.numel() * 4  # the two checkpoint inputs
    assert kept < x.numel() * 4  # neither input is held on the GPU (x itself existed before)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ----------------------------------------------------------------------------- chunked loss

class MaxNumel(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def head_loss(x, ln_w, ln_b, w, targets, chunk, dtype=None):
    return levers._ChunkedHeadLoss.apply(x, ln_w, ln_b, w, targets, 1e-5, chunk, dtype or x.dtype)


@pytest.mark.parametrize("chunk", [1, 7, 96, 1000])
def test_chunked_loss_matches_full_fp64(chunk):
    model = tiny(n_positions=64).double()
    full = F.cross_entropy(model(input_ids=IDS).logits[:, :-1].reshape(-1, 256), IDS[:, 1:].reshape(-1))
    g_full = torch.autograd.grad(full, list(model.parameters()))
    chunked = levers.lm_loss(model, IDS, chunk_size=chunk)
    torch.testing.assert_close(chunked, full, rtol=0, atol=1e-12)  # same sum, float64: round-off only
    for a, b in zip(torch.autograd.grad(chunked, list(model.parameters())), g_full):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_chunked_loss_gradcheck(randn):
    x = randn(11, 6, seed=3, dtype=torch.float64).requires_grad_()
    w = randn(9, 6, seed=4, dtype=torch.float64).requires_grad_()
    ln_w, ln_b = (randn(6, seed=s, dtype=torch.float64).requires_grad_() for s in (5, 6))
    t = torch.randint(0, 9, (11,), generator=torch.Generator().manual_seed(1))
    t[3] = -100
    assert torch.autograd.gradcheck(lambda *a: head_loss(*a, t, 4), (x, ln_w, ln_b, w))


def test_chunked_loss_never_holds_full_logits(randn):
    n, v, c = 256, 300, 32
    x, w = randn(n, 8, seed=0).requires_grad_(), randn(v, 8, seed=1).requires_grad_()
    ln_w, ln_b = torch.ones(8, requires_grad=True), torch.zeros(8, requires_grad=True)
    with MaxNumel() as mode:
        head_loss(x, ln_w, ln_b, w, torch.randint(0, v, (n,)), c).backward()
    assert mode.max_numel <= c * v, f"a tensor of {mode.max_numel} elements > one chunk of logits ({c * v})"


def test_chunked_loss_under_autocast_matches_transformers_loss():
    # Under bf16 autocast both compute ln_f in fp32, bf16 logits and an fp32 softmax: the losses agree
    # to fp32 round-off of the same bf16 numbers; the gradients go through bf16 matmuls in both.
    model = tiny(n_positions=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full, chunked = levers.lm_loss(model, IDS), levers.lm_loss(model, IDS, chunk_size=16)
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, full, rtol=1e-6, atol=1e-5)
    params = list(model.parameters())
    for a, b in zip(torch.autograd.grad(chunked, params), torch.autograd.grad(full, params)):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)  # bf16 matmul outputs, 8-bit mantissa


def test_chunked_loss_errors():
    with pytest.raises(ValueError, match="chunk_size"):
        levers.lm_loss(tiny(), IDS, chunk_size=0)
