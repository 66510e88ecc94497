"""Addresses out of range in interpreted Triton kernels: loads and stores outside the tensors they were
given, and int32 offset arithmetic that overflows.

A tile that runs past the end of a sequence (N not a multiple of the block) must mask its loads and
stores (``mask=offs_n < N_K``). Without the mask a GPU reads whatever memory follows the tensor, and
the result can still be right, because the scores of those keys are masked to -inf afterwards; a store
without the mask overwrites other memory (on a CPU, the interpreter corrupts the heap and the process
dies with no message). :func:`outside_accesses` makes both visible on a CPU: every lane of a load or
store whose mask is on and whose address lies in none of the launch's tensor arguments is counted and
skipped (such a load gives ``other``, such a store is dropped).

    with lk.tritonbounds.outside_accesses() as outside:
        kernel[grid](q, k, v, o, ...)
    outside["loads"], outside["stores"]    # 0 and 0 for a kernel that masks its tail tiles

:func:`int32_overflows` drives a kernel with offsets past 2^31 elements on tiny tensors and counts int32
overflow, so 32-bit address arithmetic (``bh * N * d`` without ``.to(tl.int64)``) is visible on a CPU.

Used in: 06_triton_flashattention, 08_decode_attention, 09_flex_attention (their kernels' tests: 64-bit
offsets, and loads and stores kept inside the tensors).
"""
from __future__ import annotations

import collections
import contextlib
from typing import Iterable, Iterator

import numpy as np
import torch

from labkit.core import grading
from labkit.tritonlab import mode as tritonmode


def spans(tensors: Iterable) -> list[tuple[int, int]]:
    """(first byte, end byte) of each tensor in ``tensors`` (other values are skipped)."""
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if isinstance(t, torch.Tensor)]


def within(addresses: np.ndarray, byte_spans: list[tuple[int, int]]) -> np.ndarray:
    """Per lane of ``addresses`` (the interpreter's pointers: byte addresses), whether it lies in one of ``byte_spans``."""
    inside = np.zeros(np.shape(addresses), dtype=bool)
    for lo, hi in byte_spans:
        inside |= (addresses >= lo) & (addresses < hi)
    return inside


@contextlib.contextmanager
def outside_accesses(module: str = "__main__") -> Iterator[collections.Counter]:
    """Count (and skip) the load and store lanes of kernels defined in ``module`` that leave their tensors.

    ``counts["loads"]``, ``counts["stores"]``: lanes whose mask is on and whose address lies in no tensor
    argument of the launch that runs them. In the compiled mode (a GPU) nothing runs through the
    interpreter and the counts stay 0: the check belongs to the CPU runs of a test.
    """
    counts: collections.Counter = collections.Counter()
    if tritonmode.current() != "interpreter":
        yield counts
        return
    from triton.runtime.interpreter import TensorHandle, interpreter_builder as ib
    launch_spans: list[tuple[int, int]] = []

    def on_launch(fn, args, kwargs):
        launch_spans[:] = spans([*args, *kwargs.values()])

    def kept(mask, ptrs, kind):
        inside = within(ptrs.data, launch_spans)
        counts[kind] += int(np.count_nonzero(mask.data & ~inside))
        return TensorHandle(mask.data & inside, mask.dtype)

    names = ("create_masked_load", "create_masked_store")
    saved = {name: ib.__dict__.get(name) for name in names}      # another probe's, restored on exit
    load, store = ib.create_masked_load, ib.create_masked_store
    ib.create_masked_load = lambda ptrs, mask, *a: load(ptrs, kept(mask, ptrs, "loads"), *a)
    ib.create_masked_store = lambda ptrs, value, mask, *a: store(ptrs, value, kept(mask, ptrs, "stores"), *a)
    try:
        with tritonmode.watched_launches(on_launch, module):
            yield counts
    finally:
        for name in names:
            if saved[name] is None:
                del ib.__dict__[name]
            else:
                ib.__dict__[name] = saved[name]


def check_inside(counts: collections.Counter, *, name: str, hint: str) -> None:
    """Test-cell check on :func:`outside_accesses`'s counts: no load or store left the tensors."""
    grading.check_true(counts["loads"] == counts["stores"] == 0, name=name,
                       detail=f"核心讀了 {counts['loads']} 個、寫了 {counts['stores']} 個落在傳入張量之外的元素（直譯器略過了"
                              "它們；GPU 上越界的載入讀到別的資料，越界的儲存寫壞別的記憶體）。", hint=hint)


@contextlib.contextmanager
def int32_overflows(keep: tuple = (), pid_offset: tuple = (0, 0, 0)) -> Iterator[collections.Counter]:
    """Drive interpreted kernels with offsets past 2^31 elements on tiny tensors; count int32 overflows.

    ``counts["overflows"]``: int32 +, - and * whose exact result does not fit in 32 bits (a GPU wraps
    them silently: an address so computed points elsewhere). Loads and stores outside the tensors in
    ``keep`` are skipped (a load gives 0): a kernel can be handed a capacity, page ids or sequence
    indices (``pid_offset``, added to ``tl.program_id``) as large as a real cache's, with no memory behind.
    """
    if tritonmode.current() != "interpreter":
        raise RuntimeError("int32_overflows() runs the interpreter's kernels; set TRITON_INTERPRET=1.")
    from triton.runtime.interpreter import TensorHandle, interpreter_builder as ib
    kept_spans = spans(keep)
    counts: collections.Counter = collections.Counter()
    cls = type(ib)

    def kept(mask, ptrs):
        return TensorHandle(mask.data & within(ptrs.data, kept_spans), mask.dtype)

    def binary_op(lhs, rhs, op):
        out = cls.binary_op(ib, lhs, rhs, op)
        if op in (np.add, np.subtract, np.multiply) and out.data.dtype == np.int32:
            exact = op(np.asarray(lhs.data, dtype=np.int64), np.asarray(rhs.data, dtype=np.int64))
            counts["overflows"] += int(np.count_nonzero(exact != out.data))
        return out

    ib.binary_op = binary_op
    ib.create_get_program_id = lambda axis: TensorHandle(
        cls.create_get_program_id(ib, axis).data + np.int32(pid_offset[axis]), cls.create_get_program_id(ib, axis).dtype)
    ib.create_masked_load = lambda ptrs, mask, *a: cls.create_masked_load(ib, ptrs, kept(mask, ptrs), *a)
    ib.create_masked_store = lambda ptrs, value, mask, *a: cls.create_masked_store(ib, ptrs, value, kept(mask, ptrs), *a)
    try:
        yield counts
    finally:
        for name in ("binary_op", "create_get_program_id", "create_masked_load", "create_masked_store"):
            del ib.__dict__[name]
