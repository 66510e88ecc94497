"""Visible tests of 01_setup_and_comparison: the references its attention checks share, and exercise 2.

The checks of the attention exercises live in nb01_standard (ex1), nb01_softmax (ex3), nb01_forward (ex4)
and nb01_backward (ex5a, ex5b). A reference computes the answer another way: labkit's reference attention
(fp32 softmax, or float64 for float64 inputs), autograd through it, or plain PyTorch in the inputs' own
low precision (the baseline of the course's 2x rule, lk.grading.check_within_2x).

Used in: 01_setup_and_comparison (test cells of ex1, ex2, ex3, ex4, ex5a, ex5b)
"""
from __future__ import annotations

import torch

from labkit.core import grading
from labkit.engine import attention


def causal_keep(n: int, nk: int, causal: bool = True) -> torch.Tensor:
    """Bool [n, nk]: True where query i may see key j, j <= i + (nk - n) (bottom-right) when ``causal``, else all."""
    everything = torch.ones(n, nk, dtype=torch.bool)
    return everything.tril(nk - n) if causal else everything


def plain_attention(q, k, v, keep):
    """Plain PyTorch attention in the inputs' dtype: the 2x rule's baseline.

    Args:
        q: [..., N, d]; k, v: [..., Nk, d] (bf16 or fp16); keep: bool broadcastable to [..., N, Nk].

    Returns:
        (o, lse): o [..., N, d], scores, softmax and P @ V in q's dtype; lse [..., N], the fp32 logsumexp of
        those scores (what the rule asks of a statistic).
    """
    s = ((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5).masked_fill(~keep, float("-inf"))  # [..., N, Nk], q's dtype
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s.float(), dim=-1)


def check_against_reference(o, lse, q, k, v, *, names, atol=1e-5, lse_atol=None, rtol=0.0, float64_reference=False,
                            hint="", lse_hint="", **reference):
    """An answer's o [..., N, d] and lse [..., N] match labkit's reference attention on (q, k, v, **reference).

    Args:
        names: (name of the o check, name of the lse check).
        atol: for o and, unless ``lse_atol`` is given, lse; ``rtol`` applies to lse only.
        float64_reference: the reference runs on the inputs upcast to float64.
        reference: causal, mask, scale of lk.attention.reference_attention.

    Returns:
        (o_ref, lse_ref).
    """
    inputs = (t.double() for t in (q, k, v)) if float64_reference else (q, k, v)
    o_ref, lse_ref = attention.reference_attention(*inputs, **reference)
    grading.check_tensor(o, o_ref, name=names[0], atol=atol, hint=hint)
    grading.check_tensor(lse, lse_ref, name=names[1], atol=atol if lse_atol is None else lse_atol, rtol=rtol, hint=lse_hint)
    return o_ref, lse_ref


def reference_grads(q, k, v, do, causal):
    """(o, lse, (dq, dk, dv)): labkit's reference attention and autograd's gradients through it.

    Args:
        q, do: [..., N, d]; k, v: [..., Nk, d]; causal: bottom-right causal mask.
    """
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o_ref, lse_ref = attention.reference_attention(q, k, v, causal=causal)
    return o_ref.detach(), lse_ref.detach(), torch.autograd.grad(o_ref, (q, k, v), do)


def plain_grads(q, k, v, do, keep):
    """(dq, dk, dv) of autograd through :func:`plain_attention`'s o, all in the inputs' dtype (the 2x baseline)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    return torch.autograd.grad(plain_attention(q, k, v, keep)[0], (q, k, v), do)


def reads_per_index(reads, n: int) -> list[int]:
    """How often each of n columns (or rows) was read, given the blocks read as (first index, width), in order; a
    block read again right after itself (x[..., s:e] sliced twice in one step) counts once."""
    counts = [0] * n
    for i, block in enumerate(reads):
        if i == 0 or reads[i - 1] != block:
            for index in range(block[0], min(n, block[0] + block[1])):
                counts[index] += 1
    return counts


def score_bytes_for_every_dtype(score_matrix_bytes) -> None:
    """score_matrix_bytes(B, H, N, dtype) == B * H * N * N * dtype.itemsize for fp32, bf16 and 8-, 2-, 1-byte dtypes."""
    grading.check_scalar(score_matrix_bytes(1, 1, 1024, torch.float32), 4 * 2**20,
                         name="score_matrix_bytes(1, 1, 1024, fp32)", hint="B * H * N * N * 每個元素的位元組數。")
    grading.check_scalar(score_matrix_bytes(8, 12, 2048, torch.bfloat16), 8 * 12 * 2048 * 2048 * 2,
                         name="score_matrix_bytes(8, 12, 2048, bf16)")
    for dtype, size in ((torch.float64, 8), (torch.float16, 2), (torch.int8, 1), (torch.bool, 1), (torch.complex64, 8)):
        grading.check_scalar(score_matrix_bytes(2, 3, 64, dtype), 2 * 3 * 64 * 64 * size,
                             name=f"score_matrix_bytes(2, 3, 64, {dtype}): 每種 dtype 的元素大小",
                             hint="每個元素的位元組數是 dtype.itemsize（float64 是 8、int8 與 bool 是 1、complex64 是 8），不要只處理 fp32 與 bf16"
                                  "（torch.finfo 只收浮點數、complex64 的 bits 只算一個分量，torch.iinfo 不收 bool）；"
                                  "單位是位元組（bytes），不是位元（bits）。")


def score_bytes_exact_python_int(score_matrix_bytes) -> None:
    """The result is a Python int, exact past 2**31 elements (3 x 40 x 65536^2), where a 32-bit product wraps."""
    for args in ((1, 1, 8, torch.float16), (3, 40, 65536, torch.float32)):
        got = score_matrix_bytes(*args)
        grading.check_true(type(got) is int, name=f"score_matrix_bytes{tuple(args[:3])}: type",
                           detail=f"應回傳 Python int（不是 float 或 tensor），卻得到 {type(got).__name__}。",
                           hint="用 Python 整數相乘：int(...) * dtype.itemsize；不要除法（/）或建立張量。")
    got = score_matrix_bytes(3, 40, 65536, torch.float32)
    grading.check_true(got == 3 * 40 * 65536**2 * 4, name="score_matrix_bytes(3, 40, 65536, fp32): 超過 2**31 的值",
                       detail=f"應為 {3 * 40 * 65536**2 * 4} bytes，卻得到 {got!r}。",
                       hint="以 Python int 相乘（不會溢位）；numpy 或 torch 的 32 位元整數乘積超過 2**31 會繞回（overflow）。")
