"""Long documents and a long-range task: what long-sequence training trains and is judged on.

- :func:`stdlib_corpus`: the Python standard library's source files read as bytes (real long
  documents on every machine, offline; vocabulary 256, split by file); :func:`random_windows`
  for training, :func:`eval_windows` for evaluation.
- :func:`loss_by_position`: the validation loss at each position of a window (how much the
  model gains from seeing more context).
- :func:`passkey_batch`: a task whose answer sits more than ``min_distance`` tokens before the
  question, so only a long enough context can solve it.

Used in: 03_long_sequence_training.
"""
from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

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


__all__ = ["Corpus", "DOC_SEPARATOR", "eval_windows", "loss_by_position", "passkey_batch", "random_windows",
           "stdlib_corpus"]
