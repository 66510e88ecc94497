"""Tests for labkit.numerics.amp: gradient statistics, NaN/Inf monitor, output capture, AMP training loop."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.numerics import amp

CUDA = torch.cuda.is_available()


# ----------------------------------------------------------------------------- gradient statistics

def test_grad_stats():
    model = nn.Linear(4, 2)
    model(torch.ones(3, 4)).sum().backward()
    model.weight.grad[0, 0] = float("inf")
    model.weight.grad[0, 1] = 0.0
    model.weight.grad[0, 2] = 1e-9            # would round to 0 in fp16
    s = amp.grad_stats(model).set_index("param")
    assert s.loc["weight", "frac_nonfinite"] == pytest.approx(1 / 8)
    assert s.loc["weight", "frac_zero"] == pytest.approx(1 / 8)
    assert s.loc["weight", "frac_fp16_underflow"] == pytest.approx(1 / 8)
    assert s.loc["bias", "norm"] == pytest.approx(math.sqrt(2 * 3.0**2))
    assert math.isfinite(s.loc["weight", "norm"])


def test_grad_stats_without_grads_raises():
    with pytest.raises(ValueError, match="backward"):
        amp.grad_stats(nn.Linear(2, 2))


# ----------------------------------------------------------------------------- activation monitor

def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def test_nan_monitor_finds_first_bad_step_and_module():
    model = _mlp()
    with amp.NaNMonitor(model) as mon:
        for step in range(4):
            mon.step = step
            x = torch.ones(2, 8)
            if step == 2:
                x[0, 0] = float("inf")
            model(x)
    assert all(not m._forward_hooks for m in model.modules()), "hooks removed on exit"
    s = mon.summary().set_index("module")
    assert list(s.index) == ["0", "1", "2"] and (s["calls"] == 4).all()
    assert s.loc["0", "first_bad_step"] == 2 and s.loc["0", "inf_calls"] + s.loc["0", "nan_calls"] >= 1
    first = mon.first_nonfinite()
    assert first["step"] == 2 and first["module"] == "0"
    assert len(mon.history()) == 12


def test_nan_monitor_does_not_keep_the_model_alive():
    import gc
    import weakref

    model = _mlp()
    with amp.NaNMonitor(model) as mon:
        model(torch.ones(2, 8))
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None and len(mon.summary()) == 3  # the statistics stay, the model (and its gradients) go


def test_nan_monitor_every_and_plot():
    import matplotlib
    matplotlib.use("Agg")
    model = _mlp()
    with amp.NaNMonitor(model, modules=["0", "2"], every=2) as mon:
        for step in range(4):
            mon.step = step
            model(torch.ones(1, 8))
    assert sorted(mon.history()["step"].unique()) == [0, 2]
    assert mon.first_nonfinite() is None
    assert mon.plot() is not None


def test_nan_monitor_unknown_module():
    with pytest.raises(ValueError, match="unknown module"):
        amp.NaNMonitor(_mlp(), modules=["nope"])


def test_capture_outputs():
    model = _mlp()
    out = amp.capture_outputs(model, lambda: model(torch.ones(3, 8)))
    assert list(out) == ["0", "1", "2"] and out["2"].shape == (3, 1)
    assert all(not m._forward_hooks for m in model.modules())


# ----------------------------------------------------------------------------- AMP harness

def _toy_task(steps=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 1, generator=g)
    batches = []
    for _ in range(steps):
        x = torch.randn(32, 8, generator=g)
        batches.append((x, x @ w))
    return batches


def _mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x).float(), y)


@pytest.mark.parametrize("mode", ["fp32", "tf32", "bf16"])
def test_train_amp_learns(mode):
    run = amp.train_amp(_mlp(), _toy_task(), _mse, mode=mode, lr=1e-2)
    h = run.history
    assert list(h.columns) == ["step", "loss", "skipped", "grad_norm", "scale", "ms"]
    assert h["loss"].iloc[-3:].mean() < h["loss"].iloc[:3].mean()
    assert not h["skipped"].any() and math.isnan(run.peak_mib)  # no allocator statistics on CPU
    assert torch.get_float32_matmul_precision() == "highest", "global setting restored"
    s = run.summary()
    assert s["mode"] == mode and s["step_ms"] > 0


def test_train_amp_fp16_scaler_skips_injected_overflow():
    run = amp.train_amp(_mlp(), _toy_task(), _mse, mode="fp16", lr=1e-2, inject_overflow_at=5,
                        scaler_kwargs=dict(init_scale=2.0**10, growth_interval=100))
    h = run.history.set_index("step")
    assert h["skipped"].tolist() == [i == 5 for i in range(12)]
    assert h.loc[5, "scale"] == h.loc[4, "scale"] / 2, "scale backs off by 0.5 after an overflow"
    assert h["loss"].map(math.isfinite).all(), "training continues after the skipped step"


def test_train_amp_without_scaler_needs_a_guard():
    model = _mlp()
    amp.train_amp(model, _toy_task(), _mse, mode="bf16", inject_overflow_at=3)
    assert not all(torch.isfinite(p).all() for p in model.parameters()), "the inf reached the weights"
    model = _mlp()
    run = amp.train_amp(model, _toy_task(), _mse, mode="bf16", inject_overflow_at=3, skip_nonfinite=True)
    assert run.history["skipped"].tolist() == [i == 3 for i in range(12)]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_train_amp_with_monitor():
    model = _mlp()
    with amp.NaNMonitor(model) as mon:
        amp.train_amp(model, _toy_task(6), _mse, mode="fp32", inject_overflow_at=2, monitor=mon)
    assert mon.first_nonfinite()["step"] == 3, "weights broken at step 2 show up in step 3's forward"


def test_train_amp_unknown_mode():
    with pytest.raises(ValueError, match="unknown mode"):
        amp.train_amp(_mlp(), _toy_task(), _mse, mode="fp8")


def test_no_deprecated_amp_api():
    source = Path(amp.__file__).read_text()
    assert "cuda.amp" not in source


# ----------------------------------------------------------------------------- CUDA only

@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["fp32", "fp16", "bf16"])
def test_train_amp_cuda(mode):
    model = _mlp().cuda()
    batches = [(x.cuda(), y.cuda()) for x, y in _toy_task()]
    inject = 5 if mode == "fp16" else None
    run = amp.train_amp(model, batches, _mse, mode=mode, lr=1e-2, inject_overflow_at=inject,
                        scaler_kwargs=dict(init_scale=2.0**8))  # small scale: no real fp16 overflow in the toy
    assert math.isfinite(run.history["loss"].iloc[-1])
    assert run.peak_mib > 0 and math.isfinite(run.peak_mib)
    assert run.history["skipped"].sum() == (1 if mode == "fp16" else 0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_fp16_gradscaler_backoff():
    model = _mlp().cuda()
    batches = [(x.cuda(), y.cuda()) for x, y in _toy_task()]
    run = amp.train_amp(model, batches, _mse, mode="fp16", inject_overflow_at=3,
                        scaler_kwargs=dict(init_scale=2.0**8, growth_interval=2))
    h = run.history.set_index("step")
    assert h.loc[1, "scale"] == 2 * h.loc[0, "scale"], "scale grows after growth_interval good steps"
    assert h.loc[3, "skipped"] and h.loc[3, "scale"] == h.loc[2, "scale"] / 2


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_nan_monitor():
    model = _mlp().cuda()
    with amp.NaNMonitor(model) as mon:
        model(torch.full((2, 8), float("nan"), device="cuda"))
    assert mon.first_nonfinite()["module"] == "0"
