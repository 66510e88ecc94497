"""Problem sizes by where a notebook runs.

Two profiles exist:
- ``"cpu"``: CI, laptops and nbgrader grading; every cell finishes in seconds.
- ``"gpu"``: the real experiment on a CUDA GPU.

The choice comes from, in order: the ``LABKIT_PROFILE`` environment variable, nbgrader's
``NBGRADER_EXECUTION`` (grading always uses ``"cpu"`` sizes), and the device (``"gpu"`` when CUDA
is available). Each notebook states its own sizes for both profiles in its first code cell:

    P = lk.profiles.choose(cpu=dict(seq_lens=[128, 256]), gpu=dict(seq_lens=[1024, 4096]))
    P.seq_lens, P.name

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


def choose(*, cpu: dict, gpu: dict) -> SimpleNamespace:
    """Pick one of two size dictionaries by the active profile.

    Args:
        cpu: sizes for the small profile.
        gpu: sizes for the GPU profile; must have the same keys as ``cpu``.

    Returns:
        A namespace with the chosen sizes as attributes, plus ``name`` and ``device``.
    """
    if set(cpu) != set(gpu):
        raise ValueError(f"cpu and gpu profiles must have the same keys; differ in {set(cpu) ^ set(gpu)}")
    name = current()
    device = "cuda" if name == "gpu" and torch.cuda.is_available() else "cpu"
    return SimpleNamespace(name=name, device=device, **(gpu if name == "gpu" else cpu))
