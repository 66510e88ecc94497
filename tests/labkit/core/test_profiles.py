"""Tests for labkit.core.profiles: the cpu/gpu size profile and how it is chosen."""
from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import labkit as lk
import labkit.cp.memory

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


@pytest.mark.parametrize("total_gib, n, steps", [(7.79, 512, 20), (14.75, 1024, 20), (23.65, 2048, 20), (79.1, 4096, 50)])
def test_a_cards_reported_memory_picks_the_entry_of_its_label(fake_cuda, total_gib, n, steps):
    """Real cards report a little less than their label in GiB (an RTX 3070 7.79, a T4 14.75, an RTX 4090 23.65,
    an H100 79.1): each takes its label's entry; a smaller entry keeps the larger entries' keys it does not set."""
    class Card:
        total_memory = int(total_gib * 2**30)
    fake_cuda.setattr(torch.cuda, "get_device_properties", lambda device: Card)
    p = lk.profiles.choose(**SIZES, smaller_gpu={24: dict(n=2048, steps=20), 16: dict(n=1024), 8: dict(n=512)})
    assert (p.n, p.steps, p.memory_gb) == (n, steps, pytest.approx(total_gib))


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


# ----------------------------------------------------------------------------- the notebooks' own profiles

ROOT = Path(__file__).resolve().parents[3]
NOTEBOOKS = {p.stem[:2]: p for p in sorted((ROOT / "solutions").glob("0*/0*.ipynb")) if "01" <= p.stem[:2] <= "08"}
LABELS = (8, 16, 24, 48)   # GB on the card's label; the cap LABKIT_GPU_MEMORY_GB emulates them on a large GPU
# What a program may allocate on a card: a T4 reports 14.7 GiB of its 16 (the smallest share among the cards the
# README names), and the CUDA context and the allocator's fragmentation take up to about 1 GiB more.
USABLE = {gb: 0.92 * gb - 1.0 for gb in (*LABELS, 80)}
SMALL = lk.perfmodel.ModelShape.gpt2("small")
GiB = 2**30


def profile_call(path: Path) -> str:
    """The source of the ``lk.profiles.choose(...)`` call in a notebook's first code cell that makes one."""
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "code" and "profiles.choose(" in src:
            call = next(node for node in ast.walk(ast.parse(src)) if isinstance(node, ast.Call)
                        and getattr(node.func, "attr", "") == "choose")
            return ast.get_source_segment(src, call)
    raise AssertionError(f"{path.name}: no lk.profiles.choose(...) call")


def sizes(nn: str, label: float, monkeypatch) -> SimpleNamespace:
    """Notebook nn's sizes on a GPU of ``label`` GB (profiles.gpu_memory_gb patched: no GPU needed)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(lk.profiles, "gpu_memory_gb", lambda: float(label))
    return eval(profile_call(NOTEBOOKS[nn]), {"lk": lk, "torch": torch})  # noqa: S307 - the course's own source


def test_every_notebook_names_the_sizes_a_smaller_gpu_changes(clean_env):
    """Each notebook's profile has smaller_gpu entries whose keys its gpu profile has (choose refuses others),
    and an 8 GB card gets sizes of its own: the large-GPU sizes are set for 80-140 GB."""
    assert sorted(NOTEBOOKS) == [f"{i:02d}" for i in range(1, 9)]   # 01-08: the notebooks sized for a GPU today
    for nn in NOTEBOOKS:
        assert "smaller_gpu=" in profile_call(NOTEBOOKS[nn]), f"{nn}: no smaller_gpu sizes"
        with pytest.MonkeyPatch.context() as mp:
            large, small = sizes(nn, 80, mp), sizes(nn, 8, mp)
        assert vars(large) != vars(small), f"{nn}: an 8 GB card gets the 80 GB sizes"
        assert small.memory_gb == 8 and large.memory_gb == 80


def training(shape, *, batch: int, seq_len: int, attention: str = "flash", **kw) -> float:
    return lk.longmem.memory_model(shape, batch=batch, seq_len=seq_len, attention=attention, **kw)["total"] / GiB


@pytest.mark.parametrize("label", (*LABELS, 80))
def test_the_chosen_sizes_fit_by_labkits_memory_models(clean_env, label):
    """Where labkit models the memory (lk.perfmodel, lk.longmem, lk.cpmem), each notebook's sizes on a card of
    this label fit what a program may allocate there; eager, which keeps the N x N scores, still fits at the
    shortest N, so the comparison has rows on both sides."""
    room = USABLE[label]
    with pytest.MonkeyPatch.context() as mp:
        p02, p03, p04, p07 = (sizes(nn, label, mp) for nn in ("02", "03", "04", "07"))
    # 02: the training table (one model per row) beside the two fp32 models the notebook keeps on the GPU
    resident = 4 * (SMALL.n_params() + SMALL.n_params(max(p02.lat_seq_lens))) / GiB
    for n in p02.train_seq_lens:
        batch = max(1, p02.train_tokens // n)
        assert resident + training(SMALL, batch=batch, seq_len=n) <= room, f"02 at {label} GB: labkit, N={n}"
    shortest = min(p02.train_seq_lens)
    eager = training(SMALL, batch=max(1, p02.train_tokens // shortest), seq_len=shortest, attention="eager")
    assert resident + eager <= room, f"02 at {label} GB: eager does not train even at N={shortest}"
    # 03: labkit against sdpa (flash + checkpointing + chunked loss), and the byte-level language model
    vs = p03.vs_sdpa
    for n in vs["seq_lens"]:
        assert training(SMALL, batch=1, seq_len=n, checkpointing=True, chunked_loss=True,
                        chunk_size=vs["chunk_size"]) <= room, f"03 at {label} GB: vs_sdpa at N={n}"
    lm = lk.perfmodel.ModelShape.gpt2("small", n_positions=max(p03.lm_ctx))
    lm = lk.perfmodel.ModelShape(lm.n_layer, lm.n_embd, lm.n_head, vocab=256, n_positions=lm.n_positions)
    for n in p03.lm_ctx:
        assert training(lm, batch=max(1, p03.lm_tokens // n), seq_len=n, checkpointing=p03.lm_ckpt) <= room
    # 04: the memory model checked against a measured step, eager and sdpa
    if p04.mem_check:
        n = p04.mem_check["seq_len"]
        for attention in ("eager", "flash"):
            assert training(SMALL, batch=max(1, p04.mem_check["tokens"] // n), seq_len=n,
                            attention=attention) <= room, f"04 at {label} GB: mem_check with {attention}"
    # 07: one GPU's cp-train run (its own process) beside the notebook's process and its CUDA context
    one_gpu = lk.cpmem.cp_memory(SMALL, seq_len=p07.cp_seq_len, world=1)["total"] / GiB
    assert one_gpu + 0.5 <= room, f"07 at {label} GB: cp-train --single at N={p07.cp_seq_len}"


@pytest.mark.parametrize("cap, reserved, free", [(None, 10, 70), ("8", 1, 7), ("8", 9, 0), ("40", 0, 40)])
def test_free_bytes_counts_the_cap(fake_cuda, cap, reserved, free):
    """What the process may still allocate: the GPU's free memory (70 GiB here), under the cap at most the
    cap less what PyTorch has reserved already (read_bandwidth sizes its buffer by it)."""
    if cap is not None:
        fake_cuda.setenv("LABKIT_GPU_MEMORY_GB", cap)
    fake_cuda.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * 2**30, 80 * 2**30))
    fake_cuda.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved * 2**30)
    assert lk.profiles.free_bytes("cuda:0") == free * 2**30


def test_apply_cap_caps_the_device_a_process_uses(fake_cuda):
    """cp-train's ranks cap their own GPU (LOCAL_RANK), not only GPU 0."""
    devices = []
    fake_cuda.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device=None: devices.append((f, device)))
    fake_cuda.setenv("LABKIT_GPU_MEMORY_GB", "16")
    assert lk.profiles.apply_cap(1) == 16
    assert devices == [(pytest.approx(0.2), 1)]
