"""The board's 06_triton_flashattention: ``TritonFlashAttention.apply(q, k, v, causal)``, q [B, H, N, D], k, v
[B, H, Nk, D]. Check: fp32 (and bf16 on a GPU) forward and backward against float64 at uneven shapes (N != Nk,
bottom-right causal). Timed by :func:`labkit.engine.bench.attention_sweep` (the notebook's sweep) beside sdpa_flash,
sdpa_cudnn and fa4; score: TFLOP/s over the matmul peak, geometric mean over the shapes, forward and
forward+backward, and of the two.

Used by: :mod:`labkit.board.specs` (the registry).
"""
from __future__ import annotations

import math

import torch

from labkit.board import common
from labkit.board.common import Spec

def attention_exact(q, k, v, causal: bool, diag: int | None = None, dtype=torch.float64) -> torch.Tensor:
    """Plain attention in ``dtype``: q [B, H, N, D], k, v [B, H, Nk, D] -> o [B, H, N, D]. Causal: row i
    sees keys j <= i + diag (default Nk - N: bottom-right); a row that sees no key gives 0."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5                          # [B, H, N, Nk]
    if causal:
        diag = k.shape[-2] - q.shape[-2] if diag is None else diag
        i, j = torch.arange(q.shape[-2], device=q.device), torch.arange(k.shape[-2], device=q.device)
        s = s.masked_fill(j[None, :] > i[:, None] + diag, float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


FA_SHAPES = {"cpu": [(1, 2, 40, 40, 16, True), (2, 1, 24, 56, 32, True), (1, 1, 50, 33, 16, False)],
             "cuda": [(2, 4, 1000, 1000, 64, True), (1, 3, 333, 1100, 128, True), (2, 2, 777, 777, 128, False)]}


def _fa_check(ns: dict, seed: int, device: torch.device) -> None:
    fn = ns["TritonFlashAttention"].apply
    dtypes = common.CHECK_DTYPES[device.type]
    for i, ((b, h, n, nk, d, causal), dtype) in enumerate((s, t) for s in FA_SHAPES[device.type] for t in dtypes):
        gen = torch.Generator().manual_seed(seed + i)
        q, k, v, do = (common.randn(gen, b, h, m, d, dtype=dtype, device=device) for m in (n, nk, nk, n))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = fn(*leaves, causal)
        grads = torch.autograd.grad(o, leaves, do)
        exact = [t.double().requires_grad_() for t in (q, k, v)]
        o64 = attention_exact(*exact, causal)
        grads64 = torch.autograd.grad(o64, exact, do.double())
        plain, plain_grads = None, [None] * 3
        if dtype != torch.float32:
            low = [t.clone().requires_grad_() for t in (q, k, v)]
            plain = attention_exact(*low, causal, dtype=dtype)
            plain_grads = torch.autograd.grad(plain, low, do)
        where = f"B={b} H={h} N={n} Nk={nk} D={d} causal={causal} {str(dtype)[6:]}"
        common.compare(f"o ({where})", o, o64, plain, dtype, 2e-3)
        for name, g, g64, gp in zip(("dq", "dk", "dv"), grads, grads64, plain_grads):
            common.compare(f"{name} ({where})", g, g64, gp, dtype, 5e-3)


def _fa_calls(ns: dict, device: torch.device) -> dict:
    x = torch.randn(1, 1, 32, 16, device=device, requires_grad=True)
    fn = ns["TritonFlashAttention"].apply
    return {"forward": lambda: fn(x, x, x, True), "backward": lambda: fn(x, x, x, True).sum().backward()}


FA_TIMED = dict(seq_lens=[1024, 4096, 16384], head_dims=[64, 128], tokens=16384, width=2048)   # 06's GPU sweep


def _fa_time(ns: dict, seed: int, device: torch.device, target_ms: float) -> dict:
    from labkit.engine import attention, bench

    fn, kept = ns["TritonFlashAttention"].apply, {}

    def student(q, k, v, causal):  # the timed call; keeps the tensors the timer gave it
        kept[(q.shape[-2], q.shape[-1], causal)] = (q, k, v)
        return fn(q, k, v, causal)

    library = [b for b in ("sdpa_flash", "sdpa_cudnn", "fa4")
               if all(attention.why_not(b, device=device, dtype=torch.bfloat16, head_dim=d) is None
                      for d in FA_TIMED["head_dims"])]
    configs = bench.fixed_token_configs(**FA_TIMED)
    sweep = bench.attention_sweep(configs, backends=library, custom={"student": student}, dtype=torch.bfloat16,
                                  device=device, target_ms=target_ms, progress=False)
    bad = sweep[(sweep["backend"] == "student") & (sweep["status"] != "ok")]
    if len(bad):
        first = bad.iloc[0]
        raise RuntimeError(f"the timed call failed at N={first['N']} D={first['D']}: {first['status']}")
    gen = torch.Generator().manual_seed(seed)
    for (n, d, causal), (q, k, v) in kept.items():                   # new values, the same tensors
        with torch.no_grad():
            for t in (q, k, v):
                t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
            rows = min(128, n)                                               # batch 0, heads 0-1, the last rows:
            o = fn(q, k, v, causal)[:1, :2, -rows:]                          # a small exact reference
            qs, ks, vs, diag = q[:1, :2, -rows:], k[:1, :2], v[:1, :2], k.shape[-2] - rows
            common.compare(f"o after the timing, inputs rewritten in place (N={n} D={d} causal={causal})", o,
                     attention_exact(qs, ks, vs, causal, diag),
                     attention_exact(qs, ks, vs, causal, diag, torch.bfloat16),
                     torch.bfloat16, 0.0)
    peak = bench.matmul_peak_tflops(device=device, dtype=torch.bfloat16, n=common.PEAK_N)
    ok = sweep[sweep["status"] == "ok"]
    result = {"peak_tflops": peak, "rows": ok[["backend", "N", "D", "causal", "mode", "tflops"]].to_dict("records"),
              "failed": {r.backend: r.status for r in sweep[sweep["status"] != "ok"].itertuples()}}
    for name in ["student", *library]:
        mine = ok[ok["backend"] == name]
        per_mode = {m: common.geomean(list(mine[mine["mode"] == m]["tflops"] / peak)) if len(mine[mine["mode"] == m]) ==
                    len(configs) * 2 else math.nan for m in attention.MODES}
        per_mode["score"] = common.geomean(list(per_mode.values()))
        result[name] = per_mode
    return result




SPEC = Spec(
    graded=("TritonFlashAttention", "flash_attention_forward", "flash_attention_backward"),
    own=lambda ns: {"TritonFlashAttention.forward": ns["TritonFlashAttention"].forward,
                    "TritonFlashAttention.backward": ns["TritonFlashAttention"].backward},
    calls=_fa_calls, check=_fa_check, time=_fa_time)
