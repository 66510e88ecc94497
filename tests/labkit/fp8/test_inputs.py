"""labkit.fp8.inputs: the three cases are deterministic, shaped [B, H, N, D] and stress what they claim."""
from __future__ import annotations

import pytest
import torch

from labkit.fp8 import inputs

SHAPE = (2, 3, 64, 32)


@pytest.mark.parametrize("case", list(inputs.CASES))
def test_same_generator_state_same_tensors_in_the_asked_dtype(case):
    make = inputs.CASES[case]
    a, b = (make(*SHAPE, torch.Generator().manual_seed(5), dtype=torch.float32) for _ in range(2))
    other = make(*SHAPE, torch.Generator().manual_seed(6), dtype=torch.float32)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and not torch.equal(a[0], other[0])
    assert all(t.shape == SHAPE and t.dtype == torch.float32 for t in a)
    assert all(t.dtype == torch.bfloat16 for t in make(*SHAPE, torch.Generator().manual_seed(5)))


def test_outliers_scale_the_same_channels_of_q_and_k_only():
    q, k, v = inputs.outliers(*SHAPE, torch.Generator().manual_seed(0), dtype=torch.float32)
    big_q, big_k = (t.abs().mean(dim=(0, 1, 2)) > 4 for t in (q, k))
    assert int(big_q.sum()) == inputs.OUTLIER_CHANNELS and torch.equal(big_q, big_k)
    assert v.abs().max() < 6
    with pytest.raises(ValueError, match="channels"):
        inputs.outliers(*SHAPE, torch.Generator(), channels=0)


def test_sink_takes_most_weight_and_the_others_fall_below_e4m3s_subnormals():
    q, k, v = inputs.sink(1, 2, 256, 64, torch.Generator().manual_seed(0), dtype=torch.float32)
    s = q @ k.transpose(-1, -2) / 8
    p = torch.softmax(s, dim=-1)
    assert p[..., 0].min() > 0.9 and torch.allclose(s[..., 0], torch.full_like(s[..., 0], inputs.SINK_GAP), atol=1e-4)
    assert (torch.exp(s[..., 1:] - s[..., :1]) < 2**-10).float().mean() > 0.99   # cast to e4m3 unscaled: 0
    assert v[..., 0, :].abs().max() == 0
    with pytest.raises(ValueError, match="N >= 2"):
        inputs.sink(1, 1, 1, 16, torch.Generator())
