"""The attention function Hugging Face GPT-2 calls for ``attn_implementation="labkit"``.

- :func:`attention_forward`: transformers' calling convention (query, key, value [B, H, N, D],
  a mask from the registered mask function, scaling, dropout) routed to ``lk.attention`` with the
  backend the model's config names; padding masks and dropout go to PyTorch SDPA; RoPE models
  (``lk.rope.use_rope``) get their queries and keys rotated here.
- :func:`record_calls`: what transformers passed, call by call (to look inside a forward).
- :func:`ensure_registered`: the name ``"labkit"`` in transformers' attention and mask-function
  tables, once. ``lk.gpt2.set_attention`` calls it; a model never needs more.

The name avoids "flash": transformers treats such names as FlashAttention packages or hub kernels.
Transformers is imported inside :func:`ensure_registered`, so ``import labkit`` stays fast.

Used in: 02_gpt2_integration, 03_long_sequence_training.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F

from labkit.engine import attention as attn
from labkit.models import rope

ATTN_NAME = "labkit"
DEFAULT_BACKEND = "auto"  # used when a model's config sets no labkit_backend
_RECORDERS: list[list[dict]] = []  # the innermost record_calls() gets each call


def attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None,
                      dropout: float = 0.0, **kwargs):
    """The attention function transformers calls for ``attn_implementation="labkit"``.

    Routing: no mask and no dropout (training, unpadded prefill) goes to ``lk.attention.attention``
    with the model's backend (``config.labkit_backend``, else :data:`DEFAULT_BACKEND`), causal,
    without NaN check or sync. One query (decoding with a KV cache) sees every cached key, so it
    runs non-causal, and under "auto" on "reference" (shapes change every token; "auto" would
    re-time them). A padding mask goes to PyTorch SDPA with that mask (the FlashAttention kernels take
    none; a fully masked row gives 0, as in transformers' "sdpa"), and so does dropout: ``lk.attention``
    has no dropout argument (flash-attn 2 and SDPA's kernels have one, FA4 has none).

    Args:
        module: the calling GPT2Attention (reads ``config``, ``is_causal``, ``scaling``).
        query: [B, H, N, D]; key, value: [B, H, Nk, D].
        attention_mask: None, or [B, 1, N, Nk] bool (True = attend) from the registered mask
            function, or a float additive mask.
        scaling: score scale (GPT-2: 1/sqrt(D), divided by layer+1 if so configured).
        dropout: attention dropout probability (nonzero only in training mode).

    Returns:
        (out [B, N, H, D], None): transformers' layout; no attention weights.
    """
    if _RECORDERS:
        _RECORDERS[-1].append(dict(layer=getattr(module, "layer_idx", None), query=tuple(query.shape),
                                   key=tuple(key.shape), mask=attention_mask, scaling=scaling, dropout=dropout,
                                   other_kwargs=sorted(kwargs)))
    scale = _scale(module, query, scaling)
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    n, nk = query.shape[2], key.shape[2]
    if attention_mask is None and causal and 1 < n < nk:
        # transformers' convention (as its "sdpa"): a None mask with Nk > N > 1 only happens when
        # prefilling an empty static cache, whose slots past N are unused (top-left alignment).
        key, value = key[:, :, :n], value[:, :, :n]
    config = getattr(module, "config", None)
    base = getattr(config, "labkit_rope_base", None)
    if base is not None:
        if attention_mask is not None:
            raise ValueError("this RoPE model numbers positions 0..Nk-1 and takes no padding mask; "
                             "pass unpadded sequences.")
        query, key = rope.rotate_queries_keys(query, key, base)
        value = value.contiguous()  # v alone; otherwise its view keeps the whole fused qkv alive
    if attention_mask is None and dropout == 0.0:
        backend = getattr(config, "labkit_backend", None) or DEFAULT_BACKEND
        if backend == "auto" and n == 1:
            backend = "reference"
        out = attn.attention(query, key, value, causal=causal and n > 1, scale=scale,
                             backend=backend, layout="bhnd", nan_policy="ignore")
    else:
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.to(query.dtype)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             is_causal=attention_mask is None and causal and n > 1, scale=scale)
    return out.transpose(1, 2), None


def _scale(module, query: torch.Tensor, scaling: float | None) -> float:
    """GPT-2's score scale; older transformers pass none, so derive it from the module."""
    if scaling is not None:
        return scaling
    if getattr(module, "scaling", None) is not None:
        return module.scaling
    scale = query.shape[-1] ** -0.5 if getattr(module, "scale_attn_weights", True) else 1.0
    if getattr(module, "scale_attn_by_inverse_layer_idx", False):
        scale /= float(module.layer_idx + 1)
    return scale


@contextlib.contextmanager
def record_calls() -> Iterator[list[dict]]:
    """Record what transformers passes to :func:`attention_forward` inside the ``with`` block.

    Yields a list that fills with one dict per call (one per layer and forward): ``layer``,
    ``query`` and ``key`` shapes ([B, H, N, D]), ``mask`` (the tensor, or None), ``scaling``,
    ``dropout`` and ``other_kwargs`` (the names of the remaining keyword arguments).
    Only models whose attention implementation is "labkit" are recorded.
    """
    calls: list[dict] = []
    _RECORDERS.append(calls)
    try:
        yield calls
    finally:
        _RECORDERS.remove(calls)


def ensure_registered() -> None:
    """Put :data:`ATTN_NAME` in transformers' ``AttentionInterface`` with :func:`attention_forward`,
    and in ``AttentionMaskInterface`` with transformers' SDPA-style mask function (None for pure
    causal, else a bool [B, 1, N, Nk] mask); without the second, padding masks are dropped."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if AttentionInterface._global_mapping.get(ATTN_NAME) is not attention_forward:
        AttentionInterface.register(ATTN_NAME, attention_forward)
        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


__all__ = ["ATTN_NAME", "DEFAULT_BACKEND", "attention_forward", "ensure_registered", "record_calls"]
