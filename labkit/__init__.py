"""labkit: helpers for the course "Lab-1.5: FlashAttention Deep Dive".

Notebooks use ``import labkit as lk`` and reach each module as ``lk.env``, ``lk.attention``,
``lk.bench``, ``lk.explain``, ``lk.doctor``, ``lk.profiles``, ``lk.grading``, ``lk.plots``, ``lk.precision`` and ``lk.amp``.
"""
from . import tritonmode

tritonmode.apply_default()  # before any import of triton (torch._dynamo imports it): see labkit.tritonmode
from . import amp, attention, bench, decode, doctor, env, explain, kernels, measure, gpt2, grading, hf_attention, hfcompat, levers, longctx, longdata, longmem, overhead, perfmodel, plots, precision, predictor, profiles, profiling, reference, rope, roofline, tritonbench, tritonbounds, tritoncompile  # noqa: E402
from .checks import nb01, nb01_backward, nb01_forward, nb01_function, nb01_softmax, nb01_standard, nb02, nb02_model, nb03, nb03_positions, nb04, nb05, nb05_layernorm, nb05_policy, nb06, nb06_backward, nb06_forward, nb06_window, nb07, nb08, nb08_combine, nb08_decode, nb08_kernels, nb08_paged, nb08_split, nb09, nb09_backward, nb09_forward  # noqa: E402,F401 (lk.checks.nbNN)
from . import checks  # noqa: E402

__version__ = "0.1.0"
__all__ = ["amp", "attention", "checks", "bench", "decode", "doctor", "env", "explain", "kernels", "measure", "gpt2", "grading", "hf_attention", "hfcompat", "levers", "longctx", "longdata", "longmem", "overhead", "perfmodel", "plots", "precision", "predictor", "profiles", "profiling", "reference", "rope", "roofline", "tritonbench", "tritonbounds", "tritoncompile", "tritonmode"]
