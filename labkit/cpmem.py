"""Notebook 03's memory model on P devices: what shards with the sequence, what every device replicates.

Under context parallelism each of P devices holds N/P of the sequence's tokens: the layer inputs
checkpointing keeps, the layer being recomputed and the loss's residual shrink with P. Every
device keeps a full copy of the model: weights, gradients, AdamW state and bf16 casts, and with
learned positions that includes the position table of all N rows (``18*h`` bytes per position
with its gradient, AdamW state and cast). The chunked loss's buffers depend on its chunk size,
not on N, so they do not shrink either. The ring adds the key/value chunks in flight.

How torch moves K/V matters here. As a ring (``rotate="alltoall"``, what ``lk.cptrain`` sets)
each device holds its own chunk, the one it sends and the one it receives: memory that shrinks
with P. Torch's default, ``"allgather"``, gathers every other device's K/V of the layer at once:
``4*h`` bytes (K and V, bf16) for each of the other ``N - N/P`` tokens, memory that grows with N.

- :func:`cp_memory`: predicted peak bytes per device, by component, plus ``replicated`` and
  ``sharded`` subtotals (``lk.longmem.memory_model`` on the local tokens, full position table).
- :func:`cp_table`: the same for several (N, P) as a DataFrame in GiB.
- :func:`longest_sequence`: the longest N whose prediction fits a memory budget on P devices.

Used in: 07_context_parallel.
"""
from __future__ import annotations

from dataclasses import replace

import pandas as pd

from .longmem import KEYS, memory_model
from .perfmodel import ModelShape

REPLICATED = ("weights", "grads", "optimizer", "casts")
RING_BYTES = 24.0  # per hidden unit and local token: K/V sent and received (bf16, 2x2x2) + dK/dV in fp32 (2x4x2)
GATHER_BYTES = 4.0  # "allgather" only: per hidden unit and token of every other device, its K and V (bf16, 2x2)
ROTATIONS = ("alltoall", "allgather")


def cp_memory(shape: ModelShape, *, seq_len: int, world: int, checkpointing: bool = True,
              chunked_loss: bool = True, chunk_size: int = 4096, chunked_mlp: bool = False,
              ring_bytes: float = RING_BYTES, rotate: str = "alltoall") -> dict[str, float]:
    """Predicted peak bytes on each of ``world`` devices for one training step on ``seq_len`` tokens.

    The local share is ``ceil(seq_len / world)`` tokens (batch 1); the model, the full learned
    position table included, is replicated. ``ring`` (0 on one device): the chunks in flight during
    one layer's ring, ``ring_bytes`` per hidden unit and local token (an estimate from the tensors
    torch's ring keeps, not fitted: compare it with a measured peak); with ``rotate="allgather"``
    (torch's default) also :data:`GATHER_BYTES` per hidden unit for each of the other devices'
    ``(world - 1) * local`` tokens, whose K/V the all-gather keeps whole.

    Returns:
        dict with :data:`labkit.longmem.KEYS`, ``ring``, ``total`` (bytes per device),
        ``replicated`` and ``sharded`` (subtotals), ``local_tokens``.
    """
    if world < 1 or seq_len < world:
        raise ValueError(f"need 1 <= world <= seq_len, got world={world}, seq_len={seq_len}.")
    if rotate not in ROTATIONS:
        raise ValueError(f"rotate is one of {ROTATIONS} (torch's names), got {rotate!r}.")
    local = -(-seq_len // world)
    full_table = replace(shape, n_positions=max(shape.n_positions, seq_len))
    out = memory_model(full_table, batch=1, seq_len=local, checkpointing=checkpointing,
                       chunked_loss=chunked_loss, chunk_size=chunk_size, chunked_mlp=chunked_mlp)
    gathered = GATHER_BYTES * (world - 1) if rotate == "allgather" else 0.0
    out["ring"] = (ring_bytes + gathered) * local * shape.n_embd if world > 1 else 0.0
    out["replicated"] = sum(out[k] for k in REPLICATED)
    out["sharded"] = sum(out[k] for k in KEYS if k not in REPLICATED) + out["ring"]
    out["total"] = out["replicated"] + out["sharded"]
    out["local_tokens"] = float(local)
    return out


def cp_table(shape: ModelShape, seq_lens, worlds=(1, 2, 4, 8), **kwargs) -> pd.DataFrame:
    """:func:`cp_memory` for every (N, P): N, world, local_tokens, replicated_gib, sharded_gib,
    total_gib (per device) and positions_gib (the replicated position table's share)."""
    rows = []
    for n in seq_lens:
        for world in worlds:
            m = cp_memory(shape, seq_len=n, world=world, **kwargs)
            table = 18.0 * max(shape.n_positions, n) * shape.n_embd  # weight, grad, AdamW, bf16 cast
            rows.append(dict(N=n, world=world, local_tokens=int(m["local_tokens"]),
                             replicated_gib=m["replicated"] / 2**30, positions_gib=table / 2**30,
                             sharded_gib=m["sharded"] / 2**30, total_gib=m["total"] / 2**30))
    return pd.DataFrame(rows)


def longest_sequence(shape: ModelShape, *, budget_bytes: float, world: int, headroom: float = 0.9,
                     multiple: int = 8192, **kwargs) -> int:
    """Longest N (a multiple of ``multiple * world``, at most 2**26) whose predicted peak per
    device fits ``headroom * budget_bytes``; 0 if none does."""
    step = multiple * world
    lo, hi = 0, 2**26 // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        fits = cp_memory(shape, seq_len=mid * step, world=world, **kwargs)["total"] <= headroom * budget_bytes
        lo, hi = (mid, hi) if fits else (lo, mid - 1)
    return lo * step


__all__ = ["GATHER_BYTES", "REPLICATED", "RING_BYTES", "ROTATIONS", "cp_memory", "cp_table", "longest_sequence"]
