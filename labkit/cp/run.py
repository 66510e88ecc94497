"""``python -m labkit cp-train``: launch, check and report GPT-2 context-parallel training.

- :func:`main`: the command. With ``--nproc P`` > 1 outside ``torchrun`` it starts itself as
  ``python -m torch.distributed.run --standalone --nproc-per-node P -m labkit cp-train ...``
  (with ``--nnodes M --rdzv-endpoint host:port``: ``--nnodes M --rdzv-backend c10d`` instead of
  ``--standalone``, run the same command on each of the M machines). It runs under any other
  ``torchrun`` launch too, one machine or several: the world is torchrun's (``WORLD_SIZE``, ``RANK``,
  ``LOCAL_RANK``; each rank takes its node's GPU ``LOCAL_RANK``). Under ``torchrun`` each rank joins
  the process group (NCCL on GPUs; gloo on CPU processes, see :mod:`labkit.cp.cpu`) and a 1-D device
  mesh over every rank of every node, then
  trains (:func:`lk.cptrain.train <labkit.cp.train.train>`) or, with ``--check``, compares with one GPU.
- :func:`parse`: the options, checked before anything starts (argparse's one line, exit status 2):
  with P processes the length must split into 2P equal chunks (head-tail load balancing), ``--check``
  needs 2 or more, and each process a GPU where GPUs are used.
- :func:`check_attention`: context-parallel SDPA forward and gradients vs single-GPU SDPA.
- :func:`check_step`: a GPT-2 step's loss and gradients under context parallelism vs one GPU.
- :func:`launch`: run the command from Python (a notebook) and return its JSON result.

``--cpu`` runs CPU processes (gloo) on a machine with GPUs too: the command starts itself again
with no GPU visible (``CUDA_VISIBLE_DEVICES=""``), so a one-GPU machine can run the two-process
comparison that otherwise needs two GPUs.

Both checks use the 2x rule: the bf16 result's error against fp32 on one GPU may be at most
twice the error of plain bf16 on one GPU (the loss also passes within 0.1% of the fp32 loss).

Used in: 07_context_parallel.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.core import cliargs as ca
from labkit.core import profiles
from labkit.cp import cpu as cpcpu, train as cptrain


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit cp-train", description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=ca.integer(2, 4096), required=True,
                   help="tokens in the one training sequence (with --nproc P: a multiple of 2P)")
    p.add_argument("--nproc", type=ca.integer(1, 2), default=None,
                   help="processes (GPUs) to start through torchrun, on each machine")
    p.add_argument("--nnodes", type=ca.integer(1, 2), default=1,
                   help="machines taking part (run the same command on each; needs --rdzv-endpoint)")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="with --nnodes: torchrun's c10d rendezvous, a host:port every machine reaches")
    p.add_argument("--single", action="store_true", help="one process, no context parallelism (the baseline)")
    p.add_argument("--steps", type=ca.integer(1, 2), default=2, help="optimizer steps; the last is timed (default 2)")
    p.add_argument("--checkpointing", action="store_true", help="recompute each block in the backward")
    p.add_argument("--chunked-mlp", action="store_true", help="each block's MLP in checkpointed chunks")
    p.add_argument("--chunk-size", type=ca.integer(1, 4096), default=4096, help="positions per chunk of the loss")
    p.add_argument("--size", default="small", choices=list(cptrain.gpt2.SIZES), help="GPT-2 size")
    p.add_argument("--seed", type=ca.integer(0, 0), default=0)
    p.add_argument("--check", action="store_true", help="compare attention and a step with one GPU instead")
    p.add_argument("--rotate", default=cptrain.ROTATE_METHOD, choices=["alltoall", "allgather"],
                   help="how K/V move: alltoall = the ring, hop by hop (default); allgather = torch's default")
    p.add_argument("--no-load-balance", action="store_true",
                   help="contiguous shards instead of torch's head-tail order (per-rank step times show why)")
    p.add_argument("--no-comm", action="store_true",
                   help="timing only: every ring step on the rank's own K/V, nothing sent (wrong loss)")
    p.add_argument("--cpu", action="store_true", help="CPU processes (gloo) even where GPUs exist: the GPUs are hidden")
    p.add_argument("--json", type=ca.out_file("build/cp.json"), default=None,
                   help="write rank 0's result (all ranks) here")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    """The options, checked together before anything starts (argparse's one-line error, exit status 2)."""
    p = parser()
    args = p.parse_args(argv)
    launched = "LOCAL_RANK" in os.environ  # a torchrun worker: the world is torchrun's (--nproc was dropped)
    world = 1 if args.single else int(os.environ.get("WORLD_SIZE", 1)) if launched else (args.nproc or 1) * args.nnodes
    if args.nnodes > 1 and not launched and (args.rdzv_endpoint is None or ":" not in args.rdzv_endpoint):
        p.error("argument --nnodes: several machines meet at a c10d rendezvous: give --rdzv-endpoint HOST:PORT "
                "(a port on one of them that every machine reaches), e.g. --rdzv-endpoint node0:29500")
    if args.check and (args.no_comm or args.no_load_balance or args.rotate != cptrain.ROTATE_METHOD):
        p.error("--check compares torch's ring as cp-train trains with it: leave out --no-comm, --no-load-balance, --rotate")
    if args.check and world < 2:
        p.error("--check compares context parallelism with one GPU: give --nproc 2 or more (without --single)")
    step = 2 * world  # the load balancer cuts the sequence into 2 equal chunks per process
    if world > 1 and args.seq_len % step:
        p.error(f"argument --seq-len: with {world} processes it must be a multiple of 2*{world} = {step} "
                f"(2 equal chunks per process); got {args.seq_len}, e.g. {max(step, args.seq_len // step * step)}")
    here = world // args.nnodes  # processes on this machine
    if world > 1 and not launched and not args.cpu and torch.cuda.is_available() and torch.cuda.device_count() < here:
        p.error(f"argument --nproc: {here} processes need one GPU each and this machine has "
                f"{torch.cuda.device_count()}; use --single for the one-GPU baseline or --cpu for CPU processes")
    return args


LAUNCH_OPTIONS = ("--nproc", "--nnodes", "--rdzv-endpoint")  # torchrun's, dropped from the workers' command


def _relaunch(argv: list[str], nproc: int, nnodes: int = 1, endpoint: str | None = None) -> int:
    """This command under torchrun with ``nproc`` processes on this machine (``--nproc`` dropped);
    with ``nnodes`` > 1, one of ``nnodes`` machines meeting at the c10d rendezvous ``endpoint``."""
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in LAUNCH_OPTIONS:
            skip = True
        elif not arg.startswith(tuple(f"{o}=" for o in LAUNCH_OPTIONS)):
            rest.append(arg)
    where = (["--standalone"] if nnodes == 1 else
             [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=labkit-cp-train"])
    cmd = [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc-per-node={nproc}",
           "-m", "labkit", "cp-train", *rest]
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def _setup(single: bool):
    """(mesh or None, device): join torchrun's group and build a 1-D mesh, or one process alone.

    On GPUs: NCCL, one GPU per rank. Without CUDA: gloo on CPU processes, with :mod:`labkit.cp.cpu`'s
    CPU kernel standing in for the CUDA one PyTorch's ring attention calls.
    """
    distributed = "LOCAL_RANK" in os.environ and not single
    profiles.apply_cap(int(os.environ.get("LOCAL_RANK", 0)))   # LABKIT_GPU_MEMORY_GB caps this process too
    if not distributed:
        return None, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from torch.distributed.device_mesh import init_device_mesh

    if not torch.cuda.is_available():
        cpcpu.install()
        dist.init_process_group("gloo")
        return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",)), torch.device("cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return init_device_mesh("cuda", (dist.get_world_size(),), mesh_dim_names=("cp",)), device


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if args.cpu and os.environ.get("CUDA_VISIBLE_DEVICES") != "":  # this process may have seen the GPUs already
        return subprocess.call([sys.executable, "-m", "labkit", "cp-train", *argv], env=_cpu_env())
    if ((args.nproc or 1) * args.nnodes > 1 and not args.single and "LOCAL_RANK" not in os.environ):
        return _relaunch(argv, args.nproc or 1, args.nnodes, args.rdzv_endpoint)
    mesh, device = _setup(args.single)
    try:
        result = check(args, mesh, device) if args.check else cptrain.train(args, mesh, device)
        rows = _gather(result, mesh)
    finally:
        if mesh is not None:
            dist.destroy_process_group()
    if mesh is None or _rank() == 0:
        _report(rows, args)
    code = 0 if all(row.get("ok", True) for row in rows) else 1
    if mesh is not None:  # a torchrun worker, done and reported: leave without C++ static teardown,
        sys.stdout.flush()  # where a gloo rank on CPU sometimes aborted ("terminate called without
        sys.stderr.flush()  # an active exception", SIGABRT) after a good step: about 1 run in 16 here
        os._exit(code)
    return code


def _cpu_env() -> dict[str, str]:
    """This environment with no GPU visible (for ``--cpu``)."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _gather(result: dict, mesh) -> list[dict]:
    """Every rank's result on every rank (a list in rank order)."""
    if mesh is None:
        return [result]
    rows = [None] * mesh.size()
    dist.all_gather_object(rows, result)
    return rows


def _report(rows: list[dict], args) -> None:
    """Print one line per rank (rank 0 only) and write ``--json``."""
    if args.check:
        for row in rows:
            print(json.dumps(row))
    else:
        for r in rows:
            peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.2f} GiB"  # None: a CPU keeps no peak counter
            ring = f" K/V by {r['rotate']}" if r.get("rotate") else ""
            ring += "" if r.get("load_balance", True) else ", contiguous shards"
            ring += "" if r.get("transfer", True) else ", nothing sent (timing only)"
            print(f"rank {r['rank']}/{r['world']}: N={r['N']:,} local={r['local_tokens']:,} loss={r['losses'][-1]:.4f} "
                  f"step={r['step_s']:.2f} s tokens/s={r['tokens_per_s']:,.0f} peak={peak} "
                  f"model={r['predicted_gib']:.2f} GiB ({r['device']}{ring})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


def launch(nproc: int, seq_len: int, *options: str, cpu: bool = False, verbose: bool = False,
           timeout: float = 600.0) -> list[dict]:
    """Run ``python -m labkit cp-train`` with ``nproc`` processes (1: ``--single``); its rows per rank.

    ``options`` are further command-line flags (e.g. ``"--checkpointing"``); ``cpu``: CPU processes
    (gloo) with the GPUs hidden (``--cpu``). Prints the command, and the command's own report only
    with ``verbose`` or when it fails. Raises RuntimeError if the command fails.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        mode = ["--single"] if nproc == 1 else ["--nproc", str(nproc)]
        args = ["--seq-len", str(seq_len), *mode, *options, *(["--cpu"] if cpu else [])]
        print("$ python -m labkit cp-train", " ".join(args), flush=True)
        done = subprocess.run([sys.executable, "-m", "labkit", "cp-train", *args, "--json", str(out)],
                              timeout=timeout, capture_output=True, text=True, env=_cpu_env() if cpu else None)
        if verbose or done.returncode or not out.exists():
            print(done.stdout[-4000:], done.stderr[-2000:] if done.returncode else "", sep="\n")
        if not out.exists():
            raise RuntimeError(f"cp-train exited with status {done.returncode} without a result.")
        return json.loads(out.read_text())


def _sdpa_fwd_bwd(q, k, v, do) -> list[torch.Tensor]:
    """[o, dq, dk, dv] of causal SDPA; q, k, v, do [1, H, n, D] plain tensors (leaves made here)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    o.backward(do)
    return [o.detach(), q.grad, k.grad, v.grad]


def check_attention(mesh, device: torch.device, n: int, *, heads: int = 12, dim: int = 64, seed: int = 0) -> dict:
    """Context-parallel causal SDPA (bf16) vs one GPU: max abs error of o, dq, dk, dv against fp32.

    Every rank computes the single-GPU results on the whole sequence; the inputs and those results
    are then sharded as buffers of one context (so the shards line up), and the ring's results are
    compared shard by shard (max over ranks).
    """
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(1, heads, n, dim, generator=gen).to(device) for _ in range(4)]  # q, k, v, do (fp32)
    ref = _sdpa_fwd_bwd(*full)
    low = [t.bfloat16() for t in full]
    base = _sdpa_fwd_bwd(*low)
    buffers = [t.clone() for t in low + ref + base]
    with cptrain.sharded(mesh, buffers, seq_dim=2):
        ring = _sdpa_fwd_bwd(*buffers[:4])
    names, out = ("o", "dq", "dk", "dv"), {}
    for name, r, ref_s, base_s in zip(names, ring, buffers[4:8], buffers[8:]):
        errs = torch.stack([(r.float() - ref_s).abs().max(), (base_s.float() - ref_s).abs().max()])
        dist.all_reduce(errs, op=dist.ReduceOp.MAX, group=mesh.get_group())
        out[name] = dict(cp_err=errs[0].item(), single_bf16_err=errs[1].item(), ok=bool(errs[0] <= 2 * errs[1]))
    return out


def check_step(args, mesh, device: torch.device) -> dict:
    """One GPT-2 step (forward and backward) on ``args.seq_len`` tokens: fp32 and bf16 on one GPU,
    bf16 under context parallelism; loss and gradients (relative L2 over all parameters) vs fp32."""
    n = args.seq_len
    model = cptrain.build_model(args.size, n, device, checkpointing=args.checkpointing, chunked_mlp=args.chunked_mlp,
                                local_tokens=-(-n // mesh.size()), seed=args.seed)
    batch, runs = cptrain.make_batch(n, model.config.vocab_size, device, args.seed), {}
    for name, cp, dtype in (("fp32", None, torch.float32), ("single", None, torch.bfloat16),
                            ("cp", mesh, torch.bfloat16)):
        loss = cptrain.loss_and_grads(model, batch, cp, chunk_size=args.chunk_size, dtype=dtype)
        runs[name] = loss, torch.cat([p.grad.flatten().float() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    (ref, g_ref), (single, g_single), (cp, g_cp) = runs["fp32"], runs["single"], runs["cp"]
    grad_err = [((g - g_ref).norm() / g_ref.norm()).item() for g in (g_cp, g_single)]
    return dict(loss_fp32=ref, loss_single_bf16=single, loss_cp_bf16=cp,
                loss_ok=abs(cp - ref) <= 2 * abs(single - ref) + 1e-3 * abs(ref),
                grad_rel_err_cp=grad_err[0], grad_rel_err_single_bf16=grad_err[1], grad_ok=grad_err[0] <= 2 * grad_err[1])


def check(args, mesh, device: torch.device) -> dict:
    """``--check``: :func:`check_attention` and :func:`check_step` at ``args.seq_len``; ``ok`` if all pass."""
    attention, step = check_attention(mesh, device, args.seq_len, seed=args.seed), check_step(args, mesh, device)
    ok = all(v["ok"] for v in attention.values()) and step["loss_ok"] and step["grad_ok"]
    return dict(rank=dist.get_rank(), world=mesh.size(), N=args.seq_len, attention=attention, step=step, ok=ok)
