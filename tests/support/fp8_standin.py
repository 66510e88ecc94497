"""A PyTorch stand-in for notebook 10's ``fp8_attention`` (exercise 3, a Triton kernel): the same contract and the
same rounding where it matters, fast on a CPU. Test support only: never in labkit (it would be a copyable answer).

What it keeps of the kernel: operands dequantized per block (the kernel's tiles ARE the quantizer's blocks), key
tiles of ``block_n`` walked forward or in reverse with an online softmax (running max m and sum l), P = exp(S - m)
cast to e4m3 after multiplying by ``p_scale`` (P8), acc += P8 @ V, o = acc / (l * p_scale). What it changes: the
arithmetic is float64 instead of fp32 (products of e4m3 operands are exact in either), so the only roundings left
are the ones the study measures: the inputs' e4m3 and P's e4m3.
"""
from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn


def _dequantize(x8: torch.Tensor, descale: torch.Tensor, block: int) -> torch.Tensor:
    """x8 [B, H, N, D] e4m3 and descale (0-dim, or [B, H, ceil(N / block)]) -> float64 [B, H, N, D]."""
    if descale.dim() == 0:
        return x8.double() * descale.double()
    B, H, N, _ = x8.shape
    want = (B, H, -(-N // block))
    if tuple(descale.shape) != want:
        raise ValueError(f"descale must be 0-dim or of shape {want} (blocks of {block} rows), got {tuple(descale.shape)}")
    return x8.double() * descale.double().repeat_interleave(block, dim=-1)[..., :N, None]


def fp8_attention(q8, k8, v8, q_descale, k_descale, v_descale, causal=False, *, p_scale=256.0, reverse=False,
                  block_m=16, block_n=16):
    """Notebook 10's fp8_attention contract: q8 [B, Hq, N, D], k8 and v8 [B, Hkv, Nk, D] e4m3 -> (o bf16 [B, Hq, N, D],
    lse fp32 [B, Hq, N]). Causal is bottom-right aligned (row i sees keys j <= i + Nk - N); a row that sees no key
    gives o = 0, lse = -inf."""
    if any(t.dtype != E4M3 for t in (q8, k8, v8)):
        raise ValueError("q8, k8, v8 must be torch.float8_e4m3fn")
    B, Hq, N, D = q8.shape
    Hkv, Nk = k8.shape[1], k8.shape[2]
    if Hq % Hkv or D < 16 or D & (D - 1):
        raise ValueError(f"Hq ({Hq}) must be a multiple of Hkv ({Hkv}) and D ({D}) a power of two >= 16")
    q = _dequantize(q8, q_descale, block_m) * D ** -0.5
    k, v = (_dequantize(t, d, block_n).repeat_interleave(Hq // Hkv, dim=1) for t, d in ((k8, k_descale), (v8, v_descale)))
    s = q @ k.transpose(-1, -2)                                                    # [B, Hq, N, Nk]
    if causal:
        seen = torch.arange(Nk)[None, :] <= torch.arange(N)[:, None] + (Nk - N)
        s = s.masked_fill(~seen, float("-inf"))
    m = torch.full((B, Hq, N, 1), float("-inf"), dtype=torch.float64)
    l, acc = torch.zeros_like(m), torch.zeros(B, Hq, N, D, dtype=torch.float64)
    starts = list(range(0, Nk, block_n))
    for start in reversed(starts) if reverse else starts:
        tile = s[..., start:start + block_n]
        m_new = torch.maximum(m, tile.amax(dim=-1, keepdim=True))
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)   # a row with no key yet: no NaN
        alpha, p = torch.exp(m - shift), torch.exp(tile - shift)
        p8 = (p * p_scale).to(E4M3).double()
        l = l * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + p8 @ v[..., start:start + block_n, :]
        m = m_new
    empty = l == 0
    o = torch.where(empty, torch.zeros_like(acc), acc / torch.where(empty, torch.ones_like(l), l * p_scale))
    lse = torch.where(empty, torch.full_like(l, float("-inf")), m + torch.log(l))
    return o.to(torch.bfloat16), lse[..., 0].float()
