"""The board's 09_flex_attention: the block-sparse kernels of exercises 5 and 7.

``sparse_attention(q, k, v, lists, block, mask=, window=, document_id=, sink=)`` -> (o, lse) and
``sparse_attention_backward(q, k, v, o, lse, do, lists, block, mask=, window=, document_id=)`` -> (dq, dk, dv);
q [B, H, Nq, d], k, v [B, H, Nk, d]; ``lists``: ``create_block_mask``'s eight lists for (batch 0, head 0)
(:func:`labkit.flex.lib.torch_lists`, the board's own, never the student's ``block_lists``); masks "causal"
(top-left: q_idx >= kv_idx), "window" (causal and q_idx - kv_idx <= window), "document" (causal inside each
document of ``document_id``).

- Check: fp32 (and bf16 on a GPU) at shapes the visible tests never use: N not a multiple of the block, Nq != Nk
  (causal with Nq > Nk: rows that see the key tail's bounds; a window with Nq < Nk; documents index q and k with one id list, so Nq = Nk), uneven
  documents, a sink on the forward and its lse given to the backward; against float64 autograd through a dense
  attention with the same boolean table (the sink one more score column, value 0).
- Time (GPU, forward and forward+backward): :func:`labkit.flex.bench.sweep` (the notebook's sweep:
  ``torch.compile(flex_attention)`` and its FLASH backend, SDPA with a dense mask, FA4, varlen in the same run;
  the libraries' backward through autograd) at B = 1, H = 16, d = 128, bf16, N = 4K/8K/16K, masks causal,
  window 1024 and 16 documents; then the timed tensors rewritten in place and the student's forward checked
  again. Score (:func:`scores`): TFLOP/s of the work the mask keeps (4 d H per visible score; x3.5 forward +
  backward, as ``lk.attention.flops`` counts) over the measured matmul peak, geometric mean over the 9 shapes per
  pass, then over the two passes; a library kernel gets a score where it ran all 9.

Used by: :mod:`labkit.board.specs` (the registry).
"""
from __future__ import annotations

import torch

from labkit.board import common
from labkit.core import grading
from labkit.board.common import Spec


def rule(kind: str, window: int = 0, document_id: torch.Tensor | None = None):
    """The mask_mod of a kernel mask: "none", "causal", "window" or "document" (causal within a document)."""
    def visible(b, h, q_idx, kv_idx):
        seen = (q_idx >= kv_idx) | (kind == "none")
        if kind == "window":
            seen = seen & (q_idx - kv_idx <= window)
        if kind == "document":
            seen = seen & (document_id[q_idx] == document_id[kv_idx])
        return seen
    return visible


def allowed(mask_mod, rows: torch.Tensor, Nk: int) -> torch.Tensor:
    """The boolean table [len(rows), Nk] of ``mask_mod`` for query positions ``rows``."""
    zero = torch.zeros((), dtype=torch.long, device=rows.device)
    cols = torch.arange(Nk, device=rows.device)
    return torch.as_tensor(mask_mod(zero, zero, rows.view(-1, 1), cols.view(1, -1))).expand(len(rows), Nk)


def dense(q, k, v, table, sink=None, dtype=torch.float64):
    """Attention in ``dtype`` masked by ``table`` [Nq, Nk], sink [H] one more score column (value 0): (o, lse)."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~table, float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.to(dtype).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1))[..., :k.shape[-2]] @ v, lse


def documents(lengths: list[int]) -> torch.Tensor:
    """Document ids [sum(lengths)] of consecutive documents of these lengths."""
    return torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lengths)])


# (B, H, Nq, Nk, d, mask, window, document lengths, sink); block 16 on a CPU, 128 on a GPU (fp32: 32)
SHAPES = {"cpu": [(1, 2, 60, 41, 16, "causal", 0, None, True), (1, 2, 37, 70, 16, "window", 9, None, False),
                  (2, 1, 45, 45, 16, "document", 0, [7, 20, 18], False)],
          "cuda": [(2, 3, 1100, 777, 128, "causal", 0, None, True), (1, 4, 700, 1300, 64, "window", 200, None, False),
                   (1, 4, 1500, 1500, 128, "document", 0, [300, 777, 423], True)]}
BLOCK = {"cpu": 16, "cuda": 128, "cuda float32": 32}   # fp32 tiles of 128 x 128 would not fit in shared memory


def _check(ns: dict, seed: int, device: torch.device) -> None:
    from labkit.flex import lib as flexlib

    fwd, bwd = ns["sparse_attention"], ns["sparse_attention_backward"]
    shapes = [(s, t) for s in SHAPES[device.type] for t in common.CHECK_DTYPES[device.type]]
    for i, ((b, h, nq, nk, d, kind, window, lengths, with_sink), dtype) in enumerate(shapes):
        gen = torch.Generator().manual_seed(seed + i)
        block = BLOCK.get(f"{device.type} {str(dtype)[6:]}", BLOCK[device.type])
        q, do = (common.randn(gen, b, h, nq, d, dtype=dtype, device=device) for _ in range(2))
        k, v = (common.randn(gen, b, h, nk, d, dtype=dtype, device=device) for _ in range(2))
        sink = common.randn(gen, h, device=device) if with_sink else None
        ids = documents(lengths) if lengths else None
        mask_mod = rule(kind, window, ids)
        lists = {n: t.to(device) for n, t in flexlib.torch_lists(mask_mod, nq, nk, block).items()}
        extra = dict(mask=kind, window=window, document_id=None if ids is None else ids.to(device))
        table = allowed(rule(kind, window, extra["document_id"]), torch.arange(nq, device=device), nk)
        where = (f"B={b} H={h} Nq={nq} Nk={nk} d={d} mask={kind}{f' window={window}' if kind == 'window' else ''}"
                 f"{f' documents={lengths}' if lengths else ''}{' sink' if with_sink else ''} block={block} "
                 f"{str(dtype)[6:]}")
        o, lse = fwd(q, k, v, lists, block, sink=sink, **extra)
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        o64, lse64 = dense(*leaves, table, sink)
        grads64 = torch.autograd.grad(o64, leaves, do.double())
        plain, plain_grads = None, [None] * 3
        if dtype != torch.float32:
            low = [t.clone().requires_grad_() for t in (q, k, v)]
            plain = dense(*low, table, sink, dtype)[0]
            plain_grads = torch.autograd.grad(plain, low, do)
        common.compare(f"o ({where})", o, o64, plain, dtype, 1e-3)
        grading.check_tensor(lse.float(), lse64, name=f"lse ({where})", atol=1e-3 if dtype == torch.float32 else 2e-2)
        grads = bwd(q, k, v, o64.detach().to(dtype), lse64.detach().float(), do, lists, block, **extra)
        for name, g, g64, gp in zip(("dq", "dk", "dv"), grads, grads64, plain_grads):
            common.compare(f"{name} ({where})", g, g64, gp, dtype, 5e-3)


def _calls(ns: dict, device: torch.device) -> dict:
    from labkit.flex import lib as flexlib

    x = torch.randn(1, 1, 32, 16, device=device)
    lists = {n: t.to(device) for n, t in flexlib.torch_lists(rule("causal"), 32, 32, 16).items()}
    fwd, bwd = ns["sparse_attention"], ns["sparse_attention_backward"]

    def backward():
        o, lse = fwd(x, x, x, lists, 16)
        return bwd(x, x, x, o, lse, x, lists, 16)
    return {"sparse_attention": lambda: fwd(x, x, x, lists, 16), "sparse_attention_backward": backward}


TIMED = dict(seq_lens=[4096, 8192, 16384], H=16, d=128)   # notebook 09's GPU sweep (GPU_NS, B = 1)
CASES = [dict(name="causal", kind="causal"), dict(name="window 1024", kind="window", window=1024),
         dict(name="16 documents", kind="document", documents=16)]
RECHECK_ROWS = 128   # the last query rows of heads 0-1 checked after the timing


def _ids(case: dict, N: int, device) -> torch.Tensor | None:
    return (torch.arange(N, device=device) * case["documents"] // N) if case["kind"] == "document" else None


def kept_scores(mask_mod, N: int, device, chunk: int = 1024) -> int:
    """How many of the N x N scores ``mask_mod`` keeps (rows in chunks: an N x N int64 table would not fit)."""
    return sum(int(allowed(mask_mod, torch.arange(i, min(N, i + chunk), device=device), N).sum())
               for i in range(0, N, chunk))


PASS_KEYS = {"fwd": "fwd", "fwd+bwd": "fwd_bwd"}   # flexbench's passes -> the board's score columns, named as 06's


def scores(ok, work: dict, peak: float) -> dict:
    """Per backend of the sweep's rows that ran (``ok``: backend, pass, N, mask, tflops): the geometric mean over
    the shapes of ``work`` (N, mask) of TFLOP/s over ``peak`` for each pass, and ``score``, the geometric mean of
    the passes; NaN where a backend did not run every shape of a pass."""
    out = {}
    for backend in sorted(set(ok["backend"])):
        per_pass = {}
        for p, key in PASS_KEYS.items():
            rows = ok[(ok["backend"] == backend) & (ok["pass"] == p)]
            per_pass[key] = common.geomean(list(rows["tflops"] / peak)) if len(rows) == len(work) else float("nan")
        per_pass["score"] = common.geomean(list(per_pass.values()))
        out["student" if backend == "mine" else backend] = per_pass
    return out


def _time(ns: dict, seed: int, device: torch.device, target_ms: float) -> dict:
    from labkit.engine import attention, bench
    from labkit.flex import bench as flexbench

    fn, bwd, kept, H, d = ns["sparse_attention"], ns["sparse_attention_backward"], {}, TIMED["H"], TIMED["d"]
    cases = [dict(c, rule=lambda N, c=c: rule(c["kind"], c.get("window", 0), _ids(c, N, device)),
                  document_id=lambda N, c=c: _ids(c, N, device)) for c in CASES]
    ids = {}

    def rule_args(case, N):   # document ids made once per N: a copy in each timed call would be timed too
        if case["kind"] == "document" and N not in ids:
            ids[N] = _ids(case, N, device)
        return dict(mask=case["kind"], window=case.get("window", 0),
                    document_id=ids[N] if case["kind"] == "document" else None)

    def student(q, k, v, lists, block, case, N):   # the timed forward; keeps what the timer gave it
        kept[(N, case["name"])] = (q, k, v, lists, block, case)
        return fn(q, k, v, lists, block, **rule_args(case, N))

    def student_backward(q, k, v, o, lse, do, lists, block, case, N):
        return bwd(q, k, v, o, lse, do, lists, block, **rule_args(case, N))

    torch.manual_seed(seed)
    sweep = flexbench.sweep(cases, TIMED["seq_lens"], mine=student, mine_backward=student_backward, H=H, d=d,
                            target_ms=target_ms, device=device.type)
    bad = sweep[(sweep["backend"] == "mine") & (sweep["status"] != "ok")]
    if len(bad):
        first = bad.iloc[0]
        raise RuntimeError(f"the timed call failed at N={first['N']} mask={first['mask']} ({first['pass']}): "
                           f"{first['status']}")
    gen = torch.Generator().manual_seed(seed)
    for (n, name), (q, k, v, lists, block, case) in kept.items():    # new values, the same tensors
        with torch.no_grad():
            for t in (q, k, v):
                t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
            rows = min(RECHECK_ROWS, n)
            o = student(q, k, v, lists, block, case, n)[0][:, :2, -rows:]
            table = allowed(case["rule"](n), torch.arange(n - rows, n, device=device), n)
            qs, ks, vs = q[:, :2, -rows:], k[:, :2], v[:, :2]
            common.compare(f"o after the timing, inputs rewritten in place (N={n} mask={name})", o,
                           dense(qs, ks, vs, table)[0], dense(qs, ks, vs, table, dtype=q.dtype)[0], q.dtype, 0.0)
    work = {(n, c["name"]): 4.0 * H * d * kept_scores(c["rule"](n), n, device)
            for n in TIMED["seq_lens"] for c in cases}
    peak = bench.matmul_peak_tflops(device=device, dtype=torch.bfloat16, n=common.PEAK_N)
    ok = sweep[sweep["status"] == "ok"].copy()
    per_pass = {p: attention.flops(1, 1, 1, 1, mode=key) / attention.flops(1, 1, 1, 1) for p, key in PASS_KEYS.items()}
    ok["tflops"] = [work[(n, mask)] * per_pass[p] / (ms * 1e-3) / 1e12
                    for n, mask, p, ms in zip(ok["N"], ok["mask"], ok["pass"], ok["ms"])]
    failed = sweep[sweep["status"] != "ok"]
    return {"peak_tflops": peak,
            "rows": ok[["backend", "pass", "N", "mask", "density", "ms", "tflops"]].to_dict("records"),
            "failed": {f"{b} {p}": status for b, p, status in zip(failed["backend"], failed["pass"], failed["status"])},
            **scores(ok, work, peak)}


SPEC = Spec(
    graded=("sparse_attention", "sparse_attention_backward"),
    own=lambda ns: {"sparse_attention": ns["sparse_attention"],
                    "sparse_attention_backward": ns["sparse_attention_backward"]},
    calls=_calls, check=_check, time=_time)
