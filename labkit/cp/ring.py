"""Ring attention on P devices: simulated in one process, or as P real processes (gloo send/recv).

Each device holds one contiguous chunk of the queries, keys and values. In step s device i
attends its queries to the key/value chunk it holds (chunk ``(i - s) mod P``), merges that
partial result into its running one, and passes the chunk on to device ``i + 1``. After P steps
every query has seen every key. Chunks may be uneven; under a causal mask a device skips the
chunks that lie entirely in its future.

The merge of two partial results by their log-sum-exps is the reader's exercise, so both
runners take it as an argument, ``merge(o1, lse1, o2, lse2) -> (o, lse)`` with o [B, H, n, D]
and lse [B, H, n] (fp32):

- :func:`block_attention`: one device's partial attention, (o, lse), with global positions.
- :func:`simulate_ring`: P simulated devices in this process, step by step, with a log.
- :func:`run_ring`: the same ring as ``world`` processes started with ``fork`` (so a function
  defined in a notebook works), which pass K/V with ``torch.distributed`` send/recv over gloo.

Used in: 07_context_parallel.
"""
from __future__ import annotations

import math
import os
import socket
import time
from typing import Callable

import pandas as pd
import torch

Merge = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def chunk_sizes(n: int, world: int) -> list[int]:
    """Sizes of ``world`` contiguous chunks of ``n`` positions, as even as possible (first ones larger)."""
    if world < 1 or n < world:
        raise ValueError(f"need 1 <= world <= n, got world={world}, n={n}.")
    return [n // world + (i < n % world) for i in range(world)]


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_start: int, k_start: int,
                    causal: bool, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries q [B, H, n, D] (positions q_start..) over keys k, v [B, H, m, D] (k_start..).

    Scores are materialized in fp32 (float64 stays float64). Causal: key position <= query
    position. A row with no visible key gives o = 0 and lse = -inf.

    Returns:
        (o [B, H, n, D] in q's dtype, lse [B, H, n] in the accumulation dtype).
    """
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    s = torch.einsum("bhnd,bhmd->bhnm", q.to(work), k.to(work)) * scale  # [B, H, n, m]
    if causal:
        qi = torch.arange(q_start, q_start + q.shape[-2], device=q.device)[:, None]
        kj = torch.arange(k_start, k_start + k.shape[-2], device=q.device)[None, :]
        s = s.masked_fill(kj > qi, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # an empty row: 0, not NaN
    o = torch.einsum("bhnm,bhmd->bhnd", p, v.to(work))
    return o.to(q.dtype), torch.logsumexp(s, dim=-1)


def _ring_step(state, q, q_start, k, v, k_start, merge: Merge, causal: bool):
    """One device's step: attend to the chunk it holds and merge; None state = nothing seen yet.

    Returns (new state, whether the chunk was computed): a causal device skips a chunk whose
    first key lies after its last query.
    """
    if causal and k_start > q_start + q.shape[-2] - 1:
        return state, False
    part = block_attention(q, k, v, q_start=q_start, k_start=k_start, causal=causal)
    return (part if state is None else merge(*state, *part)), True


def _split(x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(x.split(sizes, dim=-2))


def simulate_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, merge: Merge, *, world: int,
                  causal: bool, sizes: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, pd.DataFrame]:
    """Ring attention over ``world`` simulated devices, in one process.

    Args:
        q, k, v: [B, H, N, D], the whole sequence (split here into ``sizes``, default :func:`chunk_sizes`).
        merge: the reader's merge of two partial results.

    Returns:
        (o [B, H, N, D], lse [B, H, N], log): the log has one row per step and device: step, device,
        kv_chunk (the chunk it holds), computed, bytes_sent (K and V passed on; 0 in the last step).
    """
    sizes = sizes or chunk_sizes(q.shape[-2], world)
    starts = [sum(sizes[:i]) for i in range(world)]
    qs, held = _split(q, sizes), list(zip(_split(k, sizes), _split(v, sizes), range(world)))
    states, rows = [None] * world, []
    for step in range(world):
        for i in range(world):
            kc, vc, j = held[i]
            states[i], computed = _ring_step(states[i], qs[i], starts[i], kc, vc, starts[j], merge, causal)
            sent = 0 if step == world - 1 else kc.nbytes + vc.nbytes
            rows.append(dict(step=step, device=i, kv_chunk=j, computed=computed, bytes_sent=sent))
        held = held[-1:] + held[:-1]  # every device passes its chunk to the next one
    o = torch.cat([s[0] for s in states], dim=-2)
    return o, torch.cat([s[1] for s in states], dim=-1), pd.DataFrame(rows)


def _worker(rank: int, world: int, port: int, chunks: tuple, sizes: list[int], merge: Merge, causal: bool,
            conn) -> None:
    """One ring device in its own process: gloo group, P steps, result sent back through ``conn``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        q, k, v = chunks
        starts = [sum(sizes[:i]) for i in range(world)]
        state, rows, j = None, [], rank
        for step in range(world):
            t0, held = time.perf_counter(), j
            state, computed = _ring_step(state, q, starts[rank], k, v, starts[j], merge, causal)
            sent = 0
            if step < world - 1:  # pass K/V on to rank + 1, receive the previous rank's
                j = (j - 1) % world
                shape = (*k.shape[:-2], sizes[j], k.shape[-1])
                k_in, v_in = torch.empty(shape, dtype=k.dtype), torch.empty(shape, dtype=v.dtype)
                ops = [dist.P2POp(dist.isend, t, (rank + 1) % world) for t in (k, v)]
                ops += [dist.P2POp(dist.irecv, t, (rank - 1) % world) for t in (k_in, v_in)]
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
                sent, (k, v) = k.nbytes + v.nbytes, (k_in, v_in)
            rows.append(dict(step=step, device=rank, kv_chunk=held, computed=computed,
                             bytes_sent=sent, ms=(time.perf_counter() - t0) * 1e3, pid=os.getpid()))
        dist.destroy_process_group()
        conn.send((rank, state[0].numpy(), state[1].numpy(), rows, None))
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send((rank, None, None, [], f"{type(err).__name__}: {err}"))
    finally:
        conn.close()
        os._exit(0)  # a forked child must not run the parent's exit handlers (e.g. a Jupyter kernel's)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ring(merge: Merge, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, world: int = 2,
             causal: bool = True, sizes: list[int] | None = None,
             timeout: float = 60.0) -> tuple[torch.Tensor, torch.Tensor, pd.DataFrame]:
    """Ring attention as ``world`` real processes that exchange K/V over gloo (CPU tensors).

    The processes are forked, so ``merge`` may be defined in a notebook. Same arguments and
    results as :func:`simulate_ring`; the log adds ms (the step's wall time) and pid (the process).

    Raises:
        RuntimeError: a process failed (its error is named) or ``timeout`` seconds passed.
    """
    import multiprocessing as mp

    sizes = sizes or chunk_sizes(q.shape[-2], world)
    ctx, port = mp.get_context("fork"), _free_port()
    pipes, procs = [ctx.Pipe(duplex=False) for _ in range(world)], []
    parts = list(zip(*(_split(t.detach().cpu().contiguous(), sizes) for t in (q, k, v))))
    for rank in range(world):
        chunks = tuple(t.contiguous() for t in parts[rank])
        procs.append(ctx.Process(target=_worker, args=(rank, world, port, chunks, sizes, merge, causal,
                                                       pipes[rank][1]), daemon=True))
        procs[-1].start()
    try:
        results = [_receive(pipe[0], rank, timeout) for rank, pipe in enumerate(pipes)]
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    o = torch.cat([torch.from_numpy(r[1]) for r in results], dim=-2)
    lse = torch.cat([torch.from_numpy(r[2]) for r in results], dim=-1)
    log = pd.DataFrame([row for r in results for row in r[3]]).sort_values(["step", "device"], ignore_index=True)
    return o, lse, log


def _receive(conn, rank: int, timeout: float):
    if not conn.poll(timeout):
        raise RuntimeError(f"ring process {rank} sent no result within {timeout:.0f} s.")
    result = conn.recv()
    if result[4] is not None:
        raise RuntimeError(f"ring process {rank} failed: {result[4]}")
    return result


__all__ = ["Merge", "block_attention", "chunk_sizes", "run_ring", "simulate_ring"]
