# Notebook 10 (10_fp8_attention): reference answers of ex1 (quantizers), ex2 (rotation) and ex4 (pipeline).
# Each block between "# === <grade_id>" lines is one answer cell (plain torch; fp8_attention comes from ex3).
import math

import torch

# === ex1_quantizers
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_per_tensor(x, dtype=torch.float8_e4m3fn):
    """x: any float tensor -> (x8 in dtype, same shape; descale: fp32 0-dim) with x ~= x8.float() * descale."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    fmax = torch.finfo(dtype).max
    amax = x.detach().abs().amax().float()                           # max |x| in fp32
    descale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    x8 = (x.float() / descale).clamp(-fmax, fmax).to(dtype)           # clamp first: the cast does not saturate
    return x8, descale


def quantize_per_block(x, block, dtype=torch.float8_e4m3fn):
    """x [B, H, N, D] -> (x8 [B, H, N, D] in dtype, descale fp32 [B, H, ceil(N / block)]): one scale per tile
    of `block` consecutive rows (the last tile may be short)."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if x.dim() != 4 or block < 1:
        raise ValueError(f"x must be [B, H, N, D] and block >= 1, got shape {tuple(x.shape)} and block={block}")
    B, H, N, D = x.shape
    tiles = -(-N // block)
    xf = torch.nn.functional.pad(x.float(), (0, 0, 0, tiles * block - N))   # zero rows fill the last tile
    xf = xf.reshape(B, H, tiles, block * D)
    fmax = torch.finfo(dtype).max
    amax = xf.abs().amax(dim=-1)                                      # [B, H, tiles]
    descale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    x8 = (xf / descale[..., None]).clamp(-fmax, fmax).to(dtype)
    return x8.reshape(B, H, tiles * block, D)[:, :, :N].contiguous(), descale


# === ex2_rotation
def hadamard(d):
    """Sylvester's Hadamard matrix: fp32 [d, d] of +-1 with H @ H.T = d * I."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"d must be a power of two, got {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h


def random_rotation(d, generator=None):
    """R = diag(s) @ hadamard(d) / sqrt(d), s random +-1 from `generator`: fp32 [d, d], R @ R.T = I."""
    signs = torch.randint(0, 2, (d,), generator=generator) * 2 - 1
    return signs[:, None].float() * hadamard(d) / math.sqrt(d)


def rotate_qk(q, k, rotation):
    """(q @ R, k @ R) computed in fp32, in q's and k's dtypes; q [..., D], k [..., D], rotation [D, D]."""
    r = rotation.to(device=q.device, dtype=torch.float32)      # R may come from a CPU generator
    return (q.float() @ r).to(q.dtype), (k.float() @ r).to(k.dtype)


# === ex4_pipeline
def fp8_pipeline(q, k, v, *, quant="block", rotate=False, causal=False, p_scale=256.0, reverse=False,
                 generator=None, block_m=16, block_n=16):
    """q, k, v [B, H, N, D] (bf16 or fp32) -> o bf16 [B, H, N, D]: rotate q and k (optional), quantize, fp8_attention."""
    if quant not in ("tensor", "block"):
        raise ValueError(f"quant must be 'tensor' or 'block', got {quant!r}")
    if rotate:
        q, k = rotate_qk(q, k, random_rotation(q.shape[-1], generator))
    if quant == "tensor":
        (q8, qd), (k8, kd), (v8, vd) = (quantize_per_tensor(t) for t in (q, k, v))
    else:
        (q8, qd), (k8, kd), (v8, vd) = (quantize_per_block(q, block_m), quantize_per_block(k, block_n),
                                        quantize_per_block(v, block_n))
    o, _ = fp8_attention(q8, k8, v8, qd, kd, vd, causal, p_scale=p_scale, reverse=reverse,
                         block_m=block_m, block_n=block_n)
    return o
