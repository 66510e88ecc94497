"""The attention kernels labkit can call: how each is called, and what stops it running here.

Every runner takes q, k, v in its *native* layout (:func:`native_layout`) and returns o in it:
- ``reference``: materialized scores (:func:`reference_attention`), bhnd.
- ``sdpa_math``, ``sdpa_efficient``, ``sdpa_flash``, ``sdpa_cudnn``: the ATen kernels behind
  PyTorch's ``scaled_dot_product_attention``, called by name (the op SDPA itself dispatches to,
  with its autograd formula), bhnd. Calling the op skips the ``sdpa_kernel`` context manager,
  whose enter and exit cost more CPU time than launching the kernel.
- ``flash_attn``: the FlashAttention-2 package (``flash_attn.flash_attn_func``), bnhd.
- ``fa4``: FlashAttention-4 (``flash_attn.cute.flash_attn_func``, CuTe-DSL kernels), bnhd.

:func:`static_problem` says, without running anything, why a backend cannot take some input;
:func:`why_not` runs a small problem to find out. Imports only torch: the floor below
:mod:`labkit.engine.attention`, the entry point.

Used in: 01_setup_and_comparison (``lk.attention.why_not``, ``lk.attention.BACKENDS``).
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import math
import warnings
from typing import Callable

import torch

BACKENDS = ("reference", "sdpa_math", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn", "flash_attn", "fa4")
SDPA_BACKENDS = ("sdpa_math", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn")
HALF = (torch.float16, torch.bfloat16)
_ATEN = torch.ops.aten


class AttentionInputError(ValueError):
    """Input that an attention backend cannot take; the message says how to fix it."""


def native_layout(backend: str) -> str:
    """The layout a backend reads without a copy: 'bnhd' for the flash-attn packages."""
    return "bnhd" if backend in ("flash_attn", "fa4") else "bhnd"


# ----------------------------------------------------------------------------- runners
# runner(q, k, v, causal, scale, needs_grad) -> o, all in the backend's native layout.

def _sdpa_math(q, k, v, causal, scale, needs_grad):
    return _ATEN._scaled_dot_product_attention_math(q, k, v, None, 0.0, causal, scale=scale)[0]


def _sdpa_efficient(q, k, v, causal, scale, needs_grad):
    return _ATEN._scaled_dot_product_efficient_attention(q, k, v, None, needs_grad, 0.0, causal, scale=scale)[0]


def _sdpa_flash(q, k, v, causal, scale, needs_grad):
    if q.is_cuda:
        return _ATEN._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[0]
    return _ATEN._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[0]


def _sdpa_cudnn(q, k, v, causal, scale, needs_grad):
    return _ATEN._scaled_dot_product_cudnn_attention(q, k, v, None, needs_grad, 0.0, causal, False, scale=scale)[0]


def _flash_runner(backend: str) -> Callable:
    """A runner for a FlashAttention package; the import happens at the first call."""

    def run(q, k, v, causal, scale, needs_grad):
        out = flash_function(backend)(q, k, v, softmax_scale=scale, causal=causal)
        return first_output(out)

    return run


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                        scale: float | None = None, mask: torch.Tensor | None = None):
    """Standard attention with the N x Nk score matrix materialized: the correctness yardstick.

    The textbook formula, ``softmax(q k^T * scale) v``, with the matmuls in the input dtype and the
    softmax in fp32 (as most frameworks do; fp64 inputs stay fp64).

    Args:
        q: [..., N, D]; k, v: [..., Nk, D] (any leading dims, e.g. B, H).
        causal: mask keys after each query (bottom-right aligned, :func:`causal_mask`).
        scale: score scale, default 1/sqrt(D).
        mask: optional bool tensor broadcastable to [..., N, Nk]; True = may attend.

    Returns:
        (o, lse): o [..., N, D] in q's dtype; lse [..., N] fp32 (fp64 for fp64 inputs) log-sum-exp of the scaled
        scores per query (-inf for a row with no visible key, whose output is 0).
    """
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    factor = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)).to(wide) * factor  # [..., N, Nk]
    visible = [m for m in (causal_mask(q.shape[-2], k.shape[-2], q.device) if causal else None, mask) if m is not None]
    for m in visible:
        scores = scores.masked_fill(m.logical_not(), -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [..., N]
    blind = torch.isneginf(lse).unsqueeze(-1)  # rows that see no key: softmax would give 0/0
    weights = torch.softmax(scores, dim=-1).masked_fill(blind, 0.0)
    return torch.matmul(weights.to(v.dtype), v), lse


def causal_mask(n: int, nk: int, device=None) -> torch.Tensor:
    """Bool [n, nk] mask, True where query i may see key j (j <= i + nk - n)."""
    i = torch.arange(n, device=device).unsqueeze(1)
    j = torch.arange(nk, device=device).unsqueeze(0)
    return j <= i + (nk - n)


def _reference(q, k, v, causal, scale, needs_grad):
    return reference_attention(q, k, v, causal=causal, scale=scale)[0]


RUNNERS: dict[str, Callable] = {"reference": _reference, "sdpa_math": _sdpa_math, "sdpa_efficient": _sdpa_efficient,
                                "sdpa_flash": _sdpa_flash, "sdpa_cudnn": _sdpa_cudnn,
                                "flash_attn": _flash_runner("flash_attn"), "fa4": _flash_runner("fa4")}

_PACKAGES = {  # backend: (module, distribution, install hint)
    "flash_attn": ("flash_attn", "flash-attn", "pip install flash-attn --no-build-isolation (FlashAttention-2, "
                   "sm80+, compiles against your CUDA)"),
    "fa4": ("flash_attn.cute", "flash-attn-4", "pip install flash-attn-4 (FlashAttention-4, Hopper/Blackwell)"),
}


def first_output(out):
    """FA4 (and torch's varlen) may return (o, lse): the output alone."""
    return out[0] if isinstance(out, (tuple, list)) else out


@functools.cache
def flash_function(backend: str) -> Callable:
    """A FlashAttention package's ``flash_attn_func``.

    Raises:
        ImportError: saying either that the package is not installed (with the install command),
            or that it is installed but its import fails (with the original error's first line).
    """
    module, dist, hint = _PACKAGES[backend]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the package's own imports, not ours
            fn = importlib.import_module(module).flash_attn_func
    except Exception as err:  # an installed package's import can fail with anything (CUDA libs, DSL)
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            raise ImportError(f"backend {backend!r} needs {dist}, which is not installed: {hint}") from err
        first = (str(err).splitlines() or [""])[0][:200]
        raise ImportError(f"backend {backend!r}: {dist} {version} is installed but `import {module}` fails: "
                          f"{type(err).__name__}: {first}") from err
    if backend == "fa4":  # the CuTe DSL warns about FA4's own auxiliary argument on every new shape
        warnings.filterwarnings("ignore", message=r"Argument aux_data .* cannot be converted", category=UserWarning)
    return fn


# ----------------------------------------------------------------------------- what stops a backend

def package_problem(backend: str) -> str | None:
    """Why ``backend``'s package cannot be imported here (None: it imports, or needs no package)."""
    if backend not in _PACKAGES:
        return None
    try:
        flash_function(backend)
    except ImportError as err:
        return str(err)
    return None


def static_problem(backend: str, q, k, *, causal: bool, dtype: torch.dtype | None = None) -> str | None:
    """What stops ``backend`` from taking bhnd q [B, H, N, D], k [B, H, Nk, D], knowable without
    running it (None = nothing). ``dtype``: the dtype the kernel will see (default q's)."""
    n, nk, d = q.shape[2], k.shape[2], q.shape[3]
    dtype = dtype or q.dtype
    on_cuda = q.device.type == "cuda"
    sm = _sm(q.device) if on_cuda else 0
    if backend in SDPA_BACKENDS and causal and n != nk:
        return (f"causal with N={n} != Nk={nk}: SDPA aligns the causal mask top-left, labkit bottom-right "
                "(as in a KV cache). Use backend='reference', 'flash_attn' or 'fa4', or pass equal lengths.")
    if backend in ("sdpa_efficient", "sdpa_cudnn", "flash_attn", "fa4") and not on_cuda:
        return f"needs a CUDA GPU (tensors are on {q.device}); on CPU use 'sdpa_math', 'sdpa_flash' or 'reference'."
    half_only = backend in ("flash_attn", "fa4", "sdpa_cudnn") or (backend == "sdpa_flash" and on_cuda)
    if half_only and dtype not in HALF:
        return (f"takes only float16/bfloat16, got {dtype}. Cast with .to(torch.bfloat16) or run under "
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


RUN_ERRORS = (RuntimeError, NotImplementedError, TypeError, ValueError, AssertionError, ImportError)


def why_not(backend: str, *, device, dtype: torch.dtype, head_dim: int = 64, causal: bool = True,
            backward: bool = True) -> str | None:
    """None if ``backend`` runs a small [1, 2, 128, head_dim] problem here, else the reason."""
    dev = torch.device(device)
    q, k, v = (torch.randn(1, 2, 128, head_dim, device=dev, dtype=dtype, requires_grad=backward)
               for _ in range(3))
    problem = None if backend == "reference" else static_problem(backend, q, k, causal=causal)
    if problem:
        return problem
    if native_layout(backend) == "bnhd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    try:
        o = RUNNERS[backend](q, k, v, causal, None, backward)
        if backward:
            o.float().sum().backward()
    except ImportError as err:
        return str(err)
    except RUN_ERRORS as err:
        stage = "backward" if backward and "o" in locals() else "forward"
        return f"{stage} failed: {str(err).splitlines()[0][:140]}"
    return None
