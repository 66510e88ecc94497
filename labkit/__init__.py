"""labkit: helpers for the course "Lab-1.5: FlashAttention Deep Dive".

Notebooks use ``import labkit as lk`` and reach each module as ``lk.env``, ``lk.attention``,
``lk.bench``, ``lk.profiles``, ``lk.grading`` and ``lk.plots``.
"""
from . import attention, bench, env, grading, plots, profiles

__version__ = "0.1.0"
__all__ = ["attention", "bench", "env", "grading", "plots", "profiles"]
