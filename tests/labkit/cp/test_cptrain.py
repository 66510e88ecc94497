"""labkit.cp.train and labkit.cp.run (``python -m labkit cp-train``).

PyTorch's context parallelism runs SDPA's CUDA kernels only: on a CPU these tests check the step
in one process, the attention contract context parallelism needs (SDPA with ``is_causal=True``
and no mask), the buffers torch shards in place (2 gloo processes), the command line, and the
whole context-parallel step, ``--check`` and training loop in 2 gloo processes, with the CPU
flash kernel standing in for the CUDA one (tests/cp_cpu_double.py). The ``gpu`` tests launch
torchrun on 2 GPUs.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from labkit.long import levers
from labkit.cp import cpu as cpcpu, train as cptrain
from labkit.cp.ring import _free_port

ENV = {**os.environ, "LABKIT_PROFILE": "cpu", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def tiny(n: int = 64, **kwargs):
    opts = dict(checkpointing=False, chunked_mlp=False, local_tokens=n) | kwargs
    return cptrain.build_model("tiny", n, torch.device("cpu"), **opts)


def test_batch_labels_are_next_tokens():
    ids, positions, labels = cptrain.make_batch(10, 256, torch.device("cpu"), seed=1)
    assert ids.shape == positions.shape == labels.shape == (1, 10)
    assert positions.tolist() == [list(range(10))]
    assert labels[0, :-1].tolist() == ids[0, 1:].tolist() and labels[0, -1] == -100


def test_attention_reaches_sdpa_causal_without_mask(monkeypatch):
    """Context parallelism shards SDPA only when it gets is_causal=True and no mask tensor."""
    calls, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        calls.append(dict(mask=attn_mask, **kwargs))
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    model, ids = tiny(), torch.randint(0, 256, (1, 64))
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)  # looked up at call time, as CP patches it
    logits = model(input_ids=ids, position_ids=torch.arange(64)[None]).logits
    assert len(calls) == model.config.n_layer
    assert all(c["mask"] is None and c["is_causal"] is True for c in calls)
    monkeypatch.undo()
    reference = cptrain.gpt2.build_model("tiny", attn_implementation="eager", n_positions=512)
    torch.testing.assert_close(logits, reference(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


def test_attention_refuses_a_mask():
    model = tiny()
    with pytest.raises(ValueError, match="unpadded"):
        model(input_ids=torch.randint(0, 256, (2, 8)), attention_mask=torch.tensor([[1] * 8, [0] + [1] * 7]))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_single_step_equals_lm_loss(checkpointing):
    """One process: the step's loss and gradients are lm_loss's (global mean over N-1 targets)."""
    model = tiny(checkpointing=checkpointing)
    batch = cptrain.make_batch(64, 256, torch.device("cpu"))
    loss = cptrain.loss_and_grads(model, batch, None, chunk_size=16, dtype=torch.float32)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    ref = levers.lm_loss(model, batch[0], chunk_size=16)
    ref.backward()
    assert loss == pytest.approx(ref.item(), rel=1e-6)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad)
    assert batch[0].shape == (1, 64)  # the caller's batch stays whole


def test_use_ring_sets_torchs_rotation_to_the_ring():
    """torch's context parallelism all-gathers K/V unless told otherwise; lk.cptrain sets the ring
    ("alltoall") before each context_parallel, and reports what is in effect."""
    from torch.distributed.tensor.experimental import _attention

    before = _attention._cp_options.rotate_method
    try:
        _attention.set_rotate_method("allgather")
        assert cptrain.rotate_method() == "allgather"
        assert cptrain.use_ring() == "alltoall" == cptrain.ROTATE_METHOD == cptrain.rotate_method()
    finally:
        _attention._cp_options.rotate_method = before


def test_use_ring_without_set_rotate_method_warns(monkeypatch):
    """A torch without set_rotate_method keeps its default: a warning, and the method in effect."""
    import builtins

    real_import = builtins.__import__

    def no_setter(name, globals=None, locals=None, fromlist=(), level=0):
        if name.endswith("experimental._attention") and fromlist and "set_rotate_method" in fromlist:
            raise ImportError("cannot import name 'set_rotate_method'")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", no_setter)
    with pytest.warns(UserWarning, match="set_rotate_method"):
        assert cptrain.use_ring() in ("alltoall", "allgather")


def _gloo_rank(rank: int, port: int, conn, work, args: tuple) -> None:
    """One of 2 forked gloo processes: ``work(mesh, *args)`` on a 1-D CPU mesh, its result sent back."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    result = work(init_device_mesh("cpu", (2,)), *args)
    conn.send_bytes(pickle.dumps(result))  # plain pickle: no tensor shared with a process that exits next
    dist.destroy_process_group()
    conn.close()
    os._exit(0)


def on_two_gloo_processes(work, *args, timeout: float = 180) -> list:
    """``work(mesh, *args)`` in 2 forked gloo processes (``work`` may be a test's function); results
    by rank, None for a rank that failed or timed out."""
    ctx, port = mp.get_context("fork"), _free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, pipes[r][1], work, args)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = [pickle.loads(pipe[0].recv_bytes()) if pipe[0].poll(timeout) else None for pipe in pipes]
    for proc in procs:
        proc.join(10)
    return results


def _shards(mesh) -> list[list]:
    from torch.distributed.tensor.experimental import _attention

    _attention.set_rotate_method("allgather")  # torch's default: sharded() must set the ring
    buffers = [t.clone() for t in cptrain.make_batch(16, 256, torch.device("cpu"), seed=3)]
    with cptrain.sharded(mesh, buffers):
        return [t.tolist() for t in buffers] + [cptrain.rotate_method()]


def test_sharded_buffers_keep_positions_and_labels_aligned():
    """torch shards ids, positions and labels alike (head-tail): every shard keeps global positions
    and each label is the token after its position."""
    shards = on_two_gloo_processes(_shards, timeout=60)
    ids = cptrain.make_batch(16, 256, torch.device("cpu"), seed=3)[0][0].tolist()
    assert [s[1][0] for s in shards] == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    assert [s[3] for s in shards] == ["alltoall", "alltoall"]  # K/V as a ring inside the context
    for s_ids, s_pos, s_labels, _ in shards:
        assert s_ids[0] == [ids[p] for p in s_pos[0]]
        assert s_labels[0] == [ids[p + 1] if p + 1 < 16 else -100 for p in s_pos[0]]


def _cp_steps(mesh, argv: list[str]) -> tuple:
    """Torch's context parallelism on CPU (lk.cpcpu), then the same step in this process alone:
    (cp (loss, grads), single (loss, grads), --check result, train rows of both ranks)."""
    from labkit.cp import run as cprun

    cpcpu.install()
    cpu, args = torch.device("cpu"), cprun.parser().parse_args(argv)
    model = tiny(args.seq_len, checkpointing=args.checkpointing, chunked_mlp=args.chunked_mlp,
                 local_tokens=args.seq_len // 2)
    batch = cptrain.make_batch(args.seq_len, 256, cpu)
    steps = {}
    for name, cp in (("cp", mesh), ("single", None)):
        loss = cptrain.loss_and_grads(model, batch, cp, chunk_size=args.chunk_size, dtype=torch.float32)
        steps[name] = loss, [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
    return steps["cp"], steps["single"], cprun.check(args, mesh, cpu), cprun._gather(cptrain.train(args, mesh, cpu), mesh)


@pytest.mark.parametrize("levers", [[], ["--checkpointing"], ["--checkpointing", "--chunked-mlp"]])
def test_context_parallel_step_on_two_cpu_processes(levers):
    """PyTorch's ring (gloo, lk.cpcpu's kernel standing in for the CUDA one) under labkit's step: the loss
    and gradients of 2 ranks equal one process's in fp32; --check passes; train reports both ranks."""
    argv = ["--size", "tiny", "--seq-len", "256", "--chunk-size", "64", "--steps", "2", *levers]
    results = on_two_gloo_processes(_cp_steps, argv)
    assert all(results), "a context-parallel worker failed or timed out"
    for (cp_loss, cp_grads), (loss, grads), check, rows in results:
        assert cp_loss == pytest.approx(loss, rel=1e-5)  # fp32; the ring merges partial results in fp32
        for g_cp, g in zip(cp_grads, grads):
            torch.testing.assert_close(g_cp, g, atol=1e-5, rtol=1e-4)
        assert check["ok"], check
        assert [r["rank"] for r in rows] == [0, 1] and all(r["local_tokens"] == 128 for r in rows)
        assert rows[0]["losses"] == rows[1]["losses"] and rows[0]["losses"][0] == pytest.approx(loss, rel=1e-5)
        assert all(r["rotate"] == "alltoall" and r["peak_gib"] is None for r in rows)  # no NaN: a CPU has no counter


def run_cli(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "labkit", "cp-train", *args], env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def test_cli_single_on_cpu(tmp_path):
    out = tmp_path / "r.json"
    done = run_cli("--single", "--size", "tiny", "--seq-len", "256", "--checkpointing", "--chunk-size", "64",
                   "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    assert row["world"] == 1 and row["N"] == 256 and len(row["losses"]) == 2
    assert row["losses"][1] < row["losses"][0]  # the first AdamW step lowered the loss on this sequence
    assert "tokens/s=" in done.stdout and row["predicted_gib"] > 0
    assert row["peak_gib"] is None and "peak=n/a" in done.stdout and "nan" not in done.stdout.lower()


def test_cli_context_parallel_on_cpu_processes(tmp_path):
    """Without GPUs, --nproc 2 runs torchrun with gloo: both ranks report, and the first step's loss
    (before any update) is the single process's."""
    rows = {}
    for mode in (["--single"], ["--nproc", "2"]):
        out = tmp_path / f"{len(mode)}.json"
        done = run_cli(*mode, "--size", "tiny", "--seq-len", "256", "--checkpointing", "--chunk-size", "64",
                       "--json", str(out))
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        rows[len(mode)] = json.loads(out.read_text())
    (single,), cp = rows[1], rows[2]
    assert [r["rank"] for r in cp] == [0, 1] and all(r["world"] == 2 and r["local_tokens"] == 128 for r in cp)
    assert cp[0]["losses"][0] == pytest.approx(single["losses"][0], rel=1e-5)


def test_cli_cpu_hides_the_gpus(monkeypatch):
    """--cpu: the command runs again with no GPU visible (so a one-GPU machine can run 2 CPU processes);
    launch(cpu=True) passes that environment and the flag, and prints the command."""
    from labkit.cp import run as cprun

    calls = []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(cprun.subprocess, "call", lambda cmd, env=None: calls.append((cmd, env)) or 0)
    assert cprun.main(["--nproc", "2", "--seq-len", "256", "--cpu"]) == 0
    ((cmd, env),) = calls
    assert cmd[cmd.index("cp-train") + 1:] == ["--nproc", "2", "--seq-len", "256", "--cpu"]
    assert env["CUDA_VISIBLE_DEVICES"] == ""

    class Done:
        returncode, stdout, stderr = 1, "", "boom"

    runs = []
    monkeypatch.setattr(cprun.subprocess, "run", lambda cmd, **kw: runs.append((cmd, kw)) or Done())
    with pytest.raises(RuntimeError, match="without a result"):
        cprun.launch(2, 256, "--size", "tiny", cpu=True)
    cmd, kw = runs[0]
    assert "--cpu" in cmd and kw["env"]["CUDA_VISIBLE_DEVICES"] == ""


def test_cli_asks_for_one_gpu_per_process(monkeypatch, capsys):
    from labkit.cp import run as cprun

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cprun.subprocess, "call", lambda *a, **k: pytest.fail("nothing may start"))
    with pytest.raises(SystemExit) as info:
        cprun.main(["--nproc", "2", "--seq-len", "256"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert info.value.code == 2 and "argument --nproc: 2 processes need one GPU each and this machine has 1" in err
    assert "--single" in err and "--cpu" in err
    assert cprun.parse(["--nproc", "2", "--seq-len", "256", "--cpu"]).nproc == 2, "--cpu: CPU processes instead"


@pytest.mark.parametrize("argv, rule", [
    (["--seq-len", "258", "--nproc", "2"], "multiple of 2*2 = 4"),  # 258 = 2*129: even, still not 4 equal chunks
    (["--seq-len", "100", "--nproc", "4", "--cpu"], "multiple of 2*4 = 8"),
    (["--seq-len", "64", "--check", "--nproc", "1"], "--nproc 2 or more"),
])
def test_cli_refuses_a_length_the_load_balancer_cannot_split(argv, rule, monkeypatch, capsys):
    """Context parallelism cuts the sequence into 2 equal chunks per process (head-tail load balancing):
    a length that is no multiple of 2P is refused before torchrun starts (it used to abort a gloo rank)."""
    from labkit.cp import run as cprun

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(cprun.subprocess, "call", lambda *a, **k: pytest.fail("nothing may start"))
    with pytest.raises(SystemExit) as info:
        cprun.main(argv)
    assert info.value.code == 2 and rule in capsys.readouterr().err.strip().splitlines()[-1]


def test_cli_any_length_for_one_process_and_torchruns_world_for_a_worker(monkeypatch):
    """One process has no load balancer: any length >= 2. A torchrun worker (whose --nproc was dropped)
    checks the length against torchrun's world size."""
    from labkit.cp import run as cprun

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert cprun.parse(["--seq-len", "257", "--single"]).seq_len == 257
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cprun.parse(["--seq-len", "256", "--check"]).check
    with pytest.raises(SystemExit):
        cprun.parse(["--seq-len", "258"])


def test_install_refuses_a_machine_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="without a GPU"):
        cpcpu.install()


def _two_gpus() -> bool:
    return torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 GPUs")
def test_check_on_two_gpus(tmp_path):
    """Context-parallel attention (forward, gradients) and a GPT-2 small step equal one GPU's (2x rule)."""
    out = tmp_path / "check.json"
    done = run_cli("--nproc", "2", "--seq-len", "16384", "--check", "--json", str(out), timeout=600)
    rows = json.loads(out.read_text())
    assert done.returncode == 0 and all(r["ok"] for r in rows), json.dumps(rows, indent=1)


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 GPUs")
def test_two_gpus_train_with_one_gpus_loss(tmp_path):
    rows = {}
    for mode in (["--single"], ["--nproc", "2"]):
        out = tmp_path / f"{len(mode)}.json"
        done = run_cli(*mode, "--seq-len", "32768", "--checkpointing", "--json", str(out), timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        rows[len(mode)] = json.loads(out.read_text())
    single, cp = rows[1][0], rows[2]
    assert [r["rank"] for r in cp] == [0, 1] and cp[0]["local_tokens"] == 16384
    assert cp[0]["losses"][0] == pytest.approx(single["losses"][0], rel=2e-3)
    assert all(r["peak_gib"] < single["peak_gib"] for r in cp)


def test_two_nodes_of_one_cpu_process_each(tmp_path):
    """Several machines: the same command on each, meeting at torchrun's c10d rendezvous (here 2 "nodes"
    on this machine, 1 gloo process each): --check passes over the 2 nodes' ranks, rank 0 reports."""
    from labkit.cp.ring import _free_port

    endpoint = f"127.0.0.1:{_free_port()}"
    outs = [tmp_path / f"node{i}.json" for i in range(2)]
    nodes = [subprocess.Popen([sys.executable, "-m", "labkit", "cp-train", "--nproc", "1", "--nnodes", "2",
                               "--rdzv-endpoint", endpoint, "--size", "tiny", "--seq-len", "256", "--chunk-size", "64",
                               "--check", "--json", str(out)], env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for out in outs]
    logs = [node.communicate(timeout=150)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(log[-2000:] for log in logs)
    assert any("--rdzv-backend=c10d" in log and "--nnodes=2" in log for log in logs)
    (rows,) = [json.loads(out.read_text()) for out in outs if out.exists()]  # global rank 0's node writes it
    assert [r["rank"] for r in rows] == [0, 1] and all(r["world"] == 2 and r["ok"] for r in rows), rows


def test_several_nodes_need_a_rendezvous(monkeypatch, capsys):
    from labkit.cp import run as cprun

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(cprun.subprocess, "call", lambda *a, **k: pytest.fail("nothing may start"))
    with pytest.raises(SystemExit) as info:
        cprun.main(["--nproc", "2", "--nnodes", "2", "--seq-len", "256", "--cpu"])
    assert info.value.code == 2 and "--rdzv-endpoint HOST:PORT" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # 2 nodes x 2 processes = 4 ranks: the length must split into 8 chunks
        cprun.parse(["--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", "h:1", "--seq-len", "260"])


def _variants(mesh) -> dict:
    """One step's loss under each setting cp-train can time, and alone (fp32, lk.cpcpu's kernel)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    cpcpu.install()
    model, batch = tiny(256, local_tokens=128), cptrain.make_batch(256, 256, torch.device("cpu"))
    run = dict(chunk_size=64, dtype=torch.float32)
    out = {"alone": cptrain.loss_and_grads(model, batch, None, **run),
           "contiguous_allgather": cptrain.loss_and_grads(model, batch, mesh, rotate="allgather", load_balance=False, **run),
           "no_transfer": cptrain.loss_and_grads(model, batch, mesh, transfer=False, **run)}
    out["restored"] = (_attention._cp_options.enable_load_balance, _attention._create_rotater.__name__)
    return out


def test_timing_variants_load_balance_rotation_and_no_transfer():
    """Contiguous shards and torch's all-gather give one process's loss; without K/V transfer (timing
    only) the loss differs; torch's options and rotater are restored afterwards."""
    results = on_two_gloo_processes(_variants, timeout=90)
    assert all(results), "a gloo rank failed or timed out"
    for r in results:
        assert r["contiguous_allgather"] == pytest.approx(r["alone"], rel=1e-5)
        assert r["no_transfer"] != pytest.approx(r["alone"], rel=1e-5)
        assert r["restored"] == (True, "_create_rotater")
