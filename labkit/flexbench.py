"""Notebook 09's GPU measurements: a block-sparse kernel against FlexAttention, SDPA with a mask, FA4, varlen.

:func:`sweep` times, for each sequence length and each mask the notebook passes in (its own rules: the
sliding window and the document mask are exercise answers, so they come from the notebook), one forward of

- ``mine``: the notebook's kernel, called with the block mask's lists (the same ``create_block_mask`` result);
- ``flex_triton``: ``torch.compile(flex_attention)`` (its Triton backend), ``flex_flash``: the same with
  ``kernel_options={"BACKEND": "FLASH"}`` (FlashAttention-4 kernels) where the installed torch and flash-attn-4
  offer it;
- ``sdpa_mask``: SDPA with the dense boolean mask (N x N bytes; skipped past ``dense_limit``);
- ``fa4``: FlashAttention-4's own function where the mask is one it has (causal, a causal window; documents
  through its varlen function), and ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` for documents.

Every call runs once before timing: a backend that fails (not installed, refused, out of memory) gets its
error in ``status`` and the rest go on. Timings take turns (:func:`labkit.measure.time_interleaved`).
:func:`block_mask_cost` times ``create_block_mask`` itself, the first call and later ones.

Used in: 09_flex_attention.
"""
from __future__ import annotations

import inspect
import time
from typing import Callable

import pandas as pd
import torch

from . import kernels, measure

BLOCK = 128          # FlexAttention's default block: the kernels compared read the same block lists


def _recompile_room(limit: int = 256) -> None:
    """Let torch.compile keep one graph per (mask, N) instead of falling back to eager past its default limit."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))


def _kwargs(fn: Callable, **wanted) -> dict:
    """The keyword arguments of ``wanted`` that ``fn`` accepts (FA4 and torch's varlen change between versions)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in wanted.items() if k in params}


def fa4_call(q, k, v, *, window: int | None = None, cu_seqlens: torch.Tensor | None = None) -> Callable:
    """A causal FA4 forward of q, k, v [1, H, N, d] (bhnd): plain, with a left window, or varlen over cu_seqlens."""
    if cu_seqlens is None:
        fn = kernels.flash_function("fa4")
        qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))             # [1, N, H, d]
        extra = {} if window is None else _kwargs(fn, window_size=(window, 0))
        if window is not None and not extra:
            raise TypeError("this flash-attn-4 has no window_size argument")
        return lambda: fn(qb, kb, vb, causal=True, **extra)
    import flash_attn.cute as cute

    fn = cute.flash_attn_varlen_func
    qt, kt, vt = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))  # [T, H, d]
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    extra = _kwargs(fn, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=longest, max_seqlen_k=longest)
    return lambda: fn(qt, kt, vt, causal=True, **extra)


def varlen_call(q, k, v, cu_seqlens: torch.Tensor) -> Callable:
    """torch.nn.attention.varlen.varlen_attn, causal inside each document, on [T, H, d] (signature read at run time)."""
    from torch.nn.attention.varlen import varlen_attn

    qt, kt, vt = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True} if "is_causal" in params else None
    if causal is None:
        raise TypeError("varlen_attn here has neither window_size nor is_causal")
    return lambda: varlen_attn(qt, kt, vt, cu_seqlens, cu_seqlens, longest, longest, **causal)


def _flex_calls(q, k, v, block_mask) -> dict[str, Callable]:
    from torch.nn.attention.flex_attention import flex_attention

    triton_fn = torch.compile(flex_attention, dynamic=False)
    flash_fn = torch.compile(flex_attention, dynamic=False)
    return {"flex_triton": lambda: triton_fn(q, k, v, block_mask=block_mask),
            "flex_flash": lambda: flash_fn(q, k, v, block_mask=block_mask, kernel_options={"BACKEND": "FLASH"})}


def _first_call(fn: Callable) -> tuple[str, float]:
    """Run ``fn`` once (compiles, autotunes): ("ok" or the error in one line, seconds)."""
    start = time.perf_counter()
    try:
        fn()
        torch.cuda.synchronize()
        return "ok", time.perf_counter() - start
    except Exception as err:  # noqa: BLE001 - one backend's failure is a row's status, not the sweep's end
        measure.free_memory()
        return f"{type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}", time.perf_counter() - start


def sweep(cases: list[dict], seq_lens: list[int], *, mine: Callable, H: int = 16, d: int = 128,
          dtype=torch.bfloat16, target_ms: float = 30.0, dense_limit: int = 16384,
          also: dict[str, Callable] | None = None) -> pd.DataFrame:
    """One forward per backend, mask and N: a tidy DataFrame (N, mask, density, backend, ms, first_call_s, status).

    Args:
        cases: dicts with ``name``; ``rule(N) -> mask_mod``; ``kind`` ("causal", "window" or "document");
            ``window`` (int, for "window"); ``document_id(N) -> [N] int tensor`` (for "document").
        mine: ``mine(q, k, v, lists, block, case, N)`` -> the notebook's forward; ``lists``: the block mask's
            four kv lists (kv_num_blocks, kv_indices and the full_ pair) for (batch 0, head 0), on the GPU.
        dense_limit: the longest N given to SDPA with a dense boolean mask (N x N bytes).
        also: more of the notebook's variants, name -> a function called as ``mine`` is (e.g. with a sink).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    _recompile_room()
    rows = []
    for N in seq_lens:
        q, k, v = (torch.randn(1, H, N, d, device="cuda", dtype=dtype) for _ in range(3))
        for case in cases:
            rule = case["rule"](N)
            bm = create_block_mask(rule, None, None, N, N, device="cuda", BLOCK_SIZE=BLOCK)
            lists = {name: getattr(bm, name)[0, 0] for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                                                                "full_kv_indices")}
            n_blocks = bm.kv_indices.shape[-1]
            density = float((lists["kv_num_blocks"].sum() + lists["full_kv_num_blocks"].sum()) / n_blocks ** 2)
            calls = {"mine": lambda case=case, lists=lists: mine(q, k, v, lists, BLOCK, case, N), **_flex_calls(q, k, v, bm)}
            for name, fn in (also or {}).items():
                calls[name] = lambda fn=fn, case=case, lists=lists: fn(q, k, v, lists, BLOCK, case, N)
            if N <= dense_limit:
                idx = torch.arange(N, device="cuda")
                dense = rule(torch.tensor(0, device="cuda"), torch.tensor(0, device="cuda"), idx.view(N, 1), idx.view(1, N))
                calls["sdpa_mask"] = lambda dense=dense: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
            failed = {}
            extra = {"fa4": lambda: fa4_call(q, k, v)} if case["kind"] == "causal" else \
                {"fa4": lambda: fa4_call(q, k, v, window=case["window"])} if case["kind"] == "window" else {}
            if case["kind"] == "document":
                ids = case["document_id"](N).to("cuda")
                cu = torch.zeros(int(ids.max()) + 2, dtype=torch.int32, device="cuda")
                cu[1:] = torch.cumsum(torch.bincount(ids), 0)
                extra = {"fa4": lambda: fa4_call(q, k, v, cu_seqlens=cu), "varlen": lambda: varlen_call(q, k, v, cu)}
            for name, make in extra.items():
                try:
                    calls[name] = make()
                except Exception as err:  # noqa: BLE001 - not installed or refused here: a status
                    failed[name] = (f"{type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}", 0.0)
            first = {name: _first_call(fn) for name, fn in calls.items()}
            first.update(failed)
            ok = {name: fn for name, fn in calls.items() if first[name][0] == "ok"}
            timings, errors = measure.time_interleaved(ok, device="cuda", target_ms=target_ms,
                                                       errors=(RuntimeError,)) if ok else ({}, {})
            for name, (status, seconds) in first.items():
                t = timings.get(name)
                rows.append(dict(N=N, mask=case["name"], density=density, backend=name,
                                 ms=t.median_ms if t else float("nan"), first_call_s=seconds,
                                 status=status if name not in errors else f"timing: {errors[name]}"))
            del bm, calls, ok
            measure.free_memory()
    return pd.DataFrame(rows)


def block_mask_cost(rules: dict[str, Callable], N: int, *, reps: int = 5, device: str = "cuda") -> pd.DataFrame:
    """Seconds of ``create_block_mask`` per rule at length N: the first call and the median of ``reps`` more."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows = []
    for name, rule in rules.items():
        times = []
        for _ in range(reps + 1):
            start = time.perf_counter()
            create_block_mask(rule, None, None, N, N, device=device, BLOCK_SIZE=BLOCK)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        later = sorted(times[1:])
        rows.append(dict(mask=name, N=N, first_ms=times[0] * 1e3, later_ms=later[len(later) // 2] * 1e3))
    return pd.DataFrame(rows)
