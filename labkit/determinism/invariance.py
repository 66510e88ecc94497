"""Batch invariance, measured: does a request's output keep its bits when its neighbours change?

:func:`mismatches` runs a decode function on each request alone (a batch of 1) and on batches of other sizes (the first
``size`` requests, in a shuffled order so that neighbours and positions change), and counts the requests whose row
differs in any bit from their batch-of-1 row. A batch-invariant decode has zero at every size.

    table = lk.detinvariance.mismatches(lk.detdecode.dynamic_decode, requests, sizes=(3, 8, 17))

Used in: 11_determinism (and its visible checks).
"""
from __future__ import annotations

from typing import Callable

import torch

from labkit.determinism import decode as detdecode


def alone(decode: Callable, requests: list) -> list[torch.Tensor]:
    """Each request's output [H, D] in a batch of 1."""
    return [decode(*detdecode.pad_batch([r]))[0] for r in requests]


def batch_members(count: int, size: int, seed: int) -> list[int]:
    """Which requests (indices into ``count``) form a batch of ``size``, in batch order: a permutation's first ``size``
    drawn from ``seed`` (neighbours and positions change with the size)."""
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed))[:size].tolist()


def mismatches(decode: Callable, requests: list, sizes=(3, 8, 17), *, seed: int = 0,
               single: list[torch.Tensor] | None = None) -> dict[int, list[int]]:
    """For each batch size: the requests (indices) whose row in that batch is not ``torch.equal`` to their row alone.

    Args:
        decode: (q [B, H, D], k_cache, v_cache [B, H, N_max, D], lens [B]) -> o [B, H, D].
        requests: (q [H, D], k [H, L, D], v [H, L, D]) per request (:func:`labkit.determinism.decode.make_requests`).
        sizes: batch sizes, each at most len(requests).
        single: the batch-of-1 rows, when already computed (:func:`alone`).
    """
    single = alone(decode, requests) if single is None else single
    found = {}
    for size in sizes:
        members = batch_members(len(requests), size, seed + size)
        out = decode(*detdecode.pad_batch([requests[i] for i in members]))
        found[size] = sorted(i for row, i in enumerate(members) if not torch.equal(out[row], single[i]))
    return found
