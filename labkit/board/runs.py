"""What a submission's graded calls run, not what their code names: the board's second pass against library work.

The first pass (:mod:`labkit.board.worker`: :func:`labkit.core.grading.check_own_code`, ``library_reached``) reads
names, which a submission can build at run time (``getattr(F, "scaled_dot_" + "product_attention")``). Here, while
the board checks a submission on its own inputs, every graded function (a class: its ``forward`` and ``backward``)
runs under :class:`OpLog`, a dispatch mode that records each torch operator it reaches, however it was looked up,
and with :func:`labkit.tritonlab.mode.launches` counting the notebook's Triton kernels. :func:`verdict` then names
the first call that ran a library softmax or attention operator, a matrix product in torch (the attention's work
done outside the notebook's kernels), or no kernel of the notebook at all (a kernel launched only for small inputs).

Operators seen on a CPU and on a GPU alike; a library kernel that bypasses torch's dispatcher (a CuTe DSL or Triton
kernel of another package) is left to the name checks.

Used by: :mod:`labkit.board.worker`.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import inspect
from dataclasses import dataclass, field
from typing import Callable, Iterator

from torch.utils._python_dispatch import TorchDispatchMode

from labkit.tritonlab import mode as tritonmode

LIBRARY_WORDS = ("softmax", "attention")   # aten._softmax, _safe_softmax, _scaled_dot_product_*_attention, ...
MATMULS = frozenset({"mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "dot", "vdot", "mv", "addmv", "linear",
                     "einsum", "tensordot", "_scaled_mm", "_int_mm"})


class OpLog(TorchDispatchMode):
    """Counts the operators dispatched inside the block, by name (``aten.bmm`` -> "bmm"; another namespace's op
    keeps its namespace: "flash_attn::fwd")."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name if func.namespace == "aten" else f"{func.namespace}::{name}"] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class Call:
    """One call of a graded function: its label, the operators it ran and the notebook's kernels it launched."""

    label: str
    ops: collections.Counter = field(default_factory=collections.Counter)
    launches: int = 0


def _watched(fn: Callable, label: str, calls: list[Call]) -> Callable:
    @functools.wraps(fn)
    def call(*args, **kwargs):
        record = Call(label)
        calls.append(record)
        with OpLog() as log, tritonmode.launches() as launched:
            try:
                return fn(*args, **kwargs)
            finally:
                record.ops.update(log.ops)
                record.launches = sum(launched.values())
    return call


def _watched_class(cls: type, label: str, calls: list[Call]) -> type:
    """A subclass of an autograd Function whose forward and backward are watched (called as the original's are)."""
    parts = {name: staticmethod(_watched(getattr(cls, name), f"{label}.{name}", calls))
             for name in ("forward", "backward") if name in vars(cls)}
    return type(cls.__name__, (cls,), parts)


@contextlib.contextmanager
def watch(ns: dict, names: tuple[str, ...]) -> Iterator[list[Call]]:
    """Inside the block, ``ns[name]`` for each of ``names`` is watched (functions, and classes' forward and
    backward); yields the list of :class:`Call` the calls append to. ``ns`` is restored afterwards."""
    calls: list[Call] = []
    saved = {name: ns[name] for name in names}
    for name, obj in saved.items():
        ns[name] = _watched_class(obj, name, calls) if inspect.isclass(obj) else _watched(obj, name, calls)
    try:
        yield calls
    finally:
        ns.update(saved)


def verdict(calls: list[Call]) -> str | None:
    """Why the watched calls were not the notebook's own kernels' work, or None: the first call that ran a library
    softmax or attention operator, then a matrix product in torch, then one during which none of the notebook's
    Triton kernels launched (the kernels of a graded function it calls count)."""
    for call in calls:
        library = sorted(op for op in call.ops if any(word in op for word in LIBRARY_WORDS))
        if library:
            return f"{call.label} ran {library[0]} (a library softmax or attention) on the board's inputs"
    for call in calls:
        products = sorted(op for op in call.ops if op.split("::")[-1] in MATMULS)
        if products:
            return (f"{call.label} ran torch's {products[0]} (the attention's matrix products belong in the "
                    f"notebook's kernels) on the board's inputs")
    for call in calls:
        if call.launches == 0:
            return f"{call.label} launched none of the notebook's own Triton kernels on the board's inputs"
    return None
