"""Notebook 10's FP8 kernel over launch configurations, beside 06's bf16 forward and cuDNN (issue 59's goals).

Not a pytest module: run by hand on a GPU machine, ``python tests/gpu/fp8_configs.py OUT.json`` (about 2 minutes on
an H100). The solution notebooks' own cells define the kernels (lk.tritonbench.notebook_functions), so this times
exactly what notebook 10's sweep times, but with each (block_m, block_n, num_warps, num_stages) launched directly:
which tiles the notebook's FP8_TILES and the wrapper's launch should use. Shapes as the sweep's: d 128 and 64,
B * N = 16K tokens, H = 2048 / d, N 8K and 16K, causal and not; triton.testing.do_bench; TFLOP/s with causal
FLOPs at half; x_bf16 = fp8 TFLOP/s over 06's bf16 forward in the same process (the goal: >= 1.4 at d = 128,
N >= 8K, non-causal, and >= 600 TFLOP/s). Prints one JSON line per row and writes them all to OUT.json.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import labkit as lk  # before triton (labkit picks Triton's mode)
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parents[2]
LOG2E = 1.4426950408889634
CONFIGS = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3),
           (64, 64, 4, 3), (128, 32, 8, 3), (256, 64, 8, 2)]   # block_m, block_n, num_warps, num_stages


def notebook(slug: str, names: list[str]) -> dict:
    """The solution notebook's definitions of ``names``, run in a namespace of their own."""
    ns = {"__name__": slug, "torch": torch, "triton": triton, "tl": tl, "lk": lk, "math": math, "LOG2E": LOG2E}
    return lk.tritonbench.notebook_functions(ROOT / "solutions" / slug / f"{slug}.ipynb", names, ns)


def fp8_call(kernel, q8, k8, v8, descales, bm: int, bn: int, warps: int, stages: int, causal: bool):
    """A launch of notebook 10's kernel with these tiles and launch options (per-tensor descales expanded per tile)."""
    B, H, N, D = q8.shape
    q_tiles, k_tiles = triton.cdiv(N, bm), triton.cdiv(N, bn)
    qd, kd, vd = (d.float().expand(B, H, tiles).contiguous() for d, tiles in zip(descales, (q_tiles, k_tiles, k_tiles)))
    o = torch.empty(B, H, N, D, dtype=torch.bfloat16, device=q8.device)
    lse = torch.empty(B, H, N, device=q8.device)
    return lambda: kernel[(q_tiles, B * H)](q8, k8, v8, o, lse, qd, kd, vd, D ** -0.5 * LOG2E, 256.0, H, 1, N, N,
                                            q_tiles, k_tiles, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal,
                                            REVERSE=False, EXACT=False, num_warps=warps, num_stages=stages)


def main(out: Path) -> None:
    nb10 = notebook("10_fp8_attention", ["_fp8_fwd_kernel", "quantize_per_tensor"])
    bf16_forward = notebook("06_triton_flashattention", ["flash_attention_forward"])["flash_attention_forward"]
    rows = []
    for D in (128, 64):
        for N in (8192, 16384):
            B, H = max(1, 16384 // N), 2048 // D
            for causal in (False, True):
                q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                (q8, qd), (k8, kd), (v8, vd) = (nb10["quantize_per_tensor"](t) for t in (q, k, v))
                flops = 4 * B * H * N * N * D * (0.5 if causal else 1.0)
                tflops = lambda ms: flops / ms / 1e9   # noqa: E731
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    cudnn = tflops(do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)))
                base = dict(D=D, N=N, B=B, causal=causal, cudnn=cudnn,
                            bf16_mine=tflops(do_bench(lambda: bf16_forward(q, k, v, causal))))
                for bm, bn, warps, stages in CONFIGS:
                    row = dict(base, config=f"{bm}x{bn} w{warps} s{stages}")
                    try:
                        row["fp8"] = tflops(do_bench(fp8_call(nb10["_fp8_fwd_kernel"], q8, k8, v8, (qd, kd, vd),
                                                              bm, bn, warps, stages, causal)))
                        row["x_bf16"] = row["fp8"] / row["bf16_mine"]
                    except Exception as err:   # a config that does not compile (registers, shared memory)
                        row["error"] = f"{type(err).__name__}: {str(err)[:120]}"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    out.write_text(json.dumps(rows, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("fp8_configs.json"))
