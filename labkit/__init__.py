"""labkit: helpers for the course "Lab-1.5: FlashAttention Deep Dive".

Notebooks use ``import labkit as lk`` and reach each module as ``lk.env``, ``lk.attention``,
``lk.bench``, ``lk.explain``, ``lk.doctor``, ``lk.profiles``, ``lk.grading``, ``lk.plots``, ``lk.precision`` and ``lk.amp``.
"""
from . import tritonmode

tritonmode.apply_default()  # before any import of triton (torch._dynamo imports it): see labkit.tritonmode
from . import amp, attention, bench, decode, doctor, env, explain, kernels, measure, gpt2, grading, hf_attention, hfcompat, levers, longctx, longdata, longmem, overhead, perfmodel, plots, precision, predictor, profiles, profiling, reference, rope, roofline, tritonbench, tritonbounds, tritoncompile  # noqa: E402
from .checks import nb01, nb02, nb03, nb04, nb05, nb06, nb07, nb08, nb09  # noqa: E402,F401 (lk.checks.nbNN)
from . import checks  # noqa: E402

__version__ = "0.1.0"
__all__ = ["amp", "attention", "checks", "bench", "decode", "doctor", "env", "explain", "kernels", "measure", "gpt2", "grading", "hf_attention", "hfcompat", "levers", "longctx", "longdata", "longmem", "overhead", "perfmodel", "plots", "precision", "predictor", "profiles", "profiling", "reference", "rope", "roofline", "tritonbench", "tritonbounds", "tritoncompile", "tritonmode"]
