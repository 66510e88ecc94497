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


class FakeCard:
    total_memory = 80 * 2**30               # an 80 GB card (GB on a card's label: GiB)


@pytest.fixture
def fake_cuda(clean_env):
    """Pretend CUDA is available (an 80 GB card), so the GPU choice can be tested on a CPU machine; the memory
    fractions the profile sets are recorded in ``fake_cuda.fractions``."""
    clean_env.delenv("LABKIT_GPU_MEMORY_GB", raising=False)
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    clean_env.setattr(torch.cuda, "get_device_properties", lambda device: FakeCard)
    clean_env.fractions = []
    clean_env.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device=None: clean_env.fractions.append(f))
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
    assert vars(p) == dict(name="cpu", device="cpu", memory_gb=None, seq_lens=[128, 256], d=32)


SMALLER = {24: dict(n=2048), 8: dict(n=512, steps=10)}


@pytest.mark.parametrize("cap, n, steps, fraction", [(None, 4096, 50, None), ("40", 4096, 50, 0.5),
                                                     ("16", 2048, 50, 0.2), ("8", 512, 10, 0.1), ("200", 4096, 50, None)])
def test_the_gpu_sizes_follow_the_memory_and_the_cap_limits_the_process(fake_cuda, cap, n, steps, fraction):
    """An 80 GB card takes the gpu sizes; capped by LABKIT_GPU_MEMORY_GB it takes every smaller_gpu entry at
    or above the cap (the smallest last) and the process may allocate only the cap; a cap above the card's
    memory changes nothing."""
    if cap is not None:
        fake_cuda.setenv("LABKIT_GPU_MEMORY_GB", cap)
    p = lk.profiles.choose(**SIZES, smaller_gpu=SMALLER)
    assert (p.n, p.steps) == (n, steps)
    assert p.memory_gb == (80 if cap in (None, "200") else float(cap))
    assert fake_cuda.fractions == ([] if fraction is None else [pytest.approx(fraction)])


@pytest.mark.parametrize("cap", ["0", "-5", "eight"])
def test_a_bad_memory_cap_is_refused_with_the_rule(fake_cuda, cap):
    fake_cuda.setenv("LABKIT_GPU_MEMORY_GB", cap)
    with pytest.raises(ValueError, match="positive number of GB"):
        lk.profiles.choose(**SIZES)


def test_smaller_gpu_may_only_change_sizes_the_gpu_profile_has(clean_env):
    with pytest.raises(ValueError, match=r"\['batch'\]"):
        lk.profiles.choose(**SIZES, smaller_gpu={16: dict(batch=2)})


def test_the_cpu_profile_has_no_gpu_memory(clean_env):
    clean_env.setenv("LABKIT_PROFILE", "cpu")
    assert lk.profiles.choose(**SIZES, smaller_gpu=SMALLER).memory_gb is None
