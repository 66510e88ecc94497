"""Problem sizes by where a notebook runs.

Two profiles exist:
- ``"cpu"``: CI, laptops and nbgrader grading; every cell finishes in seconds.
- ``"gpu"``: the real experiment on a CUDA GPU.

The choice comes from, in order: the ``LABKIT_PROFILE`` environment variable, nbgrader's
``NBGRADER_EXECUTION`` (grading always uses ``"cpu"`` sizes), and the device (``"gpu"`` when CUDA
is available). Each notebook states its own sizes for both profiles in its first code cell:

    P = lk.profiles.choose(cpu=dict(seq_lens=[128, 256]), gpu=dict(seq_lens=[1024, 4096]),
                           smaller_gpu={24: dict(seq_lens=[1024, 2048])})
    P.seq_lens, P.name, P.memory_gb

The ``gpu`` sizes are for a large GPU (80-140 GB); ``smaller_gpu`` maps a memory size in GB to the keys that
change on a GPU with at most that much (the smallest matching entry wins, its keys over the larger ones').
GB here is what a card's label says: 2**30 bytes (an "8 GB" card reports about 7.8 GiB, a 16 GB T4 14.7 GiB, a
24 GB RTX 4090 23.6 GiB), so an entry ``{8: ...}`` applies to every 8 GB card. ``LABKIT_GPU_MEMORY_GB`` caps
what this process may allocate on the GPU (``torch.cuda.set_per_process_memory_fraction``): a large GPU then
behaves as a small one, for sizes and for out-of-memory alike (``make execute GPU_MEMORY_GB=8`` runs the course
as on an 8 GB card). :func:`free_bytes` is what the process may still allocate, the cap counted: code that
sizes a buffer from free memory reads it instead of ``torch.cuda.mem_get_info``, which knows no cap.

Used in: every notebook.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import torch

PROFILES = ("cpu", "gpu")


def current() -> str:
    """Return the active profile name, ``"cpu"`` or ``"gpu"``."""
    forced = os.environ.get("LABKIT_PROFILE", "").strip().lower()
    if forced:
        if forced not in PROFILES:
            raise ValueError(f"LABKIT_PROFILE={forced!r} is not a profile; use one of {PROFILES}.")
        return forced
    if os.environ.get("NBGRADER_EXECUTION"):
        return "cpu"
    return "gpu" if torch.cuda.is_available() else "cpu"


def _cap_gib() -> float | None:
    """``LABKIT_GPU_MEMORY_GB`` as a number of GiB (None when unset); refuses a value that is not positive."""
    raw = os.environ.get("LABKIT_GPU_MEMORY_GB", "").strip()
    if not raw:
        return None
    try:
        cap = float(raw)
    except ValueError:
        cap = -1.0
    if not cap > 0:
        raise ValueError(f"LABKIT_GPU_MEMORY_GB={raw!r} must be a positive number of GB, e.g. 8 or 16")
    return cap


def apply_cap(device=None) -> float | None:
    """GiB of GPU memory this process may use on ``device`` (default: GPU 0): the card's, or
    ``LABKIT_GPU_MEMORY_GB`` where smaller, which is then applied as the process's cap on that device (it
    stays for the process). None without CUDA. A process of its own (``cp-train``'s ranks) calls it too."""
    if not torch.cuda.is_available():
        return None
    index = device if isinstance(device, int) else 0 if device is None else torch.device(device).index or 0
    total = torch.cuda.get_device_properties(index).total_memory / 2**30
    cap = _cap_gib()
    if cap is None:
        return total
    if cap < total:
        torch.cuda.set_per_process_memory_fraction(cap / total, index)
    return min(cap, total)


def gpu_memory_gb() -> float | None:
    """GiB of GPU memory this process may use on GPU 0, the cap applied (:func:`apply_cap`)."""
    return apply_cap(0)


def free_bytes(device=None) -> int:
    """Bytes this process may still allocate on a CUDA ``device``: the GPU's free memory, and under
    ``LABKIT_GPU_MEMORY_GB`` at most the cap less what PyTorch holds already (reserved)."""
    device = torch.device("cuda", 0) if device is None else torch.device(device)
    free = torch.cuda.mem_get_info(device)[0]
    cap = _cap_gib()
    if cap is not None:
        free = min(free, max(0, int(cap * 2**30) - torch.cuda.memory_reserved(device)))
    return free


def choose(*, cpu: dict, gpu: dict, smaller_gpu: dict[float, dict] | None = None) -> SimpleNamespace:
    """Pick a size dictionary by the active profile and, on a GPU, by its memory.

    Args:
        cpu: sizes for the small profile.
        gpu: sizes for the GPU profile on a large GPU; must have the same keys as ``cpu``.
        smaller_gpu: {GB: the keys that change on a GPU with at most that much memory}; every entry whose GB
            is at least this GPU's (or the ``LABKIT_GPU_MEMORY_GB`` cap's) applies, the smallest last.

    Returns:
        A namespace with the chosen sizes as attributes, plus ``name``, ``device`` and ``memory_gb`` (the GPU
        memory the sizes were chosen for; None in the cpu profile).
    """
    if set(cpu) != set(gpu):
        raise ValueError(f"cpu and gpu profiles must have the same keys; differ in {set(cpu) ^ set(gpu)}")
    unknown = {k for sizes in (smaller_gpu or {}).values() for k in sizes} - set(gpu)
    if unknown:
        raise ValueError(f"smaller_gpu sets keys the gpu profile does not have: {sorted(unknown)}")
    name = current()
    device = "cuda" if name == "gpu" and torch.cuda.is_available() else "cpu"
    sizes, memory = dict(cpu), None
    if name == "gpu":
        sizes, memory = dict(gpu), gpu_memory_gb()
        for gb in sorted(smaller_gpu or {}, reverse=True):
            if memory is not None and memory <= gb:
                sizes.update(smaller_gpu[gb])
    return SimpleNamespace(name=name, device=device, memory_gb=memory, **sizes)
