"""The input cases of notebook 10's accuracy study: q, k, v [B, H, N, D] drawn from a ``torch.Generator`` (the same
generator state gives the same tensors), each built to stress one part of FP8 attention.

- :func:`gaussian`: q, k, v ~ N(0, 1): the easy case, every value a few spacings of e4m3 away from its neighbours;
- :func:`outliers`: gaussian with the same few channels of every q and k scaled up: LLMs' outlier channels
  (Dettmers et al., 2022; Sun et al., 2024: a handful of hidden channels many times the rest), which reach q and
  k through their projections. One scale per tensor is set by those channels, and rounding them costs 2^-4 of a
  large number in every score; a rotation spreads them over all D channels, where each is rounded at its own size;
- :func:`sink`: key 0 made an attention sink (Xiao et al., 2023: the first token takes most of every row's weight
  and carries a near-zero value). With the key tiles walked forward the running max is the sink's score from the
  first tile on, so exp(s - m) of every other key falls below e4m3's smallest subnormal (2^-9) unless P is scaled
  by p_scale before the cast.

Every function takes (B, H, N, D, generator, dtype=torch.bfloat16) and returns (q, k, v) in ``dtype``.

Used in: 10_fp8_attention (through :mod:`labkit.fp8.study`).
"""
from __future__ import annotations

import torch

OUTLIER_CHANNELS = 4     # channels of q and k that hold the massive activations
OUTLIER_SCALE = 10.0     # how many times the other channels' size they are
SINK_GAP = 10.0          # the sink's score minus the mean score of the other keys (natural-log units)
SINK_VALUE = 0.0         # the sink's value vector, relative to the other values


def _normal(B: int, H: int, N: int, D: int, generator: torch.Generator) -> torch.Tensor:
    """fp32 [B, H, N, D] of N(0, 1) draws from ``generator``."""
    return torch.randn(B, H, N, D, generator=generator)


def gaussian(B: int, H: int, N: int, D: int, generator: torch.Generator, dtype: torch.dtype = torch.bfloat16):
    """q, k, v [B, H, N, D] ~ N(0, 1), in ``dtype``."""
    return tuple(_normal(B, H, N, D, generator).to(dtype) for _ in range(3))


def outliers(B: int, H: int, N: int, D: int, generator: torch.Generator, dtype: torch.dtype = torch.bfloat16, *,
             channels: int = OUTLIER_CHANNELS, scale: float = OUTLIER_SCALE):
    """q, k, v [B, H, N, D]: gaussian, then ``channels`` channels (drawn from ``generator``, the same for q and k)
    of q and k multiplied by ``scale``; v is untouched. Those channels then carry most of every score (their
    products are scale^2 times the others'), so attention is sharp, as it is in the heads where LLMs' outlier
    channels live; the amax of q and k, and so their per-tensor scale, is set by them.
    The size: 10x, not the 20-100x of the residual stream's massive activations. Past ~10x (with 4 of 64
    channels) the rounding of those channels alone moves the scores by O(1) in any FP8 scaling, attention turns to
    noise in every configuration and their RMSE ratio no longer measures the scaling (measured with
    :mod:`labkit.fp8.study`, B, H, N, D = 1, 2, 256, 64: per-tensor RMSE over per-block + rotation RMSE 2.9-3.4 at
    10x over 6 seeds; with N = 64, D = 64 it scatters from 1.0 to 7.3 at 16x)."""
    if not 0 < channels <= D:
        raise ValueError(f"channels must be in 1..D={D}, got {channels}")
    q, k, v = (_normal(B, H, N, D, generator) for _ in range(3))
    which = torch.randperm(D, generator=generator)[:channels]
    q[..., which] *= scale
    k[..., which] *= scale
    return q.to(dtype), k.to(dtype), v.to(dtype)


def sink(B: int, H: int, N: int, D: int, generator: torch.Generator, dtype: torch.dtype = torch.bfloat16, *,
         gap: float = SINK_GAP, value: float = SINK_VALUE):
    """q, k, v [B, H, N, D]: gaussian, then key 0 becomes a sink. Every q's component along a shared direction u
    (unit, drawn from ``generator``) is set to 2, and k_0 = u * gap * sqrt(D) / 2, so every row's score with key 0
    is ``gap`` while the others' are ~N(0, 1 + 3 / D): with gap = 10 and N = 256 the sink holds ~0.98 of every
    row's weight, the other keys ~exp(-10) ~ 5e-5 each. v_0 is scaled by ``value``: 0 by default, a sink whose
    weight does nothing (sinks carry near-zero values), so o is made of the tiny weights alone and losing them
    shows. With value = 0.02 the rounding of v_0 itself adds an error of the same size (measured with
    :mod:`labkit.fp8.study`, B, H, N, D = 1, 2, 256, 64, seeds 0-4: forward p_scale 1 RMSE over reverse p_scale 256
    RMSE falls from 4.2-5.1 to 2.9-3.2)."""
    if N < 2:
        raise ValueError(f"a sink needs N >= 2 keys, got {N}")
    q, k, v = (_normal(B, H, N, D, generator) for _ in range(3))
    u = torch.randn(D, generator=generator)
    u = u / u.norm()
    q = q + (2.0 - q @ u)[..., None] * u
    k[:, :, 0] = u * gap * D ** 0.5 / 2.0
    v[:, :, 0] = v[:, :, 0] * value
    return q.to(dtype), k.to(dtype), v.to(dtype)


CASES = {"gaussian": gaussian, "outliers": outliers, "sink": sink}
