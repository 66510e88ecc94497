"""What labkit's dispatch costs on the GPU: ``auto`` and named backends against the kernels called directly.

For each configuration, layout, causal flag and mode (forward, forward+backward) the table times:
- ``direct:<backend>``: the kernel called without labkit (SDPA pinned by ``sdpa_kernel``; the
  FlashAttention packages' ``flash_attn_func``), for every backend ``auto`` may pick;
- ``auto``: ``lk.attention.attention(..., backend="auto")``, and ``labkit:<pick>`` for the backend
  auto picked, named;
- ``control``: ``direct:<pick>`` a second time under another name: the timing's own noise.
In forward+backward rows each call's output gradient dO is ``ones_like`` of its own output, so it
arrives in the layout the kernel wrote O in, as in training (and as ``auto`` tunes).
Each call is timed with ``triton.testing.do_bench`` (CUDA events, L2 flushed between calls) where
triton is installed, else :func:`labkit.measure.time_fn`; the calls of one row take turns over
``rounds`` rounds and the median over rounds is kept, so clock drift favours none. Each round has
its own shuffled order: rotated, every call always followed the same other call (the control
always came after ``labkit:<pick>``), so what a kernel inherits from the one before it (clocks,
power) did not average out; in that order the control ranged 0.954-1.055 on an H100.

``python -m labkit bench --vs-direct`` prints the table.

Used in: instructors checking labkit on their GPU (the README's GPU notes).
"""
from __future__ import annotations

import random
import statistics
from typing import Callable

import pandas as pd
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import attention as attn
from .kernels import RUN_ERRORS, SDPA_BACKENDS, flash_function
from .measure import as_device, time_fn

_SDPA = {"sdpa_math": SDPBackend.MATH, "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
         "sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}


def direct_call(backend: str, *, causal: bool, layout: str) -> Callable:
    """``fn(q, k, v) -> o`` calling ``backend``'s kernel the documented way, on tensors in ``layout``."""
    if backend in SDPA_BACKENDS:
        def sdpa(q, k, v):
            with sdpa_kernel(_SDPA[backend]):
                if layout == "bhnd":
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=causal)
                return o.transpose(1, 2)
        return sdpa
    fn = flash_function(backend)

    def flash(q, k, v):
        if layout == "bnhd":
            out = fn(q, k, v, causal=causal)
            return out[0] if isinstance(out, tuple) else out
        out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
    return flash


def _timer(device: torch.device, rep_ms: float) -> Callable[[Callable], float]:
    """Milliseconds of one measurement of ``fn`` (about ``rep_ms`` of calls): do_bench on a GPU
    with triton, else time_fn."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench

            return lambda fn: do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")
        except ImportError:
            pass
    return lambda fn: time_fn(fn, device=device, target_ms=rep_ms).median_ms


def _row_calls(cfg: dict, *, causal: bool, layout: str, mode: str, dtype, device) -> dict[str, Callable]:
    """The calls of one row, each a closure over one shared set of inputs."""
    from .bench import attention_inputs

    needs_grad = mode == "fwd_bwd"
    q, k, v = attention_inputs(**cfg, layout=layout, dtype=dtype, device=device, requires_grad=needs_grad)
    with torch.set_grad_enabled(needs_grad):
        pick = attn.auto_choice(q, k, v, causal=causal, layout=layout)
        names = attn.auto_candidates(q, k, causal=causal, layout=layout)

    def timed(fn):
        grad_out = None  # dO arrives in the output's own layout, as in training (and in auto's tuning)

        def call():
            nonlocal grad_out
            with torch.set_grad_enabled(needs_grad):
                o = fn(q, k, v)
                if needs_grad:
                    grad_out = torch.ones_like(o) if grad_out is None else grad_out
                    torch.autograd.grad(o, (q, k, v), grad_out)
        return call

    calls = {f"direct:{b}": timed(direct_call(b, causal=causal, layout=layout)) for b in names}
    for name, backend in (("auto", "auto"), (f"labkit:{pick}", pick)):
        calls[name] = timed(lambda q, k, v, backend=backend: attn.attention(
            q, k, v, causal=causal, backend=backend, layout=layout, nan_policy="ignore"))
    calls["control"] = timed(direct_call(pick, causal=causal, layout=layout))
    return calls


def vs_direct(configs: list[dict], *, layouts=("bhnd", "bnhd"), causal=(False, True), modes=attn.MODES,
              rounds: int = 8, rep_ms: float = 100.0, dtype=torch.bfloat16, device=None,
              progress: bool = True, partial_csv=None) -> pd.DataFrame:
    """One row per (config, layout, causal, mode): the fastest direct kernel, auto, the named pick, the control.

    Returns:
        DataFrame with B, H, N, D, layout, causal, mode, best (the fastest direct backend), pick
        (auto's), best_ms, auto_ms, auto_over_best (best_ms / auto_ms: 1.0 = as fast as the best
        direct call), labkit_over_direct (direct:<pick> / labkit:<pick>), control (direct:<pick>
        against itself: the timing noise), and the failures of any call that raised.
    """
    from tqdm.auto import tqdm

    device = as_device(device)
    measure = _timer(device, rep_ms)
    groups = [(cfg, lay, c, m) for cfg in configs for lay in layouts for c in causal for m in modes]
    rows = []
    for cfg, layout, c, mode in tqdm(groups, desc="auto vs direct", disable=not progress):
        calls = _row_calls(cfg, causal=c, layout=layout, mode=mode, dtype=dtype, device=device)
        failed = {}
        for name, call in list(calls.items()):  # warm-up: FA4 compiles per shape
            try:
                call()
            except RUN_ERRORS as err:
                failed[name] = str(err).splitlines()[0][:80]
                del calls[name]
        ms: dict[str, list[float]] = {name: [] for name in calls}
        order = random.Random(len(rows))
        for _ in range(rounds):
            for name in order.sample(list(calls), len(calls)):
                ms[name].append(measure(calls[name]))
        med = {name: statistics.median(v) for name, v in ms.items()}
        direct = {name: t for name, t in med.items() if name.startswith("direct:")}
        best = min(direct, key=direct.get)
        pick = next(name for name in med if name.startswith("labkit:")).split(":", 1)[1]
        rows.append(dict(**cfg, layout=layout, causal=c, mode=mode, best=best.split(":", 1)[1], pick=pick,
                         best_ms=direct[best], auto_ms=med["auto"], auto_over_best=direct[best] / med["auto"],
                         labkit_over_direct=med[f"direct:{pick}"] / med[f"labkit:{pick}"],
                         control=med[f"direct:{pick}"] / med["control"],
                         failed="; ".join(f"{k}: {v}" for k, v in failed.items()),
                         **{f"ms {name}": t for name, t in med.items()}))
        if partial_csv is not None:
            pd.DataFrame(rows).to_csv(partial_csv, index=False)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return pd.DataFrame(rows)


def slow_rows(df: pd.DataFrame, *, threshold: float = 0.97) -> pd.DataFrame:
    """The rows of a :func:`vs_direct` table where ``auto`` ran below ``threshold`` of the best direct
    call, with ``cause``: "pick" where auto ran another kernel than the fastest direct one (a
    wrong choice), "noise" where it ran that same kernel (the two timings of one kernel differ;
    compare the row's ``control``)."""
    slow = df[df["auto_over_best"] < threshold].copy()
    slow["cause"] = ["noise" if best == pick else "pick" for best, pick in zip(slow["best"], slow["pick"])]
    return slow
