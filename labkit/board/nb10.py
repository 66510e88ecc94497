"""The board's 10_fp8_attention: exercise 3's ``fp8_attention(q8, k8, v8, q_descale, k_descale, v_descale, causal,
*, p_scale, reverse, block_m, block_n) -> (o, lse)``; q8 [B, Hq, N, D], k8, v8 [B, Hkv, Nk, D] e4m3, descales fp32,
0-dim or per tile ([B, H, ceil(n / block)]); o bf16 [B, Hq, N, D], lse fp32 [B, Hq, N].

- Own code: no SDPA, softmax or flex_attention, and no labkit but the cast the exercise gives (:data:`ALLOW`,
  ``lk.fp8cast``; :func:`labkit.core.grading.check_own_code`'s ``allow``).
- Audit (:func:`fp8_mma`, on a CPU too: Triton compiles for sm90 without a GPU): the kernel compiled for sm90 with
  :func:`labkit.checks.nb10_kernel.fp8_mma_in_ptx` (128 x 128 tiles, d = 64): both ``tl.dot`` are
  ``wgmma ... .e4m3.e4m3`` and no bf16/f16 MMA, else ``flagged`` (a kernel that widens q, k or P to bf16 is right
  but is not FP8 attention).
- Check: random e4m3 inputs and descales from the board's seed (:func:`labkit.checks.nb10_kernel.fp8_inputs`) at
  shapes the visible tests never use (N and Nk not multiples of the tiles, N != Nk both ways (causal N > Nk: rows
  that see no key), a GQA group of 3,
  tiles other than the tests', per-tensor and per-tile descales, p_scale 1, 64, 256, reverse); o within notebook
  10's e4m3 bound (:func:`labkit.checks.nb10_kernel.o_bound`) of float64 attention of the dequantized inputs, lse
  within its tolerance (:func:`labkit.checks.nb10_kernel.lse_atol`).
- Time (GPU): :func:`labkit.fp8.bench.sweep` (the notebook's sweep: kernels in turns, B*N = 16K tokens, H*d = 2048)
  at d = 128 and 64, N = 4K/8K/16K, causal and not, the notebook's GPU tiles (128 x 64), inputs cast to e4m3 with a
  fixed scale (:func:`fixed_scale`: the student's quantizer is neither timed nor needed), beside cuDNN and FA4 in
  bf16 and compiled flex_attention (and torch's FP8 SDPA where it runs) on the same inputs; then the timed tensors
  rewritten in place and the student's o checked again. Score: TFLOP/s (causal FLOPs at half,
  :func:`labkit.engine.attention.flops`) over the measured FP8 GEMM ceiling (:func:`labkit.fp8.ceilings.fp8_ceiling`:
  the fastest ``torch._scaled_mm``, never bf16's matmul), geometric mean over the 12 shapes; a library kernel gets a
  score where it ran all 12.

Used by: :mod:`labkit.board.specs` (the registry).
"""
from __future__ import annotations

import torch

from labkit.board import common
from labkit.board.common import Spec
from labkit.checks import nb10_kernel
from labkit.core import grading
from labkit.fp8 import cast

ALLOW = (cast,)   # lk.fp8cast: the e4m3 cast the exercise gives (to_e4m3 in the kernel, exact() on the host)
E4M3 = torch.float8_e4m3fn
# (B, Hq, Hkv, N, Nk, D, causal, per-tile descales, p_scale, reverse, (block_m, block_n))
SHAPES = {"cpu": [(2, 6, 2, 45, 70, 32, True, True, 64.0, True, (16, 32)),
                  (1, 3, 3, 70, 33, 16, False, False, 256.0, False, (32, 16)),
                  (1, 3, 1, 50, 37, 32, True, True, 1.0, False, (16, 16))],
          "cuda": [(2, 6, 2, 1000, 700, 128, True, True, 256.0, False, (128, 64)),
                   (1, 3, 1, 333, 1100, 64, True, False, 64.0, True, (64, 32)),
                   (2, 4, 4, 777, 500, 64, False, True, 256.0, True, (128, 128))]}


def _check(ns: dict, seed: int, device: torch.device) -> None:
    fn = ns["fp8_attention"]
    for i, (b, hq, hkv, n, nk, d, causal, per_tile, p_scale, reverse, (bm, bn)) in enumerate(SHAPES[device.type]):
        inputs = nb10_kernel.fp8_inputs(b, hq, hkv, n, nk, d, per_tile, bm, bn, seed=seed + i)
        where = (f"B={b} Hq={hq} Hkv={hkv} N={n} Nk={nk} D={d} causal={causal} "
                 f"{'per-tile' if per_tile else 'per-tensor'} descales p_scale={p_scale:g} reverse={reverse} "
                 f"tiles {bm} x {bn}")
        o, lse = fn(*inputs, causal, p_scale=p_scale, reverse=reverse, block_m=bm, block_n=bn)
        grading.check_true(isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor)
                           and (tuple(o.shape), o.dtype, tuple(lse.shape), lse.dtype)
                           == ((b, hq, n, d), torch.bfloat16, (b, hq, n), torch.float32),
                           name=f"o, lse ({where})", detail=f"want o bf16 {(b, hq, n, d)}, lse fp32 {(b, hq, n)}")
        o64, lse64, w, v, visible = nb10_kernel.attention64(*inputs, causal, bm, bn)
        _within_bound(f"o ({where})", o, o64, nb10_kernel.o_bound(o64, w, v, visible, p_scale))
        grading.check_tensor(lse.cpu(), lse64, name=f"lse ({where})", atol=nb10_kernel.lse_atol())


def _within_bound(name: str, o: torch.Tensor, o64: torch.Tensor, bound: torch.Tensor) -> None:
    """|o - o64| <= bound everywhere (notebook 10's e4m3 bound); else AssertionError naming the worst ratio."""
    err = (o.detach().cpu().double() - o64).abs().nan_to_num(float("inf"))
    grading.check_true(bool((err <= bound).all()), name=name,
                       detail=f"max error {float(err.max()):.3g}, {float((err / bound).max()):.3g}x notebook 10's "
                              "e4m3 bound (P's cast, o's rounding to bf16) against float64 attention of the "
                              "dequantized inputs")


def _tiny(ns: dict) -> tuple:
    """A small call of fp8_attention with the visible tests' tiles (16 x 16 interpreted, 64 x 32 compiled)."""
    bm, bn = nb10_kernel.blocks()
    return ns["fp8_attention"], nb10_kernel.fp8_inputs(1, 1, 1, 64, 64, 32, False, bm, bn), dict(block_m=bm,
                                                                                                 block_n=bn)


def _calls(ns: dict, device: torch.device) -> dict:
    fn, inputs, tiles = _tiny(ns)
    return {"fp8_attention": lambda: fn(*inputs, True, **tiles)}


def fp8_mma(ns: dict, device: torch.device) -> str | None:
    """Why the kernel is not FP8 attention on sm90 (its compile shows no FP8 wgmma for both dots, or does not
    compile), or None."""
    fn, inputs, tiles = _tiny(ns)
    try:
        nb10_kernel.fp8_mma_in_ptx(lambda: fn(*inputs, False, **tiles))
    except AssertionError as err:
        return ("fp8_attention: no FP8 MMA (wgmma ... .e4m3.e4m3) for both tl.dot in its sm90 compile: "
                f"{str(err).splitlines()[0][:200]}")
    return None


TIMED = {128: [4096, 8192, 16384], 64: [4096, 8192, 16384]}   # d -> N: the notebook's sweep (B*N = 16K tokens)
TIMED_CALL = dict(block_m=128, block_n=64, p_scale=256.0, reverse=False)   # the notebook's FP8_TILES, P scaled
SCALE = 64.0          # fixed_scale's factor: N(0, 1) inputs land well inside e4m3's +-448
RECHECK_ROWS = 128    # the last query rows of batch 0, heads 0-1 checked after the timing


def fixed_scale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape, ~N(0, 1)) -> (x8 = clamp(x * SCALE, +-448) in e4m3, descale 1 / SCALE: fp32 0-dim): the timed
    inputs' quantizer (a fixed scale, not the exercise's amax rule: the kernel's speed does not depend on it)."""
    return (x.float() * SCALE).clamp(-448, 448).to(E4M3), torch.tensor(1.0 / SCALE, device=x.device)


def _recheck(fn, kept: dict, gen: torch.Generator) -> None:
    """The timed calls after their e4m3 inputs got new values in place: o of the last rows within the bound."""
    for (n, d, causal), (q8, k8, v8, qd, kd, vd) in kept.items():
        with torch.no_grad():
            for t in (q8, k8, v8):
                t.copy_(fixed_scale(torch.randn(t.shape, generator=gen))[0].to(t.device))
            rows = min(RECHECK_ROWS, n)
            o = fn(q8, k8, v8, qd, kd, vd, causal, **TIMED_CALL)[0][:1, :2, -rows:]
            o64, _, w, v, visible = nb10_kernel.attention64(q8[:1, :2, -rows:], k8[:1, :2], v8[:1, :2], qd, kd, vd,
                                                            causal, TIMED_CALL["block_m"], TIMED_CALL["block_n"])
            _within_bound(f"o after the timing, inputs rewritten in place (N={n} D={d} causal={causal})", o, o64,
                          nb10_kernel.o_bound(o64, w, v, visible, TIMED_CALL["p_scale"]))


def scores(ok, roof: float, shapes: int) -> dict:
    """Per backend of the sweep's rows that ran (``ok``: backend, tflops): {"score": the geometric mean of TFLOP/s
    over ``roof``}, NaN where it did not run all ``shapes`` (the (d, N, causal) the student's kernel ran); the
    student's kernel (``fp8_mine``) as "student"."""
    out = {}
    for backend in sorted(set(ok["backend"])):
        mine = ok[ok["backend"] == backend]
        score = common.geomean(list(mine["tflops"] / roof)) if len(mine) == shapes else float("nan")
        out["student" if backend == "fp8_mine" else backend] = {"score": score}
    return out


def _time(ns: dict, seed: int, device: torch.device, target_ms: float) -> dict:
    from labkit.fp8 import bench as fp8bench, ceilings

    fn, kept = ns["fp8_attention"], {}

    def student(q8, k8, v8, qd, kd, vd, causal, **kwargs):   # the timed call; keeps the tensors the timer gave it
        kept[(q8.shape[-2], q8.shape[-1], causal)] = (q8, k8, v8, qd, kd, vd)
        return fn(q8, k8, v8, qd, kd, vd, causal, **kwargs)

    gemms = ceilings.gemm_ceiling(common.PEAK_N, device=device)     # the notebook's roofs: n = 8192
    sweep = fp8bench.sweep(student, fixed_scale, bf16_forward=None, shapes=TIMED, library=fp8bench.LIBRARY,
                           kernel_kwargs=TIMED_CALL, ceilings=gemms, target_ms=target_ms, device=device)
    bad = sweep[(sweep["backend"] == "fp8_mine") & (sweep["status"] != "ok")]
    if len(bad):
        first = bad.iloc[0]
        raise RuntimeError(f"the timed call failed at N={first['N']} d={first['d']} causal={first['causal']}: "
                           f"{first['status']}")
    _recheck(fn, kept, torch.Generator().manual_seed(seed))
    roof = ceilings.fp8_ceiling(gemms)
    ok = sweep[sweep["status"] == "ok"]
    failed = sweep[sweep["status"] != "ok"]
    return {"peak_tflops": roof, "ceilings": gemms,
            "rows": ok[["backend", "N", "d", "causal", "ms", "tflops", "pct_fp8_gemm"]].to_dict("records"),
            "failed": {f"{r.backend} N={r.N} d={r.d} causal={r.causal}": r.status for r in failed.itertuples()},
            **scores(ok, roof, int((sweep["backend"] == "fp8_mine").sum()))}


SPEC = Spec(graded=("fp8_attention",), own=lambda ns: {"fp8_attention": ns["fp8_attention"]}, calls=_calls,
            check=_check, time=_time, allow=ALLOW, audit=fp8_mma)
