"""Tests for labkit.core.measure: timing in turns (on a virtual clock where the logic is tested), peak memory."""
from __future__ import annotations

import collections
import math
import time

import pytest
import torch

import labkit as lk

M = lk.measure


def test_time_fn_cpu_measures_the_call():
    calls = []

    def sleep_2ms():
        calls.append(1)
        time.sleep(0.002)

    t = M.time_fn(sleep_2ms, device="cpu", warmup=2, target_ms=30, min_reps=5, max_reps=50)
    assert isinstance(t, M.Timing)
    assert t.p20_ms <= t.median_ms <= t.p80_ms
    assert 2.0 <= t.median_ms < 50, f"a 2 ms sleep timed as {t.median_ms:.3f} ms"
    assert 5 <= t.reps <= 50 and t.reps <= math.ceil(30 / 2.0)  # about target_ms / (time of one call)
    if len(calls) == 2 + 5:  # a loaded machine: the 5 estimate calls alone filled target_ms and are the timing
        assert t.reps == 5, "when the estimate fills target_ms, its calls are the reps"
        return
    settle = int(0.25 * 30 / t.median_ms)  # the clock-settling warm-up: about target_ms / 4
    assert 2 + 5 + t.reps <= len(calls) <= 2 + 5 + settle + 1 + t.reps, (
        "warm-up calls, the estimate, a short settling warm-up, then one call per rep")


def test_time_fn_rep_bounds():
    fast = M.time_fn(lambda: None, device="cpu", target_ms=1000, min_reps=3, max_reps=7)
    assert fast.reps == 7, "a call far below target_ms is repeated max_reps times"
    calls = []
    slow = M.time_fn(lambda: (calls.append(1), time.sleep(0.003)), device="cpu", warmup=0, target_ms=0.1,
                      min_reps=4, max_reps=9)
    assert slow.reps == 4, "a call longer than target_ms is still repeated min_reps times"
    assert len(calls) == 4, "... and those reps are the measurement: no settling warm-up, no second pass"


def test_peak_memory_is_nan_on_cpu():
    calls = []
    assert math.isnan(M.peak_memory(lambda: calls.append(torch.ones(1000)), device="cpu"))
    assert len(calls) == 1


def test_is_oom():
    assert M.is_oom(torch.OutOfMemoryError("x"))
    assert M.is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried... out of memory"))
    assert not M.is_oom(RuntimeError("shape mismatch"))


@pytest.mark.gpu
def test_time_fn_cuda_events_scale_with_work():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    one = M.time_fn(lambda: a @ a, device="cuda", warmup=3, target_ms=100)
    eight = M.time_fn(lambda: [a @ a for _ in range(8)], device="cuda", warmup=3, target_ms=100, flush_l2=True)
    assert 0 < one.p20_ms <= one.median_ms <= one.p80_ms
    # Asynchronous launches timed on the host without events would not scale with the GPU work.
    assert 5 < eight.median_ms / one.median_ms < 12, (one, eight)


@pytest.mark.gpu
def test_peak_memory_cuda_counts_an_allocation():
    n = 64 * 2**20
    extra = M.peak_memory(lambda: torch.empty(n, dtype=torch.uint8, device="cuda"), device="cuda")
    assert n <= extra < n + 2 * 2**20


def test_turns_rotate_the_order_and_spread_the_rarer_calls():
    order = []
    fns = {name: (lambda name=name: order.append(name)) for name in "abc"}
    got = M._turns_ms(fns, {"a": 6, "b": 6, "c": 2}, block=None, device=torch.device("cpu"), flush=None,
                       errors=(), failures={})
    assert {name: len(ms) for name, ms in got.items()} == {"a": 6, "b": 6, "c": 2}
    assert order[:2] == ["a", "b"] and order[2:4] == ["b", "a"], "turn i starts at name i"
    c_at = [i for i, name in enumerate(order) if name == "c"]
    assert order[c_at[0] + 1:c_at[1]].count("a") >= 2, "the two calls of c are spread over the turns"


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_turns_put_every_name_after_every_other_equally_often(n):
    """A rotation (0 1 2, 1 2 0, ...) keeps each name's predecessor fixed, so what a heavy call leaves
    behind (a lower clock) always falls on the same next name."""
    rows = [M.turn_order(n, i) for i in range(M.balanced_turns(n))]
    assert all(sorted(row) == list(range(n)) for row in rows), f"each turn runs every name once: {rows}"
    firsts = {name: sum(row[0] == name for row in rows) for name in range(n)}
    assert len(set(firsts.values())) == 1, f"every name as often first: {firsts}"
    follows = collections.Counter((a, b) for row in rows for a, b in zip(row, row[1:]))
    assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1, \
        f"every name right after every other one equally often: {dict(follows)}"


def test_turns_run_in_turn_order():
    order = []
    fns = {name: (lambda name=name: order.append(name)) for name in "abc"}
    M._turns_ms(fns, {name: 6 for name in "abc"}, block=None, device=torch.device("cpu"), flush=None, errors=(),
                failures={})
    after_a = {order[i + 1] for i in range(len(order) - 1) if order[i] == "a" and i % 3 != 2}
    assert after_a == {"b", "c"}, f"_turns_ms follows turn_order: {order}"


def test_a_block_of_calls_starts_with_an_untimed_lead_in():
    order = []
    fns = {name: (lambda name=name: order.append(name)) for name in "ab"}
    got = M._turns_ms(fns, {"a": 4, "b": 3}, block={"a": 3, "b": 4}, device=torch.device("cpu"), flush=None,
                       errors=(), failures={})
    assert {name: len(ms) for name, ms in got.items()} == {"a": 4, "b": 3}, "exactly the reps asked for are timed"
    assert order == ["a"] * 3 + ["b"] * 4 + ["a"] * 3, "blocks of a take turns with b's; lead-ins untimed"


def test_every_turn_starts_on_an_idle_gpu(monkeypatch):
    """A backlog left by the previous function would hide this one's launch cost (auto then
    picked a Python-launched kernel whose launches are slower than its kernels)."""
    order = []
    monkeypatch.setattr(M, "_sync", lambda device: order.append("sync"))
    fns = {name: (lambda name=name: order.append(name)) for name in "ab"}
    M._turns_ms(fns, {"a": 2, "b": 1}, block={"a": 3, "b": 2}, device=torch.device("cpu"), flush=None,
                errors=(), failures={})
    assert order == ["sync", "a", "a", "a", "sync", "b", "b", "sync"], "a synchronize before each turn, one at the end"


class VirtualClock:
    """Stands in for the ``time`` module of labkit.core.measure: work advances it by exact amounts, so
    timing logic is tested without a busy CPU's preemptions."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def work(self, ms: float) -> None:
        self.now += ms / 1e3


def test_lead_ins_keep_a_slow_launch_of_the_previous_function_out_of_the_timings(monkeypatch):
    clock, last = VirtualClock(), [None]
    monkeypatch.setattr(M, "time", clock)

    def kernel(name):
        def call():  # the first call after the other function pays 3 ms (an empty GPU queue refilling)
            clock.work(1.0 if last[0] in (name, None) else 4.0)
            last[0] = name
        return call

    timings, _ = M.time_interleaved({"a": kernel("a"), "b": kernel("b")}, device="cpu", target_ms=20)
    for t in timings.values():
        assert t.p20_ms == pytest.approx(1.0) and t.p80_ms == pytest.approx(1.0), f"the 1 ms call timed as {t}"


class FakeEvent:
    """A CUDA event whose elapsed time is what the test says the GPU took."""
    gpu_ms = 0.0

    def __init__(self, enable_timing=True):
        pass

    def record(self):
        pass

    def elapsed_time(self, end):
        return FakeEvent.gpu_ms


@pytest.mark.parametrize("host_ms,gpu_ms,expected", [(3.0, 1.0, 3.0), (0.5, 2.0, 2.0)])
def test_a_gpu_call_takes_the_longer_of_its_launch_and_its_kernels(monkeypatch, host_ms, gpu_ms, expected):
    """The flush queued before a call keeps the GPU busy while the host launches: the events alone would
    let a slow launch go free (FA4 beat SDPA in auto's timing, then made GPT-2's forward 1.3x slower)."""
    clock = VirtualClock()
    monkeypatch.setattr(M, "time", clock)
    monkeypatch.setattr(M.torch.cuda, "Event", FakeEvent)
    FakeEvent.gpu_ms = gpu_ms
    read = M._timed_call(lambda: clock.work(host_ms), torch.device("cuda"), flush=None)
    assert read() == pytest.approx(expected)


def test_without_host_time_a_gpu_call_is_timed_by_its_events_alone(monkeypatch):
    """As do_bench: a launch slower than the kernels is hidden (a training step's queue hides it)."""
    clock = VirtualClock()
    monkeypatch.setattr(M, "time", clock)
    monkeypatch.setattr(M.torch.cuda, "Event", FakeEvent)
    FakeEvent.gpu_ms = 1.0
    read = M._timed_call(lambda: clock.work(3.0), torch.device("cuda"), flush=None, host_time=False)
    assert read() == pytest.approx(1.0)


def test_taking_turns_cancels_a_drifting_clock(monkeypatch):
    clock, calls = VirtualClock(), [0]
    monkeypatch.setattr(M, "time", clock)

    def same_kernel():  # each call 1% slower than the one before: a clock that throttles
        calls[0] += 1
        clock.work(1.0 + 0.01 * calls[0])

    one_after_other = [M.time_fn(same_kernel, device="cpu", target_ms=30).median_ms for _ in "ab"]
    assert one_after_other[1] / one_after_other[0] > 1.1, "timed one after the other, the second looks slower"
    calls[0] = 0
    timings, _ = M.time_interleaved({"a": same_kernel, "b": same_kernel}, device="cpu", target_ms=30)
    assert timings["b"].median_ms / timings["a"].median_ms == pytest.approx(1.0, abs=0.03), \
        "taking turns, both see the same clock"


def test_time_interleaved_drops_a_failing_call_and_times_the_rest():
    calls = {"ok": 0, "bad": 0}

    def ok():
        calls["ok"] += 1

    def bad():
        calls["bad"] += 1
        if calls["bad"] == 4:  # fails while being timed, after its warm-up
            raise RuntimeError("CUDA out of memory")

    timings, failures = M.time_interleaved({"ok": ok, "bad": bad}, device="cpu", target_ms=1, min_reps=3,
                                            max_reps=5, errors=(RuntimeError,))
    assert set(timings) == {"ok"} and timings["ok"].reps == 5
    assert list(failures) == ["bad"] and "out of memory" in str(failures["bad"])
    with pytest.raises(RuntimeError):
        calls["bad"] = 0
        M.time_interleaved({"bad": bad}, device="cpu", target_ms=1, min_reps=3)  # not in errors: raised


def test_gc_paused_pauses_and_restores_the_collector():
    import gc

    with M.gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    seen = []
    M.time_interleaved({"f": lambda: seen.append(gc.isenabled())}, device="cpu", target_ms=1)
    assert seen and not any(seen), "time_interleaved times with the collector paused"
    assert gc.isenabled()
    gc.disable()
    try:
        with M.gc_paused():
            pass
        assert not gc.isenabled(), "a collector the caller had turned off stays off"
    finally:
        gc.enable()


def test_the_l2_flush_writes_or_reads_and_refuses_anything_else():
    """Off a GPU there is no L2 to flush (None); a flush other than write/read is a clear error, also
    through time_interleaved."""
    assert M.l2_flusher("cpu", "write") is None and M.l2_flusher("cpu", "read") is None
    with pytest.raises(ValueError, match="'write' or 'read'"):
        M.l2_flusher("cpu", "zero")
    with pytest.raises(ValueError, match="'write' or 'read'"):
        M.time_interleaved({"f": lambda: None}, device="cpu", flush_l2=True, flush_by="clean", target_ms=1)
