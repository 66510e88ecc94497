"""Tests for labkit.perfmodel: the IO/roofline model, timing sweeps, the time predictor and the
training-memory model with its recommender."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

import labkit as lk

PM = lk.perfmodel
GIB = 2**30


# ----------------------------------------------------------------------------- IO model and roofline

def test_io_model_by_hand():
    """B=H=1, N=4, D=2, 2-byte elements: counts worked out on paper."""
    df = PM.io_model(1, 1, 4, 2, elem_bytes=2, block_m=2).set_index("phase")
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
        return PM.io_model(2, 4, n, d, elem_bytes=elem_bytes, block_m=block_m, causal=causal).set_index("phase")

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
    df = PM.io_model(2, 3, 256, 64).set_index("phase")
    matmul = lk.attention.flops(2, 3, 256, 64)
    assert df.loc["fused (tiled)", "flop"] == matmul + 5 * 2 * 3 * 256**2
    assert df.loc["QK^T", "flop"] + df.loc["PV", "flop"] == matmul


@pytest.mark.parametrize("bad", [dict(N=0), dict(D=-1), dict(block_m=0), dict(elem_bytes=1.5)])
def test_io_model_rejects_bad_sizes(bad):
    args = dict(B=1, H=1, N=64, D=16) | bad
    extra = {k: args.pop(k) for k in ("block_m", "elem_bytes") if k in args}
    with pytest.raises(ValueError, match="positive integer"):
        PM.io_model(**args, **extra)


def test_attainable_and_roofline_points():
    assert PM.attainable_tflops(10.0, 100.0, 1e12) == pytest.approx(10.0)
    assert PM.attainable_tflops(1e3, 100.0, 1e12) == pytest.approx(100.0)
    np.testing.assert_allclose(PM.attainable_tflops(np.array([1.0, 50, 500]), 100.0, 1e12), [1, 50, 100])
    t = pd.DataFrame([dict(backend="reference", B=1, H=2, N=256, D=64, causal=False, ms=2.0),
                      dict(backend="sdpa_flash", B=1, H=2, N=256, D=64, causal=False, ms=1.0)])
    pts = PM.roofline_points(t, elem_bytes=2).set_index("backend")
    model = PM.io_model(1, 2, 256, 64).set_index("phase")
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
    ax = PM.roofline_plot(PM.roofline_points(t), peak_tflops=1.0, bandwidth=1e11)
    assert ax.get_xscale() == "log" and len(ax.collections) >= 3
    matplotlib.pyplot.close("all")


# ----------------------------------------------------------------------------- sweeps

def test_time_grid_on_cpu():
    cfgs = [dict(B=1, H=2, N=32, D=16, axis="N"), dict(B=1, H=2, N=64, D=16, axis="N")]
    df = PM.time_grid(cfgs, ["reference", "sdpa_math", "fa4"], causal=(False, True), device="cpu",
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
        PM.time_grid([dict(B=1, H=1, N=8)], ["sdpa_math"], device="cpu", progress=False)


@pytest.mark.parametrize("error, status", [(AssertionError("head dim 32 unsupported"), "error: AssertionError"),
                                           (torch.OutOfMemoryError("CUDA out of memory"), "oom")])
def test_time_grid_records_failures_as_rows(monkeypatch, error, status):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(PM.attn, "attention", fail)
    df = PM.time_grid([dict(B=1, H=1, N=16, D=8)], ["sdpa_math"], device="cpu", progress=False)
    assert df["status"].iloc[0].startswith(status), df["status"].iloc[0]
    assert "ms" not in df or df["ms"].isna().all()


def test_scaling_configs():
    cfgs = PM.scaling_configs(dict(B=2, H=4, N=128, D=32), dict(B=[1, 2], N=[64, 128, 256]))
    assert len(cfgs) == 5 and [c["axis"] for c in cfgs] == ["B", "B", "N", "N", "N"]
    assert cfgs[2] == dict(B=2, H=4, N=64, D=32, axis="N")
    with pytest.raises(ValueError, match="axes"):
        PM.scaling_configs(dict(B=1, H=1, N=8, D=8), dict(heads=[1]))


def test_random_configs():
    kw = dict(B=[1, 2, 4], H=[2, 4], N=[64, 128, 256], D=[16, 32], min_flop=2**20, min_rows=256, max_elems=2**16)
    a, b = PM.random_configs(8, **kw, seed=3), PM.random_configs(8, **kw, seed=3)
    assert a == b and len({tuple(c.values()) for c in a}) == 8
    for c in a:
        assert lk.attention.flops(c["B"], c["H"], c["N"], c["D"]) >= 2**20
        assert c["B"] * c["H"] * c["N"] >= 256 and c["B"] * c["H"] * c["N"] * c["D"] <= 2**16
    with pytest.raises(ValueError, match="grid points"):
        PM.random_configs(1000, **kw)


def _synthetic_sweep(coefs: dict, *, noise: float = 0.0, seed: int = 0) -> pd.DataFrame:
    """Rows from known per-(backend, causal) coefficients, optional multiplicative noise."""
    rng = np.random.default_rng(seed)
    cfgs = [dict(B=b, H=h, N=n, D=d) for b in (1, 2, 4) for h in (2, 4) for n in (64, 128, 256, 512) for d in (32, 64)]
    rows = [dict(c, backend=be, causal=ca, mode="fwd", status="ok") for c in cfgs for (be, ca) in coefs]
    df = pd.DataFrame(rows)
    X = PM.time_features(df)
    true = np.array([X[i] @ coefs[(r.backend, r.causal)] for i, r in enumerate(df.itertuples())])
    df["ms"] = true * (1 + noise * rng.standard_normal(len(df)))
    return df


def test_holdout_split_is_interior_and_disjoint():
    df = _synthetic_sweep({("a", False): np.array([1e-9, 1e-6, 1e-7, 0.01])})
    train, test = PM.holdout_split(df, frac=0.25, seed=1)
    key = ["B", "H", "N", "D"]
    assert len(train) + len(test) == len(df)
    assert not set(map(tuple, train[key].values)) & set(map(tuple, test[key].values))
    work = lambda d: d["B"] * d["H"] * d["N"] ** 2 * d["D"]  # noqa: E731
    assert test["N"].min() > df["N"].min() and test["N"].max() < df["N"].max()
    assert work(test).min() > work(df).min() and work(test).max() < work(df).max()
    assert len(test[key].drop_duplicates()) == round(0.25 * len(df[key].drop_duplicates()))
    with pytest.raises(ValueError, match="interior"):
        PM.holdout_split(df.head(4), frac=0.5)


def test_time_features_halve_causal_work():
    df = pd.DataFrame([dict(B=2, H=3, N=8, D=4, causal=False), dict(B=2, H=3, N=8, D=4, causal=True)])
    X = PM.time_features(df)
    assert X[0].tolist() == [4 * 2 * 3 * 64 * 4, 2 * 3 * 64, 2 * 3 * 8 * 4, 1]
    assert X[1].tolist() == [X[0, 0] / 2, X[0, 1] / 2, X[0, 2], 1]
    assert X[0, 0] == lk.attention.flops(2, 3, 8, 4)


def test_fit_time_model_recovers_exact_coefficients():
    df = _synthetic_sweep({("a", False): np.array([2e-10, 3e-7, 1e-8, 0.02])})
    coef = PM.fit_time_model(PM.time_features(df), df["ms"])
    np.testing.assert_allclose(coef, [2e-10, 3e-7, 1e-8, 0.02], rtol=1e-6)


def test_fit_time_model_minimizes_relative_error():
    """Relative least squares beats plain least squares on MAPE when times span decades."""
    df = _synthetic_sweep({("a", False): np.array([2e-10, 3e-7, 1e-8, 0.02])}, noise=0.05, seed=2)
    X, y = PM.time_features(df), df["ms"].to_numpy()
    rel = PM.fit_time_model(X, y, nonnegative=False)
    np.testing.assert_allclose(rel, np.linalg.lstsq(X / y[:, None], np.ones(len(y)), rcond=None)[0], rtol=1e-5)
    plain = np.linalg.lstsq(X, y, rcond=None)[0]
    assert PM.mape(X @ rel, y) < PM.mape(X @ plain, y)


def test_fit_time_model_keeps_costs_nonnegative():
    df = _synthetic_sweep({("a", False): np.array([2e-10, 0.0, 0.0, 0.02])}, noise=0.03, seed=4)
    coef = PM.fit_time_model(PM.time_features(df), df["ms"])
    assert (coef >= 0).all()
    assert PM.mape(PM.time_features(df) @ coef, df["ms"]) < 5


@pytest.mark.parametrize("X, y, match", [(np.ones((3, 4)), np.ones(3), "rows"), (np.ones((5, 2)), -np.ones(5), "y > 0"),
                                         (np.ones(5), np.ones(5), r"\[rows, features\]")])
def test_fit_time_model_errors(X, y, match):
    with pytest.raises(ValueError, match=match):
        PM.fit_time_model(X, y)


def test_mape():
    assert PM.mape([110, 90], [100, 100]) == pytest.approx(10.0)
    assert PM.mape(np.array([1.0]), np.array([2.0])) == pytest.approx(50.0)
    with pytest.raises(ValueError):
        PM.mape([1, 2], [1])


def test_time_predictor_per_group():
    coefs = {("a", False): np.array([2e-10, 3e-7, 1e-8, 0.02]), ("a", True): np.array([4e-10, 1e-7, 2e-8, 0.05]),
             ("b", False): np.array([1e-9, 0.0, 3e-8, 0.01])}
    df = _synthetic_sweep(coefs)
    train, test = PM.holdout_split(df, seed=0)
    pred = PM.TimePredictor().fit(train)
    assert set(pred.coef) == {("a", False, "fwd"), ("a", True, "fwd"), ("b", False, "fwd")}
    ev = pred.evaluate(test)
    assert list(ev.columns) == ["backend", "causal", "mode", "n", "mape_pct", "max_ape_pct"]
    assert (ev["mape_pct"] < 1e-3).all() and (ev["n"] == len(test) // 3).all()
    other = test.head(2).assign(backend="unknown")
    assert np.isnan(pred.predict(other)).all()
    with pytest.raises(ValueError, match="more configurations"):
        PM.TimePredictor().fit(train.head(3))


# ----------------------------------------------------------------------------- memory model

def test_gpt2_shapes_and_params():
    assert PM.ModelShape.gpt2("small").n_params() == 124_439_808  # GPT-2 small, tied embeddings
    assert PM.ModelShape.gpt2("medium").n_params() == 354_823_168
    assert PM.ModelShape.gpt2("small").n_params(4096) == 124_439_808 + 3072 * 768
    with pytest.raises(ValueError, match="size"):
        PM.ModelShape.gpt2("huge")


@pytest.mark.parametrize("attention, batch, seq_len, ckpt, gib", [
    ("sdpa", 16, 1024, False, 23.36), ("sdpa", 1, 32768, False, 45.3), ("eager", 16, 1024, False, 36.29),
    ("eager", 4, 4096, False, 76.82), ("sdpa", 1, 65536, True, 41.4)])
def test_training_memory_matches_measured_gpt2_small(attention, batch, seq_len, ckpt, gib):
    """Peaks measured on an H100 (shared/ANCHORS.md: HF GPT-2 small, bf16 autocast, fused AdamW)."""
    total = PM.training_memory(PM.ModelShape.gpt2("small"), batch=batch, seq_len=seq_len, attention=attention,
                               checkpointing=ckpt)["total"]
    assert total / GIB == pytest.approx(gib, rel=0.05)


def test_training_memory_components():
    shape = PM.ModelShape.gpt2("small")
    std = PM.training_memory(shape, batch=2, seq_len=2048, attention="standard")
    fl = PM.training_memory(shape, batch=2, seq_len=2048, attention="fa4")
    assert std["total"] == pytest.approx(sum(v for k, v in std.items() if k != "total"))
    p = shape.n_params(2048)
    assert (std["weights"], std["grads"], std["optimizer"]) == (4 * p, 4 * p, 8 * p)
    assert std["attention"] == 12 * 2 * 12 * 2048**2 * 6.0
    assert fl["attention"] == 12 * 2 * 2048 * 12 * 4.0 and fl["activations"] == std["activations"]
    longer = PM.training_memory(shape, batch=2, seq_len=4096, attention="standard")
    assert longer["attention"] == pytest.approx(4 * std["attention"]), "standard attention memory ~ N^2"
    ck = PM.training_memory(shape, batch=2, seq_len=2048, attention="standard", checkpointing=True)
    assert ck["attention"] == pytest.approx(std["attention"] / 12) and ck["activations"] < std["activations"]
    with pytest.raises(ValueError, match="unknown attention"):
        PM.training_memory(shape, batch=1, seq_len=8, attention="magic")
    with pytest.raises(ValueError, match=">= 1"):
        PM.training_memory(shape, batch=0, seq_len=8)


def test_recommend_prefers_no_checkpointing_then_largest_batch():
    shape = PM.ModelShape.gpt2("small")
    df = PM.recommend(shape, budget_bytes=80 * GIB, seq_len=1024, global_batch=32, attention="flash")
    chosen = df[df["chosen"]].iloc[0]
    assert df["chosen"].sum() == 1 and bool(chosen["fits"]) and not chosen["checkpointing"]
    assert chosen["micro_batch"] == df[df["fits"] & ~df["checkpointing"]]["micro_batch"].max()
    assert chosen["micro_batch"] * chosen["accumulation"] == 32
    assert chosen["predicted_gib"] <= 0.9 * 80
    tight = PM.recommend(shape, budget_bytes=12 * GIB, seq_len=8192, global_batch=8, attention="flash")
    assert bool(tight[tight["chosen"]]["checkpointing"].iloc[0]), "only checkpointing fits a 12 GiB budget at 8K"
    none = PM.recommend(shape, budget_bytes=1 * GIB, seq_len=1024, global_batch=4)
    assert not none["chosen"].any()
    with pytest.raises(ValueError):
        PM.recommend(shape, budget_bytes=0, seq_len=8, global_batch=1)


def test_max_seq_len():
    shape, budget = PM.ModelShape.gpt2("small"), 80 * GIB
    n = {(a, c): PM.max_seq_len(shape, budget_bytes=budget, attention=a, checkpointing=c)
         for a in ("standard", "flash") for c in (False, True)}
    assert n[("flash", False)] > 4 * n[("standard", False)] > 0
    assert n[("flash", True)] > n[("flash", False)] and n[("standard", True)] >= n[("standard", False)]
    for (a, c), val in n.items():
        mem = lambda s: PM.training_memory(shape, batch=1, seq_len=s, attention=a, checkpointing=c)["total"]  # noqa: E731
        assert val % 256 == 0 and mem(val) <= 0.9 * budget < mem(val + 256)
    assert PM.max_seq_len(shape, budget_bytes=GIB) == 0


# ----------------------------------------------------------------------------- GPU only

@pytest.mark.gpu
def test_time_grid_on_gpu(cuda_device):
    df = PM.time_grid([dict(B=2, H=4, N=256, D=64)], ["reference", "sdpa_flash"], causal=(False, True),
                      device=cuda_device, target_ms=5, progress=False)
    assert (df["status"] == "ok").all() and (df["dtype"] == "bfloat16").all()
