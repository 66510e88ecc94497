"""Tests for labkit.profiling: profiler wrappers, traces, snapshots, the IO/roofline model,
the time predictor and the training-memory model with its recommender."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

import labkit as lk

PF = lk.profiling
GIB = 2**30


# ----------------------------------------------------------------------------- profiler

@pytest.mark.parametrize("name", ["self_device_time_total", "self_cuda_time_total", "device_time_total"])
def test_device_time_reads_every_torch_spelling(name):
    """torch >= 2.4 says device_time, older versions cuda_time: both must be read."""
    evt = SimpleNamespace(**{name: 1234.0})
    assert PF._device_us(evt) == 1234.0
    assert PF._device_us(SimpleNamespace(self_cpu_time_total=5.0)) == 0.0


SOFTMAX = "softmax & elementwise"


@pytest.mark.parametrize("name, cat", [
    ("aten::bmm", "matmul"), ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "matmul"),
    ("nvjet_tst_128x256_64x4", "matmul"),
    ("flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", "fused attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "fused attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "fused attention"),
    ("fmha_cutlassF_bf16_aligned", "fused attention"),
    ("Memcpy DtoD (Device -> Device)", "memory"), ("aten::_to_copy", "memory"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>", "memory"),
    ("void at::native::vectorized_elementwise_kernel<4, exp_kernel_cuda>", SOFTMAX),
    ("void at::native::reduce_kernel<512, 1, ReduceOp<float, MaxOps<float>>>", SOFTMAX),
    ("aten::_softmax", SOFTMAX), ("aten::exp_", SOFTMAX), ("aten::sub", SOFTMAX), ("aten::transpose", "other")])
def test_category(name, cat):
    assert PF.category(name) == cat


@pytest.fixture(scope="module")
def cpu_profiles():
    q, k, v = lk.bench.attention_inputs(1, 2, 64, 16, dtype=torch.float32)
    out = {}
    with torch.no_grad():
        for backend in ("reference", "sdpa_flash"):
            out[backend] = PF.profile_fn(lambda: lk.attention.attention(q, k, v, backend=backend, nan_policy="ignore"),
                                         reps=3, warmup=1, device="cpu", label="attn")
    return out


def test_kernel_table_on_cpu(cpu_profiles):
    ref = PF.kernel_table(cpu_profiles["reference"], top=None)
    fused = PF.kernel_table(cpu_profiles["sdpa_flash"], top=None)
    assert list(ref.columns) == ["name", "category", "calls", "self_ms", "share"]
    assert ref.attrs["source"] == "cpu" and ref.attrs["total_ms"] > 0
    assert ref["share"].sum() == pytest.approx(1.0)
    assert ref["self_ms"].is_monotonic_decreasing
    assert "attn" not in set(ref["name"]), "the record_function label is a wrapper, not an operator"
    # counts are per profiled call: the reference does two matmuls per call
    assert ref.loc[ref["name"] == "aten::bmm", "calls"].sum() == pytest.approx(2.0)
    assert ref.attrs["launches"] > fused.attrs["launches"], "materialized attention runs more operators"
    assert fused.iloc[0]["category"] == "fused attention"
    assert len(PF.kernel_table(cpu_profiles["reference"], top=3)) == 3


def test_sort_key_works_with_table(cpu_profiles):
    prof = cpu_profiles["reference"]
    key = PF.sort_key(prof)
    assert key == "self_cpu_time_total"
    assert "aten::bmm" in prof.key_averages().table(sort_by=key, row_limit=20)


def test_profile_fn_rejects_zero_reps():
    with pytest.raises(ValueError, match="reps"):
        PF.profile_fn(lambda: None, reps=0, device="cpu")


def test_export_trace_and_counts(cpu_profiles, tmp_path):
    path = PF.export_trace(cpu_profiles["reference"], tmp_path / "sub" / "trace.json")
    assert path.exists()
    json.loads(path.read_text())  # valid JSON for Perfetto / chrome://tracing
    counts = PF.trace_counts(path).set_index("category")["events"]
    assert counts["cpu_op"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_memory_snapshot_explains_on_cpu(tmp_path):
    with pytest.raises(RuntimeError, match="GPU"):
        PF.memory_snapshot(lambda: None, tmp_path / "s.pickle")


def test_snapshot_allocations_on_a_synthetic_snapshot(tmp_path):
    frames_user = [{"filename": "/x/site-packages/torch/nn/functional.py", "line": 1, "name": "softmax"},
                   {"filename": "/home/me/lab.py", "line": 42, "name": "attend"}]
    trace = [dict(action="alloc", size=64 * 2**20, frames=frames_user),
             dict(action="free_completed", size=64 * 2**20, frames=frames_user),
             dict(action="alloc", size=64 * 2**20, frames=frames_user),
             dict(action="alloc", size=2**20, frames=[{"filename": "??", "line": 0, "name": "?"}])]
    snap = {"segments": [], "device_traces": [trace]}
    df = PF.snapshot_allocations(snap)
    assert df.iloc[0].to_dict() == {"size_mib": 64.0, "frame": "lab.py:42 attend", "count": 2}
    assert df.iloc[1]["frame"] == "(no Python frame)"
    path = tmp_path / "snap.pickle"
    path.write_bytes(__import__("pickle").dumps(snap))
    assert PF.snapshot_allocations(path, top=1).shape[0] == 1


# ----------------------------------------------------------------------------- IO model and roofline

def test_io_model_by_hand():
    """B=H=1, N=4, D=2, 2-byte elements: counts worked out on paper."""
    df = PF.io_model(1, 1, 4, 2, elem_bytes=2, block_m=2).set_index("phase")
    assert df.loc["QK^T", ["flop", "bytes"]].tolist() == [64, 2 * (2 * 4 * 2 + 16)]
    assert df.loc["softmax", ["flop", "bytes"]].tolist() == [5 * 16, 2 * 2 * 16]
    assert df.loc["PV", ["flop", "bytes"]].tolist() == [64, 2 * (16 + 2 * 4 * 2)]
    assert df.loc["total", "flop"] == 64 + 80 + 64
    # FA2: Q read once and O written once (2*N*D), K and V read once per Q tile (2 tiles), lse fp32
    assert df.loc["fused (tiled)", "bytes"] == 2 * (2 * 8 + 2 * 4 * 2 * 2) + 4 * 4
    assert df.loc["fused (compulsory)", "bytes"] == 2 * 4 * 8 + 4 * 4
    assert (df["intensity"] == df["flop"] / df["bytes"]).all()


@pytest.mark.parametrize("elem_bytes", [2, 4])
def test_io_model_scaling_laws(elem_bytes):
    """Standard: Theta(N D + N^2) bytes; flash tiled: ~ N^2 D^2 / M (M ~ block_m * D)."""
    def model(n, d=64, block_m=128, causal=False):
        return PF.io_model(2, 4, n, d, elem_bytes=elem_bytes, block_m=block_m, causal=causal).set_index("phase")

    small, big = model(2048), model(8192)
    assert big.loc["total", "bytes"] / small.loc["total", "bytes"] == pytest.approx(16, rel=0.05)
    assert big.loc["fused (tiled)", "bytes"] / small.loc["fused (tiled)", "bytes"] == pytest.approx(16, rel=0.1)
    assert big.loc["fused (compulsory)", "bytes"] / small.loc["fused (compulsory)", "bytes"] == pytest.approx(4)
    kv = lambda m: m.loc["fused (tiled)", "bytes"] - m.loc["fused (compulsory)", "bytes"]  # noqa: E731
    assert kv(model(8192, block_m=256)) == pytest.approx(kv(model(8192)) / 2, rel=0.02)
    assert (big.loc["total", "bytes"] > big.loc["fused (tiled)", "bytes"] > big.loc["fused (compulsory)", "bytes"])
    causal = model(8192, causal=True)
    assert causal.loc["fused (tiled)", "flop"] == pytest.approx(big.loc["fused (tiled)", "flop"] / 2)
    assert causal.loc["total", "flop"] == big.loc["total", "flop"], "materialized attention computes all scores"
    assert kv(causal) == pytest.approx(kv(big) / 2, rel=0.02)
    assert big.loc["softmax", "intensity"] == pytest.approx(5 / (2 * elem_bytes))


def test_io_model_flash_flop_matches_attention_flops():
    df = PF.io_model(2, 3, 256, 64).set_index("phase")
    matmul = lk.attention.flops(2, 3, 256, 64)
    assert df.loc["fused (tiled)", "flop"] == matmul + 5 * 2 * 3 * 256**2
    assert df.loc["QK^T", "flop"] + df.loc["PV", "flop"] == matmul


@pytest.mark.parametrize("bad", [dict(N=0), dict(D=-1), dict(block_m=0), dict(elem_bytes=1.5)])
def test_io_model_rejects_bad_sizes(bad):
    args = dict(B=1, H=1, N=64, D=16) | bad
    extra = {k: args.pop(k) for k in ("block_m", "elem_bytes") if k in args}
    with pytest.raises(ValueError, match="positive integer"):
        PF.io_model(**args, **extra)


def test_attainable_and_roofline_points():
    assert PF.attainable_tflops(10.0, 100.0, 1e12) == pytest.approx(10.0)
    assert PF.attainable_tflops(1e3, 100.0, 1e12) == pytest.approx(100.0)
    np.testing.assert_allclose(PF.attainable_tflops(np.array([1.0, 50, 500]), 100.0, 1e12), [1, 50, 100])
    t = pd.DataFrame([dict(backend="reference", B=1, H=2, N=256, D=64, causal=False, ms=2.0),
                      dict(backend="sdpa_flash", B=1, H=2, N=256, D=64, causal=False, ms=1.0)])
    pts = PF.roofline_points(t, elem_bytes=2).set_index("backend")
    model = PF.io_model(1, 2, 256, 64).set_index("phase")
    assert pts.loc["reference", "kind"] == "standard" and pts.loc["sdpa_flash", "kind"] == "flash"
    assert pts.loc["reference", "intensity"] == pytest.approx(model.loc["total", "intensity"])
    assert pts.loc["sdpa_flash", "intensity"] == pytest.approx(model.loc["fused (tiled)", "intensity"])
    assert math.isnan(pts.loc["reference", "intensity_compulsory"])
    assert pts.loc["sdpa_flash", "achieved_tflops"] == pytest.approx(model.loc["fused (tiled)", "flop"] / 1e-3 / 1e12)


def test_roofline_plot_draws():
    import matplotlib

    matplotlib.use("Agg")
    t = pd.DataFrame([dict(backend=b, B=1, H=2, N=n, D=64, causal=False, ms=1.0)
                      for b in ("reference", "sdpa_flash") for n in (128, 256)])
    ax = PF.roofline_plot(PF.roofline_points(t), peak_tflops=1.0, bandwidth=1e11)
    assert ax.get_xscale() == "log" and len(ax.collections) >= 3
    matplotlib.pyplot.close("all")


# ----------------------------------------------------------------------------- sweeps

def test_time_grid_on_cpu():
    cfgs = [dict(B=1, H=2, N=32, D=16, axis="N"), dict(B=1, H=2, N=64, D=16, axis="N")]
    df = PF.time_grid(cfgs, ["reference", "sdpa_math", "fa4"], causal=(False, True), device="cpu",
                      target_ms=1, progress=False, max_score_gib=4 * 2 * 48**2 / GIB)
    assert len(df) == 2 * 2 * 3
    assert {"B", "H", "N", "D", "axis", "backend", "causal", "mode", "status", "ms", "tflops",
            "tokens_per_s", "device", "dtype"} <= set(df.columns)
    ok = df[df["status"] == "ok"]
    assert set(ok["backend"]) == {"reference", "sdpa_math"} and set(ok["N"]) == {32}
    assert (ok["ms"] > 0).all() and (ok["tokens_per_s"] > 0).all() and (ok["dtype"] == "float32").all()
    skipped = df[df["status"].str.startswith("skipped")]
    assert set(skipped["backend"]) == {"reference", "sdpa_math"} and set(skipped["N"]) == {64}, "scores above the limit"
    assert df[df["backend"] == "fa4"]["status"].str.startswith("unsupported").all()
    with pytest.raises(ValueError, match="lacks"):
        PF.time_grid([dict(B=1, H=1, N=8)], ["sdpa_math"], device="cpu", progress=False)


@pytest.mark.parametrize("error, status", [(AssertionError("head dim 32 unsupported"), "error: AssertionError"),
                                           (torch.OutOfMemoryError("CUDA out of memory"), "oom")])
def test_time_grid_records_failures_as_rows(monkeypatch, error, status):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(PF.attn, "attention", fail)
    df = PF.time_grid([dict(B=1, H=1, N=16, D=8)], ["sdpa_math"], device="cpu", progress=False)
    assert df["status"].iloc[0].startswith(status), df["status"].iloc[0]
    assert "ms" not in df or df["ms"].isna().all()


def test_scaling_configs():
    cfgs = PF.scaling_configs(dict(B=2, H=4, N=128, D=32), dict(B=[1, 2], N=[64, 128, 256]))
    assert len(cfgs) == 5 and [c["axis"] for c in cfgs] == ["B", "B", "N", "N", "N"]
    assert cfgs[2] == dict(B=2, H=4, N=64, D=32, axis="N")
    with pytest.raises(ValueError, match="axes"):
        PF.scaling_configs(dict(B=1, H=1, N=8, D=8), dict(heads=[1]))


def test_random_configs():
    kw = dict(B=[1, 2, 4], H=[2, 4], N=[64, 128, 256], D=[16, 32], min_flop=2**20, min_rows=256, max_elems=2**16)
    a, b = PF.random_configs(8, **kw, seed=3), PF.random_configs(8, **kw, seed=3)
    assert a == b and len({tuple(c.values()) for c in a}) == 8
    for c in a:
        assert lk.attention.flops(c["B"], c["H"], c["N"], c["D"]) >= 2**20
        assert c["B"] * c["H"] * c["N"] >= 256 and c["B"] * c["H"] * c["N"] * c["D"] <= 2**16
    with pytest.raises(ValueError, match="grid points"):
        PF.random_configs(1000, **kw)


def _synthetic_sweep(coefs: dict, *, noise: float = 0.0, seed: int = 0) -> pd.DataFrame:
    """Rows from known per-(backend, causal) coefficients, optional multiplicative noise."""
    rng = np.random.default_rng(seed)
    cfgs = [dict(B=b, H=h, N=n, D=d) for b in (1, 2, 4) for h in (2, 4) for n in (64, 128, 256, 512) for d in (32, 64)]
    rows = [dict(c, backend=be, causal=ca, mode="fwd", status="ok") for c in cfgs for (be, ca) in coefs]
    df = pd.DataFrame(rows)
    X = PF.time_features(df)
    true = np.array([X[i] @ coefs[(r.backend, r.causal)] for i, r in enumerate(df.itertuples())])
    df["ms"] = true * (1 + noise * rng.standard_normal(len(df)))
    return df


def test_holdout_split_is_interior_and_disjoint():
    df = _synthetic_sweep({("a", False): np.array([1e-9, 1e-6, 1e-7, 0.01])})
    train, test = PF.holdout_split(df, frac=0.25, seed=1)
    key = ["B", "H", "N", "D"]
    assert len(train) + len(test) == len(df)
    assert not set(map(tuple, train[key].values)) & set(map(tuple, test[key].values))
    work = lambda d: d["B"] * d["H"] * d["N"] ** 2 * d["D"]  # noqa: E731
    assert test["N"].min() > df["N"].min() and test["N"].max() < df["N"].max()
    assert work(test).min() > work(df).min() and work(test).max() < work(df).max()
    assert len(test[key].drop_duplicates()) == round(0.25 * len(df[key].drop_duplicates()))
    with pytest.raises(ValueError, match="interior"):
        PF.holdout_split(df.head(4), frac=0.5)


def test_time_features_halve_causal_work():
    df = pd.DataFrame([dict(B=2, H=3, N=8, D=4, causal=False), dict(B=2, H=3, N=8, D=4, causal=True)])
    X = PF.time_features(df)
    assert X[0].tolist() == [4 * 2 * 3 * 64 * 4, 2 * 3 * 64, 2 * 3 * 8 * 4, 1]
    assert X[1].tolist() == [X[0, 0] / 2, X[0, 1] / 2, X[0, 2], 1]
    assert X[0, 0] == lk.attention.flops(2, 3, 8, 4)


def test_fit_time_model_recovers_exact_coefficients():
    df = _synthetic_sweep({("a", False): np.array([2e-10, 3e-7, 1e-8, 0.02])})
    coef = PF.fit_time_model(PF.time_features(df), df["ms"])
    np.testing.assert_allclose(coef, [2e-10, 3e-7, 1e-8, 0.02], rtol=1e-6)


def test_fit_time_model_minimizes_relative_error():
    """Relative least squares beats plain least squares on MAPE when times span decades."""
    df = _synthetic_sweep({("a", False): np.array([2e-10, 3e-7, 1e-8, 0.02])}, noise=0.05, seed=2)
    X, y = PF.time_features(df), df["ms"].to_numpy()
    rel = PF.fit_time_model(X, y, nonnegative=False)
    np.testing.assert_allclose(rel, np.linalg.lstsq(X / y[:, None], np.ones(len(y)), rcond=None)[0], rtol=1e-5)
    plain = np.linalg.lstsq(X, y, rcond=None)[0]
    assert PF.mape(X @ rel, y) < PF.mape(X @ plain, y)


def test_fit_time_model_keeps_costs_nonnegative():
    df = _synthetic_sweep({("a", False): np.array([2e-10, 0.0, 0.0, 0.02])}, noise=0.03, seed=4)
    coef = PF.fit_time_model(PF.time_features(df), df["ms"])
    assert (coef >= 0).all()
    assert PF.mape(PF.time_features(df) @ coef, df["ms"]) < 5


@pytest.mark.parametrize("X, y, match", [(np.ones((3, 4)), np.ones(3), "rows"), (np.ones((5, 2)), -np.ones(5), "y > 0"),
                                         (np.ones(5), np.ones(5), r"\[rows, features\]")])
def test_fit_time_model_errors(X, y, match):
    with pytest.raises(ValueError, match=match):
        PF.fit_time_model(X, y)


def test_mape():
    assert PF.mape([110, 90], [100, 100]) == pytest.approx(10.0)
    assert PF.mape(np.array([1.0]), np.array([2.0])) == pytest.approx(50.0)
    with pytest.raises(ValueError):
        PF.mape([1, 2], [1])


def test_time_predictor_per_group():
    coefs = {("a", False): np.array([2e-10, 3e-7, 1e-8, 0.02]), ("a", True): np.array([4e-10, 1e-7, 2e-8, 0.05]),
             ("b", False): np.array([1e-9, 0.0, 3e-8, 0.01])}
    df = _synthetic_sweep(coefs)
    train, test = PF.holdout_split(df, seed=0)
    pred = PF.TimePredictor().fit(train)
    assert set(pred.coef) == {("a", False, "fwd"), ("a", True, "fwd"), ("b", False, "fwd")}
    ev = pred.evaluate(test)
    assert list(ev.columns) == ["backend", "causal", "mode", "n", "mape_pct", "max_ape_pct"]
    assert (ev["mape_pct"] < 1e-3).all() and (ev["n"] == len(test) // 3).all()
    other = test.head(2).assign(backend="unknown")
    assert np.isnan(pred.predict(other)).all()
    with pytest.raises(ValueError, match="more configurations"):
        PF.TimePredictor().fit(train.head(3))


# ----------------------------------------------------------------------------- memory model

def test_gpt2_shapes_and_params():
    assert PF.ModelShape.gpt2("small").n_params() == 124_439_808  # GPT-2 small, tied embeddings
    assert PF.ModelShape.gpt2("medium").n_params() == 354_823_168
    assert PF.ModelShape.gpt2("small").n_params(4096) == 124_439_808 + 3072 * 768
    with pytest.raises(ValueError, match="size"):
        PF.ModelShape.gpt2("huge")


@pytest.mark.parametrize("attention, batch, seq_len, ckpt, gib", [
    ("sdpa", 16, 1024, False, 23.36), ("sdpa", 1, 32768, False, 45.3), ("eager", 16, 1024, False, 36.29),
    ("eager", 4, 4096, False, 76.82), ("sdpa", 1, 65536, True, 41.4)])
def test_training_memory_matches_measured_gpt2_small(attention, batch, seq_len, ckpt, gib):
    """Peaks measured on an H100 (shared/ANCHORS.md: HF GPT-2 small, bf16 autocast, fused AdamW)."""
    total = PF.training_memory(PF.ModelShape.gpt2("small"), batch=batch, seq_len=seq_len, attention=attention,
                               checkpointing=ckpt)["total"]
    assert total / GIB == pytest.approx(gib, rel=0.05)


def test_training_memory_components():
    shape = PF.ModelShape.gpt2("small")
    std = PF.training_memory(shape, batch=2, seq_len=2048, attention="standard")
    fl = PF.training_memory(shape, batch=2, seq_len=2048, attention="fa4")
    assert std["total"] == pytest.approx(sum(v for k, v in std.items() if k != "total"))
    p = shape.n_params(2048)
    assert (std["weights"], std["grads"], std["optimizer"]) == (4 * p, 4 * p, 8 * p)
    assert std["attention"] == 12 * 2 * 12 * 2048**2 * 6.0
    assert fl["attention"] == 12 * 2 * 2048 * 12 * 4.0 and fl["activations"] == std["activations"]
    longer = PF.training_memory(shape, batch=2, seq_len=4096, attention="standard")
    assert longer["attention"] == pytest.approx(4 * std["attention"]), "standard attention memory ~ N^2"
    ck = PF.training_memory(shape, batch=2, seq_len=2048, attention="standard", checkpointing=True)
    assert ck["attention"] == pytest.approx(std["attention"] / 12) and ck["activations"] < std["activations"]
    with pytest.raises(ValueError, match="unknown attention"):
        PF.training_memory(shape, batch=1, seq_len=8, attention="magic")
    with pytest.raises(ValueError, match=">= 1"):
        PF.training_memory(shape, batch=0, seq_len=8)


def test_recommend_prefers_no_checkpointing_then_largest_batch():
    shape = PF.ModelShape.gpt2("small")
    df = PF.recommend(shape, budget_bytes=80 * GIB, seq_len=1024, global_batch=32, attention="flash")
    chosen = df[df["chosen"]].iloc[0]
    assert df["chosen"].sum() == 1 and bool(chosen["fits"]) and not chosen["checkpointing"]
    assert chosen["micro_batch"] == df[df["fits"] & ~df["checkpointing"]]["micro_batch"].max()
    assert chosen["micro_batch"] * chosen["accumulation"] == 32
    assert chosen["predicted_gib"] <= 0.9 * 80
    tight = PF.recommend(shape, budget_bytes=12 * GIB, seq_len=8192, global_batch=8, attention="flash")
    assert bool(tight[tight["chosen"]]["checkpointing"].iloc[0]), "only checkpointing fits a 12 GiB budget at 8K"
    none = PF.recommend(shape, budget_bytes=1 * GIB, seq_len=1024, global_batch=4)
    assert not none["chosen"].any()
    with pytest.raises(ValueError):
        PF.recommend(shape, budget_bytes=0, seq_len=8, global_batch=1)


def test_max_seq_len():
    shape, budget = PF.ModelShape.gpt2("small"), 80 * GIB
    n = {(a, c): PF.max_seq_len(shape, budget_bytes=budget, attention=a, checkpointing=c)
         for a in ("standard", "flash") for c in (False, True)}
    assert n[("flash", False)] > 4 * n[("standard", False)] > 0
    assert n[("flash", True)] > n[("flash", False)] and n[("standard", True)] >= n[("standard", False)]
    for (a, c), val in n.items():
        mem = lambda s: PF.training_memory(shape, batch=1, seq_len=s, attention=a, checkpointing=c)["total"]  # noqa: E731
        assert val % 256 == 0 and mem(val) <= 0.9 * budget < mem(val + 256)
    assert PF.max_seq_len(shape, budget_bytes=GIB) == 0


# ----------------------------------------------------------------------------- GPU only

@pytest.mark.gpu
def test_kernel_table_counts_cuda_kernels(cuda_device):
    a = torch.randn(1024, 1024, device=cuda_device, dtype=torch.bfloat16)
    prof = PF.profile_fn(lambda: (a @ a).relu_(), reps=4, device=cuda_device)
    table = PF.kernel_table(prof, top=None)
    assert table.attrs["source"] == "device"
    assert "matmul" in set(table["category"]), table
    assert table.attrs["launches"] == pytest.approx(2, abs=1), "one GEMM and one elementwise kernel per call"
    assert PF.sort_key(prof) in ("self_device_time_total", "self_cuda_time_total")


@pytest.mark.gpu
def test_memory_snapshot_on_gpu(cuda_device, tmp_path):
    keep = []
    path = PF.memory_snapshot(lambda: keep.append(torch.empty(32 * 2**20, dtype=torch.uint8, device=cuda_device)),
                              tmp_path / "snap.pickle")
    top = PF.snapshot_allocations(path, top=3)
    assert top.iloc[0]["size_mib"] >= 32
    assert "test_profiling.py" in top.iloc[0]["frame"]


@pytest.mark.gpu
def test_time_grid_on_gpu(cuda_device):
    df = PF.time_grid([dict(B=2, H=4, N=256, D=64)], ["reference", "sdpa_flash"], causal=(False, True),
                      device=cuda_device, target_ms=5, progress=False)
    assert (df["status"] == "ok").all() and (df["dtype"] == "bfloat16").all()
