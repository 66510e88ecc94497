"""Tests for labkit.perf.memory: the training-memory model, its recommender, and which backends keep
the N x N scores."""
from __future__ import annotations

import pytest

import labkit as lk

PM = lk.perfmodel
GIB = 2**30


@pytest.mark.parametrize("backend, expected", [("reference", "standard"), ("sdpa_math", "standard"), ("eager", "standard"),
                                               ("sdpa_flash", "flash"), ("fa4", "flash"), ("sdpa", "flash")])
def test_kind(backend, expected):
    assert PM.kind(backend) == expected


def test_gpt2_shapes_and_params():
    assert PM.ModelShape.gpt2("small").n_params() == 124_439_808  # GPT-2 small, tied embeddings
    assert PM.ModelShape.gpt2("medium").n_params() == 354_823_168
    assert PM.ModelShape.gpt2("small").n_params(4096) == 124_439_808 + 3072 * 768
    with pytest.raises(ValueError, match="size"):
        PM.ModelShape.gpt2("huge")


@pytest.mark.parametrize("attention, batch, seq_len, ckpt, gib", [
    ("sdpa", 16, 1024, False, 23.36), ("sdpa", 1, 32768, False, 45.3), ("eager", 16, 1024, False, 36.29),
    ("eager", 4, 4096, False, 76.82), ("sdpa", 1, 65536, True, 41.4)])
def test_training_memory_matches_measured_gpt2_small(attention, batch, seq_len, ckpt, gib):
    """Peaks measured on an H100 (shared/ANCHORS.md: HF GPT-2 small, bf16 autocast, fused AdamW)."""
    total = PM.training_memory(PM.ModelShape.gpt2("small"), batch=batch, seq_len=seq_len, attention=attention,
                               checkpointing=ckpt)["total"]
    assert total / GIB == pytest.approx(gib, rel=0.05)


def test_training_memory_components():
    shape = PM.ModelShape.gpt2("small")
    std = PM.training_memory(shape, batch=2, seq_len=2048, attention="standard")
    fl = PM.training_memory(shape, batch=2, seq_len=2048, attention="fa4")
    assert std["total"] == pytest.approx(sum(v for k, v in std.items() if k != "total"))
    p = shape.n_params(2048)
    assert (std["weights"], std["grads"], std["optimizer"]) == (4 * p, 4 * p, 8 * p)
    assert std["attention"] == 12 * 2 * 12 * 2048**2 * 6.0
    assert fl["attention"] == 12 * 2 * 2048 * 12 * 4.0 and fl["activations"] == std["activations"]
    longer = PM.training_memory(shape, batch=2, seq_len=4096, attention="standard")
    assert longer["attention"] == pytest.approx(4 * std["attention"]), "standard attention memory ~ N^2"
    ck = PM.training_memory(shape, batch=2, seq_len=2048, attention="standard", checkpointing=True)
    assert ck["attention"] == pytest.approx(std["attention"] / 12) and ck["activations"] < std["activations"]
    with pytest.raises(ValueError, match="unknown attention"):
        PM.training_memory(shape, batch=1, seq_len=8, attention="magic")
    with pytest.raises(ValueError, match=">= 1"):
        PM.training_memory(shape, batch=0, seq_len=8)


def test_recommend_prefers_no_checkpointing_then_largest_batch():
    shape = PM.ModelShape.gpt2("small")
    df = PM.recommend(shape, budget_bytes=80 * GIB, seq_len=1024, global_batch=32, attention="flash")
    chosen = df[df["chosen"]].iloc[0]
    assert df["chosen"].sum() == 1 and bool(chosen["fits"]) and not chosen["checkpointing"]
    assert chosen["micro_batch"] == df[df["fits"] & ~df["checkpointing"]]["micro_batch"].max()
    assert chosen["micro_batch"] * chosen["accumulation"] == 32
    assert chosen["predicted_gib"] <= 0.9 * 80
    tight = PM.recommend(shape, budget_bytes=12 * GIB, seq_len=8192, global_batch=8, attention="flash")
    assert bool(tight[tight["chosen"]]["checkpointing"].iloc[0]), "only checkpointing fits a 12 GiB budget at 8K"
    none = PM.recommend(shape, budget_bytes=1 * GIB, seq_len=1024, global_batch=4)
    assert not none["chosen"].any()
    with pytest.raises(ValueError):
        PM.recommend(shape, budget_bytes=0, seq_len=8, global_batch=1)


def test_max_seq_len():
    shape, budget = PM.ModelShape.gpt2("small"), 80 * GIB
    n = {(a, c): PM.max_seq_len(shape, budget_bytes=budget, attention=a, checkpointing=c)
         for a in ("standard", "flash") for c in (False, True)}
    assert n[("flash", False)] > 4 * n[("standard", False)] > 0
    assert n[("flash", True)] > n[("flash", False)] and n[("standard", True)] >= n[("standard", False)]
    for (a, c), val in n.items():
        mem = lambda s: PM.training_memory(shape, batch=1, seq_len=s, attention=a, checkpointing=c)["total"]  # noqa: E731
        assert val % 256 == 0 and mem(val) <= 0.9 * budget < mem(val + 256)
    assert PM.max_seq_len(shape, budget_bytes=GIB) == 0
