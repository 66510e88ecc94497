"""Attention: one entry point over every kernel, checked once and cheap on every call after.

Shapes use one vocabulary: B batch, H heads, N query length, Nk key length, D head dim.
Two layouts are named, never implied: ``"bhnd"`` ([B, H, N, D], SDPA's) and ``"bnhd"``
([B, N, H, D], flash-attn's). Causal masking is aligned bottom-right, as in flash-attn and in
decoding with a KV cache: query i may see keys j <= i + (Nk - N).

Backends (:mod:`labkit.engine.kernels`): ``reference`` (:func:`reference_attention`), ``sdpa_math``,
``sdpa_efficient``, ``sdpa_flash``, ``sdpa_cudnn``, ``flash_attn`` (FlashAttention-2), ``fa4``
(FlashAttention-4), and ``auto``: the fastest that runs here for this shape, timed once and cached.

Dispatch: the first call with a new *key* (backend, layout, causal, shapes, dtypes, devices,
whether autograd needs gradients, the autocast dtype) validates the input, resolves ``auto``
and builds a plan: the kernel call with its layout transposes. Every later call with that key
looks the plan up and runs it, so labkit adds about a dictionary look-up to the kernel launch.

Used in: 01_setup_and_comparison, 02_gpt2_integration, 03_long_sequence_training.
"""
from __future__ import annotations

import threading
from typing import Callable

import torch

from labkit.engine.check import (LAYOUTS, NAN_POLICIES, _as_bhnd, _cast_dtype, _check_choice, _check_finite, check_causal,
                                 check_count, check_scale, validate)
from labkit.engine.kernels import (BACKENDS, HALF, RUN_ERRORS, RUNNERS, AttentionInputError, causal_mask, native_layout,
                      package_problem, reference_attention, static_problem, why_not)
from labkit.core.measure import time_interleaved

MODES = ("fwd", "fwd_bwd")  # what flops() and the benchmarks time: forward, forward+backward
MAX_PLANS = 4096  # distinct keys kept (decoding with a growing KV cache makes a new key per token)

Plan = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "float | None"], torch.Tensor]
_PLANS: dict[tuple, Plan] = {}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              scale: float | None = None, backend: str = "auto", layout: str = "bhnd",
              nan_policy: str = "raise") -> torch.Tensor:
    """Scaled dot-product attention through a named backend.

    Args:
        q: [B, H, N, D] ("bhnd") or [B, N, H, D] ("bnhd").
        k, v: same layout, with Nk keys.
        causal: bottom-right aligned causal mask; a bool (numpy's too), else TypeError.
        scale: default 1/sqrt(D); else a finite number > 0 (ValueError for NaN, inf, 0 or less).
        backend: one of BACKENDS or "auto".
        layout: "bhnd" or "bnhd"; the output has the same layout as q, and q's dtype (under
            autocast, fp32 inputs run in the autocast dtype, as SDPA does).
        nan_policy: "raise" checks q, k, v for NaN/Inf on every call (one GPU sync);
            "ignore" skips the check (benchmarks, training loops).

    Returns:
        o: attention output in q's layout.
    """
    if torch.compiler.is_compiling():
        return _traced_attention(q, k, v, causal, scale, backend, layout, nan_policy)
    if causal is not True and causal is not False:  # 0, "False", np.bool_: the key would take 0 for False
        causal = check_causal(causal)
    try:
        key = _key(q, k, v, causal, backend, layout, nan_policy)
        plan = _PLANS[key]
    except (AttributeError, TypeError, KeyError):  # not tensors (validate says so), or a new key
        plan = _new_plan(q, k, v, causal=causal, backend=backend, layout=layout, nan_policy=nan_policy)
    if scale is not None:
        check_scale(scale)
    if nan_policy == "raise":
        _check_finite(q, k, v)
    return plan(q, k, v, scale)


def _key(q, k, v, causal, backend, layout, nan_policy) -> tuple:
    """Everything the plan depends on; raises AttributeError for inputs that are not tensors."""
    device = q.device
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    cast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    return (backend, layout, causal, nan_policy, grad, cast, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype,
            device, k.device, v.device)


def _new_plan(q, k, v, *, causal, backend, layout, nan_policy) -> Plan:
    """Validate, resolve "auto", build the plan and cache it under its key."""
    validate(q, k, v, causal=causal, backend=backend, layout=layout, nan_policy="ignore")
    _check_choice("nan_policy", nan_policy, NAN_POLICIES)
    cast, needs_grad, causal = _cast_dtype(q), grad_needed(q, k, v), bool(causal)
    name = auto_choice(q, k, v, causal=causal, layout=layout) if backend == "auto" else backend
    plan = _plan(name, layout, causal, needs_grad, cast)
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    _PLANS[_key(q, k, v, causal, backend, layout, nan_policy)] = plan
    return plan


def _plan(backend: str, layout: str, causal: bool, needs_grad: bool, cast: torch.dtype | None) -> Plan:
    """``plan(q, k, v, scale) -> o`` in ``layout``: ``backend``'s kernel, with transposes to and from
    its native layout and the autocast cast."""
    run = RUNNERS[backend]
    if native_layout(backend) == layout:
        def plan(q, k, v, scale):
            if cast is not None:
                q, k, v = q.to(cast), k.to(cast), v.to(cast)
            return run(q, k, v, causal, scale, needs_grad)
    else:
        def plan(q, k, v, scale):
            if cast is not None:
                q, k, v = q.to(cast), k.to(cast), v.to(cast)
            return run(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, scale, needs_grad).transpose(1, 2)
    return plan


def _traced_attention(q, k, v, causal, scale, backend, layout, nan_policy) -> torch.Tensor:
    """``attention`` while torch.compile traces it: no plan cache (the checks are traced once per
    graph); "auto" is resolved outside the graph, on real tensors."""
    validate(q, k, v, causal=causal, backend=backend, layout=layout, nan_policy=nan_policy, scale=scale)
    causal = bool(causal)
    name = _outside_graph()(q, k, v, causal, layout) if backend == "auto" else backend
    return _plan(name, layout, causal, grad_needed(q, k, v), _cast_dtype(q))(q, k, v, scale)


_OUTSIDE_GRAPH: list = []   # auto_choice under torch.compiler.disable, made at the first trace


def _outside_graph():
    """``auto_choice`` as torch.compile runs it: outside the graph (torch.compiler.disable). Made at the first trace,
    when torch._dynamo is loaded anyway: decorating at import loaded it in every process (~1.2 s of CPU each)."""
    if not _OUTSIDE_GRAPH:
        _OUTSIDE_GRAPH.append(torch.compiler.disable(_auto_on_tensors))
    return _OUTSIDE_GRAPH[0]


def _auto_on_tensors(q, k, v, causal: bool, layout: str) -> str:
    return auto_choice(q, k, v, causal=causal, layout=layout)


def grad_needed(q, k, v) -> bool:
    """Whether autograd needs gradients of a call on q, k, v (then "auto" times forward+backward)."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


# ----------------------------------------------------------------------------- auto

_AUTO_CACHE: dict[tuple, str] = {}
# What the tuning saw, per key: backend -> median ms, or the error that dropped it (read by labkit.engine.explain).
_AUTO_TIMINGS: dict[tuple, dict[str, float | str]] = {}
TUNE_MS = 30.0  # timing budget per candidate: with 10 ms, one H100 run picked a kernel 15% slower than the best


def auto_choice(q, k, v, *, causal: bool = False, layout: str = "bhnd") -> str:
    """The backend ``backend="auto"`` runs for tensors like these (in ``layout``).

    Candidates are the fused backends that pass the static checks (``sdpa_math`` only when none
    does; ``reference`` when nothing else can, e.g. causal N != Nk on a CPU); a single candidate
    is taken as it is. Several are timed (forward, or forward+backward when autograd needs
    gradients) on detached views of the inputs, taking turns in short blocks
    (:func:`labkit.core.measure.time_interleaved`) so a GPU clock that drifts favours no one, with L2
    flushed before each call (in a training step the inputs come cold from other layers) and each
    turn started on an idle GPU. What a call costs depends on the situation:
    - inference (no gradients): the longer of its GPU and its host time. A forward at short N is
      bound by the host (GPT-2 small's at N = 512-1024, batch 4: 8-12 ms on an H100, far above its
      kernels), so a kernel whose Python launch outlasts its kernels (FA4's forward at those shapes)
      costs the model its launch: timed by its events alone, FA4 won and made GPT-2 1.2-1.3x slower
      than SDPA on an H200.
    - training (forward+backward): its GPU time, as ``triton.testing.do_bench`` times it. A step
      queues the forward and backward of every layer, so the launches run while the GPU works and
      are hidden; counting FA4's host time of about 1 ms (forward+backward at N = 1024) picked cuDNN
      where FA4 ran 10% faster under do_bench (H100, B=16, H=32, D=64, causal, bhnd).
    The lowest median wins and is cached per (device, dtype, shapes, causal, layout, grad). A candidate
    that fails (e.g. a kernel that does not compile for this shape) drops out.

    The timing runs in a thread of its own, outside the caller's autograd state: inside
    activation checkpointing, autocast, ``no_grad`` or ``inference_mode`` the call that tunes
    saves, returns and records exactly what a call that finds the choice cached does.
    """
    key = _auto_key(q, k, v, causal, layout)
    if key not in _AUTO_CACHE:
        names = auto_candidates(q, k, causal=causal, layout=layout)
        if len(names) == 1:
            _AUTO_CACHE[key], _AUTO_TIMINGS[key] = names[0], {}
        else:
            _AUTO_CACHE[key], _AUTO_TIMINGS[key] = _fastest(names, q, k, v, causal, layout, grad_needed(q, k, v),
                                                            _cast_dtype(q))
    return _AUTO_CACHE[key]


def auto_timings(q, k, v, *, causal: bool = False, layout: str = "bhnd") -> dict[str, float | str]:
    """What tuning "auto" for tensors like these measured: {backend: median ms, or the first line of the
    error that dropped it}; empty when there was a single candidate (nothing timed). Tunes if needed."""
    auto_choice(q, k, v, causal=causal, layout=layout)
    return dict(_AUTO_TIMINGS[_auto_key(q, k, v, causal, layout)])


def kernel_dtype(q) -> torch.dtype:
    """The dtype the kernel sees for q: the autocast dtype for fp32 q under autocast, else q's."""
    return _cast_dtype(q) or q.dtype


def _auto_key(q, k, v, causal: bool, layout: str) -> tuple:
    """What "auto"'s choice depends on: device, the dtype the kernel sees, shapes, causal, layout and
    whether autograd needs gradients (forward, or forward+backward, is timed)."""
    return (q.device, kernel_dtype(q), q.shape, k.shape, causal, layout, grad_needed(q, k, v))


def auto_candidates(q, k, *, causal: bool = False, layout: str = "bhnd") -> list[str]:
    """The backends "auto" chooses from for q, k in ``layout``: the fused ones that pass the static
    checks, else sdpa_math, else the reference."""
    dtype, (q, k) = _cast_dtype(q) or q.dtype, _as_bhnd(q, k, layout=layout)
    runnable = [b for b in BACKENDS[1:]
                if static_problem(b, q, k, causal=causal, dtype=dtype) is None and package_problem(b) is None]
    return [b for b in runnable if b != "sdpa_math"] or runnable or ["reference"]


def _fastest(names: list[str], q, k, v, causal: bool, layout: str, needs_grad: bool,
             cast) -> tuple[str, dict[str, float | str]]:
    """Time ``names`` against each other in a fresh thread: (the fastest, or the first if none ran;
    {name: median ms, or the first line of the error that dropped it})."""
    outcome: dict[str, object] = {}

    def tune() -> None:
        try:
            if q.device.type == "cuda":
                torch.cuda.set_device(q.device)  # the current device is per thread
            steps = {name: _step(_plan(name, layout, causal, needs_grad, cast), q, k, v, needs_grad) for name in names}
            outcome["timings"], outcome["failures"] = time_interleaved(
                steps, device=q.device, warmup=2, target_ms=TUNE_MS, min_reps=5, max_reps=200, flush_l2=True,
                errors=RUN_ERRORS, host_time=not needs_grad)
        except BaseException as err:  # handed to the caller's thread
            outcome["error"] = err

    worker = threading.Thread(target=tune, name="labkit-auto")
    worker.start()
    worker.join()
    if "error" in outcome:
        raise outcome["error"]
    timings = outcome["timings"]
    seen = {name: timings[name].median_ms for name in timings}
    seen.update({name: (str(err).strip().splitlines() or [type(err).__name__])[0] for name, err in outcome["failures"].items()})
    return (min(timings, key=lambda name: timings[name].median_ms) if timings else names[0]), seen


def _step(plan: Plan, q, k, v, needs_grad: bool) -> Callable[[], None]:
    """One call of ``plan`` on detached views of q, k, v (with its backward if needed)."""
    q, k, v = (t.detach().requires_grad_(needs_grad) for t in (q, k, v))
    grad_out = None

    def step():
        nonlocal grad_out
        o = plan(q, k, v, None)
        if needs_grad:  # the gradients alone, as labkit.engine.bench times them
            grad_out = torch.ones_like(o) if grad_out is None else grad_out
            torch.autograd.grad(o, (q, k, v), grad_out)

    return step


# ----------------------------------------------------------------------------- work and error

def flops(batch: int, heads: int, n: int, head_dim: int, *, causal: bool = False,
          mode: str = "fwd", nk: int | None = None) -> float:
    """FLOPs of attention: 4*B*H*N*Nk*D forward (two matmuls), halved when causal,
    x3.5 for forward+backward ("fwd_bwd": the backward does 2.5x the forward's matmuls).

    Every size is an int >= 0 (ValueError below 0, TypeError for another type); ``causal`` a bool."""
    sizes = dict(batch=batch, heads=heads, n=n, head_dim=head_dim, nk=n if nk is None else nk)
    batch, heads, n, head_dim, nk = (check_count(name, value) for name, value in sizes.items())
    total = 4.0 * batch * heads * n * nk * head_dim
    if check_causal(causal):
        total /= 2
    if mode not in MODES:
        raise ValueError(f"mode must be 'fwd' or 'fwd_bwd', got {mode!r}")
    return total * (3.5 if mode == "fwd_bwd" else 1.0)


def max_error_vs_fp32(o: torch.Tensor, q, k, v, *, causal: bool = False, layout: str = "bhnd") -> float:
    """Max |o - fp32 reference| for inputs q, k, v (any dtype, same layout as o)."""
    qf, kf, vf = _as_bhnd(*(t.detach().float() for t in (q, k, v)), layout=layout)
    ref = reference_attention(qf, kf, vf, causal=causal)[0]
    ref, = _as_bhnd(ref, layout=layout)
    return float((o.detach().float() - ref).abs().max())


__all__ = ["BACKENDS", "HALF", "LAYOUTS", "MODES", "AttentionInputError", "attention", "auto_candidates", "auto_choice",
           "auto_timings", "causal_mask", "grad_needed", "kernel_dtype",
           "flops", "max_error_vs_fp32", "native_layout", "reference_attention", "validate", "why_not"]
