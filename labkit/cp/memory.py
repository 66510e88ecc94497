"""Notebook 03's memory model on P devices: what shards with the sequence, what every device replicates.

Under context parallelism each of P devices holds N/P of the sequence's tokens: the layer inputs
checkpointing keeps, the layer being recomputed and the loss's residual shrink with P. Every
device keeps a full copy of the model: weights, AdamW state, gradients and bf16 casts, and with
learned positions that includes the position table of all N rows. The chunked loss's buffers
depend on its chunk size, not on N, so they do not shrink either.

What is alive *at the peak* decides the prediction, and three things are not there (each found
in the code and checked against a step's allocations on a CPU, tests/labkit/cp/test_cpmem.py):

- the position table's gradient: the embedding's backward is the step's last op, after every
  layer has freed its input, so the table costs ``12*h`` bytes per position at the layers' peak
  (fp32 weight and AdamW's two moments), not ``18*h``;
- its bf16 cast: autocast casts the weights of matmuls, never an embedding's;
- the ring's buffers: torch's ring attention (``torch.distributed.tensor.experimental.
  _context_parallel._attention``, torch 2.11 and 2.13) allocates them inside the attention op and
  frees them when it returns. The recomputed layer peaks later, in its MLP's backward
  (``lever.layer``), where no ring buffer is alive. The ring is a phase of its own:
  the layer inputs, what the recomputed layer keeps while its attention runs backward
  (:data:`ATTENTION_LAYER`) and :func:`ring_buffer_bytes` (K/V received and the copy sent on, dK/dV
  accumulated in fp32, received and sent on). It sets the peak only when the layer's own peak is
  small (the chunked MLP) or K/V are all-gathered on many devices;
- on the first step only, AdamW's state: torch creates it in the first ``optimizer.step()``, after
  the backward, so a first step (``cp-train --steps 1``, how the reach runs are timed) peaks without
  it (``first_step=True``); from the second step on it is alive all the time.

How torch moves K/V matters for that phase. As a ring (``rotate="alltoall"``, what ``lk.cptrain``
sets) each device holds one chunk in flight. Torch's default, ``"allgather"``, gathers every
device's K/V of the layer at once: :data:`GATHER_BYTES` per hidden unit for each of the other
``N - N/P`` tokens. The backward passes dK/dV hop by hop either way.

- :func:`cp_memory`: predicted peak bytes per device, by component, plus ``replicated`` and
  ``sharded`` subtotals (``lk.longmem.memory_model`` on the local tokens, full position table).
- :func:`ring_buffer_bytes`: the ring backward's buffers per hidden unit and local token.
- :func:`cp_table`: the same for several (N, P) as a DataFrame in GiB.
- :func:`longest_sequence`: the longest N whose prediction fits a memory budget on P devices.

Used in: 07_context_parallel.
"""
from __future__ import annotations

from dataclasses import replace

import pandas as pd

from labkit.long.memory import KEYS, memory_model
from labkit.perf.memory import MemoryCoefficients, ModelShape

REPLICATED = ("weights", "grads", "optimizer", "casts")
GATHER_BYTES = 4.0  # "allgather" only: per hidden unit and token of every other device, its K and V (bf16, 2x2)
ATTENTION_LAYER = 20.0  # per hidden unit and local token: the recomputed layer while its attention runs backward
ROTATIONS = ("alltoall", "allgather")
TABLE_AT_PEAK = 12.0  # per position and hidden unit: fp32 weight + AdamW's two moments (no gradient, no cast yet)


def ring_buffer_bytes(kv_bytes: float = 2.0, acc_bytes: float = 4.0) -> float:
    """Bytes per hidden unit and local token that torch's ring backward holds at its peak (P >= 2).

    Counted from ``_templated_ring_attention_backward``: dQ, dK, dV accumulators (``3*acc``);
    K/V made contiguous, concatenated to send on and received (``3 * 2*kv``); dK/dV concatenated
    to send on and received (``2 * 2*acc``); the kernel's dQ, dK, dV of this step (``3*kv``).
    bf16 K/V with fp32 accumulation: 46; all fp32 (a CPU test): 64.
    """
    return 3 * acc_bytes + 6 * kv_bytes + 4 * acc_bytes + 3 * kv_bytes


def cp_memory(shape: ModelShape, *, seq_len: int, world: int, checkpointing: bool = True,
              chunked_loss: bool = True, chunk_size: int = 4096, chunked_mlp: bool = False,
              rotate: str = "alltoall", first_step: bool = False) -> dict[str, float]:
    """Predicted peak bytes on each of ``world`` devices for one training step on ``seq_len`` tokens.

    The local share is ``ceil(seq_len / world)`` tokens (batch 1); the model, the full learned
    position table included, is replicated. The peak is the larger of notebook 03's peak on the
    local tokens (without the position table's gradient and cast, see the module's text) and, on
    ``world`` >= 2, the ring's phase (``ring``: :func:`ring_buffer_bytes`, with ``rotate=
    "allgather"`` (torch's default) also :data:`GATHER_BYTES` per hidden unit for each of the other
    devices' tokens). ``first_step``: the step that creates AdamW's state (``optimizer`` is 0 until its end,
    where weights, every gradient and the new state are alive: that phase is the peak if it is larger).

    Returns:
        dict with :data:`labkit.long.memory.KEYS`, ``ring`` (0 unless the ring's phase is the peak),
        ``total`` (bytes per device), ``replicated`` and ``sharded`` (subtotals), ``local_tokens``,
        ``ring_phase`` (that phase's total, 0 on one device) and ``ring_at_peak`` (1.0 or 0.0).
    """
    if world < 1 or seq_len < world:
        raise ValueError(f"need 1 <= world <= seq_len, got world={world}, seq_len={seq_len}.")
    if rotate not in ROTATIONS:
        raise ValueError(f"rotate is one of {ROTATIONS} (torch's names), got {rotate!r}.")
    local, h, coef = -(-seq_len // world), shape.n_embd, MemoryCoefficients()
    positions = max(shape.n_positions, seq_len)
    full_table = replace(shape, n_positions=positions)
    out = memory_model(full_table, batch=1, seq_len=local, checkpointing=checkpointing,
                       chunked_loss=chunked_loss, chunk_size=chunk_size, chunked_mlp=chunked_mlp)
    every = full_table.n_params()  # a phase that counts every parameter's gradient/cast counts the table's too
    if out["grads"] == coef.grad * every:
        out["grads"] -= coef.grad * positions * h  # made by the embedding's backward, the step's last op
    if out["casts"] == coef.cast * every:
        out["casts"] -= coef.cast * positions * h  # autocast does not cast an embedding's weight
    if first_step:   # AdamW's state is made at the step's end, where weights and every gradient are alive
        step_end = dict.fromkeys(KEYS, 0.0) | dict(weights=out["weights"], grads=coef.grad * every,
                                                   optimizer=out["optimizer"])
        out["optimizer"] = 0.0
        if sum(step_end.values()) > sum(out[k] for k in KEYS):
            out.update(step_end)
    out["ring"], out["ring_phase"], out["ring_at_peak"] = 0.0, 0.0, 0.0
    if world > 1:
        gathered = GATHER_BYTES * (world - 1) if rotate == "allgather" else 0.0
        inputs = shape.n_layer * local * h * coef.checkpoint if checkpointing else out["activations"]
        held = inputs + (ATTENTION_LAYER * local * h if checkpointing else 0.0)
        ring = dict(out, logits=0.0, attention=0.0, activations=held,
                    ring=(ring_buffer_bytes() + gathered) * local * h)
        phase = sum(ring[k] for k in (*KEYS, "ring"))
        if phase > sum(out[k] for k in KEYS):
            out.update(ring, ring_at_peak=1.0)
        out["ring_phase"] = phase
    out["replicated"] = sum(out[k] for k in REPLICATED)
    out["sharded"] = sum(out[k] for k in KEYS if k not in REPLICATED) + out["ring"]
    out["total"] = out["replicated"] + out["sharded"]
    out["local_tokens"] = float(local)
    return out


def cp_table(shape: ModelShape, seq_lens, worlds=(1, 2, 4, 8), **kwargs) -> pd.DataFrame:
    """:func:`cp_memory` for every (N, P): N, world, local_tokens, replicated_gib, sharded_gib,
    total_gib (per device), positions_gib (the replicated position table at the peak) and
    ring_gib (the ring's buffers where they set the peak, else 0)."""
    rows = []
    for n in seq_lens:
        for world in worlds:
            m = cp_memory(shape, seq_len=n, world=world, **kwargs)
            table = TABLE_AT_PEAK * max(shape.n_positions, n) * shape.n_embd
            rows.append(dict(N=n, world=world, local_tokens=int(m["local_tokens"]),
                             replicated_gib=m["replicated"] / 2**30, positions_gib=table / 2**30,
                             sharded_gib=m["sharded"] / 2**30, ring_gib=m["ring"] / 2**30,
                             total_gib=m["total"] / 2**30))
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


__all__ = ["ATTENTION_LAYER", "GATHER_BYTES", "REPLICATED", "ROTATIONS", "TABLE_AT_PEAK", "cp_memory", "cp_table",
           "longest_sequence", "ring_buffer_bytes"]
