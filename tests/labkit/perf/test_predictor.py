"""Tests for labkit.perf.predictor: timing sweeps, configurations, the held-out split and the grouped
time predictor.

Notebook 04's exercise functions (features, relative least squares, MAPE) are written here
another way (row by row, normal equations in fp64) and passed in, as the notebook passes the
student's.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import labkit as lk

PR = lk.predictor
GIB = 2**30


def features(df: pd.DataFrame) -> np.ndarray:
    """[rows, 4]: matmul FLOPs, score elements (both halved if causal), token elements, 1."""
    out = []
    for r in df.itertuples():
        work = 0.5 if r.causal else 1.0
        out.append([4.0 * r.B * r.H * r.N**2 * r.D * work, 1.0 * r.B * r.H * r.N**2 * work, 1.0 * r.B * r.H * r.N * r.D, 1.0])
    return np.array(out).reshape(len(out), 4)


def relative_fit(X, y):
    """argmin sum(((X @ c - y) / y)^2) via the normal equations on column-scaled A = X / y."""
    A = np.asarray(X, dtype=np.float64) / np.asarray(y, dtype=np.float64)[:, None]
    norm = np.sqrt((A**2).sum(axis=0))
    As = A / norm
    return np.linalg.solve(As.T @ As, As.sum(axis=0)) / norm


def mean_ape(pred, true) -> float:
    return float(np.mean([abs(p - t) / abs(t) for p, t in zip(pred, true)]) * 100)


# ----------------------------------------------------------------------------- sweeps

def test_time_grid_on_cpu():
    cfgs = [dict(B=1, H=2, N=32, D=16, axis="N"), dict(B=1, H=2, N=64, D=16, axis="N")]
    df = PR.time_grid(cfgs, ["reference", "sdpa_math", "fa4"], causal=(False, True), device="cpu",
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
        PR.time_grid([dict(B=1, H=1, N=8)], ["sdpa_math"], device="cpu", progress=False)


@pytest.mark.parametrize("error, status", [(AssertionError("head dim 32 unsupported"), "error: AssertionError"),
                                           (torch.OutOfMemoryError("CUDA out of memory"), "oom")])
def test_time_grid_records_failures_as_rows(monkeypatch, error, status):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(PR.attn, "attention", fail)
    df = PR.time_grid([dict(B=1, H=1, N=16, D=8)], ["sdpa_math"], device="cpu", progress=False)
    assert df["status"].iloc[0].startswith(status), df["status"].iloc[0]
    assert "ms" not in df or df["ms"].isna().all()


def test_scaling_configs():
    cfgs = PR.scaling_configs(dict(B=2, H=4, N=128, D=32), dict(B=[1, 2], N=[64, 128, 256]))
    assert len(cfgs) == 5 and [c["axis"] for c in cfgs] == ["B", "B", "N", "N", "N"]
    assert cfgs[2] == dict(B=2, H=4, N=64, D=32, axis="N")
    with pytest.raises(ValueError, match="axes"):
        PR.scaling_configs(dict(B=1, H=1, N=8, D=8), dict(heads=[1]))


def test_random_configs():
    kw = dict(B=[1, 2, 4], H=[2, 4], N=[64, 128, 256], D=[16, 32], min_flop=2**20, min_rows=256, max_elems=2**16)
    a, b = PR.random_configs(8, **kw, seed=3), PR.random_configs(8, **kw, seed=3)
    assert a == b and len({tuple(c.values()) for c in a}) == 8
    for c in a:
        assert lk.attention.flops(c["B"], c["H"], c["N"], c["D"]) >= 2**20
        assert c["B"] * c["H"] * c["N"] >= 256 and c["B"] * c["H"] * c["N"] * c["D"] <= 2**16
    with pytest.raises(ValueError, match="grid points"):
        PR.random_configs(1000, **kw)


def _synthetic_sweep(coefs: dict, *, noise: float = 0.0, seed: int = 0) -> pd.DataFrame:
    """Rows from known per-(backend, causal) coefficients, optional multiplicative noise."""
    rng = np.random.default_rng(seed)
    cfgs = [dict(B=b, H=h, N=n, D=d) for b in (1, 2, 4) for h in (2, 4) for n in (64, 128, 256, 512) for d in (32, 64)]
    df = pd.DataFrame([dict(c, backend=be, causal=ca, mode="fwd", status="ok") for c in cfgs for (be, ca) in coefs])
    true = np.array([x @ coefs[(r.backend, r.causal)] for x, r in zip(features(df), df.itertuples())])
    df["ms"] = true * (1 + noise * rng.standard_normal(len(df)))
    return df


def test_holdout_split_is_interior_and_disjoint():
    df = _synthetic_sweep({("a", False): np.array([1e-9, 1e-6, 1e-7, 0.01])})
    train, test = PR.holdout_split(df, frac=0.25, seed=1)
    key = ["B", "H", "N", "D"]
    assert len(train) + len(test) == len(df)
    assert not set(map(tuple, train[key].values)) & set(map(tuple, test[key].values))
    work = lambda d: d["B"] * d["H"] * d["N"] ** 2 * d["D"]  # noqa: E731
    assert test["N"].min() > df["N"].min() and test["N"].max() < df["N"].max()
    assert work(test).min() > work(df).min() and work(test).max() < work(df).max()
    assert len(test[key].drop_duplicates()) == round(0.25 * len(df[key].drop_duplicates()))
    with pytest.raises(ValueError, match="interior"):
        PR.holdout_split(df.head(4), frac=0.5)


# ----------------------------------------------------------------------------- predictor

def test_time_predictor_per_group():
    coefs = {("a", False): np.array([2e-10, 3e-7, 1e-8, 0.02]), ("a", True): np.array([4e-10, 1e-7, 2e-8, 0.05]),
             ("b", False): np.array([1e-9, 0.0, 3e-8, 0.01])}
    train, test = PR.holdout_split(_synthetic_sweep(coefs), seed=0)
    pred = PR.TimePredictor(features, relative_fit).fit(train)
    assert set(pred.coef) == {("a", False, "fwd"), ("a", True, "fwd"), ("b", False, "fwd")}
    np.testing.assert_allclose(pred.coef[("a", True, "fwd")], coefs[("a", True)], rtol=1e-6)
    ev = pred.evaluate(test, mean_ape)
    assert list(ev.columns) == ["backend", "causal", "mode", "n", "mape_pct", "max_ape_pct"]
    assert (ev["mape_pct"] < 1e-3).all() and (ev["n"] == len(test) // 3).all()
    assert np.isnan(pred.predict(test.head(2).assign(backend="unknown"))).all()
    with pytest.raises(ValueError, match="more configurations"):
        PR.TimePredictor(features, relative_fit).fit(train.head(3))


def test_time_predictor_evaluate_uses_the_metric_per_group_and_row():
    df = pd.DataFrame([dict(B=1, H=1, N=8, D=4, causal=False, backend="a", mode="fwd", status="ok", ms=ms)
                       for ms in (1.0, 2.0, 4.0, 8.0, 16.0)])
    pred = PR.TimePredictor(lambda d: np.ones((len(d), 1)), relative_fit)
    pred.coef[("a", False, "fwd")] = np.array([2.0])  # predicts 2 ms everywhere
    ev = pred.evaluate(df, mean_ape).iloc[0]
    apes = [100.0, 0.0, 50.0, 75.0, 87.5]
    assert ev["n"] == 5 and ev["mape_pct"] == pytest.approx(np.mean(apes)) and ev["max_ape_pct"] == pytest.approx(100.0)


def test_time_predictor_keeps_costs_nonnegative():
    df = _synthetic_sweep({("a", False): np.array([2e-10, 0.0, 0.0, 0.02])}, noise=0.03, seed=4)
    free = PR.TimePredictor(features, relative_fit, nonnegative=False).fit(df).coef[("a", False, "fwd")]
    assert (free < 0).any(), "noise makes the unconstrained fit give a negative cost"
    pred = PR.TimePredictor(features, relative_fit).fit(df)
    coef = pred.coef[("a", False, "fwd")]
    assert (coef >= 0).all() and (coef == 0).any()
    assert mean_ape(pred.predict(df), df["ms"]) < 5


# ----------------------------------------------------------------------------- GPU only

@pytest.mark.gpu
def test_time_grid_on_gpu(cuda_device):
    df = PR.time_grid([dict(B=2, H=4, N=256, D=64)], ["reference", "sdpa_flash"], causal=(False, True),
                      device=cuda_device, target_ms=5, progress=False)
    assert (df["status"] == "ok").all() and (df["dtype"] == "bfloat16").all()
