"""labkit.tritonlab.bounds: loads and stores that leave the launch's tensors are counted and skipped; int32 offsets that overflow."""
from __future__ import annotations

import pytest
import torch

import labkit as lk  # before triton: sets TRITON_INTERPRET=1 here (no CUDA in CI)

MODE = lk.tritonmode.setup()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

pytestmark = pytest.mark.skipif(MODE != "interpreter", reason="the probe runs the interpreter's kernels")


@triton.jit
def _copy(x_ptr, out_ptr, n, MASK_LOAD: tl.constexpr, MASK_STORE: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = x[i] + 1 over one block of BLOCK lanes; the tail past n masked where asked."""
    offs = tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=0.0) if MASK_LOAD else tl.load(x_ptr + offs)
    if MASK_STORE:
        tl.store(out_ptr + offs, x + 1, mask=inside)
    else:
        tl.store(out_ptr + offs, x + 1)


def _run(mask_load: bool, mask_store: bool, n: int = 20):
    """Copy 20 elements with a block of 32 lanes from a slice of a guarded buffer (guard: 12 elements of 7.0)."""
    x_buf, out_buf = torch.full((n + 12,), 7.0), torch.full((n + 12,), -1.0)
    x_buf[:n] = torch.arange(n, dtype=torch.float32)
    with lk.tritonbounds.outside_accesses(module=__name__) as outside:
        _copy[(1,)](x_buf[:n], out_buf[:n], n, MASK_LOAD=mask_load, MASK_STORE=mask_store, BLOCK=32)
    return outside, out_buf


def test_a_masked_kernel_stays_inside():
    outside, out = _run(True, True)
    assert outside["loads"] == 0 and outside["stores"] == 0
    assert out[:20].tolist() == [float(i + 1) for i in range(20)] and (out[20:] == -1).all()


@pytest.mark.parametrize("mask_load, mask_store, loads, stores", [
    (False, True, 12, 0),     # 12 lanes past the end read
    (True, False, 0, 12),     # 12 lanes past the end written
    (False, False, 12, 12),
])
def test_lanes_past_the_end_are_counted_and_skipped(mask_load, mask_store, loads, stores):
    outside, out = _run(mask_load, mask_store)
    assert (outside["loads"], outside["stores"]) == (loads, stores)
    assert out[:20].tolist() == [float(i + 1) for i in range(20)], "the lanes inside are unchanged"
    assert (out[20:] == -1).all(), "a store past the end is dropped: the memory after the tensor keeps its values"


def test_spans_and_within_on_byte_addresses():
    x = torch.zeros(4, dtype=torch.float32)
    (lo, hi), = lk.tritonbounds.spans([x, 3, None])        # non-tensors are skipped
    assert hi - lo == 16
    import numpy as np
    inside = lk.tritonbounds.within(np.array([lo, hi - 4, hi, lo - 1]), [(lo, hi)])
    assert inside.tolist() == [True, True, False, False]


def test_nothing_is_counted_outside_the_block():
    with lk.tritonbounds.outside_accesses(module=__name__) as outside:
        pass
    _run(False, False)                                   # after the block: the real methods again
    assert outside["loads"] == outside["stores"] == 0


@triton.jit
def _row_sum(x_ptr, out_ptr, stride, WIDE: tl.constexpr):
    """out[b] = x[b * stride + 0..15]; b widened to 64 bits first when WIDE."""
    b = tl.program_id(0)
    if WIDE:
        b = b.to(tl.int64)
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.load(x_ptr + b * stride + tl.arange(0, 16)), 0))


@pytest.mark.parametrize("wide", [True, False])
def test_int32_overflows_drives_offsets_past_2_31_on_tiny_tensors(wide):
    x, out = torch.ones(2, 16), torch.full((2,), 5.0)
    with lk.tritonbounds.int32_overflows(keep=(x, out)) as small:         # real offsets: the memory is read
        _row_sum[(2,)](x, out, 16, WIDE=wide)
    assert small["overflows"] == 0 and out.tolist() == [16.0, 16.0]
    with lk.tritonbounds.int32_overflows(keep=(x, out), pid_offset=(2**20, 0, 0)) as big:   # b * 2^12 passes 2^31
        _row_sum[(2,)](x, out, 2**12, WIDE=wide)
    assert big["overflows"] == (0 if wide else 2) and out.tolist() == [16.0, 16.0]   # stores past out: skipped
    _row_sum[(2,)](x, out, 16, WIDE=wide)                                   # the probe is off again
    assert out.tolist() == [16.0, 16.0]


def test_the_probe_nests_and_check_inside_names_the_counts():
    x, out = torch.arange(20.0), torch.zeros(20)
    with lk.tritonbounds.outside_accesses(module=__name__) as outer:
        with lk.tritonbounds.outside_accesses(module=__name__) as inner:
            _copy[(1,)](x, out, 20, MASK_LOAD=False, MASK_STORE=True, BLOCK=32)
        _copy[(1,)](x, out, 20, MASK_LOAD=True, MASK_STORE=False, BLOCK=32)   # the inner one restored the outer's
    assert (inner["loads"], inner["stores"]) == (12, 0), "the innermost probe sees the lanes first (and skips them)"
    assert (outer["loads"], outer["stores"]) == (0, 12)
    lk.tritonbounds.check_inside(inner.__class__(), name="nothing outside", hint="")
    with pytest.raises(AssertionError, match="12"):
        lk.tritonbounds.check_inside(outer, name="a store past the end", hint="mask=offs < n")
