"""labkit: helpers for the course "Lab-1.5: FlashAttention Deep Dive".

Notebooks use ``import labkit as lk`` and reach every module they need as ``lk.<name>``. Each line below binds
those names for one part of the package (``from labkit.cp import memory as cpmem``: lk.cpmem lives in
labkit/cp/memory.py), to the module itself, so a test that patches ``lk.cpmem.x`` patches the code.
The board (labkit/board/, instructors only) is never imported here: the student bundle leaves it out.
"""
from labkit.tritonlab import mode as tritonmode

tritonmode.apply_default()  # before any import of triton (torch._dynamo imports it): see tritonmode
from labkit.core import env, grading, measure, plots, profiles  # noqa: E402

env.import_torch_modules_quietly()  # before a notebook's first torch.compile: see env.QUIET_IMPORTS
from labkit.engine import attention, bench, doctor, explain, kernels, overhead  # noqa: E402
from labkit.models import gpt2, hf_attention, hfcompat, rope  # noqa: E402
from labkit.long import ctx as longctx, data as longdata, levers, memory as longmem  # noqa: E402
from labkit.perf import memory as perfmodel, predictor, profiling, roofline  # noqa: E402
from labkit.numerics import amp, precision  # noqa: E402
from labkit.tritonlab import bench as tritonbench, bounds as tritonbounds, compile as tritoncompile  # noqa: E402
from labkit.cp import cpu as cpcpu, memory as cpmem, ring as ringproc, run as cprun, train as cptrain  # noqa: E402
from labkit.decoding import decode  # noqa: E402
from labkit.flex import bench as flexbench, lib as flexlib, packtrain  # noqa: E402
from labkit.fp8 import bench as fp8bench, benchview as fp8view, cast as fp8cast, ceilings as fp8ceilings  # noqa: E402
from labkit.fp8 import formats as fp8formats, inputs as fp8inputs, study as fp8study  # noqa: E402
from labkit.tritonlab import order as tritonorder  # noqa: E402
from labkit.determinism import backward as detbackward, decode as detdecode, invariance as detinvariance  # noqa: E402
from labkit.determinism import bench as detbench, reduce as detreduce, switches as detswitches  # noqa: E402
from labkit.course import reference  # noqa: E402
from labkit import checks  # noqa: E402 (lk.checks.nbNN: the visible tests of notebook NN)

__version__ = "0.1.0"
__all__ = ["amp", "attention", "bench", "checks", "cpcpu", "cpmem", "cprun", "cptrain", "decode", "detbackward", "detbench", "detdecode", "detinvariance", "detreduce", "detswitches", "doctor", "env", "explain",
           "flexbench", "flexlib", "fp8bench", "fp8cast", "fp8ceilings", "fp8formats", "fp8inputs", "fp8study", "fp8view", "gpt2", "grading", "hf_attention", "hfcompat", "kernels", "levers", "longctx",
           "longdata", "longmem", "measure", "overhead", "packtrain", "perfmodel", "plots", "precision", "predictor",
           "profiles", "profiling", "reference", "ringproc", "rope", "roofline", "tritonbench", "tritonbounds",
           "tritoncompile", "tritonmode", "tritonorder"]
