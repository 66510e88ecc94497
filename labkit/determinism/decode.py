"""Given code: split-KV decode (FlashDecoding, notebook 08's idea) and the launch heuristic that makes a request's bits
depend on its batch.

A decode step has one query token per request, q [B, H, D], against a KV cache k, v [B, H, N_max, D] of which request
b uses its first ``lens[b]`` keys. :func:`split_partials` cuts each request's keys into splits of ``split_size`` keys
(split s holds keys [s * split_size, (s + 1) * split_size), cut at ``lens[b]``): one program per (split, head) writes
the split's normalized output o_s (fp32) and its log-sum-exp lse_s; a split past the request's end writes o_s = 0 and
lse_s = -inf, which adds exactly nothing to a combine. The combine merges the splits by their log-sum-exps.

How many splits? A library picks them per launch to fill the GPU: few (batch x heads) programs leave most
multiprocessors (SMs) idle, so it cuts the keys finer. :func:`heuristic_num_splits` is that rule, simplified from
flash-attn's ``num_splits_heuristic`` (waves of B x H x splits programs over the SMs); :func:`dynamic_decode` uses it,
with the split size derived from the batch's longest request. The same request then gets other split boundaries in
another batch, so other roundings: the batch-variance notebook 11 measures.

Used in: 11_determinism.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _split_partials_kernel(q_ptr, k_ptr, v_ptr, lens_ptr, o_part_ptr, lse_part_ptr, H, N_MAX, SPLIT, N_SPLITS,
                           sm_scale, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """grid (N_SPLITS, B * H): o_part fp32 [B * H, N_SPLITS, D], lse_part fp32 [B * H, N_SPLITS]."""
    split, head = tl.program_id(0), tl.program_id(1).to(tl.int64)
    length = tl.load(lens_ptr + head // H)
    lo = split * SPLIT
    hi = tl.minimum(lo + SPLIT, length)
    dims = tl.arange(0, D)
    query = tl.load(q_ptr + head * D + dims).to(tl.float32)
    best = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], dtype=tl.float32)
    weighted = tl.zeros([D], dtype=tl.float32)
    for first in range(lo, hi, BLOCK_N):
        keys = first + tl.arange(0, BLOCK_N)
        ok = keys < hi
        at = head * N_MAX * D + keys[:, None] * D + dims[None, :]
        k_blk = tl.load(k_ptr + at, mask=ok[:, None], other=0.0).to(tl.float32)
        v_blk = tl.load(v_ptr + at, mask=ok[:, None], other=0.0).to(tl.float32)
        scores = tl.where(ok, tl.sum(query[None, :] * k_blk, axis=1) * sm_scale, float("-inf"))   # [BLOCK_N]
        new_best = tl.maximum(best, tl.max(scores, axis=0))
        fade = tl.exp(best - new_best)
        probs = tl.exp(scores - new_best)
        total = total * fade + tl.sum(probs, axis=0)
        weighted = weighted * fade + tl.sum(probs[:, None] * v_blk, axis=0)
        best = new_best
    empty = hi <= lo
    out = tl.where(empty, 0.0, weighted / tl.where(empty, 1.0, total))
    lse = tl.where(empty, float("-inf"), best + tl.log(tl.where(empty, 1.0, total)))
    tl.store(o_part_ptr + (head * N_SPLITS + split) * D + dims, out)
    tl.store(lse_part_ptr + head * N_SPLITS + split + tl.arange(0, 1), lse)


def split_partials(q, k_cache, v_cache, lens, split_size: int, num_splits: int, *, block_n: int = 16):
    """Each request's keys cut into ``num_splits`` splits of ``split_size`` keys; one partial per split.

    Args:
        q: [B, H, D]; k_cache, v_cache: [B, H, N_max, D]; one dtype, D a power of two.
        lens: [B] int, 1 <= lens[b] <= N_max; split_size * num_splits must cover max(lens).

    Returns:
        (o_part fp32 [B, H, num_splits, D], lse_part fp32 [B, H, num_splits]): split s of request b holds keys
        [s * split_size, min((s + 1) * split_size, lens[b])); an empty split has o = 0 and lse = -inf.
    """
    B, H, D = q.shape
    n_max = k_cache.shape[2]
    if split_size * num_splits < int(lens.max()):
        raise ValueError(f"{num_splits} splits of {split_size} keys do not cover the longest request ({int(lens.max())})")
    o_part = torch.empty(B, H, num_splits, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    _split_partials_kernel[(num_splits, B * H)](
        q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), lens.to(device=q.device, dtype=torch.int32),
        o_part, lse_part, H, n_max, split_size, num_splits, 1.0 / math.sqrt(D), D=D, BLOCK_N=block_n)
    return o_part, lse_part


def heuristic_num_splits(programs: int, num_sms: int, max_splits: int, *, max_split_count: int = 128) -> int:
    """The split count a library picks for ``programs`` = B x H: the count, up to ``max_splits`` (no split shorter
    than a key block), whose waves of programs x splits over ``num_sms`` SMs are at least 85% as full as the fullest.

    A simplification of flash-attn's ``num_splits_heuristic``: 1 when B x H already fills 80% of the SMs."""
    if programs >= 0.8 * num_sms:
        return 1
    candidates = range(1, min(max_splits, max_split_count) + 1)
    fill = {s: programs * s / (num_sms * math.ceil(programs * s / num_sms)) for s in candidates}
    best = max(fill.values())
    return next(s for s in candidates if fill[s] >= 0.85 * best)


def combine(o_part: torch.Tensor, lse_part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """o_part [..., S, D], lse_part [..., S] -> o [..., D] in ``dtype``: weights exp(lse_s - max_s lse_s), in fp32."""
    top = lse_part.amax(-1, keepdim=True)
    weight = torch.exp(lse_part - top)                                            # [..., S]; empty splits 0
    return ((weight[..., None] * o_part).sum(-2) / weight.sum(-1, keepdim=True)).to(dtype)


def dynamic_decode(q, k_cache, v_cache, lens, *, num_sms: int = 132, block_n: int = 16) -> torch.Tensor:
    """Today's launch: the split count from the batch (:func:`heuristic_num_splits` over B x H programs and
    ``num_sms`` SMs), the split size from the longest request; partials, then :func:`combine`. o [B, H, D]."""
    B, H, _ = q.shape
    longest = int(lens.max())
    count = heuristic_num_splits(B * H, num_sms, triton.cdiv(longest, block_n))
    size = triton.cdiv(longest, count)
    return combine(*split_partials(q, k_cache, v_cache, lens, size, triton.cdiv(longest, size), block_n=block_n),
                   q.dtype)


def unsplit_decode(q, k_cache, v_cache, lens, *, block_n: int = 16) -> torch.Tensor:
    """One program per (request, head) over all its keys (one split): o [B, H, D]."""
    longest = int(lens.max())
    return combine(*split_partials(q, k_cache, v_cache, lens, longest, 1, block_n=block_n), q.dtype)


def make_requests(lens: list[int], heads: int, dim: int, *, dtype=torch.float32, generator=None, device="cpu") -> list:
    """One decode request per length: (q [H, D], k [H, L, D], v [H, L, D]) with standard normal entries."""
    def draw(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).to(device)
    return [(draw(heads, dim), draw(heads, n, dim), draw(heads, n, dim)) for n in lens]


def pad_batch(requests: list) -> tuple:
    """Requests (q, k, v) -> a batch (q [B, H, D], k_cache, v_cache [B, H, N_max, D], lens [B] int32): each cache
    padded with zeros past its request's length up to the batch's longest."""
    longest = max(k.shape[1] for _, k, _ in requests)

    def padded(x):
        return torch.nn.functional.pad(x, (0, 0, 0, longest - x.shape[1]))
    q = torch.stack([r[0] for r in requests])
    k_cache, v_cache = (torch.stack([padded(r[i]) for r in requests]) for i in (1, 2))
    lens = torch.tensor([r[1].shape[1] for r in requests], dtype=torch.int32, device=q.device)
    return q, k_cache, v_cache, lens
