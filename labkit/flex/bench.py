"""Notebook 09's GPU measurements: a block-sparse kernel against FlexAttention, SDPA with a mask, FA4, varlen.

:func:`sweep` times, for each head size d, each sequence length N and each mask the notebook passes in (its own
rules: the sliding window and the document mask are exercise answers, so they come from the notebook), the
forward (``pass`` "fwd") and the forward with its backward ("fwd+bwd": dq, dk, dv for a fixed dO) of

- ``mine``: the notebook's kernels, called with the block mask's eight lists (the same ``create_block_mask``
  result); its backward is the notebook's too (``mine_backward``, given the forward's o and lse);
- ``flex_triton``: ``torch.compile(flex_attention)`` (its Triton backend), ``flex_flash``: the same with
  ``kernel_options={"BACKEND": "FLASH"}`` (FlashAttention-4 kernels) where the installed torch and flash-attn-4
  offer it; both differentiated by autograd through the compiled function;
- ``sdpa_mask``: SDPA with the dense boolean mask (N x N bytes; skipped past ``dense_limit``);
- ``fa4``: FlashAttention-4's own function where the mask is one it has (causal, a causal window; documents
  through its varlen function), and ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` for documents.

Every call runs once before timing: a backend that fails (not installed, refused, out of memory) gets its
error in ``status`` and the rest go on. Timings take turns (:func:`labkit.core.measure.time_interleaved`), one pass at a
time: the forwards with each other, then the forward+backwards, so that a 0.2-ms forward is not timed in turns with
15-ms forward+backwards (:func:`_timed_by_pass`).
:func:`build_block_mask` builds each block mask (compiled when the eager build runs out of memory);
:func:`block_mask_cost` times the eager ``create_block_mask`` itself, the first call and later ones. The packed
(varlen) calls are :mod:`labkit.flex.varlen`'s, which the notebook's training step uses too.

Used in: 09_flex_attention.
"""
from __future__ import annotations

import time
from typing import Callable

import pandas as pd
import torch

from labkit.core import measure
from labkit.engine import kernels
from labkit.engine.bench import recompile_room
from labkit.flex.varlen import fa4_varlen, kwargs_accepted, varlen_attend

BLOCK = 128          # FlexAttention's default block: the kernels compared read the same block lists
PASSES = ("fwd", "fwd+bwd")
LIST_NAMES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
              "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def status_of(err: BaseException) -> str:
    """One line for a table: "oom" when memory ran out, else the error's type and the first line of its message."""
    if measure.is_oom(err):
        return "oom"
    first = str(err).splitlines()[0][:120] if str(err) else ""
    return f"{type(err).__name__}: {first}"


def _fa4_spec(q, k, v, case: dict, cu: torch.Tensor | None):
    """(inputs, fn): FA4 causal, windowed or varlen over q, k, v [1, H, N, d] (bhnd) laid out as it wants."""
    if cu is not None:
        longest = int((cu[1:] - cu[:-1]).max())
        return tuple(t[0].transpose(0, 1).contiguous() for t in (q, k, v)), \
            lambda a, b, c: fa4_varlen(a, b, c, cu, longest)                 # [T, H, d]
    fn = kernels.flash_function("fa4")
    extra = {} if case["kind"] == "causal" else kwargs_accepted(fn, window_size=(case["window"], 0))
    if case["kind"] != "causal" and not extra:
        raise TypeError("this flash-attn-4 has no window_size argument")
    return tuple(t.transpose(1, 2).contiguous() for t in (q, k, v)), \
        lambda a, b, c: kernels.first_output(fn(a, b, c, causal=True, **extra))  # [1, N, H, d]


def _specs(q, k, v, case: dict, bm, rule, N: int, dense_limit: int) -> tuple[dict, dict]:
    """The library backends as {name: (inputs, fn)} (fn(*inputs) -> o) and {name: status} for those refused."""
    from torch.nn.attention.flex_attention import flex_attention

    triton_fn = torch.compile(flex_attention, dynamic=False)
    flash_fn = torch.compile(flex_attention, dynamic=False)
    specs = {"flex_triton": ((q, k, v), lambda a, b, c: triton_fn(a, b, c, block_mask=bm)),
             "flex_flash": ((q, k, v), lambda a, b, c: flash_fn(a, b, c, block_mask=bm,
                                                                  kernel_options={"BACKEND": "FLASH"}))}
    failed = {}
    makers = {}
    if N <= dense_limit:
        def sdpa():
            idx = torch.arange(N, device=q.device)
            zero = torch.tensor(0, device=q.device)
            dense = rule(zero, zero, idx.view(N, 1), idx.view(1, N))
            return (q, k, v), lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, attn_mask=dense)
        makers["sdpa_mask"] = sdpa
    cu = None
    if case["kind"] == "document":
        ids = case["document_id"](N).to(q.device)
        cu = torch.zeros(int(ids.max()) + 2, dtype=torch.int32, device=q.device)
        cu[1:] = torch.cumsum(torch.bincount(ids), 0)
        longest = int((cu[1:] - cu[:-1]).max())
        makers["varlen"] = lambda: (tuple(t[0].transpose(0, 1).contiguous() for t in (q, k, v)),
                                    lambda a, b, c: varlen_attend(a, b, c, cu, longest))
    makers["fa4"] = lambda: _fa4_spec(q, k, v, case, cu)
    for name, make in makers.items():
        try:
            specs[name] = make()
        except Exception as err:  # noqa: BLE001 - not installed, refused or out of memory here: a status
            failed[name] = status_of(err)
    return specs, failed


def _train(inputs: tuple, fn: Callable) -> Callable:
    """fn's forward and backward: dq, dk, dv by autograd for a fixed random dO (leaves of their own)."""
    leaves = tuple(t.detach().requires_grad_() for t in inputs)
    do = []

    def step():
        o = kernels.first_output(fn(*leaves))
        if not do:
            do.append(torch.randn_like(o))
        return torch.autograd.grad(o, leaves, do[0])
    return step


def _first_call(fn: Callable, device: str) -> tuple[str, float]:
    """Run ``fn`` once (compiles, autotunes): ("ok" or the error in one line, seconds)."""
    start = time.perf_counter()
    try:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return "ok", time.perf_counter() - start
    except Exception as err:  # noqa: BLE001 - one backend's failure is a row's status, not the sweep's end
        measure.free_memory()
        return status_of(err), time.perf_counter() - start


def _calls(q, k, v, lists, case, N, bm, rule, *, mine, mine_backward, also, passes, dense_limit):
    """{(backend, pass): callable} to time and {(backend, pass): status} of those that could not be built."""
    calls = {}
    ours = {"mine": mine, **(also or {})}
    for name, fn in ours.items():
        if "fwd" in passes:
            calls[(name, "fwd")] = lambda fn=fn: fn(q, k, v, lists, BLOCK, case, N)
    if "fwd+bwd" in passes and mine_backward is not None:
        do = torch.randn_like(q)

        def mine_step():
            o, lse = mine(q, k, v, lists, BLOCK, case, N)
            return mine_backward(q, k, v, o, lse, do, lists, BLOCK, case, N)
        calls[("mine", "fwd+bwd")] = mine_step
    specs, refused = _specs(q, k, v, case, bm, rule, N, dense_limit)
    for name, (inputs, fn) in specs.items():
        if "fwd" in passes:
            calls[(name, "fwd")] = lambda inputs=inputs, fn=fn: fn(*inputs)
        if "fwd+bwd" in passes:
            calls[(name, "fwd+bwd")] = _train(inputs, fn)
    failed = {(name, p): status for name, status in refused.items() for p in passes}
    return calls, failed


def _timed_by_pass(calls: dict, device: str, target_ms: float) -> tuple[dict, dict]:
    """:func:`labkit.core.measure.time_interleaved` over the calls of one pass at a time ({(backend, pass): fn}):
    ({key: Timing}, {key: error}). Calls in turns share the GPU's conditions; what a heavy call leaves behind
    (clocks, power) falls on the next turn, so like is timed with like. Each call is timed at least once per
    turn of a whole balanced round (:func:`labkit.core.measure.balanced_turns`), so even a call too slow for more
    than the minimum follows each other call as often."""
    timings, errors = {}, {}
    for p in dict.fromkeys(key[1] for key in calls):
        group = {key: fn for key, fn in calls.items() if key[1] == p}
        t, e = measure.time_interleaved(group, device=device, target_ms=target_ms, errors=(RuntimeError,),
                                        min_reps=max(5, measure.balanced_turns(len(group))))
        timings.update(t)
        errors.update(e)
    return timings, errors


def build_block_mask(rule: Callable, N: int, device: str):
    """``create_block_mask(rule)`` at length N (block 128), eagerly; compiled (``torch.compile(create_block_mask)``:
    the rule evaluated block by block, the same lists) when the eager build, a whole [N, N] bool mask and int64 sums
    (9 N^2 bytes), runs out of memory. (``create_block_mask(..., _compile=True)`` does the same in torch 2.11-2.13
    but warns that the flag is deprecated.)"""
    from torch.nn.attention.flex_attention import create_block_mask

    try:
        return create_block_mask(rule, None, None, N, N, device=device, BLOCK_SIZE=BLOCK)
    except Exception as err:  # noqa: BLE001 - only out of memory falls through to the compiled build
        if not measure.is_oom(err):
            raise
    measure.free_memory()
    return torch.compile(create_block_mask)(rule, None, None, N, N, device=device, BLOCK_SIZE=BLOCK)


def sweep(cases: list[dict], seq_lens: list[int] | dict[int, list[int]], *, mine: Callable,
          mine_backward: Callable | None = None, H: int = 16, d: int = 128, dtype=torch.bfloat16,
          target_ms: float = 30.0, dense_limit: int = 16384, also: dict[str, Callable] | None = None,
          progress: bool = True, device: str = "cuda") -> pd.DataFrame:
    """Forward (and forward+backward) per backend, head size, N and mask: a tidy DataFrame
    (d, N, mask, density, backend, pass, ms, p20_ms, p80_ms, first_call_s, status); ms is the median call.

    Args:
        cases: dicts with ``name``; ``rule(N) -> mask_mod``; ``kind`` ("causal", "window" or "document");
            ``window`` (int, for "window"); ``document_id(N) -> [N] int tensor`` (for "document").
        seq_lens: the lengths N at head size ``d``, or {d: lengths} for several head sizes.
        mine: ``mine(q, k, v, lists, block, case, N) -> (o, lse)``, the notebook's forward; ``lists``: the block
            mask's eight lists for (batch 0, head 0), on the GPU (kv_* for the forward, q_* for dK, dV).
        mine_backward: ``mine_backward(q, k, v, o, lse, do, lists, block, case, N) -> (dq, dk, dv)``; given, every
            backend is timed in the pass "fwd+bwd" too (the others through autograd).
        dense_limit: the longest N given to SDPA with a dense boolean mask (N x N bytes).
        also: more of the notebook's forward variants, name -> a function called as ``mine`` is (e.g. a sink).
        device: "cuda"; "cpu" only to test the sweep itself (FlexAttention has no backward there).
    """
    from tqdm.auto import tqdm

    recompile_room()
    shapes = [(hd, n) for hd, ns in (seq_lens if isinstance(seq_lens, dict) else {d: seq_lens}).items() for n in ns]
    passes = PASSES if mine_backward is not None else ("fwd",)
    rows = []
    with tqdm(total=len(shapes) * len(cases), desc="flex sweep", disable=not progress) as bar:
        for hd, N in shapes:
            q, k, v = (torch.randn(1, H, N, hd, device=device, dtype=dtype) for _ in range(3))
            for case in cases:
                bar.set_postfix_str(f"d={hd} N={N} {case['name']}")
                rule = case["rule"](N)
                try:
                    bm = build_block_mask(rule, N, device)
                except Exception as err:  # noqa: BLE001 - out of memory at this N: a status, the sweep goes on
                    rows += [dict(d=hd, N=N, mask=case["name"], density=float("nan"), backend="create_block_mask",
                                  **{"pass": p}, ms=float("nan"), first_call_s=0.0, status=status_of(err))
                             for p in passes]
                    measure.free_memory()
                    bar.update()
                    continue
                lists = {name: getattr(bm, name)[0, 0] for name in LIST_NAMES}
                n_blocks = bm.kv_indices.shape[-1]
                density = float((lists["kv_num_blocks"].sum() + lists["full_kv_num_blocks"].sum()) / n_blocks ** 2)
                calls, failed = _calls(q, k, v, lists, case, N, bm, rule, mine=mine, mine_backward=mine_backward,
                                       also=also, passes=passes, dense_limit=dense_limit)
                first = {key: _first_call(fn, device) for key, fn in calls.items()}
                first.update({key: (status, 0.0) for key, status in failed.items()})
                ok = {key: fn for key, fn in calls.items() if first[key][0] == "ok"}
                timings, errors = _timed_by_pass(ok, device, target_ms)
                for (name, p), (status, seconds) in first.items():
                    t = timings.get((name, p))
                    rows.append(dict(d=hd, N=N, mask=case["name"], density=density, backend=name, **{"pass": p},
                                     ms=t.median_ms if t else float("nan"), p20_ms=t.p20_ms if t else float("nan"),
                                     p80_ms=t.p80_ms if t else float("nan"), first_call_s=seconds,
                                     status=status if (name, p) not in errors else f"timing: {errors[(name, p)]}"))
                del bm, calls, ok, lists
                measure.free_memory()
                bar.update()
            del q, k, v
            measure.free_memory()
    return pd.DataFrame(rows)


def ratios(df: pd.DataFrame, others=("flex_triton", "flex_flash")) -> pd.DataFrame:
    """other / mine per (d, N, mask) and pass (> 1: mine faster), from :func:`sweep`'s rows that ran."""
    t = df[df["status"] == "ok"].pivot_table(index=["d", "N", "mask"], columns=["pass", "backend"], values="ms")
    out = {}
    for p in t.columns.get_level_values(0).unique():
        for other in others:
            if (p, other) in t and (p, "mine") in t:
                out[f"{other} / mine {p}"] = t[(p, other)] / t[(p, "mine")]
    return pd.DataFrame(out)


def variant_cost(df: pd.DataFrame, variant: str, base: str = "mine", pass_: str = "fwd") -> pd.DataFrame:
    """Per (d, N, mask): what ``variant`` adds to ``base``'s time, ``extra`` = median / median - 1, with the range the
    timings' spread allows: ``low`` = variant's p20 / base's p80 - 1, ``high`` = variant's p80 / base's p20 - 1."""
    ok = df[(df["status"] == "ok") & (df["pass"] == pass_) & df["backend"].isin([variant, base])]
    t = ok.pivot_table(index=["d", "N", "mask"], columns="backend", values=["ms", "p20_ms", "p80_ms"]).dropna()
    return pd.DataFrame({"extra": t[("ms", variant)] / t[("ms", base)] - 1,
                         "low": t[("p20_ms", variant)] / t[("p80_ms", base)] - 1,
                         "high": t[("p80_ms", variant)] / t[("p20_ms", base)] - 1})


def density_speedup(df: pd.DataFrame, dense: str, sparse: str, backend: str = "mine") -> pd.DataFrame:
    """Per (d, N) and pass: ``backend``'s time on mask ``dense`` / on mask ``sparse``, beside their density ratio."""
    ok = df[(df["status"] == "ok") & (df["backend"] == backend)]
    t = ok.pivot_table(index=["d", "N"], columns=["pass", "mask"], values="ms")
    dens = ok.drop_duplicates(["d", "N", "mask"]).pivot_table(index=["d", "N"], columns="mask", values="density")
    out = {f"speed-up {p}": t[(p, dense)] / t[(p, sparse)] for p in t.columns.get_level_values(0).unique()
           if (p, dense) in t and (p, sparse) in t}
    if dense in dens and sparse in dens:
        out["density ratio"] = dens[dense] / dens[sparse]
    return pd.DataFrame(out)


def block_mask_cost(rules: dict[str, Callable], N: int, *, reps: int = 5, device: str = "cuda") -> pd.DataFrame:
    """Milliseconds of ``create_block_mask`` per rule at length N: the first call and the median of ``reps`` more.

    Returns:
        DataFrame: mask, N, first_ms, later_ms, status ("ok", or :func:`status_of` of the error, e.g. "oom": the
        eager ``create_block_mask`` builds the whole [N, N] mask and int64 intermediates: N^2 + 8 N^2 bytes).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    rows = []
    for name, rule in rules.items():
        times = []
        try:
            for _ in range(reps + 1):
                start = time.perf_counter()
                create_block_mask(rule, None, None, N, N, device=device, BLOCK_SIZE=BLOCK)
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
        except Exception as err:  # noqa: BLE001 - out of memory at this N: a status, the other rules go on
            rows.append(dict(mask=name, N=N, first_ms=float("nan"), later_ms=float("nan"), status=status_of(err)))
            measure.free_memory()
            continue
        later = sorted(times[1:])
        rows.append(dict(mask=name, N=N, first_ms=times[0] * 1e3, later_ms=later[len(later) // 2] * 1e3, status="ok"))
    return pd.DataFrame(rows)
