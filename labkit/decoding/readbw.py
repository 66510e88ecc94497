"""Read-only memory bandwidth: the ceiling of a kernel that only reads, and a read-only reference call.

Copy bandwidth (:func:`labkit.engine.bench.copy_bandwidth`) counts a read and a write of every byte; the memory
turns the bus around between them, so a stream that only reads (a decode step reads its K/V cache and
writes a few KB) goes faster than a copy. Against copy bandwidth a good decode kernel can show more than
100%, which says the roof was the wrong one, not that the kernel beat the hardware:

- :func:`read_bandwidth`: the measured read ceiling. One launch of a streaming sum over a buffer far
  larger than L2, tuned: several vector loads in flight per thread, several programs per SM, the best of
  :data:`READ_CONFIGS`, timed as the decode kernels are. Bytes read / time.
- :func:`read_once`: the same kernel (the best config found on this device) over given tensors, one launch
  each plus a total: what reading exactly these bytes reaches at their size (fixed costs included), a
  reference row beside the kernels, not a bound.

On a CPU both use ``torch.sum`` (Triton's interpreter would time Python, not memory).

Used in: 08_decode_attention (through ``lk.decode``).
"""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from labkit.core import measure, profiles
from labkit.decoding import graphtime

READ_ONLY = "read only"   # the name of read_once's row or column
# (elements per load, loads in flight per step, warps, programs per SM); bf16: 4096 elements = 8 KB a load
# (on an H200 the first two reached 4.55 TB/s over 4-8 GiB, timed as the decode kernels are; a loop with
# one load per step reached 3.8; eviction hints and .cg loads changed nothing)
READ_CONFIGS = [(1024, 8, 4, 32), (1024, 4, 4, 32), (1024, 8, 4, 16), (2048, 8, 4, 8), (8192, 2, 8, 4),
                (512, 16, 2, 16)]
_best: dict[int, tuple[int, int, int, int]] = {}   # device index -> the fastest READ_CONFIGS entry found there


@triton.jit
def _read_kernel(x_ptr, sums_ptr, n, per_program, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Program p sums elements [p * per_program, min((p + 1) * per_program, n)) of x into sums[p] (fp32),
    UNROLL independent loads of BLOCK elements in flight per step (a plain loop waits for each load)."""
    p = tl.program_id(0).to(tl.int64)
    lo = p * per_program
    hi = tl.minimum(lo + per_program, n)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(lo, hi, BLOCK * UNROLL):
        for u in tl.static_range(UNROLL):
            offs = start + u * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < hi, other=0.0).to(tl.float32)
    tl.store(sums_ptr + p, tl.sum(acc, 0))


def _sum_call(x: torch.Tensor, sums: torch.Tensor, config: tuple[int, int, int, int]) -> Callable[[], None]:
    """One launch of :func:`_read_kernel` over x (1-D view) into sums [programs] with ``config``."""
    block, unroll, warps, _ = config
    programs = sums.numel()
    per = -(-x.numel() // programs // block) * block
    return lambda: _read_kernel[(programs,)](x, sums, x.numel(), per, BLOCK=block, UNROLL=unroll, num_warps=warps)


def _programs(device: torch.device, config: tuple[int, int, int, int]) -> int:
    return config[3] * torch.cuda.get_device_properties(device).multi_processor_count


def read_bandwidth(*, device=None, mib: int | None = None, target_ms: float = 50.0) -> float:
    """Measured read-only bandwidth in bytes/s (reads only counted): the fastest of :data:`READ_CONFIGS`
    streaming over a ``mib`` MiB bf16 buffer (default: 8 GiB, or a quarter of the free GPU memory if less,
    ``LABKIT_GPU_MEMORY_GB``'s cap counted: :func:`labkit.core.profiles.free_bytes`),
    timed as the decode kernels are (:func:`labkit.decoding.graphtime.time_per_call`: graphs of LAYERS launches, L2
    flushed by a read), so fixed costs weigh alike. The winning config is kept for :func:`read_once` on this
    device. CPU: ``torch.sum`` over a ``mib`` (default 64) MiB fp32 buffer."""
    device = measure.as_device(device)
    if mib is None:
        mib = 64 if device.type != "cuda" else min(8192, profiles.free_bytes(device) // 4 // 2**20)  # cap counted
    if mib < 1:
        raise ValueError(f"mib must be at least 1, got {mib}")
    if device.type != "cuda":  # fp32: a CPU's sum of bf16 is bound by the conversion (~1 GB/s), not by memory
        x = torch.ones(mib * 2**18, dtype=torch.float32)
        t = measure.time_fn(lambda: x.sum(), device=device, target_ms=target_ms)
        return x.numel() * x.element_size() / (t.median_ms * 1e-3)
    x = torch.ones(mib * 2**19, dtype=torch.bfloat16, device=device)
    calls = {config: _sum_call(x, torch.empty(_programs(device, config), device=device), config)
             for config in READ_CONFIGS}
    per_call, _ = graphtime.time_per_call([calls], device, target_ms=target_ms)
    best = min(per_call, key=per_call.get)
    _best[device.index or 0] = best
    nbytes = x.numel() * x.element_size()
    del x, calls                                  # the buffer (up to 8 GiB) back to the GPU, not kept reserved
    graphtime.release(device)
    return nbytes / (per_call[best] * 1e-3)


def read_once(*tensors: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A call that reads every element of ``tensors`` once and returns their total (fp32, a 0-d tensor): what
    reading the same bytes and computing nothing reaches at that size, timed the same way as the kernels.
    A reference, not a bound: one launch per tensor and one for the total (the fixed costs of short reads
    show in it); :func:`read_bandwidth` is the ceiling. On a GPU, :func:`read_bandwidth`'s best config on
    this device (a default before it has run); on a CPU ``torch.sum``."""
    if not tensors or any(not t.is_contiguous() for t in tensors):
        raise ValueError("read_once takes one or more contiguous tensors")
    device = tensors[0].device
    if device.type != "cuda":
        return lambda: sum(t.sum(dtype=torch.float32) for t in tensors)
    config = _best.get(device.index or 0, READ_CONFIGS[1])
    sums = torch.empty(len(tensors), _programs(device, config), dtype=torch.float32, device=device)
    launches = [_sum_call(t.view(-1), row, config) for t, row in zip(tensors, sums)]

    def run():
        for launch in launches:
            launch()
        return sums.sum()
    return run
