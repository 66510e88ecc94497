"""The GPU part of notebook 11: run-to-run bits, batch invariance at GPU sizes, and what invariance costs.

- :func:`run_to_run`: how many distinct bit patterns ``runs`` identical calls give (1 = reproducible).
- :func:`decode_sweep`: the reader's fixed-split decode against the dynamic split (the launch heuristic over this GPU's
  SMs) and the unsplit kernel, per batch and context length: milliseconds and the ratios the goals name.
- :func:`backward_sweep`: the reader's deterministic backward against the given atomic-dQ one (d = 128).
- :func:`verdicts`: the goals, each with its worst measured ratio and PASS / MISS.

Times: :func:`labkit.core.measure.time_interleaved` (CUDA events, the calls taking turns). Used in: 11_determinism.
"""
from __future__ import annotations

from typing import Callable

import pandas as pd
import torch
from triton.runtime.errors import OutOfResources

from labkit.core import measure
from labkit.determinism import backward as detbackward, decode as detdecode, reduce as detreduce

FAILURES = (RuntimeError, OutOfResources)   # a kernel that does not fit this GPU: its row says so, the sweep goes on
DECODE_GOAL = 1.10      # fixed split / dynamic split at batch >= 8: at most 10% slower
BACKWARD_GOAL = 1.20    # deterministic / atomic backward: at most 20% slower
CACHE_BYTES = 24 * 2**30   # a decode case whose K and V caches together pass this is skipped (printed as such)


def run_to_run(fn: Callable[[], object], runs: int = 100) -> int:
    """Distinct results (bit for bit) of ``runs`` identical calls of ``fn`` (on a GPU: the hardware's orders)."""
    return len(detreduce.distinct([fn() for _ in range(runs)]))


def decode_batch(batch: int, length: int, heads: int, dim: int, device, dtype=torch.bfloat16, seed: int = 0):
    """A decode batch at GPU sizes: q [B, H, D], caches [B, H, N, D] (random), lens [B] spread over [N/2, N]."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, heads, dim, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(batch, heads, length, dim, device=device, dtype=dtype, generator=gen) for _ in range(2))
    lens = torch.randint(length // 2, length + 1, (batch,), device=device, generator=gen, dtype=torch.int32)
    lens[0] = length
    return q, k, v, lens


def decode_sweep(fixed_decode: Callable, *, batches=(1, 8, 64), lengths=(8192, 32768, 131072), heads: int = 8,
                 dim: int = 128, device="cuda") -> pd.DataFrame:
    """Per (batch, N): fixed_ms (the reader's), dynamic_ms (:func:`labkit.determinism.decode.dynamic_decode` with this
    GPU's SM count), unsplit_ms, fixed_over_dynamic, fixed_over_unsplit, splits (the heuristic's count); a case whose
    caches pass :data:`CACHE_BYTES` has a note instead of times."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    for batch in batches:
        for length in lengths:
            row = {"batch": batch, "N": length, "note": ""}
            if 2 * batch * heads * length * dim * 2 > CACHE_BYTES:
                rows.append({**row, "note": f"skipped: caches over {CACHE_BYTES / 2**30:.0f} GiB"})
                continue
            args = decode_batch(batch, length, heads, dim, device)
            fns = {"fixed": lambda: fixed_decode(*args), "unsplit": lambda: detdecode.unsplit_decode(*args),
                   "dynamic": lambda: detdecode.dynamic_decode(*args, num_sms=sms)}
            timings, failed = measure.time_interleaved(fns, device=device, errors=FAILURES)
            row.update({f"{name}_ms": t.median_ms for name, t in timings.items()})
            row["note"] = "; ".join(f"{name}: {type(err).__name__}" for name, err in failed.items())
            row["splits"] = detdecode.heuristic_num_splits(batch * heads, sms, -(-length // 16))
            rows.append(row)
            del args
            measure.free_memory()
    table = pd.DataFrame(rows)
    if "fixed_ms" in table:
        table["fixed_over_dynamic"] = table["fixed_ms"] / table["dynamic_ms"]
        table["fixed_over_unsplit"] = table["fixed_ms"] / table["unsplit_ms"]
    return table


def backward_sweep(deterministic_backward: Callable, *, lengths=(4096, 8192), dim: int = 128, tokens: int = 16384,
                   device="cuda", blocks: dict | None = None) -> pd.DataFrame:
    """Per N (B = tokens / N, H = 2048 / d, bf16): det_ms, atomic_ms and det_over_atomic."""
    blocks = blocks or {"block_m": 64, "block_n": 64}
    rows = []
    for length in lengths:
        B, H = max(1, tokens // length), 2048 // dim
        q, k, v, do = (torch.randn(B, H, length, dim, device=device, dtype=torch.bfloat16) for _ in range(4))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        lse = torch.logsumexp((q.float() @ k.float().transpose(-2, -1)) * dim ** -0.5, -1) if length <= 8192 else None
        if lse is None:
            rows.append({"N": length, "B": B, "H": H, "note": "skipped: lse by PyTorch needs N x N scores"})
            continue
        fns = {"det": lambda: deterministic_backward(q, k, v, o, lse, do, **blocks),
               "atomic": lambda: detbackward.atomic_backward(q, k, v, o, lse, do, **blocks)}
        timings, failed = measure.time_interleaved(fns, device=device, errors=FAILURES)
        rows.append({"N": length, "B": B, "H": H, "note": "; ".join(f"{n}: {type(e).__name__}" for n, e in failed.items()),
                     **{f"{n}_ms": t.median_ms for n, t in timings.items()}})
        del q, k, v, do, o, lse
        measure.free_memory()
    table = pd.DataFrame(rows)
    if "det_ms" in table:
        table["det_over_atomic"] = table["det_ms"] / table["atomic_ms"]
    return table


def verdicts(decode: pd.DataFrame, backward: pd.DataFrame) -> pd.DataFrame:
    """The goals with the worst measured ratio of each: fixed / dynamic at batch >= 8 (<= 1.10), fixed / unsplit at
    batch 1 (<= 1.00), deterministic / atomic backward (<= 1.20)."""
    big, one = decode[decode["batch"] >= 8], decode[decode["batch"] == 1]
    goals = [("fixed split vs dynamic split, batch >= 8", big.get("fixed_over_dynamic"), DECODE_GOAL),
             ("fixed split vs unsplit, batch 1", one.get("fixed_over_unsplit"), 1.0),
             ("deterministic vs atomic backward", backward.get("det_over_atomic"), BACKWARD_GOAL)]
    rows = []
    for goal, ratios, limit in goals:
        worst = None if ratios is None or ratios.dropna().empty else float(ratios.max())
        rows.append({"goal": goal, "limit": limit, "worst_ratio": worst,
                     "verdict": "not measured" if worst is None else ("PASS" if worst <= limit else "MISS")})
    return pd.DataFrame(rows)
