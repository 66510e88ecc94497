"""GPU runs for notebook 07 and ``cp-train`` on 2 and 4 GPUs (issue 39): what CPU tests cannot measure.

Not a pytest module (no ``test_`` prefix): the lead runs it on a machine with 2 or 4 GPUs, one
subcommand per device call (each fits 10 minutes; /tmp/gpu_request_h7.md gives the plan).

- ``bandwidth --nproc P``: bus bandwidth of all-gather, all-to-all and one ring hop (``permute_tensor``,
  what torch's ``alltoall`` rotation sends) over NCCL, nccl-tests' convention (bus = alg x (P-1)/P
  for the collectives; a hop moves one buffer per rank, bus = alg); beside lk.cpmem's bytes per ring step.
- ``reach --nproc P --lengths N1,N2,...``: the longest of the lengths that trains (one step each,
  longest first, stopping at the first that fits); the peak per rank and lk.cpmem's prediction.
- ``torchsrc``: the installed torch's context-parallel source, the lines lk.cpmem counts (to compare
  torch 2.11 on the GPU machine with 2.13 here).

Every subcommand prints JSON lines and, with ``--out DIR`` (default $OUT or build/cp_gpu), writes them there.
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _emit(rows: list[dict], out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for row in rows:
        print(json.dumps(row), flush=True)
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1))


def bandwidth_worker(sizes_mib: list[int], repeats: int) -> list[dict]:
    """One torchrun rank: time each collective (median of ``repeats`` after 3 warm-ups)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as ft_c

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    group, rows = dist.group.WORLD, []
    for mib in sizes_mib:
        n = mib * 2**20 // 2  # bf16 elements per rank
        x = torch.randn(n, device=device, dtype=torch.bfloat16)
        gathered = torch.empty(n * world, device=device, dtype=torch.bfloat16)
        swapped = torch.empty_like(x)
        ops = {
            "all_gather": (lambda: dist.all_gather_into_tensor(gathered, x), (world - 1) / world, n * 2 * world),
            "all_to_all": (lambda: dist.all_to_all_single(swapped, x), (world - 1) / world, n * 2),
            "ring_hop": (lambda: ft_c.permute_tensor(x, list(range(1, world)) + [0], group).wait(), 1.0, n * 2),
        }
        for name, (fn, factor, nbytes) in ops.items():
            times = []
            for i in range(3 + repeats):
                torch.cuda.synchronize(device)
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize(device)
                if i >= 3:
                    times.append(time.perf_counter() - t0)
            s = sorted(times)[len(times) // 2]
            rows.append(dict(op=name, world=world, rank=rank, mib_per_rank=mib, seconds=s,
                             alg_gbs=nbytes / s / 1e9, bus_gbs=nbytes / s / 1e9 * factor,
                             device=torch.cuda.get_device_name(device)))
    dist.destroy_process_group()
    return rows


def bandwidth(args) -> int:
    if "LOCAL_RANK" not in os.environ:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               __file__, "bandwidth", "--sizes", args.sizes, "--out", str(args.out)]
        print("+", " ".join(cmd), flush=True)
        return subprocess.call(cmd, cwd=ROOT)
    rows = bandwidth_worker([int(s) for s in args.sizes.split(",")], repeats=5)
    if os.environ["RANK"] == "0":
        from labkit.cp import memory as cpmem

        h = 768  # GPT-2 small: one ring hop per layer and step sends K and V of the local tokens, bf16
        for row in rows:
            row["model_ring_step_mib_at_256k"] = 4 * (262144 // row["world"]) * h / 2**20
            row["ring_buffers_bytes_per_token_h"] = cpmem.ring_buffer_bytes()
        _emit(rows, args.out, f"bandwidth_p{rows[0]['world']}")
    return 0


def reach(args) -> int:
    """Longest first: one step (--steps 1) per length until one trains; rows of that run."""
    rows = []
    for n in sorted((int(s) for s in args.lengths.split(",")), reverse=True):
        mode = ["--single"] if args.nproc == 1 else ["--nproc", str(args.nproc)]
        out = args.out / f"reach_p{args.nproc}_{n}.json"
        cmd = [sys.executable, "-m", "labkit", "cp-train", *mode, "--seq-len", str(n), "--steps", "1",
               "--checkpointing", *args.levers.split(), "--json", str(out)]
        print("+", " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
        ok = done.returncode == 0 and out.exists()
        print(done.stdout[-1500:] if ok else done.stderr[-800:], flush=True)
        rows.append(dict(N=n, world=args.nproc, ok=ok, wall_s=time.perf_counter() - t0,
                         ranks=json.loads(out.read_text()) if ok else None))
        if ok:
            break
    _emit(rows, args.out, f"reach_p{args.nproc}")
    return 0 if any(r["ok"] for r in rows) else 1


def torchsrc(args) -> int:
    """torch's version, the hash of its context-parallel module, and the lines lk.cpmem's terms rest on."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention as module
    except ImportError:
        from torch.distributed.tensor.experimental import _attention as module
    text = inspect.getsource(module)
    keys = ("rotate_method: _RotateMethod", "convert_to_f32: bool", "enable_load_balance: bool",
            "dkv_rotater = _create_rotater", "torch.zeros_like(query, dtype=accum_dtype)",
            "all_gather_single(", "permute_tensor(", "next_grad_kv = torch.cat", "next_kv = torch.cat")
    lines = [f"{i + 1}: {line.strip()}" for i, line in enumerate(text.splitlines()) if any(k in line for k in keys)]
    _emit([dict(torch=torch.__version__, module=module.__name__, sha256=hashlib.sha256(text.encode()).hexdigest(),
                lines=lines)], args.out, "torchsrc")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tests/gpu/cp_gpu.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "build" / "cp_gpu")))
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bandwidth")
    b.add_argument("--nproc", type=int, default=torch.cuda.device_count())
    b.add_argument("--sizes", default="4,64,256", help="MiB per rank")
    b.add_argument("--out", type=Path, default=argparse.SUPPRESS)
    r = sub.add_parser("reach")
    r.add_argument("--nproc", type=int, required=True)
    r.add_argument("--lengths", required=True, help="comma-separated N, tried longest first")
    r.add_argument("--levers", default="", help="more cp-train flags, e.g. '--chunked-mlp'")
    r.add_argument("--timeout", type=float, default=400.0)
    r.add_argument("--out", type=Path, default=argparse.SUPPRESS)
    t = sub.add_parser("torchsrc")
    t.add_argument("--out", type=Path, default=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return {"bandwidth": bandwidth, "reach": reach, "torchsrc": torchsrc}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
