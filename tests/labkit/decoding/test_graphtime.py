"""CUDA-graph timing: errors kept without the frames that would hold graphs alive, memory handed back."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from labkit.decoding import graphtime


def _failed_call(keep) -> tuple[BaseException, weakref.ref]:
    """A call that fails while its frame holds a tensor (as a failed capture holds its graph and inputs):
    (the error as ``keep`` returns it, a weak reference to the tensor)."""
    big = torch.zeros(1000)
    try:
        held = big  # noqa: F841
        raise RuntimeError("cannot take this input")
    except RuntimeError as err:
        return keep(err), weakref.ref(big)


def test_a_kept_error_holds_no_frame_and_so_nothing_the_failed_call_held():
    """The cause of the H200 out-of-memory: an error kept with its traceback keeps the failed call's frame,
    and with it whatever that frame held (a graph, its pool, inputs), with no collection to free it."""
    gc.disable()
    try:
        raw, held_raw = _failed_call(lambda err: err)
        bare, held_bare = _failed_call(graphtime._bare)
        assert held_raw() is not None            # the plain error still holds the frame's tensor
        assert held_bare() is None               # the bare one does not: freed without a collection
    finally:
        gc.enable()
    assert bare.__traceback__ is None and bare.__context__ is None and str(bare) == "cannot take this input"


def test_time_per_call_off_a_gpu_times_the_calls_as_they_are_and_reports_failures_bare():
    def fails():
        raise ValueError("no kernel for this input")
    per_call, errors = graphtime.time_per_call([{"ok": lambda: torch.ones(8).sum(), "bad": fails}], "cpu",
                                               target_ms=1)
    assert set(per_call) == {"ok"} and per_call["ok"] > 0
    assert set(errors) == {"bad"} and errors["bad"].__traceback__ is None


def test_layered_cycles_the_caches_and_refuses_nothing_to_time():
    per_cache = [{"a": i, "b": 10 + i} for i in range(3)]
    assert graphtime.layered(per_cache, 5) == {"a": [0, 1, 2, 0, 1], "b": [10, 11, 12, 10, 11]}
    with pytest.raises(ValueError, match="at least one cache"):
        graphtime.layered([], 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_sweep_of_calls_that_fail_gives_their_memory_back():
    """Shapes whose call fails in its warm-up while its frame holds 1 GiB of inputs, one after another, as a
    sweep meets a backend that cannot take a shape: the errors are reported and, with the collector paused as
    the timer pauses it, the memory is free again (on an H200 the kept tracebacks held 116 GiB: out of memory)."""
    def fails_holding_inputs():
        x = torch.ones(256 * 2**20, device="cuda")                  # noqa: F841 - 1 GiB the frame holds
        raise ValueError("No available kernel")

    graphtime.release("cuda")
    before = torch.cuda.memory_allocated()
    kept = {}
    gc.disable()
    try:
        for shape in range(3):
            replays, errors = graphtime.graphed({"fails": fails_holding_inputs}, "cuda")
            assert not replays and "No available kernel" in str(errors["fails"])
            kept[shape] = errors["fails"]                            # reported later, as a sweep's table does
    finally:
        gc.enable()
    assert torch.cuda.memory_allocated() <= before + 2**20
