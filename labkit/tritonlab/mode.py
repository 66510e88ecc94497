"""Triton's execution mode here: the interpreter on a CPU, compiled kernels on a GPU.

Triton decides at decoration time: ``@triton.jit`` builds an interpreted function when
``TRITON_INTERPRET=1`` is in the environment, a compiled one otherwise, and triton's own library
functions are decorated when triton is first imported. So ``import labkit`` sets the switch from the
device (:func:`apply_default`: the interpreter when there is no CUDA device), before anything
imports triton, and a notebook calls :func:`setup` to check it. The same kernel source then runs on
CPU tensors through numpy (grading, CI, laptops) and on CUDA tensors as GPU code; :func:`device` is
where the kernels' tensors must live.

Two probes serve the tests of a student's kernels:

- :func:`launches` counts the kernel launches of functions defined in the notebook (``__main__``),
  so an answer that never launches a Triton kernel (PyTorch only) is caught.
- :func:`loaded_elements` counts the elements the interpreter loads, so skipping work (a causal
  tile skipped, not just masked) is visible on a CPU.

Addresses out of range (int32 offsets, loads and stores past a tensor's end): :mod:`labkit.tritonlab.bounds`.

:func:`setup` also makes a launch of an autotuned kernel that passes a tuned meta-parameter
(``BLOCK_M=...``) fail with a message naming the cause.

    mode = lk.tritonmode.setup()          # "interpreter" or "compiled"; import triton after it
    with lk.tritonmode.launches() as n:
        kernel[grid](...)
    n["kernel"]                           # 1

Used in: 06_triton_flashattention, 08_decode_attention.
"""
from __future__ import annotations

import collections
import contextlib
import os
from typing import Callable, Iterator

import torch

def apply_default() -> None:
    """Set ``TRITON_INTERPRET=1`` when no CUDA device is here and the variable is unset.

    Called by ``import labkit`` before anything imports triton: Triton decorates its own
    library functions (``tl.sum``, ``tl.max``, ...) in the mode set when triton is first imported,
    and ``torch._dynamo`` imports triton. A GPU machine is left as it is (compiled kernels).
    """
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def setup() -> str:
    """Import triton in this process's mode and check that its library was decorated in that mode.

    Returns:
        "interpreter" or "compiled".

    Raises:
        RuntimeError: triton was imported before the mode was set (restart the kernel and import
            labkit first), or compiled kernels were asked for without a CUDA device.
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    mode = current()
    if isinstance(tl.standard.sum, InterpretedFunction) != (mode == "interpreter"):
        raise RuntimeError(f"triton was imported before TRITON_INTERPRET was set for the {mode} mode; restart "
                           "the kernel and run `import labkit` before importing triton (or torch._dynamo).")
    if mode == "compiled" and not torch.cuda.is_available():
        raise RuntimeError("compiled Triton kernels need a CUDA GPU; unset TRITON_INTERPRET=0 to use the interpreter.")
    if mode == "interpreter":
        _patch_bf16_dot()
        _patch_bf16_rounding()
        _patch_device_calls()
    _patch_autotuned_launch()
    return mode


def _patch_autotuned_launch() -> None:
    """Name the cause when a launch of an autotuned kernel passes a tuned meta-parameter.

    ``kernel[grid](..., BLOCK_M=64)`` on an ``@triton.autotune`` kernel whose configs set
    ``BLOCK_M`` fails inside triton with "got multiple values for keyword argument 'BLOCK_M'",
    naming triton's (or :func:`launches`'s) ``run``, not the cause. Refuse it before, saying that
    the autotuner chooses those parameters. Idempotent.
    """
    from triton.runtime.autotuner import Autotuner

    original = Autotuner.run
    if getattr(original, "_labkit_tuned", False):
        return

    def run(self, *args, **kwargs):
        tuned = {name for config in self.configs for name in config.kwargs}
        given = set(kwargs) | set(self.arg_names[:len(args)])
        clash = [name for name in self.arg_names if name in tuned & given]
        if clash:
            names, chosen = ", ".join(clash), ", ".join(n for n in self.arg_names if n in tuned)
            kernel = getattr(self.base_fn, "__name__", "kernel")
            raise TypeError(
                f"{kernel} 是自動調校（@triton.autotune）的核心：{chosen} 由自動調校器從 configs 中選擇，"
                f"啟動時不可傳入（這次傳了 {names}）。請拿掉它們，網格寫成 "
                f"grid = lambda meta: (triton.cdiv(N, meta[\"BLOCK_M\"]), ...)。\n"
                f"({kernel} is autotuned: the autotuner chooses {chosen}, so they must not be passed "
                f"(got {names}); read them in the grid function from meta.)")
        return original(self, *args, **kwargs)

    run._labkit_tuned = True
    Autotuner.run = run


def _patch_bf16_dot() -> None:
    """Make the interpreter's ``tl.dot`` read bf16 operands as numbers.

    triton 3.9's interpreter keeps bf16 tensors as their raw uint16 bits and ``create_dot``
    multiplies those bits as integers (it widens only fp8). Widen bf16 to fp32 first: exact, and
    what the tensor cores do (bf16 products accumulated in fp32). Idempotent.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    original = InterpreterBuilder.create_dot
    if getattr(original, "_labkit_bf16", False):
        return

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            return TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, *args, **kwargs):
        return original(self, widen(a), widen(b), d, *args, **kwargs)

    create_dot._labkit_bf16 = True
    InterpreterBuilder.create_dot = create_dot


def _patch_bf16_rounding() -> None:
    """Round fp32 -> bf16 casts to nearest even, as the GPU's ``cvt.rn.bf16.f32`` does: triton 3.9's
    interpreter truncates (up to one unit in the last place off, not half of one), so a correct kernel
    would fail the 2x rule against PyTorch's rounded bf16. Idempotent."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    original = InterpreterBuilder.cast_impl
    if getattr(original, "_labkit_rne", False):
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return original(self, src, dst_type)

    cast_impl._labkit_rne = True
    InterpreterBuilder.cast_impl = cast_impl


def _patch_device_calls() -> None:
    """Patch the language once per device function per launch, not at every call of it: triton 3.9's interpreter
    re-patches every ``tl`` builtin (``inspect.getmembers``) at each call of a ``@triton.jit`` helper, once per
    program and loop step: a quarter of the CPU time of grading 06's and 08's kernels. The first call of each helper
    in a launch patches as before; later ones find the language already patched. Outside a launch, as before.
    Idempotent."""
    from triton.runtime.interpreter import GridExecutor, InterpretedFunction, InterpreterError

    if getattr(InterpretedFunction.__call__, "_labkit_once", False):
        return
    launch_call, device_call = GridExecutor.__call__, InterpretedFunction.__call__
    patched: list[set] = []   # per launch in progress: the helpers whose call patched the language in it

    def launch(self, *args, **kwargs):
        patched.append(set())
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            patched.pop()

    def call(self, *args, **kwargs):
        if not patched or self.fn not in patched[-1]:
            if patched:
                patched[-1].add(self.fn)
            return device_call(self, *args, **kwargs)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:   # as triton's own call reports it
            raise InterpreterError(repr(e)) from e

    call._labkit_once = True
    GridExecutor.__call__, InterpretedFunction.__call__ = launch, call


def current() -> str:
    """The mode ``@triton.jit`` uses now: "interpreter" or "compiled"."""
    interpret = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
    return "interpreter" if interpret else "compiled"


def device() -> torch.device:
    """Where the kernels' tensors live: CPU tensors for the interpreter, the CUDA device otherwise."""
    return torch.device("cpu" if current() == "interpreter" else "cuda")


SMALL_PROBLEM_SCORES = 1 << 24   # B*H*N_Q*N_K below this: one config, tuning costs more than it saves


def tile_configs(compiled: list[tuple[int, int, int, int]], *, small: tuple[int, int, int, int]) -> list:
    """Autotuning configs over ``BLOCK_M`` and ``BLOCK_N`` for this mode.

    Args:
        compiled: (BLOCK_M, BLOCK_N, num_warps, num_stages) per candidate, tried on a GPU.
        small: a config with small tiles and few stages (fits any GPU's shared memory): the first
            on a GPU, the only one :func:`tune_large_only` keeps for small or fp32 problems (and the
            one it drops for large ones), and the only one in the interpreter (no speed to tune
            there; the autotuner would run the kernel once per config).

    Returns:
        A list of ``triton.Config`` for ``@triton.autotune(configs=...)``.
    """
    import triton

    if current() == "interpreter":
        return [triton.Config({"BLOCK_M": small[0], "BLOCK_N": small[1]})]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in [small, *compiled]]


def tune_large_only(configs: list, named_args: dict, **kwargs) -> list:
    """``early_config_prune`` for ``@triton.autotune``: keep only the first config (``small`` of
    :func:`tile_configs`) for fp32 inputs or fewer than :data:`SMALL_PROBLEM_SCORES` scores, and
    all the others (not ``small``: it never wins there) for larger problems.

    Each candidate costs a compilation (seconds) per new key; tests call many small shapes, where
    the fastest tile saves microseconds. Reads the kernel's ``q_ptr`` [BH, N_Q, D], ``N_Q`` and
    ``N_K`` arguments, positional or keyword.
    """
    args = {**named_args, **kwargs}
    q = args["q_ptr"]
    scores = q.shape[0] * args["N_Q"] * args["N_K"]
    if q.dtype == torch.float32 or scores < SMALL_PROBLEM_SCORES:
        return configs[:1]
    return configs[1:] or configs


@contextlib.contextmanager
def watched_launches(on_launch: Callable, module: str = "__main__") -> Iterator[None]:
    """Call ``on_launch(fn, args, kwargs)`` before every launch of a Triton kernel defined in ``module``.

    ``fn`` is the kernel's Python function; ``args``/``kwargs`` are the launch's own (an autotuned
    kernel's launch carries the chosen config's block sizes, ``num_warps`` and ``num_stages``).
    Interpreted and compiled kernels alike; warm-up compilations are not launches.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    originals = {cls: cls.run for cls in (InterpretedFunction, JITFunction)}

    def watching(original):
        def run(self, *args, **kwargs):
            if getattr(self.fn, "__module__", None) == module and not kwargs.get("warmup"):
                on_launch(self.fn, args, kwargs)
            return original(self, *args, **kwargs)
        return run

    for cls, original in originals.items():
        cls.run = watching(original)
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.run = original


@contextlib.contextmanager
def launches(module: str = "__main__") -> Iterator[collections.Counter]:
    """Count launches of Triton kernels defined in ``module`` (a notebook: "__main__"), by kernel name.

    Autotuned and heuristics-wrapped kernels count once per launch of the kernel they wrap
    (autotuning's trial runs count too).
    """
    counts: collections.Counter = collections.Counter()
    with watched_launches(lambda fn, args, kwargs: counts.update([fn.__name__]), module):
        yield counts


@contextlib.contextmanager
def loaded_elements() -> Iterator[collections.Counter]:
    """Count what the interpreter loads: ``counts["elements"]``, the elements read (masked-off lanes
    excluded), and ``counts["lanes"]``, the lanes of every load issued, masked off or not: a loop over a
    whole cache whose loads are masked down to one split reads few elements but issues many lanes.
    And the work: ``counts["products"]``, the multiply-adds of every ``tl.dot`` (M x K by K x N: M·K·N), masked
    lanes or not: a loop over every block whose loads are masked down to the listed ones still computes them all.

    Only the interpreter can count (compiled kernels run on the GPU); raises in the compiled mode.
    """
    if current() != "interpreter":
        raise RuntimeError("loaded_elements() counts the interpreter's loads; set TRITON_INTERPRET=1.")
    from triton.runtime.interpreter import interpreter_builder

    counts: collections.Counter = collections.Counter()
    original = interpreter_builder.create_masked_load

    def masked_load(ptrs, mask, *args, **kwargs):
        counts["elements"] += int(mask.data.sum())
        counts["lanes"] += int(mask.data.size)
        return original(ptrs, mask, *args, **kwargs)

    def dot(a, b, *args, **kwargs):
        counts["products"] += int(a.data.size) * int(b.data.shape[-1])
        return original_dot(a, b, *args, **kwargs)

    original_dot = interpreter_builder.create_dot
    interpreter_builder.create_masked_load, interpreter_builder.create_dot = masked_load, dot
    try:
        yield counts
    finally:
        del interpreter_builder.create_masked_load, interpreter_builder.create_dot  # the class's methods again
