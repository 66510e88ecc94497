"""Tests for labkit.profiles: the cpu/gpu size profile and how it is chosen."""
from __future__ import annotations

import pytest
import torch

import labkit as lk

SIZES = dict(cpu=dict(n=128, steps=2), gpu=dict(n=4096, steps=50))


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("LABKIT_PROFILE", raising=False)
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    return monkeypatch


@pytest.fixture
def fake_cuda(clean_env):
    """Pretend CUDA is available, so the GPU choice can be tested on a CPU machine."""
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    return clean_env


def test_device_decides_without_overrides(clean_env):
    expected = "gpu" if torch.cuda.is_available() else "cpu"
    assert lk.profiles.current() == expected


def test_cuda_means_gpu_profile(fake_cuda):
    assert lk.profiles.current() == "gpu"
    p = lk.profiles.choose(**SIZES)
    assert (p.name, p.device, p.n, p.steps) == ("gpu", "cuda", 4096, 50)


@pytest.mark.parametrize("value,expected", [("cpu", "cpu"), ("gpu", "gpu"), (" GPU ", "gpu"), ("Cpu", "cpu")])
def test_labkit_profile_overrides(clean_env, value, expected):
    clean_env.setenv("LABKIT_PROFILE", value)
    assert lk.profiles.current() == expected
    p = lk.profiles.choose(**SIZES)
    assert p.name == expected and p.n == SIZES[expected]["n"]
    # The gpu profile on a machine without CUDA keeps its sizes but runs on the CPU.
    assert p.device == ("cuda" if expected == "gpu" and torch.cuda.is_available() else "cpu")


def test_labkit_profile_cpu_beats_cuda(fake_cuda):
    fake_cuda.setenv("LABKIT_PROFILE", "cpu")
    p = lk.profiles.choose(**SIZES)
    assert (p.name, p.device, p.n) == ("cpu", "cpu", 128)


@pytest.mark.parametrize("value", ["tpu", "large", "gpu0"])
def test_labkit_profile_bad_value(clean_env, value):
    clean_env.setenv("LABKIT_PROFILE", value)
    with pytest.raises(ValueError, match=rf"LABKIT_PROFILE='{value}' is not a profile; use one of \('cpu', 'gpu'\)"):
        lk.profiles.current()


def test_nbgrader_execution_forces_cpu(fake_cuda):
    fake_cuda.setenv("NBGRADER_EXECUTION", "autograde")
    assert lk.profiles.current() == "cpu"
    p = lk.profiles.choose(**SIZES)
    assert (p.name, p.device, p.n) == ("cpu", "cpu", 128)


def test_labkit_profile_beats_nbgrader(fake_cuda):
    fake_cuda.setenv("NBGRADER_EXECUTION", "validate")
    fake_cuda.setenv("LABKIT_PROFILE", "gpu")
    assert lk.profiles.current() == "gpu"


def test_choose_keys_mismatch(clean_env):
    with pytest.raises(ValueError, match="same keys") as info:
        lk.profiles.choose(cpu=dict(n=1, steps=2), gpu=dict(n=2, seq=3))
    assert "steps" in str(info.value) and "seq" in str(info.value)


def test_choose_returns_every_size(clean_env):
    clean_env.setenv("LABKIT_PROFILE", "cpu")
    p = lk.profiles.choose(cpu=dict(seq_lens=[128, 256], d=32), gpu=dict(seq_lens=[1024], d=64))
    assert vars(p) == dict(name="cpu", device="cpu", seq_lens=[128, 256], d=32)
