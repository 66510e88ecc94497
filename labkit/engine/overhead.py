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
triton is installed, else :func:`labkit.core.measure.time_fn`; the calls of one row take turns over
``rounds`` rounds, each round in its own shuffled order, with Python's garbage collector paused.
Each ratio is the median over rounds of the two calls' ratio within a round (:func:`paired_ratio`),
not a ratio of two medians. What made that necessary, measured on an H100 (one kernel under two
names, 40-120 rounds): under the 700 W power limit the SM clock wandered 1305-1740 MHz, so one
``do_bench`` of a GPU-bound kernel varied 2-4% (a ratio of medians over 12 rounds came out up to
4% off 1.0); FlashAttention-4's forward+backward at N = 1024, whose Python launches outlast its
kernels, varied 25-40% with the host's speed, in runs of slow rounds: over 40 rounds of 40 ms
two separate medians differed by 11% (paired: 4%), over 120 rounds of 10 ms by 2.4% (paired:
0.3%). Short measurements in many rounds follow that drift better than long ones in few: with
the defaults (60 rounds of ``rep_ms`` 10) the 80-row table's control stayed within 0.992-1.010 on
that H100, against 0.960-1.039 from 12 rounds of 40 ms before.
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

from labkit.engine import attention as attn
from labkit.engine.kernels import RUN_ERRORS, SDPA_BACKENDS, first_output, flash_function
from labkit.core.measure import as_device, gc_paused, time_fn

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
            return first_output(fn(q, k, v, causal=causal))
        out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
        return first_output(out).transpose(1, 2)
    return flash


def _timer(device: torch.device, rep_ms: float) -> Callable[[Callable], float]:
    """Milliseconds of one measurement of ``fn`` (about ``rep_ms`` of calls): do_bench on a GPU
    with triton, else time_fn. do_bench's 25 ms of warm-up let a clock held by the power limit
    settle to this kernel's own draw rather than that of the call timed before it."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench

            return lambda fn: do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
        except ImportError:
            pass
    return lambda fn: time_fn(fn, device=device, target_ms=rep_ms).median_ms


def _row_calls(cfg: dict, *, causal: bool, layout: str, mode: str, dtype, device) -> dict[str, Callable]:
    """The calls of one row, each a closure over one shared set of inputs."""
    from labkit.engine.bench import attention_inputs

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
              rounds: int = 60, rep_ms: float = 10.0, dtype=torch.bfloat16, device=None,
              progress: bool = True, partial_csv=None) -> pd.DataFrame:
    """One row per (config, layout, causal, mode): the fastest direct kernel, auto, the named pick, the control.

    Returns:
        DataFrame with B, H, N, D, layout, causal, mode, best (the direct backend of lowest median),
        pick (auto's), best_ms, auto_ms (medians), auto_over_best (direct:<best> / auto, paired:
        1.0 = as fast as the best direct call), labkit_over_direct (direct:<pick> / labkit:<pick>),
        control (direct:<pick> against itself: the timing noise), the failures of any call that
        raised, screened_out (direct calls timed in the first rounds only, see :func:`_take_turns`)
        and each call's median as ``ms <name>``.
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
        pick = next(name for name in calls if name.startswith("labkit:")).split(":", 1)[1]
        ms = _take_turns(calls, rounds, measure, order=random.Random(len(rows)), keep=f"direct:{pick}")
        med = {name: statistics.median(v) for name, v in ms.items()}
        direct = {name: t for name, t in med.items() if name.startswith("direct:")}
        best = min(direct, key=direct.get)
        rows.append(dict(**cfg, layout=layout, causal=c, mode=mode, best=best.split(":", 1)[1], pick=pick,
                         best_ms=direct[best], auto_ms=med["auto"], auto_over_best=paired_ratio(ms[best], ms["auto"]),
                         labkit_over_direct=paired_ratio(ms[f"direct:{pick}"], ms[f"labkit:{pick}"]),
                         control=paired_ratio(ms[f"direct:{pick}"], ms["control"]),
                         failed="; ".join(f"{k}: {v}" for k, v in failed.items()),
                         screened_out=" ".join(name for name, v in ms.items() if len(v) < rounds),
                         **{f"ms {name}": t for name, t in med.items()}))
        if partial_csv is not None:
            pd.DataFrame(rows).to_csv(partial_csv, index=False)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return pd.DataFrame(rows)


SCREEN_ROUNDS = 5   # rounds every call is timed before the clearly slower direct calls stop
SCREEN_CUTOFF = 1.3  # a direct call whose median is this far above the fastest one's cannot be the best


def _take_turns(calls: dict[str, Callable], rounds: int, measure: Callable[[Callable], float],
                order: random.Random, keep: str) -> dict[str, list[float]]:
    """Milliseconds of each call in each round (each round in its own shuffled order, the garbage
    collector paused). After ``SCREEN_ROUNDS`` rounds, direct calls more than ``SCREEN_CUTOFF``
    times slower than the fastest direct one (e.g. SDPA's efficient kernel, 2-4x behind on an
    H100) are no longer timed: they cannot be the best, and they took most of a row's time.
    The calls that are not direct ones, and ``keep`` (direct:<pick>, which labkit is compared
    with), run every round."""
    ms: dict[str, list[float]] = {name: [] for name in calls}
    active = list(calls)
    with gc_paused():
        for r in range(rounds):
            if r == SCREEN_ROUNDS:
                med = {name: statistics.median(v) for name, v in ms.items() if name.startswith("direct:")}
                fastest = min(med.values())
                active = [name for name in active
                          if name == keep or name not in med or med[name] <= SCREEN_CUTOFF * fastest]
            for name in order.sample(active, len(active)):
                ms[name].append(measure(calls[name]))
    return ms


def paired_ratio(numerator_ms: list[float], denominator_ms: list[float]) -> float:
    """Median over rounds of ``numerator_ms[r] / denominator_ms[r]``: the two calls of a ratio are
    compared within each round, so what drifts between rounds (GPU clocks under the power limit,
    the host's speed) cancels instead of adding to the noise of two separate medians."""
    return statistics.median(a / b for a, b in zip(numerator_ms, denominator_ms, strict=True))


def slow_rows(df: pd.DataFrame, *, threshold: float = 0.97) -> pd.DataFrame:
    """The rows of a :func:`vs_direct` table where ``auto`` ran below ``threshold`` of the best direct
    call, with ``cause``: "pick" where auto ran another kernel than the fastest direct one (a
    wrong choice), "noise" where it ran that same kernel (the two timings of one kernel differ;
    compare the row's ``control``)."""
    slow = df[df["auto_over_best"] < threshold].copy()
    slow["cause"] = ["noise" if best == pick else "pick" for best, pick in zip(slow["best"], slow["pick"])]
    return slow
