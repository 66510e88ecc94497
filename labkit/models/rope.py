"""Rotary positions for GPT-2: a model with no position table, so nothing in it grows with N.

RoFormer's pairing (Su et al., 2021): channels (2i, 2i + 1) of each head form the complex number
z_i = x_2i + j x_2i+1, rotated at position m by e^{j m theta_i}, theta_i = base^(-2i / D). (Llama
and GPT-NeoX pair channel i with i + D/2 instead, "rotate-half"; the two differ by a fixed
permutation of the channels, which a model trained from scratch absorbs.) Scores then depend on
positions only through m - n, for any length: no table to extend, no weight, gradient or
optimizer state per position.

- :func:`use_rope`: turn a GPT-2 (attention "labkit") into the RoPE variant in place.
- :func:`rotate_queries_keys`: what the "labkit" attention function applies to such a model.

Used in: 03_long_sequence_training.
"""
from __future__ import annotations

import torch
from torch import nn

_TABLE: dict[tuple, torch.Tensor] = {}  # the last (N, D, base, device) table: every layer shares it


def _rotations(n: int, head_dim: int, base: float, device: torch.device) -> torch.Tensor:
    """e^{j m theta_i} for m < n, i < head_dim / 2: complex64 [n, head_dim / 2], angles in float64."""
    key = (n, head_dim, base, device)
    if key not in _TABLE:
        theta = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
        angles = torch.arange(n, dtype=torch.float64, device=device)[:, None] * theta  # [n, D/2]
        _TABLE.clear()  # one table at a time: at N = 1M it is 256 MiB
        _TABLE[key] = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
    return _TABLE[key]


def _rotate(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """x [..., N, D] times rotations [N, D/2] as complex pairs (2i, 2i+1), in fp32; x's dtype out."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # [..., N, D/2]
    return torch.view_as_real(pairs * rotations).flatten(-2).to(x.dtype)


def rotate_queries_keys(query: torch.Tensor, key: torch.Tensor, base: float = 10000.0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` [B, H, N, D] and ``key`` [B, H, Nk, D] by their positions.

    Keys sit at positions 0..Nk-1, queries at the last N of them (Nk - N..Nk-1, as with a KV
    cache whose keys are stored unrotated). Returns tensors of the inputs' shapes and dtypes.
    """
    (n, d), nk = query.shape[-2:], key.shape[-2]
    if d % 2 or n > nk:
        raise ValueError(f"RoPE needs an even head dim and N <= Nk; got D={d}, N={n}, Nk={nk}.")
    rotations = _rotations(nk, d, base, key.device)
    return _rotate(query, rotations[nk - n:]), _rotate(key, rotations)


class NoPositions(nn.Module):
    """Stands in for GPT-2's position table ``wpe``: adds nothing, holds no weight."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width
        self.register_buffer("zero", torch.zeros(()), persistent=False)  # follows the model's device and dtype

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Zeros [*position_ids.shape, width], expanded from one element (no memory per position)."""
        return self.zero.expand(*position_ids.shape, self.width)


def use_rope(model, base: float = 10000.0) -> None:
    """Make GPT-2 ``model`` the RoPE variant in place: drop the learned position table and rotate
    queries and keys in the "labkit" attention function (``lk.gpt2.set_attention(model, "labkit...")``
    must stay the implementation; other implementations refuse a RoPE model).

    Meant for training from scratch: pretrained GPT-2 weights expect learned positions.
    """
    model.transformer.wpe = NoPositions(model.config.n_embd)
    model.config.labkit_rope_base = float(base)


__all__ = ["NoPositions", "rotate_queries_keys", "use_rope"]
