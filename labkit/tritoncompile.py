"""A notebook's Triton kernels compiled for real GPUs on any machine, CPU included.

The interpreter (``TRITON_INTERPRET=1``, how a CPU runs notebook 06) accepts code the GPU compiler
refuses, a plain Python global read inside ``@triton.jit`` first of all. Triton's own compiler
needs no GPU to build PTX and a cubin for a chosen architecture (``triton.compile`` with a
``GPUTarget``), so a kernel that passes on a CPU can be checked to compile for sm80 (Ampere) and
sm90 (Hopper), and a CPU-only reader sees what the compiler made of it: registers, spills, shared
memory, and whether ``tl.dot`` became Hopper's ``wgmma`` or Ampere's ``mma.sync``.

- :func:`recorded`: the launches of the notebook's kernels while a block runs (their arguments).
- :func:`compile_launches`: compile each distinct kernel for each architecture; one report per pair.
- :func:`check_compiles`: the test cells' check; fails in :mod:`labkit.grading`'s style, naming the
  kernel, the architecture and the cause.
- :func:`check_no_tf32`: the test cells' check that fp32 launches stay IEEE fp32 in the compiled code.
- :func:`report_table`: the reports as a DataFrame.

The compiler runs in a separate Python process (``tritoncompile_worker.py``) with the interpreter
off; the kernels are rebuilt there from their source, with the globals they read.

Used in: 06_triton_flashattention.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable, Iterator

import torch

from . import grading, tritonmode

ARCHS = {80: "sm80 (Ampere)", 90: "sm90 (Hopper)"}
WORKER = Path(__file__).with_name("tritoncompile_worker.py")
POINTER_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
                 torch.int32: "i32", torch.int64: "i64", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
                 torch.bool: "i1"}


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch of a notebook kernel: the Python function and its arguments by parameter name."""

    fn: Callable
    args: dict
    num_warps: int = 4
    num_stages: int = 3

    @property
    def kernel(self) -> str:
        return self.fn.__name__


@dataclasses.dataclass(frozen=True)
class Report:
    """What the compiler made of one kernel for one architecture (``ok`` False: ``error`` says why).

    ``registers`` and ``spills`` (local-memory bytes, where spilled registers go) are per thread;
    ``mma`` is the tensor-core instruction ``tl.dot`` became ("wgmma", "mma.sync" or None); ``tf32``
    whether one of them multiplies TF32 operands (``input_precision="tf32"``, or no ``input_precision``
    on fp32 operands: the GPU's default), which the interpreter cannot show (numpy multiplies exactly)."""

    kernel: str
    arch: int
    ok: bool
    error: str
    registers: int | None
    spills: int | None
    shared_bytes: int | None
    mma: str | None
    tf32: bool | None = None


def _python_function(kernel) -> Callable | None:
    """The Python function behind a ``@triton.jit`` kernel (interpreted or compiled), else None."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return kernel.fn if isinstance(kernel, (InterpretedFunction, JITFunction)) else None


@contextlib.contextmanager
def recorded(module: str = "__main__") -> Iterator[list[Launch]]:
    """Record every launch of a Triton kernel defined in ``module`` (a notebook: "__main__").

    Autotuned kernels are recorded with the config the autotuner chose (its block sizes, warps and
    stages).
    """
    launches: list[Launch] = []

    def record(fn, args, kwargs):
        params = inspect.signature(fn).parameters
        bound = inspect.signature(fn).bind_partial(*args, **{k: v for k, v in kwargs.items() if k in params})
        launches.append(Launch(fn, dict(bound.arguments), kwargs.get("num_warps") or 4, kwargs.get("num_stages") or 3))

    with tritonmode.watched_launches(record, module):
        yield launches


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        if value.dtype not in POINTER_TYPES:
            raise TypeError(f"a {value.dtype} tensor argument has no Triton pointer type here")
        return "*" + POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"argument of type {type(value).__name__} is not a tensor or a number")


def _source_without_decorators(fn: Callable) -> str:
    """``fn``'s definition with its decorators removed (they may name notebook objects)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    node = tree.body[0]
    node.decorator_list = []
    return ast.unparse(node)


def _module_source(kernels: list[Callable]) -> str:
    """A module that defines ``kernels`` and what they read: jit helpers (recursively), modules,
    ``tl.constexpr`` and dtype constants, and plain values as plain globals (which the compiler
    refuses inside a kernel, as it does on a GPU)."""
    import triton.language as tl

    header, body, done = ["import triton", "import triton.language as tl"], [], set()

    def emit(fn: Callable) -> None:
        if fn in done:
            return
        done.add(fn)
        for name, value in grading.loaded_globals(fn).items():
            helper = _python_function(value)
            if helper is not None:
                emit(helper)
                if helper.__name__ != name:
                    header.append(f"# {name} is {helper.__name__}")
                    body.append(f"{name} = {helper.__name__}")
            elif inspect.ismodule(value):
                header.append(f"import {value.__name__} as {name}")
            elif isinstance(value, tl.constexpr):
                header.append(f"{name} = tl.constexpr({value.value!r})")
            elif isinstance(value, tl.dtype):
                header.append(f"{name} = tl.dtype({value.name!r})")
            elif isinstance(value, (bool, int, float, str)):
                header.append(f"{name} = {value!r}")
        body.append("@triton.jit\n" + _source_without_decorators(fn))

    for fn in kernels:
        emit(fn)
    return "\n".join(dict.fromkeys(header)) + "\n\n\n" + "\n\n\n".join(body) + "\n"


def _explain(error: str, arch: int) -> str:
    """The compiler's error, with the usual cause first, in Chinese."""
    first = error.strip().splitlines()[0] if error.strip() else "unknown error"
    if "Cannot access global variable" in error:
        name = error.split("Cannot access global variable", 1)[1].split()[0]
        return (f"kernel 讀取了 Python 全域變數 {name}：GPU 編譯器只接受 tl.constexpr 全域常數或 kernel 的參數"
                f"（直譯器不檢查這點，所以 CPU 上能跑）。把它宣告成 `{name} = tl.constexpr(...)` 或當參數傳入。")
    return f"Triton 編譯器（{ARCHS.get(arch, arch)}）拒絕了這個 kernel：{first}"


def compile_launches(launches: list[Launch], archs=(80, 90), config: dict | None = None,
                     timeout: float = 300.0) -> list[Report]:
    """Compile each distinct kernel among ``launches`` (its first launch's argument types) for each arch.

    Args:
        launches: from :func:`recorded`.
        archs: compute capabilities, e.g. 80 (A100), 90 (H100).
        config: overrides of the launches' constexprs and options, e.g. ``{"BLOCK_M": 128,
            "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}``: the tiles a GPU would use, where the
            recorded launch had the interpreter's small ones. Keys a kernel lacks are ignored.

    Returns:
        One :class:`Report` per kernel and arch, in launch order; a kernel the compiler refuses gets
        ``ok=False`` and the reason in ``error``.
    """
    config = dict(config or {})
    first: dict[Callable, Launch] = {}
    for launch in launches:
        first.setdefault(launch.fn, launch)
    jobs = []
    for fn, launch in first.items():
        params = inspect.signature(fn).parameters
        signature, constexprs = {}, {}
        for name, param in params.items():
            value = config.get(name, launch.args.get(name, param.default))
            if "constexpr" in str(param.annotation):
                signature[name], constexprs[name] = "constexpr", value
            else:
                signature[name] = _arg_type(value)
        jobs.append({"name": fn.__name__, "signature": signature, "constexprs": constexprs,
                     "num_warps": config.get("num_warps", launch.num_warps),
                     "num_stages": config.get("num_stages", launch.num_stages)})
    if not jobs:
        return []
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    job = {"source": _module_source(list(first)), "kernels": jobs, "archs": list(archs)}
    done = subprocess.run([sys.executable, str(WORKER)], input=json.dumps(job), capture_output=True, text=True,
                          env=env, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the Triton compiler process failed:\n{done.stderr[-2000:]}")
    rows = json.loads(done.stdout)
    return [Report(**{**row, "error": _explain(row["error"], row["arch"]) if row["error"] else ""}) for row in rows]


def check_compiles(run: Callable[[], object], *, name: str, archs=(80, 90), config: dict | None = None,
                   module: str = "__main__") -> list[Report]:
    """Test-cell check: every notebook kernel ``run()`` launches compiles for each of ``archs``.

    Fails (``AssertionError`` with a Chinese message naming the kernel, the GPU generation and the
    cause) when ``run`` launches no notebook kernel or the compiler refuses one. Returns the reports.
    """
    with recorded(module) as launches:
        run()
    grading.check_true(bool(launches), name=name, detail="沒有啟動任何在 notebook 中定義的 Triton kernel。",
                       hint="答案要呼叫你自己的 @triton.jit kernel（kernel[grid](...)），不是 PyTorch 函式。")
    reports = compile_launches(launches, archs, config)
    for r in reports:
        grading.check_true(r.ok, name=f"{name}：{r.kernel} 能為 {ARCHS.get(r.arch, r.arch)} 編譯",
                           detail=r.error, hint="在 CPU 上用直譯器通過的 kernel，GPU 的編譯器可能仍然拒絕。")
    return reports


def check_no_tf32(reports: list[Report], *, name: str, hint: str) -> None:
    """Test-cell check: no compiled kernel of ``reports`` (from fp32 launches) multiplies in TF32.

    The interpreter multiplies fp32 exactly whatever ``input_precision`` says; the compiled code shows
    the choice: ``mma.sync ... .tf32`` (sm80) or ``wgmma ... .tf32`` (sm90).
    """
    for r in reports:
        grading.check_true(not r.tf32, name=f"{name}：{r.kernel} 在 {ARCHS.get(r.arch, r.arch)} 上保持 IEEE fp32",
                           detail=f"fp32 輸入編譯出的 GPU 程式碼用了 TF32 的張量核心指令（{r.mma} ... .tf32）："
                                  "tl.dot 以 TF32 相乘（尾數只有 10 位元，誤差約 1e-3）。", hint=hint)


def report_table(reports: list[Report]):
    """The reports as a DataFrame: kernel, GPU, registers, spills, shared memory (KiB), MMA instruction."""
    import pandas as pd

    return pd.DataFrame([{"kernel": r.kernel, "gpu": ARCHS.get(r.arch, f"sm{r.arch}"), "compiles": r.ok,
                          "registers/thread": r.registers, "local (spill) bytes/thread": r.spills,
                          "shared KiB": None if r.shared_bytes is None else round(r.shared_bytes / 1024, 1),
                          "tl.dot became": r.mma, "TF32": r.tf32, "error": r.error} for r in reports])
