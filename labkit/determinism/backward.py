"""Given code: FlashAttention-2's backward with dQ added by atomics (one kernel), the variant whose dQ bits depend on
the order its programs run in.

One program per (key block j, head): it loads K_j and V_j once, walks every query block i, recomputes
P_ij = exp(S_ij - lse_i), and accumulates dV_j += P_ij^T dO_i and dK_j += scale * dS_ij^T Q_i in fp32 registers
(written once at the end: one program owns them). dQ_i gets a contribution scale * dS_ij K_j from EVERY key block j,
that is from every program of the head: here each program adds its contribution into an fp32 dQ buffer with
``tl.atomic_add``, so the sum over j is taken in the order the programs reach row block i. Notebook 06's backward
avoids that with a second kernel (one program per query block, which loops over the key blocks itself); notebook 11's
exercise keeps the single pass and gives each (key block, query block) pair a slot of its own.

Layouts: q, o, do [B, H, N, D]; k, v [B, H, N_K, D]; lse [B, H, N] fp32 natural-log log-sum-exp of the scaled scores
(-inf for a row that sees no key). Causal masks are bottom-right aligned: query i sees key j <= i + (N_K - N).

Used in: 11_determinism.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _bwd_atomic_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_acc_ptr, dk_ptr, dv_ptr,
                          N_Q, N_K, sm_scale, CAUSAL: tl.constexpr, D: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """grid (cdiv(N_K, BLOCK_N), B * H); every tensor contiguous; dq_acc fp32 [B * H, N_Q, D], zeroed."""
    key_block, head = tl.program_id(0), tl.program_id(1).to(tl.int64)
    keys = key_block * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D)
    key_ok = keys < N_K
    kv_at = head * N_K * D + keys[:, None] * D + dims[None, :]
    k_blk = tl.load(k_ptr + kv_at, mask=key_ok[:, None], other=0.0)
    v_blk = tl.load(v_ptr + kv_at, mask=key_ok[:, None], other=0.0)
    grad_k = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    grad_v = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    for first_row in range(0, N_Q, BLOCK_M):
        rows = first_row + tl.arange(0, BLOCK_M)
        row_ok = rows < N_Q
        q_at = head * N_Q * D + rows[:, None] * D + dims[None, :]
        q_blk = tl.load(q_ptr + q_at, mask=row_ok[:, None], other=0.0)
        do_blk = tl.load(do_ptr + q_at, mask=row_ok[:, None], other=0.0)
        row_lse = tl.load(lse_ptr + head * N_Q + rows, mask=row_ok, other=0.0)
        row_delta = tl.load(delta_ptr + head * N_Q + rows, mask=row_ok, other=0.0)
        seen = row_ok[:, None] & key_ok[None, :] & (row_lse[:, None] > float("-inf"))
        if CAUSAL:
            seen = seen & (keys[None, :] <= rows[:, None] + (N_K - N_Q))
        scores = tl.dot(q_blk, tl.trans(k_blk)) * sm_scale
        probs = tl.where(seen, tl.exp(scores - row_lse[:, None]), 0.0)                  # [BLOCK_M, BLOCK_N] fp32
        grad_v = tl.dot(tl.trans(probs.to(do_blk.dtype)), do_blk, grad_v)
        dprobs = tl.dot(do_blk, tl.trans(v_blk))
        dscores = probs * (dprobs - row_delta[:, None])
        grad_k = tl.dot(tl.trans(dscores.to(q_blk.dtype)), q_blk, grad_k)
        dq_part = tl.dot(dscores.to(k_blk.dtype), k_blk) * sm_scale                    # this key block's share of dQ_i
        tl.atomic_add(dq_acc_ptr + q_at, dq_part, mask=row_ok[:, None])
    tl.store(dk_ptr + kv_at, (grad_k * sm_scale).to(dk_ptr.dtype.element_ty), mask=key_ok[:, None])
    tl.store(dv_ptr + kv_at, grad_v.to(dv_ptr.dtype.element_ty), mask=key_ok[:, None])


def row_delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """D = rowsum(dO * O) in fp32: o, do [..., N, D] -> [..., N] fp32 (FlashAttention-2's preprocess)."""
    return (do.float() * o.float()).sum(-1)


def atomic_backward(q, k, v, o, lse, do, causal: bool = False, *, block_m: int = 16, block_n: int = 16):
    """FlashAttention-2's backward in one pass, dQ added across key blocks by ``tl.atomic_add``.

    Args:
        q, o, do: [B, H, N, D]; k, v: [B, H, N_K, D]; one dtype (fp32, bf16 or fp16), D a power of two >= 16.
        lse: [B, H, N] fp32, natural log; causal: bottom-right aligned mask.
        block_m, block_n: query and key tile sizes (powers of two >= 16).

    Returns:
        (dq, dk, dv) in q's dtype and shapes; dq rounded once from the fp32 atomic sum.
    """
    B, H, N, D = q.shape
    n_k = k.shape[2]
    q, k, v, do = (t.contiguous() for t in (q, k, v, do))
    lse, delta = lse.float().contiguous(), row_delta(o, do).contiguous()
    dq_acc = torch.zeros(B, H, N, D, dtype=torch.float32, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    _bwd_atomic_dq_kernel[(triton.cdiv(n_k, block_n), B * H)](
        q, k, v, do, lse, delta, dq_acc, dk, dv, N, n_k, 1.0 / math.sqrt(D), CAUSAL=causal, D=D,
        BLOCK_M=block_m, BLOCK_N=block_n)
    return dq_acc.to(q.dtype), dk, dv
