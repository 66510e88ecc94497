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
- :func:`graphed`: calls captured in CUDA graphs and replayed, as a serving engine runs a decode step: what
  the notebook times on a GPU, so that the host's launch path (Python wrappers, Triton's and SDPA's
  dispatch: microseconds per kernel) is not what a kernel of microseconds is compared by.
  :func:`layered` puts :data:`LAYERS` calls in one graph, as a model's decode step has one attention per
  layer, on :func:`caches_for` distinct caches so none is read from L2.
- :func:`time_per_call`: the notebook's timing of decode calls: graphs of :data:`LAYERS` calls, L2 flushed by
  a read, milliseconds per call.
- :func:`read_once`: a kernel that only reads the cache, once: what reading alone reaches at that size,
  timed the same way (a reference, not a bound).
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

import functools
import importlib
import math
import warnings
from typing import Callable

import pandas as pd
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import bench, measure
from .kernels import RUN_ERRORS, flash_function  # RUN_ERRORS: what a kernel that cannot take an input raises

SDPA_DECODE_BACKENDS = ("sdpa_math", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn")
YARDSTICKS = SDPA_DECODE_BACKENDS + ("fa4",)
LAYERS = 8   # attention calls per timed CUDA graph: a model's decode step runs one per layer in one graph
READ_ONLY = "read only"   # the name of read_once's row or column


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
        target_ms: timing budget per call (:func:`labkit.measure.time_interleaved`, L2 flushed by a read
            before each timed call: at N = 8K one layer's K/V in bf16, 33.6 MB, fits in an H100's 50 MB
            L2, and a loop of one call would read it from there, faster than any decode step of a real
            model does).
        fa4: also time ``flash_attn.cute.flash_attn_func`` where it imports (:func:`yardsticks`).
        cuda_graph: time replays of CUDA graphs of :data:`LAYERS` calls on :func:`caches_for` distinct caches
            (default: on a GPU); else each call launched from Python, one at a time (:func:`time_per_call`).

    Returns:
        One row per (B, N, backend): ``ms`` (median per call), ``gb_per_s`` = :func:`tensor_bytes` of q,
        k, v and o over the time, ``status`` ("ok", else :func:`labkit.bench.failure_status`: "oom",
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
            if device.type == "cuda":
                torch.cuda.empty_cache()                     # the graphs' pools and caches of this shape back
    return pd.DataFrame(rows)


NOISE_BLOCK = 2**20


def _noise(shape: tuple[int, ...], dtype: torch.dtype, device, *, seed: int) -> torch.Tensor:
    """A tensor of ``shape`` filled with standard-normal values: a block of ``NOISE_BLOCK`` drawn by a seeded CPU
    generator, repeated (fast at gigabytes; needs no CUDA generator, which a failed graph capture breaks)."""
    numel = math.prod(shape)
    block = torch.randn(min(numel, NOISE_BLOCK), generator=torch.Generator().manual_seed(seed)).to(device, dtype)
    return block.repeat(-(-numel // block.numel()))[:numel].view(shape)


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


def _forward(model, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, k_pages: list[torch.Tensor],
             v_pages: list[torch.Tensor], attention: Callable) -> torch.Tensor:
    """Every layer of a Llama-style model on ids [B, n] at positions pos [B, n]; returns the greedy next ids [B, 1].

    Each layer's new K/V go into its pages at slots [B * n] (row-major over B, n) before its attention,
    ``attention(layer, q [B, H_q, n, d], k, v [B, H_kv, n, d]) -> o [B, n, H_q, d]``.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inner, (b, n) = model.model, ids.shape
    d = inner.layers[0].self_attn.head_dim
    h = inner.embed_tokens(ids)                                       # [B, n, hidden]
    cos, sin = inner.rotary_emb(h, pos)
    for i, layer in enumerate(inner.layers):
        attn, x = layer.self_attn, layer.input_layernorm(h)
        q, k, v = (proj(x).view(b, n, -1, d).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)                   # [B, H, n, d]
        write_kv(k_pages[i], v_pages[i], slots, k.transpose(1, 2).reshape(b * n, -1, d),
                 v.transpose(1, 2).reshape(b * n, -1, d))
        h = h + attn.o_proj(attention(i, q, k, v).reshape(b, n, -1).to(h.dtype))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(inner.norm(h[:, -1])).argmax(-1, keepdim=True)


def _warm_up(fn: Callable[[], object]) -> None:
    """``fn`` run twice on a side stream before its capture (Triton compiles, libraries set up, the caching
    allocator warms up); its errors propagate. Twice: a library may finish its setup only on the second
    call (FA4's first call compiles and runs its kernel, the second is the first through its compiled-kernel
    cache): in the capture that setup invalidated it (``cudaErrorStreamCaptureInvalidated``, H100)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)


def _capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``fn``, warmed up (:func:`_warm_up`), captured in a CUDA graph: (the graph, the output tensor each
    replay overwrites). ``fn`` must read its inputs from tensors that stay in place and must not
    synchronise with the host."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graphed(fns: dict[str, Callable[[], object]], device) -> tuple[dict[str, Callable[[], object]],
                                                                 dict[str, BaseException]]:
    """Each call captured in a CUDA graph of its own, to be timed as a serving engine runs a decode step.

    A replay launches the captured kernels with one driver call, so its host time is microseconds whatever
    the Python and dispatch code around the kernels cost: what is compared is the GPU's time (and the gaps
    between a call's kernels), not whose launch path is lighter.

    Args:
        fns: name -> a call without arguments that reads tensors that stay in place and never synchronises
            with the host (e.g. no ``int(seqlens.max())``), as the calls of :func:`yardsticks` and the
            notebook's kernels given ``max_len``; or a list of such calls, captured one after another in
            one graph (:func:`layered`: a replay then runs them all, and its time is theirs together).
        device: a CUDA device; CUDA graphs exist only there.

    Returns:
        (name -> a call that replays the graph and returns the captured output, which every replay
        overwrites; name -> the error of a call that failed when first run, e.g. a backend that cannot
        take this input, or while it was captured, e.g. one that synchronises, or one that finishes
        its setup inside the capture (FA4's forward on an H100 did, ``cudaErrorStreamCaptureInvalidated``,
        until :func:`_warm_up` ran each call twice). A failed capture leaves CUDA's default random-number
        generator unusable in this process (the next ``torch.randn`` on the GPU fails): a caller that goes
        on makes its inputs without it, as :func:`sdpa_decode_sweep` and notebook 08 (a CPU generator) do.
    """
    if torch.device(device).type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, not {device}: time the calls as they are there")
    replays, errors = {}, {}
    for name, fn in fns.items():
        calls = list(fn) if isinstance(fn, (list, tuple)) else [fn]
        try:
            for call in calls:
                _warm_up(call)                        # a call that cannot run fails here, before any capture
        except RUN_ERRORS as err:
            errors[name] = err
            continue
        try:
            replays[name] = functools.partial(_replay, *_capture(functools.partial(_in_turn, calls)))
        except RuntimeError as err:                   # torch's AcceleratorError and FA4's CUDA errors among them
            errors[name] = err.with_traceback(None)   # its frames would keep the failed graph's memory alive
    return replays, errors


def time_per_call(per_cache: list[dict[str, Callable[[], object]]], device, *, target_ms: float,
                  graph: bool | None = None, eager: dict[str, Callable[[], object]] | None = None,
                  ) -> tuple[dict[str, float], dict[str, BaseException]]:
    """Median milliseconds per call of each name of ``per_cache`` (the same calls on each of several caches,
    :func:`caches_for` of them), timed in turns (:func:`labkit.measure.time_interleaved`).

    With ``graph`` (default: on a GPU): each name's :data:`LAYERS` calls cycling the caches captured in one CUDA
    graph (:func:`layered`, :func:`graphed`), L2 flushed by a read before each replay, a replay's time over
    ``LAYERS``. Without: the calls on the first cache launched from Python, one at a time. ``eager``: more calls
    timed in the same turns as they are, each doing what one replay does (``LAYERS`` calls; divided alike).

    Returns (name -> ms per call; name -> the error of a call that could not run or be captured).
    """
    device = torch.device(device)
    graph = device.type == "cuda" if graph is None else graph
    layers = LAYERS if graph else 1
    calls, errors = graphed(layered(per_cache, layers), device) if graph else (dict(per_cache[0]), {})
    calls.update(eager or {})
    timings, failed = measure.time_interleaved(calls, device=device, target_ms=target_ms, flush_l2=True,
                                               flush_by="read", errors=RUN_ERRORS)
    errors.update(failed)
    return {name: t.median_ms / layers for name, t in timings.items()}, errors


def _in_turn(calls: list[Callable[[], object]]):
    """Run ``calls`` one after another; returns the last one's output."""
    for call in calls:
        out = call()
    return out


def caches_for(cache_bytes: int, device, *, layers: int = LAYERS) -> int:
    """How many distinct caches the ``layers`` calls of a timed graph cycle through (1 to ``layers``):
    enough that between two reads of one byte the calls read at least three times the GPU's L2, so each
    call reads its cache from memory, as each layer of a model does. 1 off a GPU.

    Example: an H100 (50 MB L2), batch 1, N = 8K, 8 KV heads, d = 128, bf16 (33.6 MB): 5 caches.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, min(layers, -(-3 * l2 // max(1, cache_bytes))))


def layered(per_cache: list[dict[str, Callable[[], object]]], layers: int = LAYERS) -> dict[str, list]:
    """name -> the ``layers`` calls of one timed graph (for :func:`graphed`), call i on cache
    ``i % len(per_cache)``: per_cache[c] holds the same names' calls on cache c. A name missing from a
    cache's calls is left out."""
    if not per_cache or layers < 1:
        raise ValueError(f"need at least one cache and one layer, got {len(per_cache)} caches, layers={layers}")
    names = [name for name in per_cache[0] if all(name in calls for calls in per_cache)]
    return {name: [per_cache[i % len(per_cache)][name] for i in range(layers)] for name in names}


@triton.jit
def _read_kernel(x_ptr, sums_ptr, n, per_program, BLOCK: tl.constexpr):
    """Program p sums elements [p * per_program, min((p + 1) * per_program, n)) of x into sums[p] (fp32)."""
    p = tl.program_id(0).to(tl.int64)
    lo = p * per_program
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(lo, tl.minimum(lo + per_program, n), BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < tl.minimum(lo + per_program, n), other=0.0).to(tl.float32)
    tl.store(sums_ptr + p, tl.sum(acc, 0))


READ_BLOCK = 4096


def read_once(*tensors: torch.Tensor, programs: int | None = None) -> Callable[[], torch.Tensor]:
    """A call that reads every element of ``tensors`` once and returns their total (fp32, a 0-d tensor): what
    reading the same bytes and computing nothing reaches at that size, timed the same way. A reference,
    not a bound: it launches a kernel per tensor and one more for the total, and its reads are not tuned
    (at 64K-128K tokens on an H100 good attention kernels beat it by 7-13%: notebook 08's reference run).
    On a GPU a Triton streaming sum (``programs`` contiguous slices, 4 per SM by default); on a CPU
    ``torch.sum`` (Triton's interpreter there would time Python, not memory)."""
    if not tensors or any(not t.is_contiguous() for t in tensors):
        raise ValueError("read_once takes one or more contiguous tensors")
    device = tensors[0].device
    if device.type != "cuda":
        return lambda: sum(t.sum(dtype=torch.float32) for t in tensors)
    if programs is None:
        programs = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    sums = torch.empty(len(tensors), programs, dtype=torch.float32, device=device)

    def run():
        for t, row in zip(tensors, sums):
            per = -(-t.numel() // programs // READ_BLOCK) * READ_BLOCK
            _read_kernel[(programs,)](t, row, t.numel(), per, BLOCK=READ_BLOCK)
        return sums.sum()
    return run


def _replay(graph: torch.cuda.CUDAGraph, out):
    """Replay ``graph``; returns the output its capture wrote (overwritten in place)."""
    graph.replay()
    return out


@torch.no_grad()
def generate_paged(model, prompt: torch.Tensor, new_tokens: int, *, allocator, attend: Callable,
                   k_pages: list[torch.Tensor], v_pages: list[torch.Tensor],
                   cuda_graph: bool | None = None) -> torch.Tensor:
    """Greedy generation with a Llama-style Hugging Face model, its KV cache in pages.

    The prompt is prefilled with causal SDPA (prefill is not the lesson); every decode step writes
    each layer's new K/V into the pages at the slots ``allocator.append(seq, 1)`` returns and calls
    ``attend`` for the attention. The sequences are freed at the end, even after an error.

    A decode step launches some 40 kernels per layer, each costing microseconds of Python and driver
    time for microseconds of GPU work at batch 1. With ``cuda_graph`` the first decode step is captured
    in a CUDA graph and every later step replays it: its inputs (token ids, slots, page table,
    lengths; positions follow from the lengths) are copied into the same tensors each step, one
    host -> GPU copy, so the host only runs the allocator.

    Args:
        model: a ``LlamaForCausalLM`` (or one with the same module names), in eval mode.
        prompt: [B, T] token ids (equal lengths).
        new_tokens: tokens to generate per sequence.
        allocator: the student's page allocator: ``append(seq, n) -> slots [n]``, ``pages(seq)``,
            ``length(seq)``, ``free(seq)``; sequences are named 0..B-1.
        attend: ``attend(q [B, H_q, d], k_pages, v_pages, block_table [B, P] int32, seqlens [B] int32,
            max_len)`` -> o [B, H_q, d]. ``max_len`` is T + new_tokens, a Python int bounding every
            sequence's length for the whole generation: the kernel's wrapper need not read
            ``seqlens.max()`` (a GPU -> CPU sync per layer), and its launch is the same every step (a
            graph replays fixed launches; only the tensors' contents change). ``block_table`` has
            ceil(max_len / page_size) columns.
        k_pages, v_pages: per layer, [num_pages, page_size, H_kv, d].
        cuda_graph: replay the decode step from a CUDA graph (default: where the model is on a GPU).

    Returns:
        [B, T + new_tokens] token ids, as ``model.generate(prompt, do_sample=False)`` would give.
    """
    if new_tokens < 0:
        raise ValueError(f"new_tokens = {new_tokens}; it must be >= 0")
    if new_tokens == 0:
        return prompt
    b, t = prompt.shape
    device, capacity = prompt.device, t + new_tokens
    width = -(-capacity // k_pages[0].shape[1])
    use_graph = device.type == "cuda" if cuda_graph is None else cuda_graph
    if use_graph and device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs the model on a CUDA device, not {device}")

    def prefill(i, q, k, v):                                          # causal over the prompt
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)

    ids = torch.zeros(b, 1, dtype=torch.long, device=device)         # the step's inputs, in tensors that stay put:
    packed = torch.zeros(b * (2 + width), dtype=torch.long, device=device)   # slots [B], lens [B], table [B, width]

    def decode_step():                                                # reads only ids and packed: replayable
        slots, lens, table = packed[:b], packed[b:2 * b].int(), packed[2 * b:].view(b, width).int()

        def paged(i, q, k, v):
            return attend(q[:, :, 0].contiguous(), k_pages[i], v_pages[i], table, lens, capacity)[:, None]
        return _forward(model, ids, (lens - 1).long()[:, None], slots, k_pages, v_pages, paged)

    graph, out = None, [prompt]
    try:
        slots = torch.stack([allocator.append(s, t) for s in range(b)]).reshape(-1).to(device)
        pos = torch.arange(t, device=device)[None].expand(b, t)
        out.append(_forward(model, prompt, pos, slots, k_pages, v_pages, prefill))
        for _ in range(new_tokens - 1):
            slots = torch.cat([allocator.append(s, 1) for s in range(b)])
            lens = torch.tensor([allocator.length(s) for s in range(b)])
            table = page_table([allocator.pages(s) for s in range(b)], width=width)
            packed.copy_(torch.cat([slots, lens, table.view(-1).long()]))   # one host -> GPU copy per step
            ids.copy_(out[-1])
            if not use_graph:
                out.append(decode_step())
                continue
            if graph is None:
                _warm_up(decode_step)
                graph, next_ids = _capture(decode_step)
            graph.replay()
            out.append(next_ids.clone())
    finally:
        for s in range(b):
            try:
                allocator.free(s)
            except KeyError:                                          # never allocated: append failed first
                pass
    return torch.cat(out, dim=1)
