"""Packed training for notebook 09: GPT-2 trained on documents packed into one sequence, against the same
documents padded.

- :func:`stdlib_batches`: the course's length mix: the Python standard library's source files (one file a
  document, its bytes the tokens, as notebook 09's section 4 counts them), drawn at random until a batch holds
  exactly ``tokens`` tokens (the last document cut to fit: a shorter document of its own). ``scale`` divides
  every length (the same shape of mix at a size one GPU trains in one step).
- :func:`packed_batch` (the notebook's ``pack``: tokens, cu_seqlens, position ids restarted per document,
  document ids) and :func:`padded_batch` (one row per document, padded to the longest); both carry next-token
  targets inside each document only (none across a boundary, none on padding).
- :func:`use_packed_attention`: a GPT-2 whose attention is whatever function :func:`attending` installs:
  ``attend(q, k, v) -> o`` on the packed [1, H, T, D] (registered in transformers' ``AttentionInterface`` as
  :data:`ATTN_NAME`, with no mask function, so transformers builds no [T, T] mask); :func:`varlen_packed`
  turns a varlen call on [T, H, D] and cu_seqlens (FA4's, torch's) into such an attention.
- :func:`train`: each variant from the same initial weights on the same batches (AdamW): the loss per target
  token at every step and the tokens per second (real tokens, not padding) over the steps after the warm-up;
  :func:`loss_gap` and :func:`verdicts` read its table (a padded baseline that could not run is said so).

The notebook's kernels and masks are exercise answers: they come in as arguments, never from here.

Used in: 09_flex_attention.
"""
from __future__ import annotations

import contextlib
import math
import sysconfig
import time
from pathlib import Path
from typing import Callable, Iterator

import pandas as pd
import torch
import torch.nn.functional as F

from labkit.core import measure
from labkit.models import gpt2
from labkit.flex import bench as flexbench, varlen

ATTN_NAME = "labkit_packed"   # the attention implementation of a packed model (no "flash" in it: see hf_attention)
PADDED = "padded_sdpa"        # train()'s name for the unpacked reference: padded rows, SDPA with the padding mask
IGNORE = -100                 # a position without a target (cross_entropy's ignore_index)
_ACTIVE: list[Callable] = []  # the attention of the running packed step (innermost attending())


def _packed_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                      scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers' calling convention: q, k, v [1, H, T, D] -> ([1, T, H, D], None) through the active attend."""
    if not _ACTIVE:
        raise RuntimeError(f"a model with attention {ATTN_NAME!r} runs inside `with lk.packtrain.attending(attend):`")
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed sequence (batch 1), got batch {query.shape[0]}")
    if dropout:
        raise ValueError("the packed attentions take no dropout: build the model with dropout=0")
    if scaling is not None and abs(scaling * query.shape[-1] ** 0.5 - 1) > 1e-6:
        raise ValueError(f"the packed attentions use the scale 1/sqrt(D); this model asks for {scaling}")
    return _ACTIVE[-1](query, key, value).transpose(1, 2), None


def use_packed_attention(model) -> None:
    """Switch ``model`` (a transformers GPT-2) to :data:`ATTN_NAME` in place: its attention is the active attend."""
    from transformers import AttentionInterface

    if AttentionInterface._global_mapping.get(ATTN_NAME) is not _packed_attention:
        AttentionInterface.register(ATTN_NAME, _packed_attention)
    model.set_attn_implementation(ATTN_NAME)


@contextlib.contextmanager
def attending(attend: Callable) -> Iterator[None]:
    """Inside the block, a packed model's every layer calls ``attend(q, k, v) -> o`` ([1, H, T, D])."""
    _ACTIVE.append(attend)
    try:
        yield
    finally:
        _ACTIVE.pop()


def stdlib_batches(n_batches: int, tokens: int, *, max_len: int, scale: int = 1, seed: int = 0
                   ) -> list[list[torch.Tensor]]:
    """``n_batches`` lists of byte documents ([len] int64) holding exactly ``tokens`` tokens each.

    A document is a random standard-library ``*.py`` file's first min(size // scale, max_len) bytes (at least
    one); the last one of a batch is cut to what is left.
    """
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n_batches):
        docs, total = [], 0
        while total < tokens:
            path = files[int(torch.randint(len(files), (1,), generator=gen))]
            n = min(max(1, path.stat().st_size // scale), max_len, tokens - total)
            docs.append(torch.frombuffer(bytearray(path.read_bytes()[:n]), dtype=torch.uint8).long())
            total += n
        batches.append(docs)
    return batches


def next_token_targets(docs: list[torch.Tensor]) -> torch.Tensor:
    """[sum of lengths] int64: each token's next token in its own document, IGNORE at a document's last token."""
    return torch.cat([torch.cat([d[1:], torch.tensor([IGNORE])]) for d in docs])


def packed_batch(docs: list[torch.Tensor], pack: Callable, device, max_len: int | None = None) -> dict:
    """``pack(docs)`` (the notebook's exercise 8) on ``device`` plus the model's inputs and targets ([1, T]).

    ``max_len``: the bound on a document's length that varlen kernels get (default: this batch's longest); a
    fixed bound (the model's positions) keeps a kernel compiled per bound from compiling again every batch.
    """
    packed = {name: t.to(device) for name, t in pack(docs).items()}
    packed["max_len"] = max_len or max(len(d) for d in docs)
    packed["input_ids"] = packed["tokens"].view(1, -1)
    packed["targets"] = next_token_targets(docs).to(device).view(1, -1)
    return packed


def padded_batch(docs: list[torch.Tensor], device, pad_id: int = 0) -> dict:
    """One row per document, right-padded: input_ids, attention_mask (1 real, 0 padding), targets [n, longest]."""
    longest = max(len(d) for d in docs)
    ids = torch.full((len(docs), longest), pad_id, dtype=torch.int64)
    targets = torch.full((len(docs), longest), IGNORE, dtype=torch.int64)
    mask = torch.zeros(len(docs), longest, dtype=torch.int64)
    for row, d in enumerate(docs):
        ids[row, :len(d)], mask[row, :len(d)], targets[row, :len(d)] = d, 1, next_token_targets([d])
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "targets": targets.to(device)}


def summed_loss(model, batch: dict) -> tuple[torch.Tensor, int]:
    """(sum of the next-token cross-entropies in fp32, number of targets) of a packed or padded batch."""
    inputs = {name: batch[name] for name in ("input_ids", "attention_mask") if name in batch}
    if "position_ids" in batch:
        inputs["position_ids"] = batch["position_ids"].view(1, -1)
    logits = model(**inputs, use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["targets"].flatten(), ignore_index=IGNORE,
                           reduction="sum")
    return loss, int((batch["targets"] != IGNORE).sum())


def varlen_packed(fn: Callable) -> Callable:
    """A varlen call ``fn(q, k, v, cu_seqlens, max_len) -> o`` on [T, H, D] as a prepare: packed -> attend."""
    def prepare(packed: dict) -> Callable:
        cu, longest = packed["cu_seqlens"].to(torch.int32), int(packed["max_len"])

        def attend(q, k, v):
            q3, k3, v3 = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))   # [1, H, T, D] -> [T, H, D]
            return fn(q3, k3, v3, cu, longest).transpose(0, 1).unsqueeze(0)        # -> [1, H, T, D]
        return attend
    return prepare


fa4_packed = varlen_packed(varlen.fa4_varlen)       # FA4's flash_attn_varlen_func, causal per document
torch_varlen_packed = varlen_packed(varlen.varlen_attend)   # torch.nn.attention.varlen.varlen_attn


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model(size: str, max_len: int, device, seed: int, packed: bool, overrides: dict):
    model = gpt2.build_model(size, attn_implementation="sdpa", device=device, seed=seed,
                             **{"vocab_size": 256, "n_positions": max_len, **overrides}).train()
    model.config.use_cache = False
    if packed:
        use_packed_attention(model)
    return model


def _run(name: str, prepare, batches, *, pack, size, max_len, steps, warmup, device, dtype, seed, lr, overrides):
    """One variant: losses per step and tokens per second after the warm-up (a status string if it failed)."""
    model = _model(size, max_len, device, seed, prepare is not None, overrides)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=device.type == "cuda")
    losses, start, tokens = [], None, 0
    _sync(device)
    began = time.perf_counter()
    for step in range(steps):
        if step == warmup:
            _sync(device)
            start = time.perf_counter()
        docs = batches[step % len(batches)]
        batch = padded_batch(docs, device) if prepare is None else packed_batch(docs, pack, device, max_len)
        context = contextlib.nullcontext() if prepare is None else attending(prepare(batch))
        with context, torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss, n = summed_loss(model, batch)
        (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()) / n)
        tokens += sum(len(d) for d in docs) if step >= warmup else 0
    _sync(device)
    end = time.perf_counter()
    seconds = end - start if start is not None else float("nan")
    warm_steps = min(warmup, steps)               # every step is a warm-up step when warmup >= steps
    warm_end = start if start is not None else end
    return dict(variant=name, status="ok", tokens_per_s=tokens / seconds if tokens else float("nan"),
                warmup_ms=(warm_end - began) / warm_steps * 1e3 if warm_steps else float("nan"),
                step_ms=seconds / max(steps - warmup, 1) * 1e3, losses=losses)


def train(variants: dict[str, Callable | None], batches: list[list[torch.Tensor]], *, pack: Callable,
          size: str = "tiny", max_len: int = 512, steps: int = 4, warmup: int = 1, device=None,
          dtype=torch.bfloat16, seed: int = 0, lr: float = 3e-4, **overrides) -> pd.DataFrame:
    """Train a fresh GPT-2 (same seed: same weights) per variant on ``batches`` (cycled): one row per variant.

    Args:
        variants: name -> ``prepare(packed) -> attend`` for a packed variant (``packed``: :func:`packed_batch`'s
            dict on the device; called once per step, so a block mask or lists are built per batch, as training
            must), or None for the padded reference with SDPA (name it :data:`PADDED`).
        pack: the notebook's ``pack(docs)`` (exercise 8).
        size: a ``lk.gpt2.SIZES`` name; built with a byte vocabulary (256) and ``max_len`` learned positions.
        warmup: steps not timed (compilation, autotuning, and what a backend prepares for each new shape: padded
            batches change shape from batch to batch); ``warmup = len(batches)`` times a second pass over batches
            every variant has already seen once. Every step's loss is kept.
        dtype: autocast dtype (fp32: no autocast).
    Returns:
        DataFrame: variant, status ("ok" or the error), tokens_per_s, warmup_ms and step_ms (mean milliseconds a
        step, warm-up and timed steps), loss_0 ... loss_{steps-1} (the mean next-token loss per target token at
        each step, before that step's update).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    for name, prepare in variants.items():
        try:
            row = _run(name, prepare, batches, pack=pack, size=size, max_len=max_len, steps=steps, warmup=warmup,
                       device=device, dtype=dtype, seed=seed, lr=lr, overrides=overrides)
        except Exception as err:  # noqa: BLE001 - one variant's failure (missing package, OOM) is its row's status
            row = dict(variant=name, status=flexbench.status_of(err), tokens_per_s=float("nan"),
                       warmup_ms=float("nan"), step_ms=float("nan"), losses=[])
        row.update({f"loss_{i}": row["losses"][i] if i < len(row["losses"]) else float("nan") for i in range(steps)})
        del row["losses"]
        rows.append(row)
        measure.free_memory()
    return pd.DataFrame(rows).set_index("variant")


def loss_gap(table: pd.DataFrame, reference: str = PADDED) -> pd.Series:
    """Per variant: the largest |loss - reference's loss| / reference's loss over the steps (NaN if not run)."""
    cols = [c for c in table.columns if c.startswith("loss_")]
    ref = table.loc[reference, cols].astype(float)
    return ((table[cols].astype(float) - ref).abs() / ref).max(axis=1, skipna=False)


def verdicts(table: pd.DataFrame, *, goal: float = 1.5, tolerance: float = 2 ** -7,
             reference: str = PADDED) -> list[str]:
    """One line per variant of :func:`train`'s table: tokens/s, the speed-up over ``reference`` against ``goal`` and
    the largest relative loss difference against ``tolerance``. When the reference itself did not run (``oom`` on a
    small GPU, say) the lines say so and give tokens/s alone: a ratio to a missing baseline is not "below goal"."""
    ref = table.loc[reference]
    baseline = ref["status"] == "ok"
    lines = [] if baseline else [
        f"{reference}: {ref['status']}: the padded baseline did not run here, so no speed-up over it and no loss "
        f"difference to it can be measured (its padded batches hold more tokens than the packed ones)"]
    gaps = loss_gap(table, reference)
    for name, row in table.drop(reference).iterrows():
        line = f"{name}: {row['status']}" if row["status"] != "ok" else f"{name}: {row['tokens_per_s']:,.0f} tokens/s"
        if row["status"] == "ok" and baseline:
            speed = row["tokens_per_s"] / ref["tokens_per_s"]
            line += (f" = {speed:.2f}x padded (goal >= {goal:g}x: {'ok' if speed >= goal else 'below goal'}); "
                     f"largest loss difference {gaps[name]:.1e} "
                     f"({'within' if gaps[name] <= tolerance else 'NOT within'} 2^{math.log2(tolerance):g})")
        lines.append(line)
    return lines
