"""labkit.determinism.decode and invariance: split partials and their combine match float64 attention whatever the
split; empty splits add nothing; the heuristic's split count falls as the batch grows; dynamic splits are not batch
invariant, a fixed split size is."""
from __future__ import annotations

import pytest
import torch
import triton

import labkit as lk  # before triton kernels run: sets TRITON_INTERPRET=1 here (no CUDA in CI)

lk.tritonmode.setup()
from labkit.determinism import decode, invariance  # noqa: E402
from labkit.engine.kernels import reference_attention  # noqa: E402

LENS = [37, 1, 130, 61, 95, 7, 150, 49, 23]


def requests(lens=LENS, dim=16, seed=0):
    return decode.make_requests(lens, 2, dim, generator=torch.Generator().manual_seed(seed))


def float64(req):
    q, k, v = (t.double() for t in req)
    return reference_attention(q[:, None], k, v)[0][:, 0]


def fixed(q, k, v, lens, size=48):
    return decode.combine(*decode.split_partials(q, k, v, lens, size, triton.cdiv(int(lens.max()), size)), q.dtype)


@pytest.mark.parametrize("fn", [decode.dynamic_decode, decode.unsplit_decode, fixed, lambda *a: fixed(*a, size=5)])
def test_every_split_matches_float64(fn):
    reqs = requests(dim=32)
    out = fn(*decode.pad_batch(reqs))
    assert out.shape == (len(LENS), 2, 32) and out.dtype == torch.float32
    assert float((out.double() - torch.stack([float64(r) for r in reqs])).abs().max()) < 1e-5


def test_empty_splits_and_the_padded_batch():
    q, k, v, lens = decode.pad_batch(requests([3, 40]))
    assert k.shape == (2, 2, 40, 16) and lens.tolist() == [3, 40] and float(k[0, :, 3:].abs().max()) == 0
    o_part, lse_part = decode.split_partials(q, k, v, lens, 16, 3)
    assert torch.isneginf(lse_part[0, :, 1:]).all() and float(o_part[0, :, 1:].abs().max()) == 0
    assert torch.isfinite(lse_part[1]).all()
    with pytest.raises(ValueError, match="cover"):
        decode.split_partials(q, k, v, lens, 16, 2)


def test_the_heuristic_splits_less_as_the_batch_grows():
    counts = [decode.heuristic_num_splits(b * 16, 132, 64) for b in (1, 2, 4, 8, 64)]
    assert counts == sorted(counts, reverse=True) and counts[0] > 1 and counts[-1] == 1
    assert decode.heuristic_num_splits(2, 132, 3) <= 3


def test_dynamic_splits_vary_with_the_batch_and_a_fixed_size_does_not():
    reqs = requests()
    assert any(invariance.mismatches(decode.dynamic_decode, reqs, (3, 9)).values())
    assert invariance.mismatches(fixed, reqs, (3, 9)) == {3: [], 9: []}


def test_batch_members_shuffle_and_repeat():
    assert invariance.batch_members(17, 8, 3) == invariance.batch_members(17, 8, 3)
    assert sorted(invariance.batch_members(17, 17, 1)) == list(range(17))
    assert invariance.batch_members(17, 17, 1) != list(range(17))
