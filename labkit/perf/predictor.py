"""Measure forward times over many configurations and fit a time predictor to them.

- Measurements: :func:`time_grid` (a fast forward-time sweep), :func:`scaling_configs` (one
  factor at a time), :func:`random_configs` (a seeded sample of a grid), :func:`holdout_split`
  (held-out configurations inside the measured range).
- Fitting: :class:`TimePredictor` fits one model per (backend, causal, mode) with the features
  and the fit it is given (04_performance_analysis passes the reader's own), keeping every cost
  coefficient >= 0.

Used in: 04_performance_analysis.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import numpy as np
import pandas as pd
import torch

from labkit.engine import attention as attn
from labkit.engine import bench
from labkit.core.env import device_info
from labkit.perf.memory import kind


def time_grid(configs: list[dict], backends: Iterable[str], *, causal: Iterable[bool] = (False,),
              dtype=None, device=None, target_ms: float = 25.0, max_score_gib: float = 2.0,
              seed: int = 0, progress: bool = True) -> pd.DataFrame:
    """Forward time of each backend on each configuration; one row per (config, causal, backend).

    Built for the many configurations a predictor needs: inputs are drawn once per configuration
    on the device and only the forward is timed (with :func:`labkit.engine.bench.time_fn`), whereas
    :func:`labkit.engine.bench.attention_sweep` also measures memory and error on fresh inputs per row.
    Standard (materialized) backends skip configurations whose fp32 [B, H, N, N] scores would
    exceed ``max_score_gib``.

    Args:
        configs: dicts with B, H, N, D (extra keys, e.g. "axis", are copied to the rows).
        dtype: default bf16 on a GPU, fp32 on a CPU.

    Returns:
        DataFrame: the config keys, backend, causal, mode ("fwd"), status ("ok", "oom",
        "skipped: ...", "unsupported: ...", "error: ..."), ms, tflops, tokens_per_s, device, dtype.
    """
    from tqdm.auto import tqdm

    bad = [cfg for cfg in configs if not {"B", "H", "N", "D"} <= set(cfg)]
    if bad:
        raise ValueError(f"config {bad[0]} lacks some of B, H, N, D; give all four.")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    common = dict(mode="fwd", device=device_info(device).name, dtype=str(dtype).replace("torch.", ""))
    rows = []
    for i, cfg in enumerate(tqdm(configs, desc="time grid", disable=not progress)):
        inputs = _LayoutInputs(cfg, device, dtype, seed + i)
        for c in causal:
            for b in backends:
                layout = attn.native_layout(b)
                row = dict(cfg, backend=b, causal=bool(c), **common)
                row.update(_time_one(b, cfg, bool(c), inputs[layout], layout, device, target_ms, max_score_gib))
                rows.append(row)
        del inputs  # freed by reference counting; a full gc.collect per config would cost ~0.3 s
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return pd.DataFrame(rows)


class _LayoutInputs(dict):
    """Seeded q, k, v [B, H, N, D] drawn on the device; the [B, N, H, D] copy (what flash-attn
    packages read without a copy) is made on first use."""

    def __init__(self, cfg: dict, device, dtype, seed: int):
        gen = torch.Generator(device=device).manual_seed(seed)
        shape = (cfg["B"], cfg["H"], cfg["N"], cfg["D"])
        super().__init__(bhnd=[torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(3)])

    def __missing__(self, layout: str):
        self[layout] = [t.transpose(1, 2).contiguous() for t in self["bhnd"]]
        return self[layout]


def _time_one(backend: str, cfg: dict, causal: bool, qkv, layout: str, device, target_ms: float,
              max_score_gib: float) -> dict:
    """One row's status and, when "ok", its ms, tflops and tokens_per_s."""
    B, H, N, D = (cfg[k] for k in "BHND")
    if kind(backend) == "standard" and 4 * B * H * N * N > max_score_gib * 2**30:
        return dict(status=f"skipped: scores > {max_score_gib:g} GiB")
    q, k, v = qkv
    status = "ok"

    def call():
        return attn.attention(q, k, v, causal=causal, backend=backend, layout=layout, nan_policy="ignore")

    try:
        with torch.no_grad():
            ms = bench.time_fn(call, device=device, target_ms=target_ms).median_ms
    except attn.AttentionInputError as err:
        status = f"unsupported: {err}"
    except Exception as err:  # noqa: BLE001 - any backend failure (JIT compile, shape limits) is a row status
        first = (str(err).splitlines() or [""])[0][:120]
        status = "oom" if bench.is_oom(err) else f"error: {type(err).__name__}: {first}"
    if status == "oom":
        bench.free_memory()  # outside the except block, whose traceback holds the failed call's tensors
    if status != "ok":
        return dict(status=status)
    return dict(status="ok", ms=ms, tflops=bench.tflops(attn.flops(B, H, N, D, causal=causal), ms),
                tokens_per_s=B * N / (ms * 1e-3))


def scaling_configs(base: dict, axes: dict[str, Iterable[int]]) -> list[dict]:
    """One-factor-at-a-time configurations: ``base`` with one of B, H, N, D varied; "axis" names it."""
    bad = set(axes) - {"B", "H", "N", "D"}
    if bad:
        raise ValueError(f"axes must be among B, H, N, D; got {sorted(bad)}.")
    return [dict(base, **{axis: int(val)}, axis=axis) for axis, vals in axes.items() for val in vals]


def random_configs(n: int, *, B: Iterable[int], H: Iterable[int], N: Iterable[int], D: Iterable[int],
                   min_flop: float = 0.0, min_rows: int = 0, max_elems: float = math.inf, seed: int = 0) -> list[dict]:
    """``n`` distinct configurations drawn (seeded) from the grid B x H x N x D.

    Kept are those with forward FLOPs >= ``min_flop`` (kernel time well above launch jitter),
    B*H*N >= ``min_rows`` query rows (enough Q tiles to fill every SM several times over) and
    at most ``max_elems`` elements in q (memory).
    """
    grid = [dict(B=b, H=h, N=s, D=d) for b in B for h in H for s in N for d in D
            if attn.flops(b, h, s, d) >= min_flop and b * h * s >= min_rows and b * h * s * d <= max_elems]
    if len(grid) < n:
        raise ValueError(f"only {len(grid)} grid points satisfy the limits; ask for n <= {len(grid)} or widen them.")
    pick = np.random.default_rng(seed).choice(len(grid), size=n, replace=False)
    return [grid[i] for i in sorted(pick)]


def holdout_split(df: pd.DataFrame, *, frac: float = 0.25, seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Split rows into (train, test) by configuration; test configurations lie strictly inside
    the range of N and of work B*H*N^2*D, so evaluating them is interpolation, not extrapolation."""
    cfgs = df[["B", "H", "N", "D"]].drop_duplicates().reset_index(drop=True)
    work = cfgs["B"] * cfgs["H"] * cfgs["N"] ** 2 * cfgs["D"]
    inside = cfgs[(cfgs["N"] > cfgs["N"].min()) & (cfgs["N"] < cfgs["N"].max())
                  & (work > work.min()) & (work < work.max())]
    n_test = max(1, round(frac * len(cfgs)))
    if len(inside) < n_test:
        raise ValueError(f"only {len(inside)} interior configurations for {n_test} test ones; "
                         "measure more configurations or lower frac.")
    test_cfgs = inside.sample(n=n_test, random_state=seed)
    is_test = df.set_index(["B", "H", "N", "D"]).index.isin(test_cfgs.set_index(["B", "H", "N", "D"]).index)
    return df[~is_test].copy(), df[is_test].copy()


Features = Callable[[pd.DataFrame], np.ndarray]  # rows with B, H, N, D, causal -> [rows, features]
Fit = Callable[[np.ndarray, np.ndarray], np.ndarray]  # X [rows, features], y [rows] ms -> coef [features]
Metric = Callable[[np.ndarray, np.ndarray], float]  # (pred, true) -> error in percent, e.g. MAPE


class TimePredictor:
    """One time model per (backend, causal, mode): ms ~ features(rows) @ coef, coef = fit(X, y).

    With ``nonnegative`` a coefficient that comes out negative (a "cost" below zero, which has
    no physical meaning) is dropped and the rest refitted, until all are >= 0.

    Args:
        features: e.g. notebook 04's ``design_matrix``; fit: e.g. its ``fit_time_model``.
    """

    GROUP = ["backend", "causal", "mode"]

    def __init__(self, features: Features, fit: Fit, *, nonnegative: bool = True):
        self.features, self._fit, self.nonnegative = features, fit, nonnegative
        self.coef: dict[tuple, np.ndarray] = {}

    def fit(self, df: pd.DataFrame) -> "TimePredictor":
        """Fit every group of ``df`` (rows with status "ok") that has more rows than features."""
        for key, g in df[df["status"] == "ok"].groupby(self.GROUP):
            X = np.asarray(self.features(g), dtype=float)
            if len(g) > X.shape[1]:
                self.coef[key] = self._fit_group(X, g["ms"].to_numpy(dtype=float))
        if not self.coef:
            raise ValueError("no group had more ok rows than features; measure more configurations.")
        return self

    def _fit_group(self, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        active = list(range(X.shape[1]))
        while True:
            coef = np.zeros(X.shape[1])
            coef[active] = np.asarray(self._fit(X[:, active], y), dtype=float)
            if not self.nonnegative or (coef >= 0).all() or len(active) == 1:
                return coef
            active.remove(int(np.argmin(coef)))

    def predict(self, df: pd.DataFrame) -> np.ndarray:
        """Predicted ms per row (NaN for a group that was not fitted)."""
        X = np.asarray(self.features(df), dtype=float)
        keys = df[self.GROUP].itertuples(index=False, name=None)
        return np.array([x @ self.coef[k] if k in self.coef else np.nan for x, k in zip(X, keys)])

    def evaluate(self, df: pd.DataFrame, metric: Metric) -> pd.DataFrame:
        """Per group of ``df``'s ok rows (e.g. held-out configurations): n, the ``metric`` over
        the group (mape_pct when ``metric`` is a MAPE) and its worst single row (max_ape_pct)."""
        ok = df[df["status"] == "ok"].assign(pred_ms=lambda d: self.predict(d)).dropna(subset=["pred_ms"])
        rows = [dict(zip(self.GROUP, key), n=len(g), mape_pct=metric(g["pred_ms"].to_numpy(), g["ms"].to_numpy()),
                     max_ape_pct=max(metric(np.array([p]), np.array([t])) for p, t in zip(g["pred_ms"], g["ms"])))
                for key, g in ok.groupby(self.GROUP)]
        return pd.DataFrame(rows, columns=[*self.GROUP, "n", "mape_pct", "max_ape_pct"])
