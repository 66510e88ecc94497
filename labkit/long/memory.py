"""The memory of one long-sequence training step: predicted lever by lever, and measured.

- :func:`memory_model`: predicted peak GPU bytes by component, for any combination of the
  levers of :mod:`labkit.long.levers` and :mod:`labkit.models.rope` (FlashAttention, checkpointing, chunked
  loss, chunked MLP, offloaded checkpoints, RoPE instead of a learned position table), built
  on ``lk.perfmodel.training_memory``.
- :func:`saved_tensor_bytes`: what autograd keeps for the backward, measurable on a CPU too.
- :func:`peak_live_bytes`: the most bytes of new tensors alive at once, forward and backward (a CPU's peak).
- :func:`model_shape`: the :class:`~labkit.perf.memory.ModelShape` of a GPT-2 config.

Used in: 03_long_sequence_training.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from labkit.perf.memory import MemoryCoefficients, ModelShape, training_memory

KEYS = ("weights", "grads", "optimizer", "casts", "activations", "attention", "logits")  # summed into total


@dataclass(frozen=True)
class LeverCoefficients:
    """Bytes per hidden unit and token of a checkpointed step with the chunked loss, by phase.

    Fitted to peaks measured phase by phase (the chunked loss's backward ends one phase) for
    GPT-2 small on an H100 (bf16 autocast, fused AdamW, batch 1, labkit attention, N = 16K-128K,
    torch 2.11); the search's peaks up to N = 1M agree within 6% (tests/labkit/long/test_longmem.py lists them).
    """

    layer: float = 120.0                 # the layer being recomputed, at its backward's peak (full MLP)
    layer_chunked_mlp: float = 26.0      # the same with the MLP in checkpointed chunks
    block_forward: float = 66.0          # one block's forward temporaries (nothing saved), full MLP
    block_forward_chunked_mlp: float = 8.0
    rope: float = 4.0                    # RoPE: the rotation's fp32 gradients in the recomputed layer
    loss_residual: float = 8.0           # chunked loss: the residual it keeps (fp32) and its gradient


def _check(checkpointing: bool, chunked_loss: bool, chunk_size: int, offload: bool, chunked_mlp: bool,
           rope: bool) -> None:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    if (offload or chunked_mlp or rope) and not (checkpointing and chunked_loss):
        raise ValueError("the offload, chunked-MLP and RoPE terms are for checkpointed steps with the chunked "
                         "loss: use checkpointing=True and chunked_loss=True with them.")


def memory_model(shape: ModelShape, *, batch: int, seq_len: int, attention: str = "flash",
                 checkpointing: bool = False, chunked_loss: bool = False, chunk_size: int = 4096,
                 chunked_mlp: bool = False, offload: bool = False, rope: bool = False,
                 coef: MemoryCoefficients = MemoryCoefficients(),
                 lever: LeverCoefficients = LeverCoefficients()) -> dict[str, float]:
    """Predicted peak bytes of one training step (batch ``B``, ``t = B*N`` tokens), by component.

    Without the chunked loss: ``lk.perfmodel.training_memory`` (per layer ``t*h*coef.hidden``
    bytes of activations plus, for standard attention, the scores ``B*H*N^2*coef.scores`` or
    FlashAttention's ``t*H*coef.lse``; checkpointing keeps ``t*h*coef.checkpoint`` per layer plus
    one layer's activations; the loss holds ``t*V*coef.logits``).

    With the chunked loss (:func:`lk.levers.lm_loss <labkit.long.levers.lm_loss>`) a step has three
    candidate peaks, and the largest is returned, by component:

    - forward: the layer inputs kept so far and one block's temporaries (``lever.block_forward``);
    - loss: the layer inputs, ``t*h*lever.loss_residual``, the gradient and bf16 copy of
      ``lm_head`` only, and the chunks' buffers ``max(8*c1, 6*(c1 + c2))*V + 4*t`` for chunks
      ``c1 = min(chunk_size, t)``, ``c2 = min(chunk_size, t - c1)`` (one chunk: fp32 logits and
      logsumexp's temporary; several: the next chunk's bf16 logits and fp32 softmax while the
      previous one's fp32 softmax and bf16 gradient are bound), independent of N;
    - layers' backward (checkpointing): every gradient, the layer inputs and the layer being
      recomputed (``lever.layer``); without checkpointing, every layer's activations.

    The levers (checkpointing and chunked loss on): ``chunked_mlp`` uses the ``*_chunked_mlp``
    coefficients (the MLP's 4x-wide tensors exist for one chunk at a time); ``offload`` moves the
    layer inputs and the loss's residual to host memory (``host``, not in ``total``: the GPU
    holds the input being recomputed); ``rope`` drops the learned position table (its weight,
    gradient, AdamW state and bf16 copy: ``18*h`` bytes per position) and adds the rotation
    table (complex64, ``4*D`` bytes per position) and ``t*h*lever.rope`` in the layers' backward.

    Returns:
        dict with weights, grads, optimizer, casts, activations, attention, logits, total (GPU
        bytes) and host (bytes in host memory).
    """
    _check(checkpointing, chunked_loss, chunk_size, offload, chunked_mlp, rope)
    out = training_memory(shape, batch=batch, seq_len=seq_len, attention=attention,
                          checkpointing=checkpointing, coef=coef)
    out["host"] = 0.0
    if not chunked_loss:
        out["total"] = sum(out[k] for k in KEYS)
        return out
    t, h, L = batch * seq_len, shape.n_embd, shape.n_layer
    if rope:
        positions = max(shape.n_positions, seq_len) * h
        for key, c in (("weights", coef.weight), ("grads", coef.grad), ("optimizer", coef.optimizer),
                       ("casts", coef.cast)):
            out[key] -= c * positions
        out["attention"] += 4.0 * (h // shape.n_head) * seq_len + lever.rope * t * h
    inputs = L * t * h * coef.checkpoint if checkpointing else out["activations"]
    if offload:
        out["host"], inputs = inputs + t * h * 4.0, 0.0
    phases = [_loss_phase(out, shape, t, chunk_size, inputs, coef, lever)]
    if not checkpointing:  # every layer's activations, standard attention's scores included, are alive
        phases[0]["attention"] = out["attention"]
    else:
        mlp = "_chunked_mlp" if chunked_mlp else ""
        layer = getattr(lever, "layer" + mlp) + (coef.checkpoint if offload else 0.0)  # + the input copied back
        forward = dict(out, grads=0.0, attention=0.0, logits=0.0,
                       activations=inputs + t * h * getattr(lever, "block_forward" + mlp))
        phases += [forward, dict(out, logits=0.0, activations=inputs + t * h * layer)]
    out = max(phases, key=lambda part: sum(part[k] for k in KEYS))
    out["total"] = sum(out[k] for k in KEYS)
    return out


def _loss_phase(out: dict, shape: ModelShape, t: int, chunk_size: int, inputs: float,
                coef: MemoryCoefficients, lever: LeverCoefficients) -> dict:
    """What is alive while the chunked loss runs (see :func:`memory_model`)."""
    h, V = shape.n_embd, shape.vocab
    c1 = min(chunk_size, t)
    c2 = min(chunk_size, t - c1)
    return dict(out, grads=coef.grad * V * h, casts=coef.cast * V * h, attention=0.0,
                activations=inputs + lever.loss_residual * t * h, logits=max(8 * c1, 6 * (c1 + c2)) * V + 4.0 * t)


def saved_tensor_bytes(fn: Callable[[], object], *, exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the tensors autograd saves for the backward while ``fn()`` runs.

    Each storage counts once (views of one tensor share it); tensors in ``exclude`` (e.g. the
    model's parameters) are not counted. This is the activation memory of a training step, and
    unlike the allocator's peak it can be measured on a CPU. Tensors kept by non-reentrant
    checkpointing (the checkpoint inputs) are counted; the ones it recomputes are not.
    The hook keeps a detached view: a node that saves its own output would otherwise hold that
    output (and with it the whole graph) in a reference cycle no garbage collection frees.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def peak_live_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes of the tensors that operations create while ``fn()`` runs and that are alive at once.

    Each new storage counts from the operation that creates it until it is freed (views and
    in-place results of existing tensors do not count again); tensors that existed before
    (parameters, inputs) do not count. With the backward inside ``fn`` this is the step's peak
    above what it started with, which a CPU's allocator does not record: for example, whether
    a chunked loss holds one chunk of logits at a time in the backward or all of them.
    """
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    live: dict[int, int] = {}  # data_ptr -> bytes of the storages alive now
    total, peak = [0], [0]

    def free(key: int) -> None:
        total[0] -= live.pop(key, 0)

    class _Live(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor) and t.device.type != "meta"}
            for t in tree_flatten(out)[0]:
                if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                    continue
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in live and key not in inputs:
                    live[key] = storage.nbytes()
                    total[0] += live[key]
                    peak[0] = max(peak[0], total[0])
                    weakref.finalize(storage, free, key)
            return out

    with _Live():
        fn()
    return peak[0]


def model_shape(config) -> ModelShape:
    """The :class:`~labkit.perf.memory.ModelShape` of a ``GPT2Config`` (e.g. ``model.config``)."""
    return ModelShape(config.n_layer, config.n_embd, config.n_head, vocab=config.vocab_size,
                      n_positions=config.n_positions)


__all__ = ["KEYS", "LeverCoefficients", "memory_model", "model_shape", "peak_live_bytes", "saved_tensor_bytes"]
