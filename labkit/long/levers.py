"""Memory levers for long sequences: each trades time (or host memory) for GPU memory that grows with N.

- :class:`Checkpointed`: keep a module's input, recompute its activations in the backward
  (``torch.utils.checkpoint``, non-reentrant). Hugging Face models: ``lk.gpt2.enable_checkpointing``.
- :func:`chunk_mlp`: each GPT-2 block's ``mlp(ln_2(x))`` runs in chunks of positions, each chunk
  checkpointed, so even the layer being recomputed never holds the 4x-wide MLP activations of
  all N positions at once.
- :class:`OffloadSaved`: while active, the tensors autograd saves outside checkpointed regions
  (the checkpointed block inputs above all) wait in pinned host memory for the backward.
- :func:`lm_loss`: GPT-2's next-token loss, by default as transformers computes it, or chunked:
  final LayerNorm, LM head and cross-entropy chunk by chunk in both passes, never N x vocabulary
  logits at once (a custom ``autograd.Function`` that keeps one log-sum-exp per position).

``lk.longmem.memory_model`` predicts what each lever saves; ``lk.longctx`` combines them.

Used in: 03_long_sequence_training.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Checkpointed(nn.Module):
    """``module`` whose activations are recomputed in the backward instead of kept.

    In training with grad enabled, the forward runs under ``torch.utils.checkpoint`` with
    ``use_reentrant=False`` (the recommended mode: works with kwargs, inputs that need no grad
    and nested hooks); only the inputs are saved. Elsewhere it is ``module`` unchanged.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        if self.training and torch.is_grad_enabled():
            return checkpoint(self.module, *args, use_reentrant=False, **kwargs)
        return self.module(*args, **kwargs)


class ChunkedMLP(nn.Module):
    """``mlp(ln(x))`` for x [B, N, C], in training run ``chunk_size`` positions at a time, each
    chunk checkpointed: autograd keeps x (shared by the chunks) instead of the MLP's activations."""

    def __init__(self, ln: nn.Module, mlp: nn.Module, chunk_size: int):
        super().__init__()
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
        self.ln, self.mlp, self.chunk_size = ln, mlp, chunk_size

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and torch.is_grad_enabled()):
            return self._run(x)
        parts = [checkpoint(self._run, part, use_reentrant=False) for part in x.split(self.chunk_size, dim=1)]
        return torch.cat(parts, dim=1)


def chunk_mlp(model, chunk_size: int = 8192) -> None:
    """Run every GPT-2 block's ``mlp(ln_2(x))`` as a :class:`ChunkedMLP` (in place).

    ``ln_2`` moves inside the chunks (the block's ``ln_2`` becomes the identity), so the chunks
    keep the block's fp32 residual rather than ln_2's output; the parameters stay the same
    tensors, in the same order (their names gain ``mlp.ln.`` / ``mlp.mlp.``).
    """
    for block in model.transformer.h:
        if isinstance(block.mlp, ChunkedMLP):
            block.mlp.chunk_size = chunk_size
            continue
        block.mlp = ChunkedMLP(block.ln_2, block.mlp, chunk_size)
        block.ln_2 = nn.Identity()


class OffloadSaved(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: tensors autograd saves while it is active wait in host memory.

    A CUDA tensor of at least ``min_bytes`` that is not one of ``keep`` (the parameters) is
    copied to pinned host memory when saved and back when the backward needs it (both copies
    asynchronous on the current stream). Inside checkpointed regions checkpointing's own hooks
    win, so what moves is what checkpointing keeps: the block inputs (and the loss's input).
    ``host_bytes`` adds up what was moved (CPU tensors, already in host memory, count too).
    """

    def __init__(self, *, keep: Iterable[torch.Tensor] = (), min_bytes: int = 2**20):
        self.host_bytes = 0
        kept = {t.untyped_storage().data_ptr() for t in keep}

        def pack(t: torch.Tensor):
            nbytes = t.numel() * t.element_size()
            if nbytes < min_bytes or t.untyped_storage().data_ptr() in kept:
                return t
            self.host_bytes += nbytes
            if t.device.type == "cpu":
                return t
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return t.device, host.copy_(t, non_blocking=True)

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return host.to(device, non_blocking=True)

        super().__init__(pack, unpack)


class _ChunkedHeadLoss(torch.autograd.Function):
    """Mean cross-entropy of ``layer_norm(x) @ weight.T``, chunk by chunk in both passes."""

    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, weight, targets, eps, chunk_size, dtype):
        # x [T, C] residual stream, weight [V, C], targets [T] (-100: no loss); logits [chunk, V] at most
        acc, w = torch.promote_types(dtype, torch.float32), weight.to(dtype)
        valid = targets != -100
        total, lses = torch.zeros((), dtype=acc, device=x.device), []
        for s in range(0, x.shape[0], chunk_size):
            y = F.layer_norm(x[s:s + chunk_size].to(acc), x.shape[-1:], ln_weight.to(acc), ln_bias.to(acc), eps)
            logits = (y.to(dtype) @ w.T).to(acc)  # [c, V]
            lse = torch.logsumexp(logits, dim=-1)  # [c]
            picked = logits.gather(1, targets[s:s + chunk_size].clamp(min=0)[:, None])[:, 0]
            total = total + ((lse - picked) * valid[s:s + chunk_size]).sum()
            lses.append(lse)
        ctx.save_for_backward(x, ln_weight, ln_bias, weight, targets, torch.cat(lses))
        ctx.eps, ctx.chunk_size, ctx.dtype, ctx.n_valid = eps, chunk_size, dtype, valid.sum()
        return total / ctx.n_valid

    @staticmethod
    def backward(ctx, grad):
        x, ln_weight, ln_bias, weight, targets, lse = ctx.saved_tensors
        c, dtype, acc = ctx.chunk_size, ctx.dtype, lse.dtype
        w, scale = weight.to(dtype), grad / ctx.n_valid
        d_x, d_w = torch.empty_like(x), torch.zeros(weight.shape, dtype=acc, device=weight.device)
        lw, lb = (p.detach().to(acc).requires_grad_() for p in (ln_weight, ln_bias))
        d_lw, d_lb = torch.zeros_like(lw), torch.zeros_like(lb)
        for s in range(0, x.shape[0], c):
            t = targets[s:s + c]
            with torch.enable_grad():  # recompute this chunk's LayerNorm, with a graph for its backward
                xc = x[s:s + c].detach().to(acc).requires_grad_()
                y = F.layer_norm(xc, x.shape[-1:], lw, lb, ctx.eps).to(dtype)
            p = (y.detach() @ w.T).to(acc).sub_(lse[s:s + c, None]).exp_()  # softmax [c, V]
            p[torch.arange(len(t), device=t.device), t.clamp(min=0)] -= 1.0   # d loss / d logits
            d_logits = p.mul_((t != -100)[:, None] * scale).to(dtype)
            d_w += (d_logits.T @ y.detach()).to(acc)
            gx, glw, glb = torch.autograd.grad(y, (xc, lw, lb), d_logits @ w)
            d_x[s:s + c], d_lw, d_lb = gx.to(x.dtype), d_lw + glw, d_lb + glb
        return (d_x, d_lw.to(ln_weight.dtype), d_lb.to(ln_bias.dtype), d_w.to(weight.dtype),
                None, None, None, None)


def lm_loss(model, ids: torch.Tensor, *, chunk_size: int | None = None, position_ids: torch.Tensor | None = None,
            targets: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token loss (mean over the B*(N-1) predicted positions) of GPT-2 ``model`` on ``ids`` int64 [B, N].

    ``chunk_size=None``: transformers' own loss (full [B, N, V] logits, upcast to fp32).
    Otherwise the final LayerNorm, ``lm_head`` and the loss run ``chunk_size`` positions at a
    time (in the autocast dtype for the matmul, fp32 for LayerNorm and softmax, as transformers
    does); the backward recomputes each chunk. Saved for the backward: the residual stream
    [B*N, C] and a log-sum-exp per position, instead of ln_f's output and N x V logits.

    Chunked only: ``position_ids`` [B, N] (default 0..N-1) and ``targets`` int64 [B, N] (default
    the next token; -100 = no loss; the mean is over the others), for a shard of a longer
    sequence (``lk.cptrain``).
    """
    if chunk_size is None and (position_ids is not None or targets is not None):
        raise ValueError("position_ids and targets are for the chunked loss: pass a chunk_size.")
    if chunk_size is None:
        return model(input_ids=ids, labels=ids, use_cache=False).loss
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    ln_f = model.transformer.ln_f
    model.transformer.ln_f = nn.Identity()  # the loss applies it, chunk by chunk
    try:
        x = model.transformer(input_ids=ids, position_ids=position_ids, use_cache=False).last_hidden_state  # [B, N, C]
    finally:
        model.transformer.ln_f = ln_f
    if targets is None:
        targets = F.pad(ids[:, 1:], (0, 1), value=-100)  # the next token; none after the last one
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    with torch.autocast(device, enabled=False):
        return _ChunkedHeadLoss.apply(x.reshape(-1, x.shape[-1]), ln_f.weight, ln_f.bias, model.lm_head.weight,
                                      targets.reshape(-1), ln_f.eps, chunk_size, dtype)


__all__ = ["Checkpointed", "ChunkedMLP", "OffloadSaved", "chunk_mlp", "lm_loss"]
