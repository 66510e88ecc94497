"""Decoding attention: what a decode step reads, SDPA timed at one query token, and a paged-cache loop.

Notebook 08 writes the decode kernels (no split, split-KV with its combine, paged) and the page
allocator itself; this module holds what the notebook measures and the plumbing around the
student's code, never an answer:

- :func:`tensor_bytes`: the bytes a kernel must read and write, counted from the tensors it is given.
- :func:`yardsticks`: the library kernels (SDPA's backends, FA4) as calls on one decode problem, each in
  its own layout: what the notebook's kernels are measured against; :func:`fa4_paged` is FA4 reading a
  paged cache through its ``page_table``.
- :func:`sdpa_decode_sweep`: those kernels at query length 1 over context length and batch, as achieved
  GB/s (a tidy DataFrame).
- :func:`fa4_num_splits`: the ``num_splits`` FA4 takes on this GPU (its split-KV path needs Blackwell).
- :func:`page_table`: per-sequence page lists as the padded int32 table a paged kernel reads.
- :func:`write_kv`: new tokens' K/V scattered into the pages at the slots an allocator returned.
- :func:`generate_paged`: greedy generation with a Hugging Face Llama model whose decode attention is
  the student's paged kernel and whose cache pages come from the student's allocator (both passed in).

Layouts: a contiguous cache is ``[B, N, H_kv, d]`` (bnhd, as flash-attn's KV cache); a paged cache
is ``[num_pages, page_size, H_kv, d]``; a decode query is ``[B, H_q, d]``.

Used in: 08_decode_attention.
"""
from __future__ import annotations

import importlib
import warnings
from typing import Callable

import pandas as pd
import torch
import torch.nn.functional as F

from . import bench, measure
from .kernels import RUN_ERRORS, flash_function  # RUN_ERRORS: what a kernel that cannot take an input raises

SDPA_DECODE_BACKENDS = ("sdpa_math", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn")
YARDSTICKS = SDPA_DECODE_BACKENDS + ("fa4",)


def tensor_bytes(*tensors: torch.Tensor) -> int:
    """Bytes held by ``tensors`` (elements x element size): what a kernel that reads or writes each
    of them once moves through memory at least."""
    return sum(t.numel() * t.element_size() for t in tensors)


def _sdpa_runner(backend: str, q, k, v) -> Callable[[], torch.Tensor]:
    """A call of SDPA with one backend forced. q [B, H_q, 1, d]; k, v [B, H_kv, N, d] (GQA, not repeated)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"sdpa_math": SDPBackend.MATH, "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
              "sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def run():
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1])
    return run


def fa4_num_splits(device) -> int:
    """``num_splits`` for FA4 on ``device``: 0 (its own split heuristic) where its split-KV path runs, 1 (no
    split) on Ampere and Hopper, where flash-attn-4 4.0 refuses splits ("SplitKV not supported on SM 9.0")."""
    device = torch.device(device)
    return 0 if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10 else 1


def _fa4_function(name: str) -> Callable | None:
    """``flash_attn.cute``'s function ``name``, or None where FA4 does not import (:func:`labkit.kernels.flash_function`)."""
    try:
        flash_function("fa4")
    except ImportError:
        return None
    return getattr(importlib.import_module("flash_attn.cute"), name)


def _fa4_runner(q, k, v) -> Callable[[], torch.Tensor] | None:
    """FlashAttention-4 on q [B, 1, H_q, d] and a cache k, v [B, N, H_kv, d] (:func:`fa4_num_splits`),
    or None where ``flash_attn.cute`` does not import."""
    fn = _fa4_function("flash_attn_func")
    if fn is None:
        return None
    splits = fa4_num_splits(q.device)
    return lambda: fn(q, k, v, num_splits=splits)


def fa4_paged(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor,
              seqlens: torch.Tensor) -> Callable[[], torch.Tensor] | None:
    """FA4 reading a paged cache: a call without arguments, or None where ``flash_attn.cute`` does not import.

    Args:
        q: [B, H_q, d]; k_pages, v_pages: [num_pages, page_size, H_kv, d]; table: [B, max pages] int32
            (row b: sequence b's pages in token order); seqlens: [B] int32, keys per sequence.
    """
    fn = _fa4_function("flash_attn_varlen_func")
    if fn is None:
        return None
    q4, table, seqlens = q[:, None], table.to(torch.int32).contiguous(), seqlens.to(torch.int32)
    splits = fa4_num_splits(q.device)
    return lambda: fn(q4, k_pages, v_pages, seqused_k=seqlens, page_table=table, num_splits=splits)


def yardsticks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               backends: tuple[str, ...] = YARDSTICKS) -> dict[str, Callable[[], torch.Tensor]]:
    """The library kernels a decode kernel is measured against, each on the same problem in its own layout.

    Args:
        q: [B, H_q, d], one query token per sequence.
        k, v: [B, N, H_kv, d], a contiguous cache (bnhd, the layout of the notebook's kernels and of FA4).
        backends: names from :data:`YARDSTICKS`; "fa4" is left out where ``flash_attn.cute`` does not import.

    Returns:
        name -> a call without arguments. SDPA gets its own [B, H, N, d] copies of K/V (made here, once,
        outside any timing) and ``enable_gqa``; FA4 reads the bnhd cache as it is.
    """
    unknown = set(backends) - set(YARDSTICKS)
    if unknown:
        raise ValueError(f"unknown yardsticks {sorted(unknown)}; choose from {YARDSTICKS}")
    sdpa = [b for b in backends if b in SDPA_DECODE_BACKENDS]
    if sdpa:
        qs, ks, vs = q[:, :, None], k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    fns = {name: _sdpa_runner(name, qs, ks, vs) for name in sdpa}
    if "fa4" in backends and (runner := _fa4_runner(q[:, None], k, v)) is not None:
        fns["fa4"] = runner
    return fns


def sdpa_decode_sweep(contexts: list[int], batches: list[int], *, h_q: int, h_kv: int, d: int,
                      dtype: torch.dtype, device, target_ms: float = 20.0, fa4: bool = True) -> pd.DataFrame:
    """Time one decode step (query length 1) of each SDPA backend, and FA4, over context and batch.

    Args:
        contexts: context lengths N (keys per sequence).
        batches: batch sizes B.
        h_q, h_kv, d: query heads, key/value heads (GQA when h_kv < h_q), head dim.
        target_ms: timing budget per call (:func:`labkit.measure.time_interleaved`, L2 flushed before each
            call: at N = 8K one layer's K/V in bf16, 33.5 MB, fits in an H100's 50 MB L2, and a loop of one
            call would read it from there, faster than any decode step of a real model does).
        fa4: also time ``flash_attn.cute.flash_attn_func`` where it imports (:func:`yardsticks`).

    Returns:
        One row per (B, N, backend): ``ms`` (median), ``gb_per_s`` = :func:`tensor_bytes` of q, k, v
        and o over the time, ``status`` ("ok", else :func:`labkit.bench.failure_status`: "oom", "error: ...", ...).
    """
    device = torch.device(device)
    backends = SDPA_DECODE_BACKENDS + (("fa4",) if fa4 else ())
    rows = []
    for b in batches:
        for n in contexts:
            q = torch.randn(b, h_q, d, dtype=dtype, device=device)
            k, v = (torch.randn(b, n, h_kv, d, dtype=dtype, device=device) for _ in range(2))
            moved = tensor_bytes(q, k, v, q)                     # o has q's size
            fns = yardsticks(q, k, v, backends)
            with warnings.catch_warnings():  # a forced backend that cannot take the input says why, then raises
                warnings.simplefilter("ignore", UserWarning)
                timings, errors = measure.time_interleaved(fns, device=device, target_ms=target_ms, flush_l2=True,
                                                           errors=RUN_ERRORS)
            for name in fns:
                ok = name in timings
                ms = timings[name].median_ms if ok else float("nan")
                rows.append(dict(backend=name, B=b, N=n, h_q=h_q, h_kv=h_kv, d=d, dtype=str(dtype).split(".")[-1],
                                 bytes=moved, ms=ms, gb_per_s=moved / (ms * 1e-3) / 1e9 if ok else float("nan"),
                                 status="ok" if ok else bench.failure_status(errors[name]),
                                 device=device.type))
            del q, k, v, fns
    return pd.DataFrame(rows)


def page_table(pages: list[list[int]], *, width: int | None = None, device=None) -> torch.Tensor:
    """The page table of a batch: row b lists sequence b's pages in order, padded with 0.

    Args:
        pages: per sequence, its page ids in token order (an allocator's ``pages(seq)``).
        width: columns (default: the longest list, at least 1).

    Returns:
        int32 [B, width]. Padding is page 0: a kernel must not read past a sequence's length.
    """
    width = max([1, *map(len, pages)]) if width is None else width
    if any(len(p) > width for p in pages):
        raise ValueError(f"a sequence has more than width={width} pages")
    table = torch.zeros(len(pages), width, dtype=torch.int32)
    for row, p in enumerate(pages):
        table[row, :len(p)] = torch.tensor(p, dtype=torch.int32)
    return table.to(device)


def write_kv(k_pages: torch.Tensor, v_pages: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Store new tokens' keys and values in the paged cache, in place.

    Args:
        k_pages, v_pages: [num_pages, page_size, H_kv, d].
        slots: [T] flat slot of each token, ``page * page_size + offset``.
        k, v: [T, H_kv, d].
    """
    if slots.numel() != k.shape[0]:
        raise ValueError(f"{slots.numel()} slots for {k.shape[0]} tokens")
    flat = slots.to(device=k_pages.device, dtype=torch.long)
    k_pages.view(-1, *k_pages.shape[2:])[flat] = k.to(k_pages.dtype)
    v_pages.view(-1, *v_pages.shape[2:])[flat] = v.to(v_pages.dtype)


@torch.no_grad()
def generate_paged(model, prompt: torch.Tensor, new_tokens: int, *, allocator, attend: Callable,
                   k_pages: list[torch.Tensor], v_pages: list[torch.Tensor]) -> torch.Tensor:
    """Greedy generation with a Llama-style Hugging Face model, its KV cache in pages.

    The prompt is prefilled with causal SDPA (prefill is not the lesson); every decode step writes
    each layer's new K/V into the pages at the slots ``allocator.append(seq, 1)`` returns and calls
    ``attend`` for the attention. The sequences are freed at the end, even after an error.

    Args:
        model: a ``LlamaForCausalLM`` (or one with the same module names), in eval mode.
        prompt: [B, T] token ids (equal lengths).
        new_tokens: tokens to generate per sequence.
        allocator: the student's page allocator: ``append(seq, n) -> slots [n]``, ``pages(seq)``,
            ``length(seq)``, ``free(seq)``; sequences are named 0..B-1.
        attend: ``attend(q [B, H_q, d], k_pages, v_pages, block_table [B, P] int32, seqlens [B] int32,
            max_len)`` -> o [B, H_q, d]; ``max_len`` is the longest sequence as a Python int (known on the
            host here, so the kernel's wrapper need not read ``seqlens.max()``, a GPU -> CPU sync per layer).
        k_pages, v_pages: per layer, [num_pages, page_size, H_kv, d].

    Returns:
        [B, T + new_tokens] token ids, as ``model.generate(prompt, do_sample=False)`` would give.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inner, (b, t) = model.model, prompt.shape
    layers = inner.layers
    d = layers[0].self_attn.head_dim
    ids, out = prompt, [prompt]
    try:
        for step in range(new_tokens):
            n = ids.shape[1]                                          # tokens fed this step: T, then 1
            slots = torch.stack([allocator.append(s, n) for s in range(b)])   # [B, n]
            start = allocator.length(0) - n
            pos = torch.arange(start, start + n, device=ids.device)[None].expand(b, n)
            h = inner.embed_tokens(ids)                               # [B, n, hidden]
            cos, sin = inner.rotary_emb(h, pos)
            table = page_table([allocator.pages(s) for s in range(b)], device=ids.device)
            lengths = [allocator.length(s) for s in range(b)]
            lens = torch.tensor(lengths, dtype=torch.int32, device=ids.device)
            for i, layer in enumerate(layers):
                attn, x = layer.self_attn, layer.input_layernorm(h)
                q, k, v = (proj(x).view(b, n, -1, d).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
                q, k = apply_rotary_pos_emb(q, k, cos, sin)           # [B, H, n, d]
                write_kv(k_pages[i], v_pages[i], slots.reshape(-1), k.transpose(1, 2).reshape(b * n, -1, d),
                         v.transpose(1, 2).reshape(b * n, -1, d))
                if step == 0:                                         # prefill: causal over the prompt
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
                else:                                                 # decode: the student's kernel
                    o = attend(q[:, :, 0].contiguous(), k_pages[i], v_pages[i], table, lens, max(lengths))[:, None]
                h = h + attn.o_proj(o.reshape(b, n, -1).to(h.dtype))
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            logits = model.lm_head(inner.norm(h[:, -1]))              # [B, vocab]
            ids = logits.argmax(-1, keepdim=True)                     # greedy
            out.append(ids)
    finally:
        for s in range(b):
            try:
                allocator.free(s)
            except KeyError:                                          # never allocated: append failed first
                pass
    return torch.cat(out, dim=1)
