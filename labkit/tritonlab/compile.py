"""A notebook's Triton kernels compiled for real GPUs on any machine, CPU included.

The interpreter (``TRITON_INTERPRET=1``, how a CPU runs notebook 06) accepts code the GPU compiler
refuses, a plain Python global read inside ``@triton.jit`` first of all. Triton's own compiler
needs no GPU to build PTX and a cubin for a chosen architecture (``triton.compile`` with a
``GPUTarget``), so a kernel that passes on a CPU can be checked to compile for sm80 (Ampere) and
sm90 (Hopper), and a CPU-only reader sees what the compiler made of it: registers, spills, shared
memory, and whether ``tl.dot`` became Hopper's ``wgmma`` or Ampere's ``mma.sync``.

- :func:`recorded`: the launches of the notebook's kernels while a block runs (their arguments).
- :func:`compile_launches`: compile each distinct kernel for each architecture; one report per pair.
- :func:`check_compiles`: the test cells' check; fails in :mod:`labkit.core.grading`'s style, naming the
  kernel, the architecture and the cause.
- :func:`check_no_tf32`: the test cells' check that fp32 launches stay IEEE fp32 in the compiled code.
- :func:`check_fp32_statistics`: the test cells' check that bf16/fp16 launches compute in fp32 (Triton IR).
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

from labkit.core import codereach, grading
from labkit.tritonlab import mode as tritonmode

ARCHS = {80: "sm80 (Ampere)", 90: "sm90 (Hopper)"}
WORKER = Path(__file__).with_name("compile_worker.py")
POINTER_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
                 torch.int32: "i32", torch.int64: "i64", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
                 torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}


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
    mma_ops: tuple = ()         # the distinct MMA instructions of the PTX ("wgmma.mma_async....m64n64k32.f32.e4m3.e4m3")
    low_precision: tuple = ()   # ttir_only: (function, statement, kind, op, type): see the worker's low_precision


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
        for name, value in codereach.loaded_globals(fn).items():
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


def _distinct(launches: list[Launch], by_types: bool) -> dict:
    """The first launch of each kernel (``by_types``: of each kernel, tensor argument types and constexpr values,
    so a branch that only another constexpr reaches, a kernel without its sink say, is compiled too), in order."""
    first: dict = {}
    for launch in launches:
        key = (launch.fn,)
        if by_types:
            params = inspect.signature(launch.fn).parameters
            key += (tuple(_arg_type(v) for v in launch.args.values() if isinstance(v, torch.Tensor)),
                    tuple(repr(launch.args.get(n)) for n, p in params.items() if "constexpr" in str(p.annotation)))
        first.setdefault(key, launch)
    return first


def compile_launches(launches: list[Launch], archs=(80, 90), config: dict | None = None,
                     timeout: float = 300.0, ttir_only: bool = False) -> list[Report]:
    """Compile each distinct kernel among ``launches`` (its first launch's argument types) for each arch.

    Args:
        launches: from :func:`recorded`.
        archs: compute capabilities, e.g. 80 (A100), 90 (H100).
        config: overrides of the launches' constexprs and options, e.g. ``{"BLOCK_M": 128,
            "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}``: the tiles a GPU would use, where the
            recorded launch had the interpreter's small ones. Keys a kernel lacks are ignored.
        ttir_only: run the frontend only (Triton IR: no PTX, much faster than a compile), once per
            kernel, distinct argument types and constexpr values (a bf16 and an fp16 launch both, a
            causal and a windowed one both), and fill ``low_precision``.

    Returns:
        One :class:`Report` per kernel and arch, in launch order; a kernel the compiler refuses gets
        ``ok=False`` and the reason in ``error``.
    """
    config = dict(config or {})
    first = _distinct(launches, ttir_only)
    jobs = []
    for launch in first.values():
        fn = launch.fn
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
    kernels = list(dict.fromkeys(launch.fn for launch in first.values()))
    job = {"source": _module_source(kernels), "kernels": jobs, "archs": list(archs), "ttir_only": ttir_only}
    done = subprocess.run([sys.executable, str(WORKER)], input=json.dumps(job), capture_output=True, text=True,
                          env=env, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the Triton compiler process failed:\n{done.stderr[-2000:]}")
    rows = json.loads(done.stdout)
    return [Report(**{**row, "error": _explain(row["error"], row["arch"]) if row["error"] else "",
                      "low_precision": tuple(map(tuple, row.get("low_precision", ()))),
                      "mma_ops": tuple(row.get("mma_ops", ()))}) for row in rows]


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


def _low_precision_words(kind: str, op: str, dtype: str) -> str:
    """A finding of the worker's ``low_precision`` in Chinese: what ran in ``dtype``, or where a rounded value went."""
    dtype = {"f16": "fp16"}.get(dtype, dtype)
    if kind == "computed":
        short = op.split(".")[-1]
        word = {"addf": "加法或 tl.sum 的加總", "subf": "減法", "mulf": "乘法", "divf": "除法"}.get(short, f"{short} ")
        return f"{word}以 {dtype} 計算"
    use = {"arith.extf": "又轉回 fp32（拿去計算或存進 fp32 的輸出）", "tt.reduce": "拿去歸約（tl.max／tl.sum）",
           "scf.yield": "帶出迴圈或分支（留在低精度）"}.get(op, f"拿去計算（{op}）")
    return f"轉成 {dtype}（捨入）之後{use}，不是只給 tl.dot 當運算元或給 tl.store 存回"


def check_fp32_statistics(run: Callable[[], object], *, name: str, rule: str, hint: str,
                          module: str = "__main__") -> list[Report]:
    """Test-cell check: the notebook kernels ``run()`` launches on bf16/fp16 tensors compute in fp32.

    The interpreter does not compute bf16 as the GPU does, and a statistic rounded to bf16 (a row max, a score)
    often costs too little on small inputs for a numeric test to see. So read the Triton IR the compiler's
    front end builds for the same launch (no GPU, no PTX): no arithmetic, exp, log or reduction
    on bf16/fp16 values, and a value rounded to bf16/fp16 only as a ``tl.dot`` operand or for a ``tl.store``.
    Fails naming the helper, the statement and the rule.
    """
    with recorded(module) as launches:
        run()
    grading.check_true(bool(launches), name=name, detail="沒有啟動任何在 notebook 中定義的 Triton kernel。",
                       hint="答案要呼叫你自己的 @triton.jit kernel（kernel[grid](...)），不是 PyTorch 函式。")
    reports = compile_launches(launches, archs=(90,), ttir_only=True)
    for r, launch in zip(reports, _distinct(launches, True).values()):
        grading.check_true(r.ok, name=f"{name}：{r.kernel} 能編譯", detail=r.error,
                           hint="在 CPU 上用直譯器通過的 kernel，GPU 的編譯器可能仍然拒絕。")
        low = "、".join(sorted({POINTER_TYPES[v.dtype] for v in launch.args.values()
                                if isinstance(v, torch.Tensor) and v.dtype in (torch.bfloat16, torch.float16)}))
        places = "\n".join(f"  {fn}：`{stmt}`：{_low_precision_words(*rest)}" for fn, stmt, *rest in r.low_precision[:4])
        grading.check_true(not r.low_precision, name=f"{name}：{r.kernel}（{low} 輸入）以 fp32 計算",
                           detail=f"規則：{rule}。為 GPU 編譯出的 Triton IR 在這些地方用了低精度（這一關讀程式碼："
                                  f"CPU 上的直譯器不照 GPU 的方式計算 bf16，有些捨入在小例子上的誤差也小到數值測試看不出來）："
                                  f"\n{places}", hint=hint)
    return reports


def report_table(reports: list[Report]):
    """The reports as a DataFrame: kernel, GPU, registers, spills, shared memory (KiB), MMA instruction."""
    import pandas as pd

    return pd.DataFrame([{"kernel": r.kernel, "gpu": ARCHS.get(r.arch, f"sm{r.arch}"), "compiles": r.ok,
                          "registers/thread": r.registers, "local (spill) bytes/thread": r.spills,
                          "shared KiB": None if r.shared_bytes is None else round(r.shared_bytes / 1024, 1),
                          "tl.dot became": r.mma, "TF32": r.tf32, "error": r.error} for r in reports])
