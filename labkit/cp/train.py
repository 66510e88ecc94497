"""GPT-2 training on one long sequence across P GPUs, on PyTorch's context parallelism.

``torch.distributed.tensor.experimental.context_parallel`` shards the step's buffers along the
sequence (head-tail order, which balances the causal work) and replaces SDPA by ring attention
over the mesh. What the model must do for it (found on PyTorch 2.11, 2x H200):

- attention reaches ``F.scaled_dot_product_attention`` as ``is_causal=True`` with no mask tensor
  (a full-length mask cannot be sharded): :func:`cp_attention`, registered as :data:`ATTN_NAME`
  with a mask function that returns None;
- the token ids, the position ids and the labels (shifted before sharding) are the buffers, so
  each shard keeps its global positions and next tokens; sharding is in place, on plain tensors
  (tensors that require grad cannot be resized: make leaves inside the context);
- each rank's loss is the sum over its tokens divided by the global count (the chunked loss of
  ``lk.levers.lm_loss``), and gradients are summed across ranks before the optimizer step: the
  result is the gradient of the global mean, as on one GPU;
- K/V travel as a ring (:data:`ROTATE_METHOD`, set by :func:`use_ring` before each
  ``context_parallel``): torch's default, ``"allgather"``, gathers the other ranks' K/V in one
  collective, so every rank holds the whole sequence's K/V of a layer (memory that grows with N,
  not N/P) and that one transfer must hide behind the first step's compute alone;
  ``"alltoall"`` passes each rank's chunk to the next, step by step, as notebook 07 teaches and
  :mod:`labkit.cp.memory` models. (The backward passes dK/dV hop by hop whatever the setting.)

:func:`train` runs the measured steps; :mod:`labkit.cp.run` is ``python -m labkit cp-train`` (it
starts itself under ``torchrun`` for ``--nproc`` > 1) and its check against one GPU. Torch's ring
calls SDPA's CUDA kernels; without a GPU the processes use gloo and :mod:`labkit.cp.cpu`'s CPU
kernel in their place, so the same step runs on a CPU too.

Used in: 07_context_parallel.
"""
from __future__ import annotations

import contextlib
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.models import gpt2
from labkit.long import levers, memory as longmem
from labkit.cp import memory as cpmem

ATTN_NAME = "labkit_cp"
ROTATE_METHOD = "alltoall"  # torch's name for the ring: each rank passes its K/V chunk to the next, P-1 hops
MLP_CHUNKS = 16  # --chunked-mlp: positions per chunk = ceil(local tokens / MLP_CHUNKS)


def cp_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                 **kwargs):
    """Causal attention through ``F.scaled_dot_product_attention`` (looked up at call time, so
    context parallelism's ring replaces it), for transformers' AttentionInterface.

    Args:
        query, key, value: [B, H, n, D] (n: this rank's tokens under context parallelism).

    Returns:
        (out [B, n, H, D], None).
    """
    if attention_mask is not None or dropout:
        raise ValueError(f"'{ATTN_NAME}' takes unpadded causal input without dropout.")
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2), None


def _no_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> None:
    """The mask function of :data:`ATTN_NAME`: causal is SDPA's ``is_causal``, never a tensor.

    It also overrides transformers' guess that the shards' non-contiguous position ids (e.g. 0-3
    and 12-15) are packed sequences. Padding cannot be expressed this way, so it is refused.
    """
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(f"'{ATTN_NAME}' takes unpadded causal input: drop the padding mask.")
    return None


def build_model(size: str, n: int, device: torch.device, *, checkpointing: bool, chunked_mlp: bool,
                local_tokens: int, seed: int = 0):
    """GPT-2 ``size`` (random init, ``n`` learned positions) in training mode on :func:`cp_attention`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, cp_attention)
    AttentionMaskInterface.register(ATTN_NAME, _no_mask)
    model = gpt2.build_model(size, attn_implementation="sdpa", device=device, seed=seed,
                             n_positions=max(n, gpt2.SIZES[size]["n_positions"]))
    model.set_attn_implementation(ATTN_NAME)
    model.train().config.use_cache = False
    if checkpointing:
        gpt2.enable_checkpointing(model)
    if chunked_mlp:
        levers.chunk_mlp(model, -(-local_tokens // MLP_CHUNKS))
    return model


def make_batch(n: int, vocab: int, device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    """[ids, position ids, labels], each int64 [1, n]: random tokens, 0..n-1, the next token (-100 last)."""
    ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed)).to(device)
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)
    return [ids, torch.arange(n, device=device)[None], labels]


def use_ring(method: str = ROTATE_METHOD) -> str:
    """Make torch's context parallelism rotate K/V by ``method`` ("alltoall": the ring); returns the
    method in effect (:func:`rotate_method`).

    ``set_rotate_method`` is a private module's function (``torch.distributed.tensor.experimental.
    _attention``, in torch 2.11 and 2.13): where it is missing, a warning says so and torch's
    default stays in effect.
    """
    try:
        from torch.distributed.tensor.experimental._attention import set_rotate_method
    except ImportError:
        warnings.warn(f"this torch ({torch.__version__}) has no set_rotate_method: context parallelism keeps "
                      f"its default K/V rotation ({rotate_method()}), which lk.cpmem models too.", stacklevel=2)
    else:
        set_rotate_method(method)
    return rotate_method()


def rotate_method() -> str:
    """How torch's context parallelism moves K/V now: "alltoall" (the ring) or "allgather" (torch's
    default where it cannot be read)."""
    try:
        from torch.distributed.tensor.experimental._attention import _cp_options
    except ImportError:
        return "allgather"
    return "alltoall" if getattr(_cp_options.rotate_method, "name", "") == "ALL_TO_ALL" else "allgather"


class _LocalRotater:
    """A K/V "rotation" that sends nothing: each step gets back this rank's own buffer (same shapes,
    same compute, wrong result): what a ring step costs without its transfer."""

    def __init__(self, *args, **kwargs):
        self._buffer = None

    def exchange_buffers(self, curr_buffer: torch.Tensor) -> None:
        self._buffer = curr_buffer

    def next_buffer(self) -> torch.Tensor:
        return self._buffer


@contextlib.contextmanager
def no_kv_transfer():
    """Inside: torch's ring attention computes every step on the rank's own K/V and dK/dV (no
    communication; timing only, the result is wrong). Patches the private ``_create_rotater``."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    original = _attention._create_rotater
    _attention._create_rotater = lambda *args, **kwargs: _LocalRotater()
    try:
        yield
    finally:
        _attention._create_rotater = original


@contextlib.contextmanager
def sharded(mesh, buffers: list[torch.Tensor], seq_dim: int = 1, *, rotate: str = ROTATE_METHOD,
            load_balance: bool = True):
    """context_parallel over ``mesh`` with K/V moved by ``rotate`` (:func:`use_ring`; default the ring),
    sharding ``buffers`` (plain tensors) in place along ``seq_dim`` and not restoring them; nothing
    when mesh is None. ``load_balance=False``: contiguous shards, no head-tail order (torch's
    ``_cp_options.enable_load_balance``, restored afterwards)."""
    if mesh is None:
        yield
        return
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    use_ring(rotate)
    before, _cp_options.enable_load_balance = _cp_options.enable_load_balance, load_balance
    try:
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[seq_dim] * len(buffers),
                              no_restore_buffers=set(buffers)):
            yield
    finally:
        _cp_options.enable_load_balance = before


def loss_and_grads(model, batch: list[torch.Tensor], mesh, *, chunk_size: int, dtype: torch.dtype,
                   rotate: str = ROTATE_METHOD, load_balance: bool = True, transfer: bool = True) -> float:
    """Forward and backward of one step on ``batch`` (see :func:`make_batch`); returns the global mean loss.

    Under ``mesh`` (context parallelism) each rank holds its shard; the parameters' ``.grad``
    afterwards hold the gradient of the global mean on every rank. ``rotate`` and ``load_balance``:
    see :func:`sharded`; ``transfer=False``: :func:`no_kv_transfer` (timing only, wrong gradients).
    """
    ids, positions, labels = (t.clone() for t in batch)  # sharded in place: keep the caller's batch whole
    count = (labels != -100).sum()
    device = ids.device.type
    quiet = contextlib.nullcontext() if transfer or mesh is None else no_kv_transfer()
    with sharded(mesh, [ids, positions, labels], rotate=rotate, load_balance=load_balance), quiet:
        with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
            mean = levers.lm_loss(model, ids, chunk_size=chunk_size, position_ids=positions, targets=labels)
        loss = mean * (labels != -100).sum() / count  # this rank's share of the global mean
        loss.backward()
    loss = loss.detach()
    if mesh is not None:
        group = mesh.get_group()
        works = [dist.all_reduce(p.grad, group=group, async_op=True) for p in model.parameters() if p.grad is not None]
        works.append(dist.all_reduce(loss, group=group, async_op=True))
        for work in works:
            work.wait()
    return loss.item()


def train(args, mesh, device: torch.device) -> dict:
    """``args.steps`` AdamW steps on one sequence of ``args.seq_len`` tokens; the last one is timed.

    Returns:
        dict for this rank: rank, world, N, local_tokens, losses, step_s, tokens_per_s (global tokens
        of the timed step), peak_gib (CUDA; None on a CPU, which keeps no peak counter),
        predicted_gib (``lk.cpmem``, for the K/V rotation in effect) and rotate (that rotation;
        None on one device).
    """
    world = mesh.size() if mesh is not None else 1
    local = -(-args.seq_len // world)
    model = build_model(args.size, args.seq_len, device, checkpointing=args.checkpointing,
                        chunked_mlp=args.chunked_mlp, local_tokens=local, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    batch, losses, step_s = make_batch(args.seq_len, model.config.vocab_size, device, args.seed), [], float("nan")
    for step in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        losses.append(loss_and_grads(model, batch, mesh, chunk_size=args.chunk_size, dtype=_dtype(device),
                                     rotate=getattr(args, "rotate", ROTATE_METHOD),
                                     load_balance=not getattr(args, "no_load_balance", False),
                                     transfer=not getattr(args, "no_comm", False)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_s = time.perf_counter() - t0
    shape = longmem.model_shape(model.config)
    rotate = rotate_method() if mesh is not None else None
    predicted = cpmem.cp_memory(shape, seq_len=args.seq_len, world=world, checkpointing=args.checkpointing,
                                chunk_size=args.chunk_size, chunked_mlp=args.chunked_mlp,
                                rotate=rotate or ROTATE_METHOD, first_step=args.steps == 1)["total"]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return dict(rank=dist.get_rank() if mesh is not None else 0, world=world, N=args.seq_len, local_tokens=local,
                losses=losses, step_s=step_s, tokens_per_s=args.seq_len / step_s, peak_gib=peak,
                predicted_gib=predicted / 2**30, rotate=rotate, checkpointing=args.checkpointing,
                chunked_mlp=args.chunked_mlp, load_balance=not getattr(args, "no_load_balance", False),
                transfer=not getattr(args, "no_comm", False),
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


__all__ = ["ATTN_NAME", "MLP_CHUNKS", "ROTATE_METHOD", "build_model", "cp_attention", "loss_and_grads", "make_batch",
           "no_kv_transfer", "rotate_method", "sharded", "train", "use_ring"]
