"""Tests for labkit.engine.bench: the FLOP model, the attention sweep and auto vs the fastest backend."""
from __future__ import annotations

import time

import pandas as pd
import pytest
import torch

import labkit as lk

B_ = lk.bench
DOC_COLUMNS = ["backend", "B", "H", "N", "D", "causal", "mode", "status", "ms", "ms_p20", "ms_p80",
               "tflops", "extra_mib", "max_err", "first_call_s", "device", "dtype"]


def test_tflops():
    assert B_.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert B_.tflops(1e9, 1.0) == pytest.approx(1.0)


def test_matmul_peak_and_copy_bandwidth_on_cpu():
    assert 0 < B_.matmul_peak_tflops(device="cpu", dtype=torch.float32, n=64) < 100
    assert 0 < B_.copy_bandwidth(device="cpu", mib=1) < 1e13


# ----------------------------------------------------------------------------- FLOP model and configs

def test_flops_formula():
    flops = lk.attention.flops
    assert flops(2, 3, 128, 64) == 4 * 2 * 3 * 128 * 128 * 64
    assert flops(2, 3, 128, 64, causal=True) == 2 * 2 * 3 * 128 * 128 * 64
    assert flops(2, 3, 128, 64, mode="fwd_bwd") == 3.5 * 4 * 2 * 3 * 128 * 128 * 64
    assert flops(1, 1, 16, 8, causal=True, mode="fwd_bwd") == 3.5 * 2 * 16 * 16 * 8
    assert flops(1, 2, 16, 8, nk=48) == 4 * 2 * 16 * 48 * 8


@pytest.mark.parametrize("mode", ["bwd", "forward", ""])
def test_flops_bad_mode(mode):
    with pytest.raises(ValueError, match="mode must be 'fwd' or 'fwd_bwd'"):
        lk.attention.flops(1, 1, 16, 8, mode=mode)


def test_fixed_token_configs():
    cfgs = B_.fixed_token_configs([128, 256, 512], [32, 64], tokens=1024, width=256)
    assert [(c["N"], c["D"]) for c in cfgs] == [(128, 32), (256, 32), (512, 32), (128, 64), (256, 64), (512, 64)]
    for c in cfgs:
        assert set(c) == {"B", "H", "N", "D"}
        assert c["B"] * c["N"] == 1024 and c["H"] * c["D"] == 256
    # Never zero: a sequence longer than the token budget still gets one batch element.
    assert B_.fixed_token_configs([4096], [512], tokens=1024, width=256) == [dict(B=1, H=1, N=4096, D=512)]


@pytest.mark.parametrize("layout,shape", [("bhnd", (2, 3, 5, 4)), ("bnhd", (2, 5, 3, 4))])
def test_attention_inputs_seeded(layout, shape):
    a = B_.attention_inputs(2, 3, 5, 4, layout=layout, dtype=torch.float32, seed=1)
    b = B_.attention_inputs(2, 3, 5, 4, layout=layout, dtype=torch.float32, seed=1)
    c = B_.attention_inputs(2, 3, 5, 4, layout=layout, dtype=torch.float32, seed=2)
    assert all(t.shape == shape for t in a)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[0], a[1])
    g = B_.attention_inputs(1, 1, 2, 2, dtype=torch.bfloat16, requires_grad=True)
    assert all(t.requires_grad and t.is_leaf and t.dtype == torch.bfloat16 for t in g)


# ----------------------------------------------------------------------------- attention_sweep

SMALL = B_.fixed_token_configs([32, 64], [16], tokens=128, width=32)  # 2 configs: B=4/2, H=2, D=16


def _sweep(**kw):
    kw.setdefault("dtype", torch.float32)
    return B_.attention_sweep(SMALL, device="cpu", target_ms=1, progress=False, **kw)


def test_attention_sweep_cpu_default_backends():
    df = _sweep()
    assert list(df.columns) == DOC_COLUMNS
    assert set(df["backend"]) == {"reference", "sdpa_math", "sdpa_flash", "auto"}, "what runs on CPU, plus auto"
    n_backends = df["backend"].nunique()
    assert len(df) == len(SMALL) * 2 * 2 * n_backends
    keys = ["B", "H", "N", "D", "causal", "mode", "backend"]
    assert not df.duplicated(keys).any(), "one row per (config, causal, mode, backend)"
    assert (df["status"] == "ok").all(), df.loc[df["status"] != "ok", ["backend", "status"]]
    assert set(df["mode"]) == {"fwd", "fwd_bwd"} and set(df["causal"]) == {False, True}
    assert (df["ms_p20"] <= df["ms"]).all() and (df["ms"] <= df["ms_p80"]).all() and (df["ms"] > 0).all()
    assert (df["tflops"] > 0).all() and (df["max_err"] < 1e-5).all()  # fp32 vs fp32 reference
    assert df["extra_mib"].isna().all(), "no allocator statistics on a CPU"
    assert (df["first_call_s"] > 0).all() and (df["first_call_s"] < 60).all()
    assert (df["device"] == lk.env.device_info("cpu").name).all() and (df["dtype"] == "float32").all()
    row = df[(df["N"] == 64) & (df["causal"]) & (df["mode"] == "fwd_bwd")].iloc[0]
    flop = lk.attention.flops(row["B"], row["H"], 64, 16, causal=True, mode="fwd_bwd")
    assert row["tflops"] == pytest.approx(B_.tflops(flop, row["ms"]))


def test_attention_sweep_records_unsupported_rows():
    df = _sweep(backends=["sdpa_cudnn", "sdpa_math"], modes=("fwd",))
    assert len(df) == len(SMALL) * 2 * 2
    bad, good = df[df["backend"] == "sdpa_cudnn"], df[df["backend"] == "sdpa_math"]
    assert bad["status"].str.startswith("unsupported: ").all() and bad["status"].str.contains("CUDA").all()
    assert bad["ms"].isna().all() and (good["status"] == "ok").all()


def test_attention_sweep_with_no_row_that_ran_keeps_the_columns():
    df = _sweep(backends=["flash_attn"], causal=(True,), modes=("fwd",))
    assert list(df.columns) == DOC_COLUMNS and len(df) == len(SMALL)
    assert df["status"].str.startswith("unsupported").all() and df["tflops"].isna().all()


def _failing_run(monkeypatch, backend: str, error: BaseException):
    """Make one backend's kernel call raise ``error``; the others run for real."""
    def run(*args, **kw):
        raise error

    monkeypatch.setitem(lk.kernels.RUNNERS, backend, run)
    monkeypatch.setattr(lk.attention, "_PLANS", {})  # plans built before hold the real kernel


def test_attention_sweep_oom_row_and_continues(monkeypatch):
    _failing_run(monkeypatch, "sdpa_math", torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB"))
    freed = []
    real_free = B_.free_memory
    monkeypatch.setattr(B_, "free_memory", lambda: freed.append(1) or real_free())
    df = _sweep(backends=["sdpa_math", "reference"], causal=(False,))
    assert len(df) == len(SMALL) * 2 * 2, "the sweep goes on after an out-of-memory row"
    assert (df.loc[df["backend"] == "sdpa_math", "status"] == "oom").all()
    assert (df.loc[df["backend"] == "reference", "status"] == "ok").all()
    assert df.loc[df["status"] == "oom", "ms"].isna().all()
    n_failed = int((df["status"] != "ok").sum())
    assert len(freed) >= n_failed, "memory is freed after every failed row"


@pytest.mark.parametrize("error,status", [
    (RuntimeError("CUDA error: an illegal memory access\nmore detail"), "error: CUDA error: an illegal memory access"),
    (ImportError("backend 'flash_attn' needs a package that is not installed"), "unsupported: backend 'flash_attn'"),
])
def test_attention_sweep_other_errors_are_rows(monkeypatch, error, status):
    _failing_run(monkeypatch, "sdpa_flash", error)
    df = _sweep(backends=["sdpa_flash", "sdpa_math"], causal=(False,), modes=("fwd",))
    assert len(df) == len(SMALL) * 2
    assert df.loc[df["backend"] == "sdpa_flash", "status"].str.startswith(status).all()
    assert (df.loc[df["backend"] == "sdpa_math", "status"] == "ok").all()


# ----------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flash_attn", "fa4"])
def test_peak_memory_reference_vs_flash(backend, make_qkv):
    B, H, N, D, dtype = 1, 8, 4096, 64, torch.bfloat16
    reason = lk.attention.why_not(backend, device="cuda", dtype=dtype, head_dim=D, causal=False, backward=False)
    if reason:
        pytest.skip(f"{backend} does not run here: {reason}")
    q, k, v = make_qkv(B, H, N, D, dtype=dtype, device="cuda", layout=lk.attention.native_layout(backend))
    layout = lk.attention.native_layout(backend)
    scores_bytes = B * H * N * N * 2  # one bf16 N x N score matrix per head
    out_bytes = B * H * N * D * 2  # the output, which every backend allocates

    def run(name):
        return lambda: lk.attention.attention(q, k, v, backend=name, layout=layout, nan_policy="ignore")

    with torch.no_grad():
        run(backend)()  # warm-up: lazy workspaces and JIT compilation are not per-call memory
        ref = B_.peak_memory(run("reference"), device="cuda")
        flash = B_.peak_memory(run(backend), device="cuda")
    mib = 2**20
    assert ref >= scores_bytes, f"reference extra {ref / mib:.1f} MiB < one score matrix {scores_bytes / mib:.1f} MiB"
    # Beyond its output, a flash kernel's extra memory is O(N) (the lse), not O(N^2).
    assert flash - out_bytes < 0.01 * scores_bytes, \
        f"{backend} extra {flash / mib:.2f} MiB (output {out_bytes / mib:.2f} MiB); scores {scores_bytes / mib:.0f} MiB"


@pytest.mark.gpu
def test_attention_sweep_cuda_smoke():
    cfgs = B_.fixed_token_configs([256], [64], tokens=1024, width=512)
    df = B_.attention_sweep(cfgs, backends=["sdpa_math", "sdpa_efficient"], causal=(True,), modes=("fwd",),
                            dtype=torch.bfloat16, device="cuda", target_ms=5, progress=False)
    assert (df["status"] == "ok").all(), df["status"]
    assert (df["extra_mib"] > 0).all() and (df["tflops"] > 0).all() and (df["max_err"] < 0.05).all()


def test_auto_vs_best():
    import pandas as pd

    rows = [dict(backend=b, D=64, causal=c, N=n, mode="fwd", status=s, tflops=t)
            for c, n, b, s, t in [(False, 128, "sdpa_math", "ok", 2.0), (False, 128, "sdpa_flash", "ok", 4.0),
                                  (False, 128, "auto", "ok", 3.8), (False, 128, "reference", "oom", float("nan")),
                                  (True, 128, "sdpa_math", "ok", 1.0)]]  # no auto row: left out
    gap = B_.auto_vs_best(pd.DataFrame(rows))
    assert len(gap) == 1
    row = gap.iloc[0]
    assert (row["best"], row["best_tflops"], row["auto_tflops"]) == ("sdpa_flash", 4.0, 3.8)
    assert row["auto_over_best"] == pytest.approx(0.95)


def test_attention_sweep_measures_custom_implementations_up_to_their_max_n():
    def mine(q, k, v, causal):
        return lk.attention.reference_attention(q, k, v, causal=causal)[0]

    def unfinished(q, k, v, causal):
        raise NotImplementedError

    configs = lk.bench.fixed_token_configs([32, 64], [16], tokens=64, width=32)
    df = lk.bench.attention_sweep(configs, backends=["sdpa_math"], custom={"mine": mine, "todo": unfinished},
                                  custom_max_n=32, modes=("fwd",), causal=(True,), dtype=torch.float32,
                                  device="cpu", target_ms=1, progress=False)
    assert sorted(df[df["backend"] == "mine"]["N"]) == [32]          # N=64 > custom_max_n: not run
    assert (df[df["backend"] == "mine"]["status"] == "ok").all()
    assert float(df[df["backend"] == "mine"]["max_err"].iloc[0]) < 1e-5
    assert (df[df["backend"] == "todo"]["status"] == "not implemented").all()
    assert len(df[df["backend"] == "sdpa_math"]) == 2


def test_attention_sweep_first_call_holds_what_a_new_shape_costs_once():
    """A backend that spends 0.2 s on the first call of each shape (a compile) shows it in first_call_s, not in ms."""
    seen = set()

    def compiles_once(q, k, v, causal):
        if q.shape not in seen:
            seen.add(q.shape)
            time.sleep(0.2)
        return lk.attention.reference_attention(q, k, v, causal=causal)[0]

    df = lk.bench.attention_sweep(SMALL, backends=["sdpa_math"], custom={"jit": compiles_once}, modes=("fwd",),
                                  causal=(False,), dtype=torch.float32, device="cpu", target_ms=1, progress=False)
    jit, plain = df[df["backend"] == "jit"], df[df["backend"] == "sdpa_math"]
    assert (jit["first_call_s"] >= 0.2).all() and (jit["ms"] < 100).all(), jit
    assert (plain["first_call_s"] < 0.2).all() and len(jit) == len(SMALL)


def test_attention_sweep_times_the_backends_of_one_configuration_in_turns():
    order = []

    def tracked(name):
        def fn(q, k, v, causal):
            order.append(name)
            time.sleep(0.001)
            return lk.attention.reference_attention(q, k, v, causal=causal)[0]
        return fn

    configs = lk.bench.fixed_token_configs([16], [8], tokens=16, width=16)
    df = lk.bench.attention_sweep(configs, backends=[], custom={"a": tracked("a"), "b": tracked("b")},
                                  modes=("fwd",), causal=(False,), dtype=torch.float32, device="cpu",
                                  target_ms=20, progress=False)
    runs = [name for i, name in enumerate(order) if i == 0 or order[i - 1] != name]  # collapse repeats
    assert runs[-4:] in (["a", "b", "a", "b"], ["b", "a", "b", "a"]), "the backends take turns to the end"
    assert (df["status"] == "ok").all() and df["ms"].notna().all()


def test_attention_sweep_times_a_slow_call_by_its_estimate():
    order = []

    def tracked(name, sleep_s):
        def fn(q, k, v, causal):
            order.append(name)
            time.sleep(sleep_s)
            return lk.attention.reference_attention(q, k, v, causal=causal)[0]
        return fn

    configs = lk.bench.fixed_token_configs([16], [8], tokens=16, width=16)
    df = lk.bench.attention_sweep(configs, backends=[], custom={"fast": tracked("fast", 0), "slow": tracked("slow", 0.01)},
                                  modes=("fwd",), causal=(False,), dtype=torch.float32, device="cpu",
                                  target_ms=30, progress=False)
    timed_slow = order.count("slow") - 2  # minus the error check and the memory probe
    assert timed_slow == 2 + lk.bench.MIN_REPS, "warm-up and the MIN_REPS estimate calls, no more"
    assert order.count("fast") > timed_slow + 2, "the fast backend goes on to fill its budget"
    assert (df["status"] == "ok").all()
    slow_row = df[df["backend"] == "slow"].iloc[0]
    assert 10 <= slow_row["ms"] < 60 and slow_row["ms_p20"] <= slow_row["ms"] <= slow_row["ms_p80"]


@pytest.mark.parametrize("choice, layout", [("fa4", "bnhd"), ("flash_attn", "bnhd"), ("sdpa_cudnn", "bhnd")])
def test_auto_is_benchmarked_in_the_layout_of_the_backend_it_picks(monkeypatch, choice, layout):
    monkeypatch.setattr(lk.attention, "auto_choice", lambda q, k, v, causal=False: choice)
    cfg = dict(B=1, H=2, N=8, D=4)
    _, q, _, _, got = B_._attention_call("auto", cfg, causal=False, mode="fwd", dtype=torch.float32, device="cpu")
    assert got == layout
    assert q.shape == ((1, 8, 2, 4) if layout == "bnhd" else (1, 2, 8, 4))


def test_forward_backward_call_times_the_gradients_without_accumulating_them():
    cfg = dict(B=1, H=2, N=16, D=8)
    call, q, k, v, _ = B_._attention_call("sdpa_math", cfg, causal=True, mode="fwd_bwd", dtype=torch.float32,
                                          device="cpu")
    seen = []
    q.register_hook(lambda g: seen.append(g.clone()))
    call(), call()
    assert len(seen) == 2 and torch.equal(seen[0], seen[1]), "each call computes dL/dq afresh"
    assert seen[0].abs().sum() > 0
    assert q.grad is None and k.grad is None and v.grad is None, "no .grad accumulates between timed calls"


def test_attention_sweep_keeps_partial_results(tmp_path):
    written = []
    real_to_csv = pd.DataFrame.to_csv

    def spy(df, path, **kwargs):
        written.append(len(df))
        return real_to_csv(df, path, **kwargs)

    configs = lk.bench.fixed_token_configs([16, 32], [8], tokens=32, width=16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pd.DataFrame, "to_csv", spy)
        df = lk.bench.attention_sweep(configs, backends=["reference"], modes=("fwd",), causal=(False,),
                                      dtype=torch.float32, device="cpu", target_ms=1, progress=False,
                                      partial_csv=tmp_path / "sweep.csv")
    assert written == [1, 2], "the CSV is rewritten after every configuration with the rows so far"
    assert pd.read_csv(tmp_path / "sweep.csv")["N"].tolist() == df["N"].tolist() == [16, 32]
