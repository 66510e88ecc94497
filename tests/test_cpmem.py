"""labkit.cpmem: the memory model on P devices (what shards, what is replicated)."""
from __future__ import annotations

import pytest

from labkit import cpmem, longmem
from labkit.perfmodel import ModelShape

SMALL = ModelShape.gpt2("small")
GIB = 2**30


def test_one_device_is_notebook_03s_model():
    n = 262144
    one = cpmem.cp_memory(SMALL, seq_len=n, world=1)
    ref = longmem.memory_model(ModelShape.gpt2("small", n_positions=n), batch=1, seq_len=n,
                               checkpointing=True, chunked_loss=True)
    assert one["total"] == pytest.approx(ref["total"])
    assert one["ring"] == 0
    assert one["total"] / GIB == pytest.approx(36.0, rel=0.05)  # measured on one H200 (issue 14)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_replicated_part_stays_sharded_part_shrinks(world):
    n = 1 << 20
    one, many = (cpmem.cp_memory(SMALL, seq_len=n, world=w) for w in (1, world))
    assert many["replicated"] == pytest.approx(one["replicated"])  # weights, grads, AdamW, casts: full copies
    assert many["local_tokens"] == n // world
    sharded_tokens = many["sharded"] - many["ring"] - many["logits"]  # the loss's chunk buffers do not shrink
    assert sharded_tokens == pytest.approx((one["sharded"] - one["logits"]) / world, rel=1e-6)
    assert many["ring"] == cpmem.RING_BYTES * (n // world) * SMALL.n_embd


def test_position_table_is_replicated():
    """The learned table grows with N on every device: 18 bytes per position and hidden unit."""
    a, b = (cpmem.cp_memory(SMALL, seq_len=n, world=4) for n in (1 << 20, 2 << 20))
    assert b["replicated"] - a["replicated"] == pytest.approx(18 * (1 << 20) * SMALL.n_embd)


def test_table_and_longest_sequence():
    df = cpmem.cp_table(SMALL, [1 << 18, 1 << 20], worlds=(1, 2))
    assert list(df.world) == [1, 2, 1, 2]
    assert (df.total_gib - df.replicated_gib - df.sharded_gib).abs().max() < 1e-9
    one = cpmem.longest_sequence(SMALL, budget_bytes=139 * GIB, world=1)
    two = cpmem.longest_sequence(SMALL, budget_bytes=139 * GIB, world=2)
    assert 0.8e6 < one < 1.1e6 and 1.3 * one < two < 2 * one  # replication keeps 2 GPUs under 2x
    assert cpmem.cp_memory(SMALL, seq_len=two, world=2)["total"] <= 0.9 * 139 * GIB
    assert cpmem.cp_memory(SMALL, seq_len=two + 2 * 8192, world=2)["total"] > 0.9 * 139 * GIB
    assert cpmem.longest_sequence(SMALL, budget_bytes=GIB, world=2) == 0


def test_bad_world():
    with pytest.raises(ValueError, match="world"):
        cpmem.cp_memory(SMALL, seq_len=4, world=8)


def test_ring_rotation_shrinks_with_p_allgather_grows_with_n():
    """As a ring ("alltoall", what lk.cptrain sets) the K/V in flight are the local tokens'; torch's
    default all-gather keeps the other devices' K/V too: 4 bytes (K and V, bf16) per hidden unit and token."""
    n, h = 1 << 20, SMALL.n_embd
    for world in (2, 4, 8):
        ring, gather = (cpmem.cp_memory(SMALL, seq_len=n, world=world, rotate=r) for r in cpmem.ROTATIONS)
        assert ring["ring"] == cpmem.RING_BYTES * (n // world) * h
        assert gather["ring"] - ring["ring"] == pytest.approx(cpmem.GATHER_BYTES * (n - n // world) * h)
        assert gather["total"] - ring["total"] == pytest.approx(gather["ring"] - ring["ring"])
    assert cpmem.cp_memory(SMALL, seq_len=n, world=1, rotate="allgather")["ring"] == 0
    with pytest.raises(ValueError, match="rotate"):
        cpmem.cp_memory(SMALL, seq_len=n, world=2, rotate="ring")
