"""What the speed-of-light board checks and times, per assignment (``python -m labkit board``).

Each :class:`Spec` names the graded functions a notebook must define and gives three steps, each run
in the student's own process (:mod:`labkit.boardrun`) on the namespace the notebook's cells built:

- ``own``: label -> function whose code :func:`labkit.grading.check_own_code` checks (no labkit, no library
  attention or softmax) and whose call must launch Triton kernels defined in the notebook;
- ``check(ns, seed, device)``: the graded functions on fresh inputs drawn from the board's secret seed, at
  shapes the visible tests never use (uneven lengths, N not a multiple of the block, N != Nk, GQA with a
  group of 3); raises AssertionError (-> ``wrong``). fp32 inputs: an absolute tolerance against float64;
  bf16 (GPU): the course's 2x rule (:func:`labkit.grading.check_within_2x`);
- ``time(ns, seed, device, target_ms)``: GPU only. The student's calls beside the library kernels, the notebook's
  timers; then the timed tensors rewritten in place and the calls checked again (a cached output fails).

06_triton_flashattention: ``TritonFlashAttention.apply(q, k, v, causal)``, q [B, H, N, D], k, v [B, H, Nk, D];
timed by :func:`labkit.bench.attention_sweep` (the notebook's sweep) beside sdpa_flash, sdpa_cudnn and fa4; score:
TFLOP/s over the matmul peak, geometric mean over the shapes, forward and forward+backward, and of the two.
08_decode_attention: ``decode_split(q, k, v, seqlens)`` and ``paged_decode(q, k_pages, v_pages, table, seqlens)``,
q [B, H_q, d], k, v [B, N, H_kv, d], pages [num_pages, page, H_kv, d]; timed as the notebook does
(:func:`labkit.graphtime.time_per_call`: CUDA graphs of 8 calls over distinct caches, L2 flushed by a read) beside
SDPA's kernels and FA4; score: GB/s over the read ceiling, geometric mean over the shapes and both functions.

Used by: :mod:`labkit.boardrun`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from . import grading


@dataclass(frozen=True)
class Spec:
    """One assignment's graded names (the notebook must define them) and its board steps."""

    graded: tuple[str, ...]
    own: Callable[[dict], dict[str, Callable]]
    calls: Callable[[dict, torch.device], dict[str, Callable[[], object]]]   # tiny calls: must launch kernels
    check: Callable[[dict, int, torch.device], None]
    time: Callable[[dict, int, torch.device, float], dict]


def forbidden() -> tuple:
    """Library functions a graded function may not reach: SDPA and the softmaxes."""
    return (F.scaled_dot_product_attention, torch.softmax, torch.Tensor.softmax, F.softmax)


def geomean(values: list[float]) -> float:
    """Geometric mean of positive values (NaN if any is missing or not positive)."""
    if not values or any(not (v > 0) for v in values):
        return math.nan
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _randn(gen: torch.Generator, *shape: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def _compare(name: str, actual: torch.Tensor, exact: torch.Tensor, plain: torch.Tensor | None, dtype,
             atol: float) -> None:
    """fp32: |actual - exact| <= atol. bf16/fp16: the 2x rule against ``plain`` (the same math in that dtype)."""
    if dtype == torch.float32 or plain is None:
        grading.check_tensor(actual, exact, name=name, atol=atol)
    else:
        floor = 1e-2 * float(exact.detach().abs().max())   # lenient: the tests grade precision, not the board
        grading.check_within_2x(actual, exact, plain, name=name, rule="statistics and accumulators in fp32",
                                floor=floor)


CHECK_DTYPES = {"cpu": [torch.float32], "cuda": [torch.float32, torch.bfloat16]}   # bf16: the 2x rule


# ---------------------------------------------------------------- 06: FlashAttention forward and backward
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
    dtypes = CHECK_DTYPES[device.type]
    for i, ((b, h, n, nk, d, causal), dtype) in enumerate((s, t) for s in FA_SHAPES[device.type] for t in dtypes):
        gen = torch.Generator().manual_seed(seed + i)
        q, k, v, do = (_randn(gen, b, h, m, d, dtype=dtype, device=device) for m in (n, nk, nk, n))
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
        _compare(f"o ({where})", o, o64, plain, dtype, 2e-3)
        for name, g, g64, gp in zip(("dq", "dk", "dv"), grads, grads64, plain_grads):
            _compare(f"{name} ({where})", g, g64, gp, dtype, 5e-3)


def _fa_calls(ns: dict, device: torch.device) -> dict:
    x = torch.randn(1, 1, 32, 16, device=device, requires_grad=True)
    fn = ns["TritonFlashAttention"].apply
    return {"forward": lambda: fn(x, x, x, True), "backward": lambda: fn(x, x, x, True).sum().backward()}


FA_TIMED = dict(seq_lens=[1024, 4096, 16384], head_dims=[64, 128], tokens=16384, width=2048)   # 06's GPU sweep
PEAK_N = 8192   # the matmul of the compute peak: n x n x n, bf16


def _fa_time(ns: dict, seed: int, device: torch.device, target_ms: float) -> dict:
    from . import attention, bench

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
            _compare(f"o after the timing, inputs rewritten in place (N={n} D={d} causal={causal})", o,
                     attention_exact(qs, ks, vs, causal, diag),
                     attention_exact(qs, ks, vs, causal, diag, torch.bfloat16),
                     torch.bfloat16, 0.0)
    peak = bench.matmul_peak_tflops(device=device, dtype=torch.bfloat16, n=PEAK_N)
    ok = sweep[sweep["status"] == "ok"]
    result = {"peak_tflops": peak, "rows": ok[["backend", "N", "D", "causal", "mode", "tflops"]].to_dict("records"),
              "failed": {r.backend: r.status for r in sweep[sweep["status"] != "ok"].itertuples()}}
    for name in ["student", *library]:
        mine = ok[ok["backend"] == name]
        per_mode = {m: geomean(list(mine[mine["mode"] == m]["tflops"] / peak)) if len(mine[mine["mode"] == m]) ==
                    len(configs) * 2 else math.nan for m in attention.MODES}
        per_mode["score"] = geomean(list(per_mode.values()))
        result[name] = per_mode
    return result


# ---------------------------------------------------------------- 08: decode, split-KV and paged
def decode_exact(q, k, v, lens, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per sequence over its first lens[b] keys, in ``dtype``.
    q [B, H_q, d]; k, v [B, N, H_kv, d]; lens [B] -> (o [B, H_q, d], lse [B, H_q])."""
    group = q.shape[1] // k.shape[2]
    k, v = (t.to(dtype).repeat_interleave(group, dim=2) for t in (k, v))         # [B, N, H_q, d]
    s = torch.einsum("bhd,bnhd->bhn", q.to(dtype), k) * q.shape[-1] ** -0.5       # [B, H_q, N]
    keep = torch.arange(k.shape[1], device=q.device)[None, :] < lens.to(q.device).long()[:, None]
    s = s.masked_fill(~keep[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhn,bnhd->bhd", torch.softmax(s, -1).nan_to_num(0.0), v), lse


def to_pages(t: torch.Tensor, table: torch.Tensor, page: int) -> torch.Tensor:
    """A contiguous cache t [B, N, H_kv, d] in pages [B * P, page, H_kv, d]: row b's page p at table[b, p]."""
    b, n = t.shape[:2]
    per = table.shape[1]
    padded = torch.zeros(b, per * page, *t.shape[2:], dtype=t.dtype, device=t.device)
    padded[:, :n] = t
    out = torch.empty(b * per, page, *t.shape[2:], dtype=t.dtype, device=t.device)
    out[table.flatten().long()] = padded.view(b * per, page, *t.shape[2:])
    return out


def paged_copy(k, v, page: int, gen: torch.Generator):
    """A contiguous cache k, v [B, N, H_kv, d] copied into shuffled pages: (k_pages, v_pages
    [B * ceil(N / page), page, H_kv, d], table [B, ceil(N / page)] int32)."""
    b, n = k.shape[:2]
    per = -(-n // page)
    table = torch.randperm(b * per, generator=gen).view(b, per).to(device=k.device, dtype=torch.int32)
    return to_pages(k, table, page), to_pages(v, table, page), table


DECODE_SHAPES = {"cpu": [(3, 6, 2, 70, 16, [70, 1, 33]), (2, 4, 4, 45, 32, [45, 17])],
                 "cuda": [(4, 32, 8, 5000, 128, [5000, 1, 3333, 4097]), (3, 12, 4, 2100, 64, [2100, 999, 64])]}


def _decode_check(ns: dict, seed: int, device: torch.device) -> None:
    split, paged = ns["decode_split"], ns["paged_decode"]
    dtypes = CHECK_DTYPES[device.type]
    for i, ((b, hq, hkv, n, d, lens), dtype) in enumerate((s, t) for s in DECODE_SHAPES[device.type] for t in dtypes):
        gen = torch.Generator().manual_seed(seed + i)
        q, k, v = _randn(gen, b, hq, d, dtype=dtype, device=device), *(_randn(gen, b, n, hkv, d, dtype=dtype,
                                                                                 device=device) for _ in range(2))
        lens = torch.tensor(lens, dtype=torch.int32, device=device)
        o64, lse64 = decode_exact(q, k, v, lens)
        plain = None if dtype == torch.float32 else decode_exact(q, k, v, lens, dtype)[0]
        kp, vp, table = paged_copy(k, v, getattr(ns.get("P"), "page_size", 16), gen)
        runs = {f"decode_split S={s}": (lambda s=s: split(q, k, v, lens, s)) for s in (None, 3)}
        runs.update({f"paged_decode S={s}": (lambda s=s: paged(q, kp, vp, table, lens, s)) for s in (None, 2)})
        for label, run in runs.items():
            o, lse = run()
            where = f"{label}, B={b} H_q={hq} H_kv={hkv} N={n} d={d} lens={lens.tolist()} {str(dtype)[6:]}"
            _compare(f"o ({where})", o, o64, plain, dtype, 1e-3)
            grading.check_tensor(lse, lse64, name=f"lse ({where})", atol=1e-3 if dtype == torch.float32 else 2e-2)


def _decode_calls(ns: dict, device: torch.device) -> dict:
    q, kv = torch.randn(1, 2, 16, device=device), torch.randn(1, 40, 1, 16, device=device)
    lens = torch.tensor([40], dtype=torch.int32, device=device)
    kp, vp, table = paged_copy(kv, kv, getattr(ns.get("P"), "page_size", 16), torch.Generator().manual_seed(0))
    return {"decode_split": lambda: ns["decode_split"](q, kv, kv, lens),
            "paged_decode": lambda: ns["paged_decode"](q, kp, vp, table, lens)}


DECODE_TIMED = [(1, 4096), (1, 16384), (1, 65536), (8, 8192)]   # (B, N), bf16
DECODE_HEADS = (32, 8, 128, 64)   # H_q, H_kv, d, page size: notebook 08's GPU shapes
MINE = ("student contiguous", "student paged")


def _decode_recheck(calls: dict[str, Callable[[], torch.Tensor]], tensors: tuple, gen: torch.Generator,
                    where: str) -> None:
    """The timed calls after ``tensors`` (q, k, v, k_pages, v_pages, table, lens) got new values in place: called, and
    on a GPU replayed from a graph captured before: a cache keyed on the tensors or an empty capture fails."""
    from . import graphtime

    q, k, v, kp, vp, table, lens = tensors
    page, g = kp.shape[1], q.shape[1] // k.shape[2]
    with torch.no_grad():
        graphs = {name: (graphtime.warm_up(call), graphtime.capture(call))[1] for name, call in calls.items()
                  if q.is_cuda}
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        kp.copy_(to_pages(k, table, page))
        vp.copy_(to_pages(v, table, page))
        o64 = decode_exact(q[:1, :g], k[:1, :, :1], v[:1, :, :1], lens[:1])[0]           # batch 0, KV head 0
        plain = decode_exact(q[:1, :g], k[:1, :, :1], v[:1, :, :1], lens[:1], torch.bfloat16)[0]
        for name, call in calls.items():
            outs = {"called": call()}
            if name in graphs:
                graph, out = graphs[name]
                graph.replay()
                outs["replayed from its CUDA graph"] = out
            for how, o in outs.items():
                _compare(f"{name} after the timing, inputs rewritten in place, {how} ({where})", o[:1, :g], o64,
                         plain, q.dtype, 0.0)


def _decode_time(ns: dict, seed: int, device: torch.device, target_ms: float) -> dict:
    from . import decode

    split, paged, gen, rows = ns["decode_split"], ns["paged_decode"], torch.Generator().manual_seed(seed), []
    hq, hkv, d, page = DECODE_HEADS
    read_bw = decode.read_bandwidth(device=device)
    for b, n in DECODE_TIMED:
        lens, per_cache = torch.full((b,), n, dtype=torch.int32, device=device), []
        for _ in range(decode.caches_for(2 * b * n * hkv * d * 2, device)):
            q, k, v = _randn(gen, b, hq, d, dtype=torch.bfloat16, device=device), *(
                _randn(gen, b, n, hkv, d, dtype=torch.bfloat16, device=device) for _ in range(2))
            kp, vp, table = paged_copy(k, v, page, gen)
            calls = {MINE[0]: lambda q=q, k=k, v=v: split(q, k, v, lens, max_len=n),
                     MINE[1]: lambda q=q, kp=kp, vp=vp, t=table: paged(q, kp, vp, t, lens, max_len=n),
                     **decode.yardsticks(q, k, v, ("sdpa_flash", "sdpa_cudnn", "fa4")),
                     decode.READ_ONLY: decode.read_once(k, v)}
            if (fa4p := decode.fa4_paged(q, kp, vp, table, lens)) is not None:
                calls["fa4 paged"] = fa4p
            per_cache.append(calls)
        per_call, errors = decode.time_per_call(per_cache, device, target_ms=target_ms)
        failed = [name for name in MINE if name in errors]
        if failed:
            why = str(errors[failed[0]]).splitlines()[0]
            raise RuntimeError(f"{failed[0]} could not be timed (B={b}, N={n}): {why}")
        moved = decode.tensor_bytes(q, k, v, q)
        rows += [dict(B=b, N=n, kernel=name, gb_per_s=moved / (ms * 1e-3) / 1e9) for name, ms in per_call.items()]
        _decode_recheck({MINE[0]: lambda: split(q, k, v, lens, max_len=n)[0],
                         MINE[1]: lambda: paged(q, kp, vp, table, lens, max_len=n)[0]},
                        (q, k, v, kp, vp, table, lens), gen, f"B={b}, N={n}")
        del per_cache
        decode.release(device)
    names = sorted({r["kernel"] for r in rows})
    result = {"read_bw": read_bw, "rows": rows}
    for name in names:
        result[name] = geomean([r["gb_per_s"] * 1e9 / read_bw for r in rows if r["kernel"] == name])
    result["student"] = {"score": geomean([r["gb_per_s"] * 1e9 / read_bw for r in rows if r["kernel"] in MINE]),
                         **{m.split()[1]: result[m] for m in MINE}}
    return result


SPECS = {
    "06_triton_flashattention": Spec(
        graded=("TritonFlashAttention", "flash_attention_forward", "flash_attention_backward"),
        own=lambda ns: {"TritonFlashAttention.forward": ns["TritonFlashAttention"].forward,
                        "TritonFlashAttention.backward": ns["TritonFlashAttention"].backward},
        calls=_fa_calls, check=_fa_check, time=_fa_time),
    "08_decode_attention": Spec(
        graded=("decode_split", "paged_decode"),
        own=lambda ns: {"decode_split": ns["decode_split"], "paged_decode": ns["paged_decode"]},
        calls=_decode_calls, check=_decode_check, time=_decode_time),
}
