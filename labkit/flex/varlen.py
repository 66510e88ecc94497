"""Packed (varlen) attention: FlashAttention-4's and torch's functions over documents laid end to end.

q, k, v [T, H, d] hold the documents one after another; ``cu_seqlens`` [n_docs + 1] int32 (leading 0) marks where
each starts; attention is causal inside each document and never crosses one. Both libraries rename keywords between
versions, so the calls read the installed signatures (:func:`kwargs_accepted`).

Used in: 09_flex_attention (through :mod:`labkit.flex.bench` and :mod:`labkit.flex.packtrain`).
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch

from labkit.engine import kernels
from labkit.engine.kernels import first_output


def kwargs_accepted(fn: Callable, **wanted) -> dict:
    """The keyword arguments of ``wanted`` that ``fn`` accepts (FA4 and torch's varlen change between versions)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in wanted.items() if k in params}


def fa4_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int):
    """FA4's ``flash_attn_varlen_func``, causal inside each document: q, k, v [T, H, d] -> o [T, H, d]."""
    kernels.flash_function("fa4")   # a clear ImportError when flash-attn-4 is missing
    import flash_attn.cute as cute

    fn = cute.flash_attn_varlen_func
    extra = kwargs_accepted(fn, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_len,
                            max_seqlen_k=max_len)
    return first_output(fn(q, k, v, causal=True, **extra))


def varlen_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int):
    """``torch.nn.attention.varlen.varlen_attn``, causal inside each document: [T, H, d] -> [T, H, d].

    Its causal switch changed name across versions (``window_size=(-1, 0)`` or ``is_causal=True``, read from the
    installed signature); the positional arguments (q, k, v, cu_seq_q, cu_seq_k, max_q, max_k) did not.
    """
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True} if "is_causal" in params else None
    if causal is None:
        raise TypeError("varlen_attn here has neither window_size nor is_causal")
    return first_output(varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **causal))
