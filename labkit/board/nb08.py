"""The board's 08_decode_attention: ``decode_split(q, k, v, seqlens)`` and ``paged_decode(q, k_pages, v_pages,
table, seqlens)``, q [B, H_q, d], k, v [B, N, H_kv, d], pages [num_pages, page, H_kv, d]. Check: GQA with uneven
lengths, both functions and several split counts. Timed as the notebook does (:func:`labkit.decoding.graphtime.time_per_call`:
CUDA graphs of 8 calls over distinct caches, L2 flushed by a read) beside SDPA's kernels and FA4; score: GB/s over
the read ceiling, geometric mean over the shapes and both functions.

Used by: :mod:`labkit.board.specs` (the registry).
"""
from __future__ import annotations

from typing import Callable

import torch

from labkit.board import common
from labkit.core import grading
from labkit.board.common import Spec

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
    dtypes = common.CHECK_DTYPES[device.type]
    for i, ((b, hq, hkv, n, d, lens), dtype) in enumerate((s, t) for s in DECODE_SHAPES[device.type] for t in dtypes):
        gen = torch.Generator().manual_seed(seed + i)
        q = common.randn(gen, b, hq, d, dtype=dtype, device=device)
        k, v = (common.randn(gen, b, n, hkv, d, dtype=dtype, device=device) for _ in range(2))
        lens = torch.tensor(lens, dtype=torch.int32, device=device)
        o64, lse64 = decode_exact(q, k, v, lens)
        plain = None if dtype == torch.float32 else decode_exact(q, k, v, lens, dtype)[0]
        kp, vp, table = paged_copy(k, v, getattr(ns.get("P"), "page_size", 16), gen)
        runs = {f"decode_split S={s}": (lambda s=s: split(q, k, v, lens, s)) for s in (None, 3)}
        runs.update({f"paged_decode S={s}": (lambda s=s: paged(q, kp, vp, table, lens, s)) for s in (None, 2)})
        for label, run in runs.items():
            o, lse = run()
            where = f"{label}, B={b} H_q={hq} H_kv={hkv} N={n} d={d} lens={lens.tolist()} {str(dtype)[6:]}"
            common.compare(f"o ({where})", o, o64, plain, dtype, 1e-3)
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
    from labkit.decoding import graphtime

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
                common.compare(f"{name} after the timing, inputs rewritten in place, {how} ({where})", o[:1, :g], o64,
                         plain, q.dtype, 0.0)


def _decode_time(ns: dict, seed: int, device: torch.device, target_ms: float) -> dict:
    from labkit.decoding import decode

    split, paged, gen, rows = ns["decode_split"], ns["paged_decode"], torch.Generator().manual_seed(seed), []
    hq, hkv, d, page = DECODE_HEADS
    read_bw = decode.read_bandwidth(device=device)
    for b, n in DECODE_TIMED:
        lens, per_cache = torch.full((b,), n, dtype=torch.int32, device=device), []
        for _ in range(decode.caches_for(2 * b * n * hkv * d * 2, device)):
            q, k, v = common.randn(gen, b, hq, d, dtype=torch.bfloat16, device=device), *(
                common.randn(gen, b, n, hkv, d, dtype=torch.bfloat16, device=device) for _ in range(2))
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
        result[name] = common.geomean([r["gb_per_s"] * 1e9 / read_bw for r in rows if r["kernel"] == name])
    result["student"] = {"score": common.geomean([r["gb_per_s"] * 1e9 / read_bw for r in rows if r["kernel"] in MINE]),
                         **{m.split()[1]: result[m] for m in MINE}}
    return result




SPEC = Spec(
    graded=("decode_split", "paged_decode"),
    own=lambda ns: {"decode_split": ns["decode_split"], "paged_decode": ns["paged_decode"]},
    calls=_decode_calls, check=_decode_check, time=_decode_time)
