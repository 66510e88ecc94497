"""One submission's run for the board, in its own process: ``python -m labkit.board.worker JOB.json``.

:mod:`labkit.board.rank` starts this worker once per student, in a fresh temporary folder (its cwd, HOME and
TMPDIR), in a process group of its own that it kills at the time limit. ``JOB.json`` holds the assignment,
the code cells to run (chosen by :func:`labkit.board.rank.cells_to_run`: the student's notebook is never read
here), the secret seed, whether to time, and where to write the result, a JSON object
``{"status", "detail", "timing"}``. Its output (the student's log) holds each cell's prints under a
``--- cell N ---`` line and, on an error, the traceback. A ``probe`` job (:func:`labkit.board.rank.probe`) stops
after its cells: the runtime under the students' limits, before any student runs. Steps, the first failure deciding the status:

1. Guards: the course's no-network guard (:func:`labkit.course.runguard.install`, ``report`` mode: a connection
   fails, a warning only prints); a memory limit, ``memory_gb`` (CPU: ``RLIMIT_AS``, default 16 GiB; GPU: a
   fraction of the card through ``torch.cuda.set_per_process_memory_fraction``, default 90%: CUDA reserves
   address space far beyond its use, so ``RLIMIT_AS`` cannot cap it).
2. A snapshot of what a submission could patch to look fast or right: SDPA and the softmaxes, the timers
   (``triton.testing.do_bench``, CUDA events and graphs, ``time.perf_counter``), and every function of
   labkit's timing, reference and grading modules and of the board's (:mod:`labkit.board.specs`; for 10 also
   notebook 10's kernel checks, the sm90 compiler's and the FP8 sweep and GEMM ceilings).
3. The cells, in one namespace named ``__main__`` (as a notebook kernel's); each compiled under its own
   file name kept in ``linecache``, as IPython does, so ``inspect`` and ``@triton.jit`` read its source.
   A cell that raises -> ``error`` (its exception's last line).
4. The snapshot again (-> ``flagged``); the graded names defined (-> ``error``); their code checked by
   :func:`labkit.core.grading.check_own_code` (no labkit but the spec's ``allow``, SDPA or softmax) and
   :func:`library_reached` (no flash-attn, FlashInfer, xFormers, flex attention or SDPA's kernel ops) (-> ``flagged``);
   a tiny call of each must launch a Triton kernel defined in the notebook (:func:`labkit.tritonlab.mode.launches`,
   -> ``flagged``); the spec's ``audit`` (10: FP8 MMA in the sm90 compile, -> ``flagged``).
5. The assignment's check on fresh inputs (:mod:`labkit.board.specs`, AssertionError -> ``wrong``), its graded
   calls watched (:mod:`labkit.board.runs`: a library softmax or attention operator or a torch matrix product run,
   however it was looked up, or no kernel of the notebook launched -> ``flagged``), then, on a GPU, its timing,
   which re-checks the timed calls' results (-> ``wrong``); the snapshot once more.

Used by: :mod:`labkit.board.rank`.
"""
from __future__ import annotations

import json
import linecache
import math
import sys
import time
import traceback
from pathlib import Path

import torch


def _last_line(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


def _guarded() -> dict[str, object]:
    """label -> object, for everything a submission must leave as it found it."""
    import torch.nn.functional as F
    import triton.testing
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    from labkit.core import grading, measure
    from labkit.engine import attention, bench
    from labkit.tritonlab import mode as tritonmode
    from labkit.decoding import decode, graphtime, readbw
    from labkit.flex import bench as flexbench, lib as flexlib
    from labkit.board import common as boardcommon, nb06 as boardshapes06, nb08 as boardshapes08, nb09 as boardshapes09
    from labkit.board import nb10 as boardshapes10
    from labkit.checks import nb10_kernel
    from labkit.fp8 import bench as fp8bench, ceilings as fp8ceilings
    from labkit.tritonlab import compile as tritoncompile

    found = {f"{owner.__name__}.{name}": getattr(owner, name) for owner, name in [
        (F, "scaled_dot_product_attention"), (F, "softmax"), (torch, "softmax"), (torch.Tensor, "softmax"),
        (torch, "logsumexp"), (torch, "einsum"), (torch, "matmul"), (torch.Tensor, "__matmul__"),
        (torch.Tensor, "__sub__"), (torch.Tensor, "abs"), (torch.Tensor, "max"), (torch.Tensor, "copy_"),
        (torch.Tensor, "double"), (torch.autograd, "grad"), (torch.cuda, "synchronize"), (torch.cuda.Event, "record"),
        (torch.cuda.Event, "elapsed_time"), (torch.cuda.CUDAGraph, "replay"), (time, "perf_counter"),
        (triton.testing, "do_bench"), (JITFunction, "run"), (Autotuner, "run")]}
    for module in (attention, bench, boardcommon, boardshapes06, boardshapes08, boardshapes09, boardshapes10, decode,
                   flexbench, flexlib, fp8bench, fp8ceilings, grading, graphtime, measure, nb10_kernel, readbw,
                   tritoncompile, tritonmode):
        found.update({f"{module.__name__}.{name}": obj for name, obj in vars(module).items()
                      if callable(obj) and not isinstance(obj, type) and not name.startswith("__")})
    return found


def _snapshot() -> dict[str, tuple]:
    return {label: (id(obj), getattr(obj, "__code__", None)) for label, obj in _guarded().items()}


def _tampered(before: dict[str, tuple]) -> str | None:
    """The first guarded name whose object or code changed since ``before``, or None."""
    now = _snapshot()
    changed = [label for label, state in before.items() if now.get(label) != state]
    return f"changed {changed[0]} (monkey-patching the timer, the reference or torch)" if changed else None


def _run_cells(cells: list[dict], ns: dict) -> None:
    for cell in cells:
        filename = f"<cell-{cell['index']}>"
        linecache.cache[filename] = (len(cell["source"]), None, cell["source"].splitlines(True), filename)
        print(f"--- cell {cell['index']} ---", flush=True)                 # the log: what each cell printed
        try:
            exec(compile(cell["source"], filename, "exec"), ns)  # noqa: S102 - the submission's own cell
        except BaseException as err:  # noqa: BLE001 - sys.exit() in a cell is an error too
            traceback.print_exc()
            raise CellError(f"cell {cell['index']}: {_last_line(err)}") from err


class CellError(Exception):
    """A notebook cell raised; the message names the cell and the exception's last line."""


class Verdict(Exception):
    """Stops the run with a status other than ok."""

    def __init__(self, status: str, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


def _limit_memory(job: dict, device: torch.device) -> None:
    gb = job.get("memory_gb")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gb * 2**30 / total) if gb else 0.9, device.index or 0)
    else:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (int((gb or 16) * 2**30), resource.getrlimit(resource.RLIMIT_AS)[1]))


LIBRARY_MODULES = ("flash_attn", "flashinfer", "xformers", "torch.nn.attention")   # labkit: check_own_code's
LIBRARY_OPS = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
               "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flex_attention"}


def library_reached(fn) -> str | None:
    """How ``fn`` reaches a library attention beyond what ``check_own_code`` forbids: a function, class or module of
    flash-attn, FlashInfer, xFormers or ``torch.nn.attention`` (flex attention), or an op of SDPA's kernels read by
    name (``torch.ops.aten._scaled_dot_product_flash_attention``); None if it does not."""
    import inspect

    from labkit.core.codereach import first_reached

    def library(obj) -> bool:
        module = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None) \
            if inspect.isroutine(obj) or inspect.isclass(obj) else None
        return isinstance(module, str) and module.startswith(LIBRARY_MODULES)

    return first_reached(fn, library, attributes=LIBRARY_OPS)


def _checks(spec, ns: dict, job: dict, device: torch.device, before: dict) -> dict | None:
    from labkit.core import grading
    from labkit.tritonlab import mode as tritonmode
    from labkit.board import runs
    from labkit.board.specs import forbidden

    missing = [name for name in spec.graded if name not in ns]
    if missing:
        raise Verdict("error", f"the notebook defines no {', '.join(missing)}")
    for label, fn in spec.own(ns).items():
        try:
            grading.check_own_code(fn, name=label, forbid=forbidden(), allow=spec.allow)
        except AssertionError as err:
            raise Verdict("flagged", f"{label}: calls a library attention, softmax or labkit: "
                                     f"{str(err).splitlines()[0][:200]}") from None
        if (reached := library_reached(fn)):
            raise Verdict("flagged", f"{label}: calls a library attention ({reached})")
    for label, call in spec.calls(ns, device).items():
        with tritonmode.launches() as launched:
            call()
        if not sum(launched.values()):
            raise Verdict("flagged", f"{label} launched none of the notebook's own Triton kernels")
    if spec.audit and (why := spec.audit(ns, device)):
        raise Verdict("flagged", why)
    if (changed := _tampered(before)):
        raise Verdict("flagged", changed)
    try:
        with runs.watch(ns, spec.graded) as calls:
            spec.check(ns, job["seed"], device)
        if (why := runs.verdict(calls)):
            raise Verdict("flagged", why)
        timing = spec.time(ns, job["seed"], device, job.get("target_ms", 30.0)) if job.get("time") else None
    except AssertionError as err:
        raise Verdict("wrong", str(err).splitlines()[0][:300]) from None
    if (changed := _tampered(before)):
        raise Verdict("flagged", changed)
    return timing


def run(job: dict) -> dict:
    """The job's result: {"status", "detail", "timing"} (timing: the spec's timing dict, or None)."""
    from labkit.course import runguard

    runguard.install("report")
    import labkit as lk

    lk.tritonmode.setup()
    from labkit.board.specs import SPECS

    device = lk.tritonmode.device()
    _limit_memory(job, device)
    spec, before = SPECS[job["assignment"]], _snapshot()
    ns = {"__name__": "__main__", "display": lambda *args, **kwargs: print(*args)}
    try:
        _run_cells(job["cells"], ns)
        if job.get("probe"):
            return {"status": "ok", "detail": "", "timing": None}
        if (changed := _tampered(before)):
            raise Verdict("flagged", changed)
        timing = _checks(spec, ns, job, device, before)
    except Verdict as verdict:
        return {"status": verdict.status, "detail": verdict.detail, "timing": None}
    except CellError as err:
        blank = isinstance(err.__cause__, NotImplementedError)
        return {"status": "error", "timing": None,
                "detail": f"{err} (an exercise left blank)" if blank else str(err)}
    except Exception as err:  # noqa: BLE001 - any other failure of the submission's code
        traceback.print_exc()
        return {"status": "error", "detail": _last_line(err), "timing": None}
    return {"status": "ok", "detail": "", "timing": timing}


def _plain(obj):
    """JSON for numpy and torch scalars; NaN stays NaN (the board reads it back with Python's json)."""
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    started = time.monotonic()
    result = run(job)
    result["seconds"] = round(time.monotonic() - started, 1)
    Path(job["result"]).write_text(json.dumps(result, default=_plain, allow_nan=True), encoding="utf-8")
    sys.stdout.flush()
    return 0 if math.isfinite(result["seconds"]) else 1


if __name__ == "__main__":
    sys.exit(main())
