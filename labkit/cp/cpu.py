"""PyTorch's context parallelism in CPU processes (gloo): a CPU kernel for the op its ring calls.

``context_parallel`` routes SDPA to ``aten._scaled_dot_product_flash_attention`` (and its
backward), which has CUDA kernels only; on a CPU, SDPA picks
``aten._scaled_dot_product_flash_attention_for_cpu``, which the ring does not handle.
:func:`install` gives the CUDA op a CPU kernel (the CPU flash kernel: same output and
log-sum-exp) and makes ``F.scaled_dot_product_attention`` call that op, so torch's own ring
attention, sharding and merge run unchanged. ``python -m labkit cp-train --nproc 2`` uses it in
each process when there is no GPU; call it only in such a process (it changes SDPA for the whole
process).

Used in: 07_context_parallel (through ``cp-train`` on a machine without GPUs).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

aten = torch.ops.aten
_LIBRARY: list[torch.library.Library] = []  # kept alive: the registration lasts as long as the library object


def _flash_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """aten._scaled_dot_product_flash_attention on CPU tensors [B, H, n, D]: (out, lse [B, H, n], placeholders)."""
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal, scale=scale)
    scalar = torch.zeros((), dtype=torch.int64)  # cumulative lengths and RNG state: unused without dropout
    return out, lse, scalar, scalar, query.shape[2], key.shape[2], scalar, scalar, torch.empty(0, dtype=query.dtype)


def _flash_backward(grad_out, query, key, value, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                    philox_seed, philox_offset, *, scale=None):
    """aten._scaled_dot_product_flash_attention_backward on CPU tensors: (dq, dk, dv)."""
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, query, key, value, out, lse, dropout_p,
                                                                      is_causal, scale=scale)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """SDPA through the flash op (the name matters: context parallelism patches F by ``__name__``)."""
    if attn_mask is not None or enable_gqa:
        raise ValueError("the CPU stand-in takes no mask and no grouped-query attention.")
    return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[0]


def install() -> None:
    """Register the CPU kernels and route ``F.scaled_dot_product_attention`` through them (this process).

    Raises:
        RuntimeError: CUDA is available (the real kernels run there).
    """
    if torch.cuda.is_available():
        raise RuntimeError("lk.cpcpu stands in for CUDA kernels on machines without a GPU; this one has CUDA.")
    if _LIBRARY:
        return
    library = torch.library.Library("aten", "IMPL")
    library.impl("_scaled_dot_product_flash_attention", _flash_forward, "CPU")
    library.impl("_scaled_dot_product_flash_attention_backward", _flash_backward, "CPU")
    _LIBRARY.append(library)
    F.scaled_dot_product_attention = scaled_dot_product_attention


__all__ = ["install", "scaled_dot_product_attention"]
