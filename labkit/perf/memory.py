"""The training-memory model: what one training step of a GPT-2-style model keeps in memory.

:class:`ModelShape` (the sizes), :class:`MemoryCoefficients` (bytes per unit, fitted to measured
peaks), :func:`training_memory` (predicted peak by component), :func:`recommend` (micro-batch,
accumulation and checkpointing for a memory budget), :func:`max_seq_len` (longest sequence that
fits), and :func:`kind`: whether an attention backend keeps the N x N scores.

The IO / roofline model lives in :mod:`labkit.perf.roofline`, the forward-time sweeps and the fitted
time predictor in :mod:`labkit.perf.predictor`, the profiler wrappers in :mod:`labkit.perf.profiling`.

Used in: 03_long_sequence_training, 04_performance_analysis.
"""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from labkit.engine import attention as attn

STANDARD = ("standard", "reference", "sdpa_math", "eager")  # attention that writes the N x N scores to memory


def kind(backend: str) -> str:
    """"standard" for backends that materialize the scores, "flash" for fused ones."""
    return "standard" if backend in STANDARD else "flash"


@dataclass(frozen=True)
class ModelShape:
    """A GPT-2-style decoder: the sizes that set its training memory."""

    n_layer: int
    n_embd: int  # hidden size h
    n_head: int
    vocab: int = 50257
    n_positions: int = 1024  # learned positions; extended to the sequence length when longer

    @classmethod
    def gpt2(cls, size: str = "small", n_positions: int = 1024) -> "ModelShape":
        """GPT-2 small / medium / large / xl."""
        sizes = {"small": (12, 768, 12), "medium": (24, 1024, 16), "large": (36, 1280, 20), "xl": (48, 1600, 25)}
        if size not in sizes:
            raise ValueError(f"unknown GPT-2 size {size!r}; choose one of {', '.join(sizes)}.")
        return cls(*sizes[size], n_positions=n_positions)

    def n_params(self, seq_len: int = 0) -> int:
        """Parameters (tied embeddings), with positions extended to ``seq_len`` when longer."""
        h, pos = self.n_embd, max(self.n_positions, seq_len)
        return self.vocab * h + pos * h + self.n_layer * (12 * h * h + 13 * h) + 2 * h


@dataclass(frozen=True)
class MemoryCoefficients:
    """Bytes per unit for bf16-autocast training with fused AdamW (fp32 master weights).

    ``hidden``, ``scores`` and ``logits`` were fitted (least squares on relative error) to the
    peaks the course measured for Hugging Face GPT-2 small on an H100 (torch 2.11, transformers
    5, dropout 0; eager and sdpa, N = 1K-64K, with and without checkpointing): all ten within 3%.
    04_performance_analysis measures the same on the reader's GPU.
    """

    weight: float = 4.0      # fp32 weights, per parameter
    grad: float = 4.0        # fp32 gradients, per parameter
    optimizer: float = 8.0   # AdamW exp_avg + exp_avg_sq, per parameter
    cast: float = 2.0        # bf16 weight copies autocast saves for backward, per parameter
    hidden: float = 94.0     # saved activations per hidden unit, token and layer
    scores: float = 6.0      # per score element and layer (standard attention only)
    lse: float = 4.0         # per head, token and layer (fused attention's fp32 log-sum-exp)
    checkpoint: float = 4.0  # per hidden unit, token and layer kept under checkpointing (fp32 input)
    logits: float = 10.4     # per vocabulary entry and token (bf16 logits, fp32 loss copy, gradient)


def training_memory(shape: ModelShape, *, batch: int, seq_len: int, attention: str = "flash",
                    checkpointing: bool = False, coef: MemoryCoefficients = MemoryCoefficients()) -> dict[str, float]:
    """Predicted peak bytes of one training step, by component.

    Args:
        attention: "standard" (or "eager", "reference", "sdpa_math": N x N scores kept per layer)
            or "flash" (or any fused backend name, "sdpa").
        checkpointing: keep only each layer's input and recompute one layer at a time.

    Returns:
        dict with weights, grads, optimizer, casts, activations, attention, logits, total (bytes).
    """
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch and seq_len must be >= 1, got {batch} and {seq_len}.")
    p, t = shape.n_params(seq_len), batch * seq_len
    h, a, L = shape.n_embd, shape.n_head, shape.n_layer
    known = STANDARD + ("flash", "sdpa", "flash_attention_2") + attn.BACKENDS
    if attention not in known:
        raise ValueError(f"unknown attention {attention!r}; use 'standard', 'flash' or one of {', '.join(known)}.")
    scores = batch * a * seq_len**2 * coef.scores if kind(attention) == "standard" else t * a * coef.lse  # per layer
    layers = 1 if checkpointing else L
    out = dict(weights=coef.weight * p, grads=coef.grad * p, optimizer=coef.optimizer * p, casts=coef.cast * p,
               activations=layers * t * coef.hidden * h + (L * t * coef.checkpoint * h if checkpointing else 0),
               attention=layers * scores, logits=t * shape.vocab * coef.logits)
    out["total"] = sum(out.values())
    return out


def recommend(shape: ModelShape, *, budget_bytes: float, seq_len: int, global_batch: int,
              attention: str = "flash", headroom: float = 0.9,
              coef: MemoryCoefficients = MemoryCoefficients()) -> pd.DataFrame:
    """Every (micro-batch, accumulation, checkpointing) that makes ``global_batch`` sequences per
    optimizer step, with its predicted peak; the ``chosen`` row fits ``headroom * budget_bytes``
    without checkpointing if possible (recomputing the forward costs ~1/3 more compute), then
    with the largest micro-batch (fewest accumulation steps). No row is chosen if none fits:
    see :func:`max_seq_len`."""
    if global_batch < 1 or budget_bytes <= 0:
        raise ValueError("global_batch must be >= 1 and budget_bytes > 0.")
    rows = []
    for ckpt in (False, True):
        for mb in (m for m in range(1, global_batch + 1) if global_batch % m == 0):
            total = training_memory(shape, batch=mb, seq_len=seq_len, attention=attention,
                                    checkpointing=ckpt, coef=coef)["total"]
            rows.append(dict(micro_batch=mb, accumulation=global_batch // mb, checkpointing=ckpt,
                             predicted_gib=total / 2**30, fits=total <= headroom * budget_bytes,
                             compute_factor=4 / 3 if ckpt else 1.0))
    df = pd.DataFrame(rows)
    fit = df[df["fits"]].sort_values(["checkpointing", "micro_batch"], ascending=[True, False])
    df["chosen"] = df.index == (fit.index[0] if len(fit) else -1)
    return df


def max_seq_len(shape: ModelShape, *, budget_bytes: float, attention: str = "flash", checkpointing: bool = False,
                batch: int = 1, headroom: float = 0.9, multiple: int = 256,
                coef: MemoryCoefficients = MemoryCoefficients()) -> int:
    """Longest sequence (a multiple of ``multiple``, at most 2**24) whose predicted peak fits; 0 if none."""
    def fits(n: int) -> bool:
        return training_memory(shape, batch=batch, seq_len=n, attention=attention, checkpointing=checkpointing,
                               coef=coef)["total"] <= headroom * budget_bytes

    lo, hi = 0, 2**24 // multiple  # in units of ``multiple``; memory grows with n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * multiple) else (lo, mid - 1)
    return lo * multiple
