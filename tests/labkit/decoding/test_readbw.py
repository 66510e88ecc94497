"""The read-only ceiling: measured, positive, above what copy bandwidth credits a read with."""
from __future__ import annotations

import pytest
import torch

from labkit.engine import bench
from labkit.decoding import readbw


def test_read_bandwidth_on_cpu_is_a_positive_rate_and_refuses_an_empty_buffer():
    assert readbw.read_bandwidth(device="cpu", mib=4, target_ms=5) > 0
    with pytest.raises(ValueError, match="mib must be at least 1"):
        readbw.read_bandwidth(device="cpu", mib=0)


def test_the_cpu_read_ceiling_is_not_bound_by_a_conversion():
    """A CPU read of the same 32 MiB runs at the copy bandwidth's order (a bf16 sum converted element by element
    ran at 0.07x of it): at least a quarter of it, a margin no load on a shared CPU closes."""
    copy = bench.copy_bandwidth(device="cpu", mib=32)
    assert readbw.read_bandwidth(device="cpu", mib=32, target_ms=20) > 0.25 * copy


def test_every_read_config_covers_every_element_once():
    """Each tuned config's launch sums the whole buffer when its slices do not divide the length (interpreter
    on a CPU): the ceiling times a read of every byte, no fewer."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.arange(70_001, dtype=torch.float32, device=device)
    for block, unroll, warps, _ in readbw.READ_CONFIGS[:3]:
        sums = torch.full((5,), float("nan"), device=device)
        readbw._sum_call(x, sums, (block, unroll, warps, 1))()
        assert sums.sum().item() == pytest.approx(x.sum().item(), rel=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_read_ceiling_bounds_a_copy_and_a_read_of_the_same_bytes():
    """Reading only is faster than copying (which moves each byte twice, the bus turning around), and the
    ceiling is at or above read_once over a large tensor (the same kernel, plus a launch per tensor)."""
    ceiling = readbw.read_bandwidth(device="cuda", mib=1024)
    assert ceiling > bench.copy_bandwidth(device="cuda", mib=1024) / 2
    x = torch.ones(2**29, dtype=torch.bfloat16, device="cuda")
    t = bench.time_fn(readbw.read_once(x), device="cuda")
    assert x.numel() * 2 / (t.median_ms * 1e-3) <= 1.03 * ceiling
