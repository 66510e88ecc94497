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
- Re-exported so the notebook reads ``lk.decode.*``: CUDA-graph timing from :mod:`labkit.decoding.graphtime`
  (:func:`graphed`, :func:`layered`, :func:`caches_for`, :func:`time_per_call`, :data:`LAYERS`), the read-only
  ceiling and reference from :mod:`labkit.decoding.readbw` (:func:`read_bandwidth`, :func:`read_once`), and the paged
  cache's plumbing from :mod:`labkit.decoding.paged` (:func:`page_table`, :func:`write_kv`, :func:`generate_paged`).
- :func:`fa4_num_splits`: the ``num_splits`` FA4 takes on this GPU (its split-KV path needs Blackwell).

Layouts: a contiguous cache is ``[B, N, H_kv, d]`` (bnhd, as flash-attn's KV cache); a decode query is ``[B, H_q, d]``.

Used in: 08_decode_attention.
"""
from __future__ import annotations

import importlib
import math
import warnings
from typing import Callable

import pandas as pd
import torch
import torch.nn.functional as F

from labkit.engine import bench
from labkit.decoding.graphtime import LAYERS, caches_for, graphed, layered, release, time_per_call  # noqa: F401 (lk.decode.*)
# RUN_ERRORS (also lk.decode.RUN_ERRORS): what a kernel that cannot take an input raises
from labkit.engine.kernels import RUN_ERRORS, flash_function  # noqa: F401
from labkit.decoding.paged import generate_paged, page_table, write_kv  # noqa: F401 (lk.decode.*)
from labkit.decoding.readbw import READ_ONLY, read_bandwidth, read_once  # noqa: F401 (lk.decode.*)

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
    """``flash_attn.cute``'s function ``name``, or None where FA4 does not import (:func:`labkit.engine.kernels.flash_function`)."""
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
        backends: names from :data:`YARDSTICKS`; "fa4" is left out off a GPU and where ``flash_attn.cute``
            does not import.

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
    if "fa4" in backends and q.is_cuda and (runner := _fa4_runner(q[:, None], k, v)) is not None:
        fns["fa4"] = runner
    return fns


def sdpa_decode_sweep(contexts: list[int], batches: list[int], *, h_q: int, h_kv: int, d: int,
                      dtype: torch.dtype, device, target_ms: float = 20.0, fa4: bool = True,
                      cuda_graph: bool | None = None) -> pd.DataFrame:
    """Time one decode step (query length 1) of each SDPA backend, FA4 and :func:`read_once` (a kernel that
    only reads the cache) over context and batch, with :func:`time_per_call`.

    Args:
        contexts: context lengths N (keys per sequence).
        batches: batch sizes B.
        h_q, h_kv, d: query heads, key/value heads (GQA when h_kv < h_q), head dim.
        target_ms: timing budget per call (:func:`labkit.core.measure.time_interleaved`, L2 flushed by a read
            before each timed call: at N = 8K one layer's K/V in bf16, 33.6 MB, fits in an H100's 50 MB
            L2, and a loop of one call would read it from there, faster than any decode step of a real
            model does).
        fa4: also time ``flash_attn.cute.flash_attn_func`` where it imports (:func:`yardsticks`).
        cuda_graph: time replays of CUDA graphs of :data:`LAYERS` calls on :func:`caches_for` distinct caches
            (default: on a GPU); else each call launched from Python, one at a time (:func:`time_per_call`).

    Returns:
        One row per (B, N, backend): ``ms`` (median per call), ``gb_per_s`` = :func:`tensor_bytes` of q,
        k, v and o over the time, ``status`` ("ok", else :func:`labkit.engine.bench.failure_status`: "oom",
        "error: ...", ...), ``timed`` ("cuda graph" or "eager"), ``calls_per_replay``.
    """
    device = torch.device(device)
    use_graph = device.type == "cuda" if cuda_graph is None else cuda_graph
    layers = LAYERS if use_graph else 1
    backends = SDPA_DECODE_BACKENDS + (("fa4",) if fa4 else ())
    size = torch.empty((), dtype=dtype).element_size()
    rows = []
    for b in batches:
        for n in contexts:
            moved = (2 * b * h_q * d + 2 * b * n * h_kv * d) * size          # q and o, K and V
            per_cache = []
            for c in range(caches_for(moved, device, layers=layers)):
                q, k, v = (_noise(shape, dtype, device, seed=3 * c + i)
                           for i, shape in enumerate([(b, h_q, d), (b, n, h_kv, d), (b, n, h_kv, d)]))
                per_cache.append({**yardsticks(q, k, v, backends), READ_ONLY: read_once(k, v)})
            with warnings.catch_warnings():  # a forced backend that cannot take the input says why, then raises
                warnings.simplefilter("ignore", UserWarning)
                per_call, errors = time_per_call(per_cache, device, target_ms=target_ms, graph=use_graph)
            for name in per_cache[0]:
                ok = name in per_call
                ms = per_call[name] if ok else float("nan")
                rows.append(dict(backend=name, B=b, N=n, h_q=h_q, h_kv=h_kv, d=d, dtype=str(dtype).split(".")[-1],
                                 bytes=moved, ms=ms, gb_per_s=moved / (ms * 1e-3) / 1e9 if ok else float("nan"),
                                 status="ok" if ok else bench.failure_status(errors[name]),
                                 timed="cuda graph" if use_graph else "eager", calls_per_replay=layers,
                                 device=device.type))
            del per_cache, errors
            release(device)                                  # the graphs' pools and caches of this shape back
    return pd.DataFrame(rows)


NOISE_BLOCK = 2**20


def _noise(shape: tuple[int, ...], dtype: torch.dtype, device, *, seed: int) -> torch.Tensor:
    """A tensor of ``shape`` filled with standard-normal values: a block of ``NOISE_BLOCK`` drawn by a seeded CPU
    generator, repeated (fast at gigabytes; needs no CUDA generator, which a failed graph capture breaks)."""
    numel = math.prod(shape)
    block = torch.randn(min(numel, NOISE_BLOCK), generator=torch.Generator().manual_seed(seed)).to(device, dtype)
    return block.repeat(-(-numel // block.numel()))[:numel].view(shape)
