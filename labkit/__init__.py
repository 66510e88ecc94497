"""labkit: helpers for the course "Lab-1.5: FlashAttention Deep Dive".

Notebooks use ``import labkit as lk`` and reach each module as ``lk.env``, ``lk.attention``,
``lk.bench``, ``lk.profiles``, ``lk.grading``, ``lk.plots``, ``lk.precision`` and ``lk.amp``.
"""
from . import amp, attention, bench, env, gpt2, grading, longctx, perfmodel, plots, precision, predictor, profiles, profiling, roofline

__version__ = "0.1.0"
__all__ = ["amp", "attention", "bench", "env", "gpt2", "grading", "longctx", "perfmodel", "plots", "precision", "predictor", "profiles", "profiling", "roofline"]
