"""Long-sequence training: data, a long-range task, and the levers that make long N fit.

- Data: :func:`stdlib_corpus` (the Python standard library's source files read as bytes: real
  long documents on every machine, offline; vocabulary 256, split by file), :func:`random_windows`,
  :func:`eval_windows`; :func:`passkey_batch`, a task whose answer sits more than
  ``min_distance`` tokens before the question (only a long enough context can solve it).
- Levers: :class:`Checkpointed` (``torch.utils.checkpoint``, ``use_reentrant=False``; for Hugging
  Face models use ``lk.gpt2.enable_checkpointing``), :func:`chunked_cross_entropy` (never holds
  N x vocab logits), :func:`rope_cache` / :func:`apply_rope` (rotary positions).
- Memory: :func:`memory_model` (``lk.perfmodel.training_memory`` plus the chunked-loss lever),
  :func:`saved_tensor_bytes` (what autograd keeps for the backward: measurable on a CPU too),
  :func:`longest_sequence` (the largest N one training step fits, per configuration, on a GPU).

Used in: 03_long_sequence_training.
"""
from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import bench
from .env import default_device
from .perfmodel import MemoryCoefficients, ModelShape, training_memory

DOC_SEPARATOR = 0  # byte between documents (never occurs in Python source)
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}


# ----------------------------------------------------------------------------- real long documents

@dataclass(frozen=True)
class Corpus:
    """Byte tokens (uint8, vocabulary 256) of whole files, split by file into train and val."""

    train: torch.Tensor  # [n_train_bytes] uint8
    val: torch.Tensor    # [n_val_bytes] uint8
    files: int
    source: str


def stdlib_corpus(max_bytes: int = 8 * 2**20, *, min_file_bytes: int = 16384, val_every: int = 10,
                  root: str | Path | None = None) -> Corpus:
    """The Python standard library's ``*.py`` files (tests excluded), read as bytes.

    Files are taken in sorted path order until ``max_bytes``; a file goes to val when the CRC32
    of its relative path is divisible by ``val_every`` (about 1/val_every of them), so the split
    is the same on every machine and no document is in both. Documents are joined by
    ``DOC_SEPARATOR``.
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _SKIP_DIRS]  # prune: site-packages is large
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    total, used = 0, 0
    for path in sorted(files):
        data = path.read_bytes()
        if len(data) < min_file_bytes:
            continue
        parts[zlib.crc32(path.relative_to(root).as_posix().encode()) % val_every == 0].append(data)
        total, used = total + len(data), used + 1
        if total >= max_bytes:
            break
    if not parts[False] or not parts[True]:
        raise FileNotFoundError(f"too few Python files of >= {min_file_bytes} bytes under {root}; pass "
                                "root= a folder of long text files, or lower min_file_bytes.")
    sep = bytes([DOC_SEPARATOR])
    as_tensor = lambda chunks: torch.frombuffer(bytearray(sep.join(chunks)), dtype=torch.uint8)  # noqa: E731
    return Corpus(as_tensor(parts[False]), as_tensor(parts[True]), used, str(root))


def random_windows(data: torch.Tensor, batch: int, seq_len: int, *,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """``batch`` random windows of ``seq_len`` tokens from 1-D ``data``: int64 [batch, seq_len]."""
    if data.dim() != 1 or data.numel() <= seq_len:
        raise ValueError(f"data must be 1-D and longer than seq_len={seq_len}, got shape {tuple(data.shape)}.")
    start = torch.randint(0, data.numel() - seq_len, (batch,), generator=generator)
    return torch.stack([data[s:s + seq_len] for s in start.tolist()]).long()


def eval_windows(data: torch.Tensor, seq_len: int, n: int) -> torch.Tensor:
    """``n`` evenly spaced windows (deterministic) of ``seq_len`` tokens: int64 [n, seq_len]."""
    if data.numel() <= seq_len:
        raise ValueError(f"data has {data.numel()} tokens, not more than seq_len={seq_len}.")
    starts = torch.linspace(0, data.numel() - seq_len - 1, n).long()
    return torch.stack([data[s:s + seq_len] for s in starts.tolist()]).long()


# ----------------------------------------------------------------------------- a long-range task

def passkey_batch(batch: int, seq_len: int, *, min_distance: int, n_keys: int = 16, repeats: int = 1,
                  vocab: int = 256, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Passkey retrieval: a key hidden in filler, asked for by the last token.

    Tokens ``0..n_keys-1`` are keys: one of them fills ``repeats`` consecutive positions that end
    at least ``min_distance`` tokens before the last position (as passkey prompts repeat the key,
    which makes it faster to learn); token ``n_keys`` is the question (always last); the rest is
    filler drawn from ``n_keys+1..vocab-1``. A model that sees fewer than ``min_distance + 1``
    tokens cannot do better than chance (1 / n_keys).

    Returns:
        (ids int64 [batch, seq_len], answer int64 [batch]).
    """
    room = seq_len - min_distance - repeats + 1  # start positions that put the last key >= min_distance back
    if min_distance < 1 or repeats < 1 or room < 1 or vocab <= n_keys + 1:
        raise ValueError(f"need min_distance >= 1, repeats >= 1, min_distance + repeats <= seq_len and vocab > "
                         f"n_keys + 1; got min_distance={min_distance}, repeats={repeats}, seq_len={seq_len}, "
                         f"n_keys={n_keys}, vocab={vocab}.")
    ids = torch.randint(n_keys + 1, vocab, (batch, seq_len), generator=generator)
    answer = torch.randint(0, n_keys, (batch,), generator=generator)
    start = torch.randint(0, room, (batch, 1), generator=generator)
    block = start + torch.arange(repeats)  # [batch, repeats]
    ids.scatter_(1, block, answer[:, None].expand(-1, repeats))
    ids[:, -1] = n_keys
    return ids, answer


# ----------------------------------------------------------------------------- activation checkpointing

class Checkpointed(nn.Module):
    """``module`` whose activations are recomputed in the backward instead of kept.

    In training with grad enabled, the forward runs under ``torch.utils.checkpoint`` with
    ``use_reentrant=False`` (the recommended mode: works with kwargs, inputs that need no grad
    and nested hooks); only the inputs are saved. Elsewhere it is ``module`` unchanged.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        if self.training and torch.is_grad_enabled():
            return checkpoint(self.module, *args, use_reentrant=False, **kwargs)
        return self.module(*args, **kwargs)


# ----------------------------------------------------------------------------- chunked cross-entropy

class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T``, chunk by chunk in both passes."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, ignore_index, dtype):
        # hidden [T, C], weight [V, C], targets [T]; logits are [chunk, V] at most, fp32 for the loss.
        valid, acc = targets != ignore_index, torch.promote_types(dtype, torch.float32)
        total, lses, w = torch.zeros((), dtype=acc, device=hidden.device), [], weight.to(dtype)
        for s in range(0, hidden.shape[0], chunk_size):
            logits = (hidden[s:s + chunk_size].to(dtype) @ w.T).to(acc)  # [c, V]
            lse = torch.logsumexp(logits, dim=-1)                                          # [c]
            picked = logits.gather(1, targets[s:s + chunk_size].clamp(min=0)[:, None])[:, 0]
            total = total + ((lse - picked) * valid[s:s + chunk_size]).sum()
            lses.append(lse)
        ctx.save_for_backward(hidden, weight, targets, torch.cat(lses))
        ctx.chunk_size, ctx.ignore_index, ctx.dtype, ctx.n_valid = chunk_size, ignore_index, dtype, valid.sum()
        return total / ctx.n_valid

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, lse = ctx.saved_tensors
        c, dtype, w = ctx.chunk_size, ctx.dtype, weight.to(ctx.dtype)
        d_hidden = torch.empty_like(hidden)
        d_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)
        scale = grad / ctx.n_valid
        for s in range(0, hidden.shape[0], c):
            h, t = hidden[s:s + c].to(dtype), targets[s:s + c]
            p = (h @ w.T).to(lse.dtype).sub_(lse[s:s + c, None]).exp_()  # softmax [c, V], recomputed in place
            p[torch.arange(len(t), device=t.device), t.clamp(min=0)] -= 1.0  # d loss / d logits
            d_logits = p.mul_((t != ctx.ignore_index)[:, None] * scale).to(dtype)
            d_hidden[s:s + c] = (d_logits @ w).to(hidden.dtype)
            d_weight += (d_logits.T @ h).to(lse.dtype)
        return d_hidden, d_weight.to(weight.dtype), None, None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          chunk_size: int = 4096, ignore_index: int = -100) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, targets)`` without ever holding N x V logits.

    Forward: per chunk of positions, the logits [chunk, V] (fp32 for the softmax, as HF upcasts),
    their log-sum-exp (kept: 4 bytes per position) and the loss; backward recomputes each chunk's
    logits. Under autocast the matmuls run in the autocast dtype, as ``lm_head`` would.

    Args:
        hidden: [..., N, C] final hidden states; weight: [V, C] (GPT-2's ``lm_head.weight``).
        targets: int64 [..., N], ``ignore_index`` where no loss is taken.

    Returns:
        The mean loss over positions whose target is not ``ignore_index`` (fp32 scalar).
    """
    if hidden.shape[:-1] != targets.shape or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"shapes: hidden [..., N, C] {tuple(hidden.shape)}, weight [V, C] {tuple(weight.shape)}, "
                         f"targets [..., N] {tuple(targets.shape)} do not match.")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    with torch.autocast(device, enabled=False):
        return _ChunkedCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
                                          chunk_size, ignore_index, dtype)


def lm_loss(model, ids: torch.Tensor, *, chunk_size: int | None = None) -> torch.Tensor:
    """Next-token loss of a GPT-2 LM head model on ``ids`` int64 [B, N].

    ``chunk_size=None``: transformers' own loss (full [B, N, V] logits, upcast to fp32);
    otherwise :func:`chunked_cross_entropy` on the final hidden states and ``lm_head.weight``.
    """
    if chunk_size is None:
        return model(input_ids=ids, labels=ids, use_cache=False).loss
    hidden = model.transformer(input_ids=ids, use_cache=False).last_hidden_state  # [B, N, C]
    return chunked_cross_entropy(hidden[:, :-1], model.lm_head.weight, ids[:, 1:], chunk_size=chunk_size)


@torch.no_grad()
def loss_by_position(model, windows: torch.Tensor, *, batch_size: int = 8) -> torch.Tensor:
    """Mean next-token loss at each position of ``windows`` int64 [n, N]: fp32 [N - 1]
    (entry i is the loss of predicting token i + 1 from tokens 0..i)."""
    device = next(model.parameters()).device
    total = torch.zeros(windows.shape[1] - 1, dtype=torch.float64)
    for batch in windows.split(batch_size):
        batch = batch.to(device)
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()  # [b, N-1, V]
        loss = F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")  # [b, N-1]
        total += loss.sum(0).double().cpu()
    return (total / windows.shape[0]).float()


# ----------------------------------------------------------------------------- rotary position embedding

def rope_cache(seq_len: int, head_dim: int, *, base: float = 10000.0, offset: int = 0, device=None,
               dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq_len, head_dim] for positions ``offset .. offset + seq_len - 1``.

    Frequencies theta_i = base^(-2i / head_dim), i < head_dim / 2, in the "rotate-half" layout
    (Llama, GPT-NeoX): channel i and channel i + head_dim/2 form the pair rotated by pos * theta_i,
    so both halves of the last dim repeat the same angles. Computed in float64, then cast.
    """
    if head_dim % 2 or head_dim < 2 or seq_len < 1:
        raise ValueError(f"head_dim must be even and >= 2 and seq_len >= 1, got {head_dim}, {seq_len}.")
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # [D/2]
    angles = torch.arange(offset, offset + seq_len, dtype=torch.float64)[:, None] * inv_freq  # [N, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [N, D]
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, H, N, D] (any [..., N, D]) by its positions: x * cos + rotate_half(x) * sin,
    with rotate_half(x) = [-x2, x1] for halves x1, x2 of the last dim. Returns x's shape and dtype;
    computes in the wider of x's and cos's dtypes.
    """
    if x.shape[-2:] != cos.shape or cos.shape != sin.shape:
        raise ValueError(f"x [..., N, D] {tuple(x.shape)} needs cos and sin of shape [N, D]; got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)} (see rope_cache).")
    wide = torch.promote_types(x.dtype, cos.dtype)
    x1, x2 = x.to(wide).chunk(2, dim=-1)
    return (x.to(wide) * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


# ----------------------------------------------------------------------------- memory: model and measurement

ACTIVATION_KEYS = ("activations", "attention", "logits")  # the terms that grow with N


def memory_model(shape: ModelShape, *, batch: int, seq_len: int, attention: str = "flash",
                 checkpointing: bool = False, chunked_loss: bool = False, chunk_size: int = 4096,
                 coef: MemoryCoefficients = MemoryCoefficients()) -> dict[str, float]:
    """Predicted peak bytes of one training step, by component (see ``lk.perfmodel.training_memory``).

    Per layer, ``B*N*h*coef.hidden`` bytes of activations plus, for standard attention, the scores
    ``B*H*N^2*coef.scores`` (FlashAttention keeps ``B*N*H*coef.lse`` instead); checkpointing keeps
    ``B*N*h*coef.checkpoint`` per layer plus one layer's activations while it is recomputed; the
    loss holds ``B*N*V*coef.logits`` (bf16 logits, their fp32 copy, the gradient).

    ``chunked_loss`` (:func:`chunked_cross_entropy` over the ``R = B*(N-1)`` shifted positions of
    :func:`lm_loss`; chunks of ``c1 = min(chunk_size, R)``, then ``c2 = min(chunk_size, R - c1)`` rows)
    has two candidate peaks; the larger is returned, by component:

    - in the loss: ``logits = max(8*c1, 6*(c1 + c2))*V + 4*B*N``, independent of N once there are
      two full chunks. One chunk: the fp32 logits plus logsumexp's fp32 temporary (8 bytes); several:
      the backward makes the next chunk's bf16 logits and fp32 softmax (6 bytes) while the previous
      chunk's fp32 softmax and bf16 gradient (6 bytes) are still bound. With it: weights, optimizer,
      the tied lm_head's gradient and bf16 copy only (``(coef.grad + coef.cast)*V*h``), the saved
      activations but no recomputed layer, and ``12*B*N*h`` (ln_f's fp32 input, output, gradient).
    - in the layers' backward (long N with checkpointing): ``training_memory`` with ``logits = 0``
      (the loss's buffers are freed by then).

    Returns:
        dict with weights, grads, optimizer, casts, activations, attention, logits, total (bytes).
    """
    out = training_memory(shape, batch=batch, seq_len=seq_len, attention=attention,
                          checkpointing=checkpointing, coef=coef)
    if not chunked_loss:
        return out
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    t, h, V = batch * seq_len, shape.n_embd, shape.vocab
    rows = batch * max(seq_len - 1, 1)
    c1 = min(chunk_size, rows)
    c2 = min(chunk_size, rows - c1)
    layers = dict(out, logits=0.0)
    loss = dict(out, grads=coef.grad * V * h, casts=coef.cast * V * h, logits=max(8 * c1, 6 * (c1 + c2)) * V + 4.0 * t)
    if checkpointing:  # only the layer inputs: no layer is being recomputed during the loss
        loss.update(activations=shape.n_layer * t * h * coef.checkpoint, attention=0.0)
    loss["activations"] += 12.0 * t * h
    for part in (layers, loss):
        part["total"] = sum(v for k, v in part.items() if k != "total")
    return max(loss, layers, key=lambda part: part["total"])


def saved_tensor_bytes(fn: Callable[[], object], *, exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the tensors autograd saves for the backward while ``fn()`` runs.

    Each storage counts once (views of one tensor share it); tensors in ``exclude`` (e.g. the
    model's parameters) are not counted. This is the activation memory of a training step, and
    unlike the allocator's peak it can be measured on a CPU. Tensors kept by non-reentrant
    checkpointing (the checkpoint inputs) are counted; the ones it recomputes are not.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


# ----------------------------------------------------------------------------- the longest sequence that trains

CONFIGS = {  # name: (attn_implementation, activation checkpointing, chunked loss)
    "eager": ("eager", False, False),
    "flash": ("sdpa", False, False),
    "flash+ckpt": ("sdpa", True, False),
    "flash+ckpt+chunked": ("sdpa", True, True),
}


def model_shape(config) -> ModelShape:
    """The :class:`~labkit.perfmodel.ModelShape` of a ``GPT2Config`` (e.g. ``model.config``)."""
    return ModelShape(config.n_layer, config.n_embd, config.n_head, vocab=config.vocab_size,
                      n_positions=config.n_positions)


def _long_step(config: str, size: str, n: int, device: torch.device, dtype: torch.dtype, chunk_size: int):
    """A closure running one training step of GPT-2 ``size`` (positions extended to ``n``) on
    ``n`` random tokens, with ``config``'s attention, checkpointing and loss."""
    from . import gpt2

    impl, ckpt, chunked = CONFIGS[config]
    model = gpt2.build_model(size, attn_implementation=impl, device=device)
    if n > model.config.n_positions:
        gpt2.extend_positions(model, n)
    model.train().config.use_cache = False
    if ckpt:
        gpt2.enable_checkpointing(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)).to(device)

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = lm_loss(model, ids, chunk_size=chunk_size if chunked else None)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _measure_step(step: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """(ms, peak bytes including what was allocated before) of the second call of ``step``."""
    step()  # warm-up: kernels chosen, AdamW state allocated
    held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    timings: list[bench.Timing] = []
    extra = bench.peak_memory(lambda: timings.append(bench.time_fn(step, device=device, warmup=0, min_reps=1,
                                                                   max_reps=1)), device=device)
    return timings[0].median_ms, held + extra


def longest_sequence(configs: Iterable[str] = tuple(CONFIGS), *, size: str = "small", start: int = 2048,
                     max_len: int = 262144, device=None, dtype: torch.dtype = torch.bfloat16,
                     chunk_size: int = 4096, max_step_s: float = 30.0, progress: bool = True) -> pd.DataFrame:
    """The longest single sequence (batch 1) one GPT-2 training step fits, per configuration.

    For each configuration in :data:`CONFIGS`, N doubles from ``start`` to ``max_len``; each N
    builds GPT-2 ``size`` (random init, positions extended to N), runs a warm-up step and one
    measured step (autocast to ``dtype``, AdamW), and stops the configuration at its first
    out-of-memory error (or after a step slower than ``max_step_s``). Memory is freed between rows.

    Returns:
        DataFrame: config, N, status ("ok", "oom" or "error: ..."), step_ms, tokens_per_s,
        peak_gib (measured, NaN on CPU), predicted_gib (:func:`memory_model`), device.
    """
    from tqdm.auto import tqdm

    from . import gpt2

    device = torch.device(device or default_device())
    unknown = set(configs) - set(CONFIGS)
    if unknown or start < 2 or max_len < start:
        raise ValueError(f"configs must come from {list(CONFIGS)} (unknown: {sorted(unknown)}) "
                         f"and 2 <= start <= max_len; got start={start}, max_len={max_len}.")
    shape = model_shape(gpt2.gpt2_config(size))
    lengths = [start * 2**i for i in range(64) if start * 2**i <= max_len]
    rows, bar = [], tqdm(total=len(configs) * len(lengths), desc="longest sequence", disable=not progress)
    for config in configs:
        for n in lengths:
            impl, ckpt, chunked = CONFIGS[config]
            predicted = memory_model(shape, batch=1, seq_len=n, attention="standard" if impl == "eager" else "flash",
                                     checkpointing=ckpt, chunked_loss=chunked, chunk_size=chunk_size)["total"]
            row = dict(config=config, N=n, status="ok", step_ms=float("nan"), tokens_per_s=float("nan"),
                       peak_gib=float("nan"), predicted_gib=predicted / 2**30, device=device.type)
            try:
                ms, peak = _measure_step(_long_step(config, size, n, device, dtype, chunk_size), device)
                row.update(step_ms=ms, tokens_per_s=n / (ms / 1e3),
                           peak_gib=peak / 2**30 if device.type == "cuda" else float("nan"))
            except (RuntimeError, MemoryError) as err:
                row["status"] = "oom" if bench.is_oom(err) else f"error: {str(err).splitlines()[0][:120]}"
            bench.free_memory()
            rows.append(row)
            bar.update(1)
            if row["status"] != "ok" or row["step_ms"] > 1e3 * max_step_s:
                bar.update(len(lengths) - 1 - lengths.index(n))
                break
    bar.close()
    return pd.DataFrame(rows)


__all__ = ["ACTIVATION_KEYS", "CONFIGS", "Checkpointed", "Corpus", "DOC_SEPARATOR", "apply_rope",
           "chunked_cross_entropy", "eval_windows", "lm_loss", "longest_sequence", "loss_by_position",
           "memory_model", "model_shape", "passkey_batch", "random_windows", "rope_cache",
           "saved_tensor_bytes", "stdlib_corpus"]
