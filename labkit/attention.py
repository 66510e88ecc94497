"""Attention: a readable reference and one entry point over every fast kernel.

Shapes use one vocabulary: B batch, H heads, N query length, Nk key length, D head dim.
Two layouts are named, never implied: ``"bhnd"`` ([B, H, N, D], SDPA's) and ``"bnhd"``
([B, N, H, D], flash-attn's). Causal masking is aligned bottom-right, as in flash-attn and in
decoding with a KV cache: query i may see keys j <= i + (Nk - N).

Backends:
- ``reference``: materialized scores, fp32 softmax (:func:`reference_attention`).
- ``sdpa_math``, ``sdpa_efficient``, ``sdpa_flash``, ``sdpa_cudnn``: PyTorch's
  ``scaled_dot_product_attention`` pinned to one kernel.
- ``flash_attn``: the FlashAttention-2 package (``flash_attn.flash_attn_func``).
- ``fa4``: FlashAttention-4 (``flash_attn.cute.flash_attn_func``), CuTe-DSL kernels.
- ``auto``: the fastest backend that runs here for this shape, timed once and cached.

Used in: 01_setup_and_comparison, 02_gpt2_integration, 03_long_sequence_training.
"""
from __future__ import annotations

import difflib
import functools
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = ("reference", "sdpa_math", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn", "flash_attn", "fa4")
LAYOUTS = ("bhnd", "bnhd")
NAN_POLICIES = ("raise", "ignore")
_SDPA = {"sdpa_math": SDPBackend.MATH, "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
         "sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
_HALF = (torch.float16, torch.bfloat16)


class AttentionInputError(ValueError):
    """Input that an attention backend cannot take; the message says how to fix it."""


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                        scale: float | None = None, mask: torch.Tensor | None = None):
    """Standard attention with the N x Nk score matrix materialized.

    Matmuls run in the input dtype, the softmax in fp32 (as most frameworks do; fp64 inputs stay fp64).

    Args:
        q: [..., N, D]; k, v: [..., Nk, D] (any leading dims, e.g. B, H).
        causal: mask keys after each query (bottom-right aligned).
        scale: score scale, default 1/sqrt(D).
        mask: optional bool tensor broadcastable to [..., N, Nk]; True = may attend.

    Returns:
        (o, lse): o [..., N, D] in q's dtype; lse [..., N] fp32 (fp64 for fp64 inputs) log-sum-exp of the scaled
        scores per query (-inf for a row with no visible key, whose output is 0).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    scores = (q @ k.transpose(-2, -1)).to(acc) * scale  # [..., N, Nk]
    keep = causal_mask(q.shape[-2], k.shape[-2], q.device) if causal else None
    if mask is not None:
        keep = mask if keep is None else keep & mask
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [..., N]
    safe_lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(scores - safe_lse.unsqueeze(-1))  # [..., N, Nk], rows sum to 1 (or are all 0)
    return p.to(v.dtype) @ v, lse


def causal_mask(n: int, nk: int, device=None) -> torch.Tensor:
    """Bool [n, nk] mask, True where query i may see key j (j <= i + nk - n)."""
    i = torch.arange(n, device=device).unsqueeze(1)
    j = torch.arange(nk, device=device).unsqueeze(0)
    return j <= i + (nk - n)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              scale: float | None = None, backend: str = "auto", layout: str = "bhnd",
              nan_policy: str = "raise") -> torch.Tensor:
    """Scaled dot-product attention through a named backend.

    Args:
        q: [B, H, N, D] ("bhnd") or [B, N, H, D] ("bnhd").
        k, v: same layout, with Nk keys.
        causal: bottom-right aligned causal mask.
        scale: default 1/sqrt(D).
        backend: one of BACKENDS or "auto".
        layout: "bhnd" or "bnhd"; the output has the same layout and dtype as q.
        nan_policy: "raise" checks q, k, v for NaN/Inf first (one GPU sync);
            "ignore" skips the check (benchmarks, training loops).

    Returns:
        o: attention output in q's layout and dtype.
    """
    validate(q, k, v, causal=causal, backend=backend, layout=layout, nan_policy=nan_policy)
    if layout == "bnhd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if backend == "auto":
        backend = auto_choice(q, k, v, causal=causal)
    o = _run(backend, q, k, v, causal, scale)
    return o.transpose(1, 2) if layout == "bnhd" else o


def _run(backend: str, q, k, v, causal: bool, scale: float | None) -> torch.Tensor:
    """Call one backend on bhnd tensors; returns a bhnd output."""
    if backend == "reference":
        return reference_attention(q, k, v, causal=causal, scale=scale)[0]
    if backend in _SDPA:
        with sdpa_kernel(_SDPA[backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    fn = _flash_function(backend)
    out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, causal=causal)
    out = out[0] if isinstance(out, tuple) else out  # FA4 returns (out, lse)
    return out.transpose(1, 2)


@functools.cache
def _flash_function(backend: str) -> Callable:
    """Import a FlashAttention package's ``flash_attn_func``; ImportError says how to install."""
    try:
        if backend == "flash_attn":
            from flash_attn import flash_attn_func
        else:
            from flash_attn.cute import flash_attn_func

            # The CuTe DSL warns about FA4's own auxiliary argument on every new shape.
            warnings.filterwarnings("ignore", message=r"Argument aux_data .* cannot be converted",
                                    category=UserWarning)
    except ImportError as err:
        hint = ("pip install flash-attn --no-build-isolation (FlashAttention-2, sm80+, compiles "
                "against your CUDA)" if backend == "flash_attn" else
                "pip install flash-attn-4 (FlashAttention-4, Hopper/Blackwell)")
        raise ImportError(f"backend {backend!r} needs a package that is not installed: {hint}") from err
    return flash_attn_func


# ----------------------------------------------------------------------------- input checks

def validate(q, k, v, *, causal: bool = False, backend: str = "auto", layout: str = "bhnd",
             nan_policy: str = "raise") -> None:
    """Raise AttentionInputError, naming the fix, if ``attention`` cannot take these inputs."""
    _check_choice("backend", backend, BACKENDS + ("auto",))
    _check_choice("layout", layout, LAYOUTS)
    _check_choice("nan_policy", nan_policy, NAN_POLICIES)
    for name, t in zip("qkv", (q, k, v)):
        if not isinstance(t, torch.Tensor):
            raise AttentionInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dim() != 4:
            raise AttentionInputError(
                f"{name} has {t.dim()} dims {tuple(t.shape)}; attention expects 4-D {_shape_name(layout)}. "
                "Add missing batch/head dims with .unsqueeze(0), or reshape [B, N, H*D] with "
                ".view(B, N, H, D).")
        if not t.is_floating_point():
            raise AttentionInputError(f"{name} has dtype {t.dtype}; attention needs floating point. "
                                      "Convert with .to(torch.bfloat16) (GPU) or .float().")
        if t.numel() == 0:
            raise AttentionInputError(f"{name} is empty {tuple(t.shape)}: every dimension must be >= 1.")
    if len({q.dtype, k.dtype, v.dtype}) > 1:
        raise AttentionInputError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); "
                                  "cast them to one with k.to(q.dtype), v.to(q.dtype).")
    if len({q.device, k.device, v.device}) > 1:
        raise AttentionInputError(f"q, k, v are on different devices ({q.device}, {k.device}, {v.device}); "
                                  "move them with .to(q.device).")
    _check_shapes(q, k, v, layout)
    if nan_policy == "raise" and not all(bool(torch.isfinite(t).all()) for t in (q, k, v)):
        raise AttentionInputError("q, k or v contains NaN or Inf. Find where it first appears (e.g. "
                                  "lk.precision's NaN monitor), or pass nan_policy='ignore' to skip this check.")
    if backend not in ("auto", "reference"):
        as_bhnd = [t.transpose(1, 2) for t in (q, k)] if layout == "bnhd" else [q, k]
        problem = _static_problem(backend, *as_bhnd, causal=causal)
        if problem:
            raise AttentionInputError(f"backend {backend!r}: {problem}")


def _check_choice(what: str, value, allowed) -> None:
    if value not in allowed:
        close = difflib.get_close_matches(str(value), allowed, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise AttentionInputError(f"unknown {what} {value!r}; choose one of {', '.join(allowed)}.{hint}")


def _shape_name(layout: str) -> str:
    return "[B, H, N, D]" if layout == "bhnd" else "[B, N, H, D]"


def _check_shapes(q, k, v, layout: str) -> None:
    """Batch, heads and head dim must agree; catch a tensor passed in the other layout."""
    h_axis, n_axis = (1, 2) if layout == "bhnd" else (2, 1)
    other = "bnhd" if layout == "bhnd" else "bhnd"
    if q.shape[h_axis] > 256 and q.shape[n_axis] <= 256 and q.shape[h_axis] > q.shape[n_axis]:
        raise AttentionInputError(
            f"q {tuple(q.shape)} read as {_shape_name(layout)} has {q.shape[h_axis]} heads and sequence "
            f"length {q.shape[n_axis]}: it looks like {_shape_name(other)}. Pass layout={other!r} "
            "or .transpose(1, 2) the tensors.")
    if k.shape != v.shape:
        raise AttentionInputError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape.")
    for axis, what in ((0, "batch size"), (h_axis, "number of heads"), (3, "head dim")):
        if q.shape[axis] != k.shape[axis]:
            raise AttentionInputError(
                f"q and k differ in {what} ({q.shape[axis]} vs {k.shape[axis]}) for layout {layout!r} "
                f"{_shape_name(layout)}. Check the layout and the .view/.transpose that built them; for "
                "grouped-query attention repeat k, v heads with .repeat_interleave(H // Hkv, dim=1).")


def _static_problem(backend: str, q, k, *, causal: bool) -> str | None:
    """What stops ``backend`` from taking bhnd q, k, knowable without running it (None = nothing)."""
    n, nk, d = q.shape[2], k.shape[2], q.shape[3]
    on_cuda = q.device.type == "cuda"
    sm = _sm(q.device) if on_cuda else 0
    if backend in _SDPA and causal and n != nk:
        return (f"causal with N={n} != Nk={nk}: SDPA aligns the causal mask top-left, labkit bottom-right "
                "(as in a KV cache). Use backend='reference', 'flash_attn' or 'fa4', or pass equal lengths.")
    if backend in ("sdpa_efficient", "sdpa_cudnn", "flash_attn", "fa4") and not on_cuda:
        return f"needs a CUDA GPU (tensors are on {q.device}); on CPU use 'sdpa_math', 'sdpa_flash' or 'reference'."
    half_only = backend in ("flash_attn", "fa4", "sdpa_cudnn") or (backend == "sdpa_flash" and on_cuda)
    if half_only and q.dtype not in _HALF:
        return (f"takes only float16/bfloat16, got {q.dtype}. Cast with .to(torch.bfloat16) or run under "
                "torch.autocast('cuda', dtype=torch.bfloat16); for fp32 use 'sdpa_math' or 'sdpa_efficient'.")
    if backend in ("flash_attn", "fa4", "sdpa_flash") and on_cuda and sm < 80:
        return f"needs an Ampere or newer GPU (sm80+); this GPU is sm{sm}. Use 'sdpa_efficient' or 'sdpa_math'."
    if backend in ("flash_attn", "sdpa_flash", "sdpa_efficient") and (d > 256 or d % 8):
        return f"head dim {d} unsupported: needs a multiple of 8 up to 256. Pad D or use 'sdpa_math'."
    if backend in ("fa4", "sdpa_cudnn") and (d > 256 or d % 8):
        return f"head dim {d} unsupported: needs a multiple of 8 up to 256 (128 on some GPUs). Use 'sdpa_math'."
    return None


@functools.cache
def _sm(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def why_not(backend: str, *, device, dtype: torch.dtype, head_dim: int = 64, causal: bool = True,
            backward: bool = True) -> str | None:
    """None if ``backend`` runs a small [1, 2, 128, head_dim] problem here, else the reason."""
    dev = torch.device(device)
    q, k, v = (torch.randn(1, 2, 128, head_dim, device=dev, dtype=dtype, requires_grad=backward)
               for _ in range(3))
    problem = None if backend == "reference" else _static_problem(backend, q, k, causal=causal)
    if problem:
        return problem
    try:
        o = _run(backend, q, k, v, causal, None)
        if backward:
            o.float().sum().backward()
    except ImportError as err:
        return str(err)
    except (RuntimeError, NotImplementedError, TypeError, ValueError, AssertionError) as err:
        stage = "backward" if backward and "o" in locals() else "forward"
        return f"{stage} failed: {str(err).splitlines()[0][:140]}"
    return None


# ----------------------------------------------------------------------------- auto

_AUTO_CACHE: dict[tuple, str] = {}


def auto_choice(q, k, v, *, causal: bool = False) -> str:
    """The backend ``backend="auto"`` uses for bhnd tensors like these (timed once per shape).

    Candidates are the fused backends that pass the static checks (``sdpa_math`` only when
    none does; ``reference`` when nothing else can, e.g. causal N != Nk on a CPU). They are timed
    on copies of the inputs (forward, or forward+backward when autograd will need it), taking
    turns in short blocks (:func:`labkit.bench.time_interleaved`), so a GPU clock that drifts during
    tuning favours no one; the lowest median wins and is cached per (device, dtype, shape,
    causal, grad). A candidate that fails on its first call (e.g. a kernel that does not compile
    for this shape) drops out.
    """
    from .bench import time_interleaved  # bench imports this module

    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    key = (str(q.device), q.dtype, tuple(q.shape), tuple(k.shape), causal, needs_grad)
    if key not in _AUTO_CACHE:
        runnable = [b for b in BACKENDS[1:] if _static_problem(b, q, k, causal=causal) is None]
        names = [b for b in runnable if b != "sdpa_math"] or runnable
        with torch.set_grad_enabled(needs_grad):
            timings, _ = time_interleaved({name: _step(name, q, k, v, causal, needs_grad) for name in names},
                                          device=q.device, warmup=1, target_ms=10.0, min_reps=3, max_reps=30,
                                          errors=_CANDIDATE_ERRORS)
        _AUTO_CACHE[key] = min(timings, key=lambda name: timings[name].median_ms) if timings else "reference"
    return _AUTO_CACHE[key]


_CANDIDATE_ERRORS = (RuntimeError, NotImplementedError, TypeError, ValueError, AssertionError, ImportError)


def _step(name: str, q, k, v, causal: bool, needs_grad: bool) -> Callable[[], None]:
    """One call of backend ``name`` on detached copies of q, k, v (with its backward if needed)."""
    q, k, v = (t.detach().requires_grad_(needs_grad) for t in (q, k, v))
    grad_out = torch.ones(*q.shape[:-1], v.shape[-1], device=q.device, dtype=q.dtype) if needs_grad else None

    def step():
        o = _run(name, q, k, v, causal, None)
        if needs_grad:  # the gradients alone, as labkit.bench times them
            torch.autograd.grad(o, (q, k, v), grad_out)

    return step


MODES = ("fwd", "fwd_bwd")  # what flops() and the benchmarks time: forward, forward+backward


def flops(batch: int, heads: int, n: int, head_dim: int, *, causal: bool = False,
          mode: str = "fwd", nk: int | None = None) -> float:
    """FLOPs of attention: 4*B*H*N*Nk*D forward (two matmuls), halved when causal,
    x3.5 for forward+backward ("fwd_bwd": the backward does 2.5x the forward's matmuls)."""
    nk = n if nk is None else nk
    total = 4.0 * batch * heads * n * nk * head_dim
    if causal:
        total /= 2
    if mode not in MODES:
        raise ValueError(f"mode must be 'fwd' or 'fwd_bwd', got {mode!r}")
    return total * (3.5 if mode == "fwd_bwd" else 1.0)


def native_layout(backend: str) -> str:
    """The layout a backend reads without a copy: 'bnhd' for the flash-attn packages."""
    return "bnhd" if backend in ("flash_attn", "fa4") else "bhnd"


def max_error_vs_fp32(o: torch.Tensor, q, k, v, *, causal: bool = False, layout: str = "bhnd") -> float:
    """Max |o - fp32 reference| for inputs q, k, v (any dtype, same layout as o)."""
    qf, kf, vf = (t.detach().float() for t in (q, k, v))
    if layout == "bnhd":
        qf, kf, vf = (t.transpose(1, 2) for t in (qf, kf, vf))
    ref = reference_attention(qf, kf, vf, causal=causal)[0]
    if layout == "bnhd":
        ref = ref.transpose(1, 2)
    return float((o.detach().float() - ref).abs().max())


__all__ = ["BACKENDS", "LAYOUTS", "AttentionInputError", "attention", "auto_choice", "causal_mask",
           "flops", "max_error_vs_fp32", "native_layout", "reference_attention", "validate",
           "why_not"]
