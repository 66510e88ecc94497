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
``LABKIT_GPU_MEMORY_GB`` caps what this process may allocate on the GPU
(``torch.cuda.set_per_process_memory_fraction``): a large GPU then behaves as a small one, for sizes and for
out-of-memory alike (``make execute GPU_MEMORY_GB=8`` runs the course as on an 8 GB card).

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


def gpu_memory_gb() -> float | None:
    """GB of GPU memory this process may use: the card's, or ``LABKIT_GPU_MEMORY_GB`` where smaller, which
    is then applied as the process's cap (once; it stays for the process). None without CUDA."""
    if not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(0).total_memory / 1e9
    raw = os.environ.get("LABKIT_GPU_MEMORY_GB", "").strip()
    if not raw:
        return total
    try:
        cap = float(raw)
    except ValueError:
        cap = -1.0
    if not cap > 0:
        raise ValueError(f"LABKIT_GPU_MEMORY_GB={raw!r} must be a positive number of GB, e.g. 8 or 16")
    if cap < total:
        torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    return min(cap, total)


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
