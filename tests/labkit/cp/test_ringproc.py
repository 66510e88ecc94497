"""labkit.cp.ring: block attention, the simulated ring and the ring as gloo processes.

The merge of two partial results is the reader's exercise, so the tests bring their own.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from labkit.cp import ring as ringproc


def merge(o1, lse1, o2, lse2):
    """The test's merge: softmax weights exp(lse_i - lse) of the two partial results."""
    lse = torch.logaddexp(lse1, lse2)
    return o1 * torch.exp(lse1 - lse)[..., None] + o2 * torch.exp(lse2 - lse)[..., None], lse


def qkv(n: int, seed: int = 0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, n, 8, generator=gen, dtype=dtype) for _ in range(3)]


def reference(q, k, v, causal):
    """(o, lse) from SDPA's math and a float64 logsumexp: computed another way than block_attention."""
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal), torch.logsumexp(s, dim=-1)


@pytest.mark.parametrize("causal", [False, True])
def test_block_attention_matches_sdpa(causal):
    q, k, v = qkv(13)
    o, lse = ringproc.block_attention(q, k, v, q_start=0, k_start=0, causal=causal)
    ref_o, ref_lse = reference(q, k, v, causal)
    torch.testing.assert_close(o, ref_o)
    torch.testing.assert_close(lse, ref_lse)


def test_block_attention_offsets_and_empty_rows():
    q, k, v = qkv(6)
    # queries at 10..15, keys at 12..17: query 10 and 11 see nothing, query 15 sees keys 12..15
    o, lse = ringproc.block_attention(q, k, v, q_start=10, k_start=12, causal=True)
    assert torch.isneginf(lse[..., :2]).all() and (o[..., :2, :] == 0).all()
    ref_o, _ = reference(q[..., 5:, :], k[..., :4, :], v[..., :4, :], causal=False)
    torch.testing.assert_close(o[..., 5:, :], ref_o)


def test_chunk_sizes():
    assert ringproc.chunk_sizes(10, 3) == [4, 3, 3]
    assert ringproc.chunk_sizes(8, 4) == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="world"):
        ringproc.chunk_sizes(3, 4)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world,n,sizes", [(1, 9, None), (2, 10, None), (3, 11, None), (4, 13, None),
                                           (3, 12, [7, 1, 4]), (4, 16, [1, 2, 3, 10])])
def test_simulated_ring_equals_reference(world, n, sizes, causal):
    q, k, v = qkv(n, seed=world)
    o, lse, log = ringproc.simulate_ring(q, k, v, merge, world=world, causal=causal, sizes=sizes)
    ref_o, ref_lse = reference(q, k, v, causal)
    torch.testing.assert_close(o, ref_o)
    torch.testing.assert_close(lse, ref_lse)
    assert len(log) == world * world
    # each device holds every chunk once; causal: device i computes chunks 0..i only
    assert (log.groupby("device").kv_chunk.nunique() == world).all()
    assert log.computed.sum() == (world * (world + 1) // 2 if causal else world * world)
    assert (log[log.step == world - 1].bytes_sent == 0).all()


def test_simulated_ring_uses_the_given_merge():
    q, k, v = qkv(8)

    def plain_sum(o1, lse1, o2, lse2):  # a wrong merge: no rescaling
        return o1 + o2, torch.maximum(lse1, lse2)

    o, _, _ = ringproc.simulate_ring(q, k, v, plain_sum, world=2, causal=False)
    assert not torch.allclose(o, reference(q, k, v, False)[0])


@pytest.mark.parametrize("causal", [False, True])
def test_gloo_ring_two_processes(causal):
    q, k, v = qkv(11, seed=7)
    o, lse, log = ringproc.run_ring(merge, q, k, v, world=2, causal=causal, timeout=60)
    ref_o, ref_lse = reference(q, k, v, causal)
    torch.testing.assert_close(o, ref_o)
    torch.testing.assert_close(lse, ref_lse)
    assert log.pid.nunique() == 2  # two real processes
    chunk = 3 * 2 * 8 * 8  # B*H*D elements per position, float64
    assert log.bytes_sent.tolist() == [2 * 6 * chunk, 2 * 5 * chunk, 0, 0]  # K and V of chunks of 6 and 5
    assert log.computed.tolist() == [True, True, not causal, True]


def test_gloo_ring_reports_a_failing_merge():
    q, k, v = qkv(6)

    def broken(o1, lse1, o2, lse2):
        raise ValueError("merge not written yet")

    with pytest.raises(RuntimeError, match="merge not written yet"):
        ringproc.run_ring(broken, q, k, v, world=2, causal=False, timeout=30)
