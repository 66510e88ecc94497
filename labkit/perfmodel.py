"""Performance models: how far attention can go, how long it takes, how much memory it needs.

- IO and roofline: :func:`io_model` (FLOPs, HBM bytes and arithmetic intensity of each phase of
  standard attention vs one fused FlashAttention pass), :func:`roofline_points`,
  :func:`roofline_plot` against peaks measured by :mod:`labkit.bench`.
- Prediction: :func:`time_grid` (a fast forward-time sweep), :func:`holdout_split`,
  :class:`TimePredictor` (relative least squares on FLOPs, score elements, token elements).
- Memory: :class:`ModelShape`, :func:`training_memory`, :func:`recommend`, :func:`max_seq_len`.

The profiler wrappers (kernel tables, traces, memory snapshots) live in :mod:`labkit.profiling`.

Used in: 03_long_sequence_training, 04_performance_analysis.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import pandas as pd
import torch

from . import attention as attn
from . import bench
from .env import device_info

SOFTMAX_FLOP = 5  # per score element: max, subtract, exp, sum, divide
STANDARD = ("standard", "reference", "sdpa_math", "eager")  # attention that writes the N x N scores to memory


# ----------------------------------------------------------------------------- IO and roofline

def io_model(B: int, H: int, N: int, D: int, *, causal: bool = False, elem_bytes: int = 2,
             block_m: int = 128) -> pd.DataFrame:
    """FLOPs, HBM bytes and arithmetic intensity of one attention forward, phase by phase.

    Standard attention (FlashAttention paper, Algorithm 0) writes S = QK^T and P = softmax(S)
    ([B, H, N, N] each, ``elem_bytes`` per element) to memory: Theta(N D + N^2) bytes. The
    materialized version computes all N x N scores even when causal (the mask is applied after).
    FlashAttention-2 loops over K/V tiles inside each ``block_m``-row Q tile: it reads Q once,
    K and V once per Q tile, writes O and the fp32 log-sum-exp: Theta(N^2 D^2 / M) bytes with
    block_m = Theta(M / D) for on-chip memory M. "compulsory" is Q, K, V, O moved once (the
    floor when the K/V re-reads hit in L2 cache). Causal FlashAttention skips tiles above the
    diagonal (half the FLOPs, about half the K/V reads).

    Returns:
        DataFrame with columns algorithm, phase, flop, bytes, intensity (FLOP per byte).
    """
    for name, val in dict(B=B, H=H, N=N, D=D, elem_bytes=elem_bytes, block_m=block_m).items():
        if int(val) != val or val < 1:
            raise ValueError(f"{name} must be a positive integer, got {val!r}.")
    bh, s, nn = B * H, elem_bytes, N * N
    rows = [("standard", "QK^T", 2 * bh * nn * D, s * bh * (2 * N * D + nn)),
            ("standard", "softmax", SOFTMAX_FLOP * bh * nn, s * bh * 2 * nn),
            ("standard", "PV", 2 * bh * nn * D, s * bh * (nn + 2 * N * D))]
    rows.append(("standard", "total", sum(r[2] for r in rows), sum(r[3] for r in rows)))
    tiles = math.ceil(N / block_m)
    ends = np.minimum(N, block_m * np.arange(1, tiles + 1))  # Q tile i sees keys < ends[i] when causal
    kv_rows = float(ends.sum()) if causal else float(N * tiles)  # K/V rows read over all Q tiles
    frac = 0.5 if causal else 1.0
    flash_flop = attn.flops(B, H, N, D, causal=causal) + SOFTMAX_FLOP * bh * nn * frac
    rows.append(("flash", "fused (tiled)", flash_flop, s * bh * (2 * N * D + 2 * kv_rows * D) + 4 * bh * N))
    rows.append(("flash", "fused (compulsory)", flash_flop, s * bh * 4 * N * D + 4 * bh * N))
    df = pd.DataFrame(rows, columns=["algorithm", "phase", "flop", "bytes"]).astype({"flop": float, "bytes": float})
    df["intensity"] = df["flop"] / df["bytes"]
    return df


def kind(backend: str) -> str:
    """"standard" for backends that materialize the scores, "flash" for fused ones."""
    return "standard" if backend in STANDARD else "flash"


def roofline_points(timings: pd.DataFrame, *, elem_bytes: int = 2, block_m: int = 128) -> pd.DataFrame:
    """Place measured forward times on the roofline.

    Args:
        timings: rows with backend, B, H, N, D, causal, ms (e.g. from :func:`time_grid`).

    Returns:
        ``timings`` plus kind, flop, bytes, intensity (model FLOP per byte: standard "total",
        flash "fused (tiled)"), intensity_compulsory (flash only: Q, K, V, O moved once) and
        achieved_tflops (model FLOPs / measured time).
    """
    rows = []
    for r in timings.itertuples():
        model = io_model(r.B, r.H, r.N, r.D, causal=bool(r.causal), elem_bytes=elem_bytes,
                         block_m=block_m).set_index("phase")
        k = kind(r.backend)
        picked = model.loc["total" if k == "standard" else "fused (tiled)"]
        rows.append(dict(kind=k, flop=picked["flop"], bytes=picked["bytes"], intensity_compulsory=(
            np.nan if k == "standard" else model.loc["fused (compulsory)", "intensity"])))
    out = timings.copy()
    for name, values in pd.DataFrame(rows, index=timings.index).items():
        out[name] = values
    out["intensity"] = out["flop"] / out["bytes"]
    out["achieved_tflops"] = out["flop"] / (out["ms"] * 1e-3) / 1e12
    return out


def attainable_tflops(intensity, peak_tflops: float, bandwidth: float):
    """Roofline: min(peak compute, intensity * bandwidth) in TFLOP/s (bandwidth in bytes/s)."""
    return np.minimum(peak_tflops, np.asarray(intensity, dtype=float) * bandwidth / 1e12)


def roofline_plot(points: pd.DataFrame, *, peak_tflops: float, bandwidth: float, ax=None,
                  label_col: str = "backend"):
    """Log-log roofline with the measured roofs and one marker per row of ``points``
    (:func:`roofline_points`: intensity, achieved_tflops, ``label_col``); for flash rows a
    hollow marker at intensity_compulsory, joined by a line: the real traffic lies in between.
    Returns the Axes."""
    import matplotlib.pyplot as plt

    from .plots import label

    ax = ax or plt.subplots(figsize=(6.4, 4.2))[1]
    ridge = peak_tflops * 1e12 / bandwidth
    xs = pd.concat([points["intensity"], points.get("intensity_compulsory", points["intensity"])]).dropna()
    lo, hi = min(xs.min(), ridge) / 4, max(xs.max(), ridge) * 4
    x = np.geomspace(lo, hi, 200)
    ax.plot(x, attainable_tflops(x, peak_tflops, bandwidth), color="black", lw=1.5,
            label=label("量測的屋頂線", "measured roofline"))
    ax.axvline(ridge, color="gray", ls=":", lw=1)
    for name, g in points.groupby(label_col, sort=False):
        dots = ax.scatter(g["intensity"], g["achieved_tflops"], s=45, label=str(name), zorder=3)
        if "intensity_compulsory" in g and g["intensity_compulsory"].notna().any():
            ax.scatter(g["intensity_compulsory"], g["achieved_tflops"], s=45, facecolors="none",
                       edgecolors=dots.get_facecolor(), zorder=3)
            ax.hlines(g["achieved_tflops"], g["intensity"], g["intensity_compulsory"],
                      colors=dots.get_facecolor(), lw=0.8, alpha=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(label("算術強度 (FLOP/byte)", "arithmetic intensity (FLOP/byte)"))
    ax.set_ylabel(label("達成 TFLOP/s", "achieved TFLOP/s"))
    ax.legend(fontsize=8)
    return ax


# ----------------------------------------------------------------------------- measured sweeps

def time_grid(configs: list[dict], backends: Iterable[str], *, causal: Iterable[bool] = (False,),
              dtype=None, device=None, target_ms: float = 25.0, max_score_gib: float = 2.0,
              seed: int = 0, progress: bool = True) -> pd.DataFrame:
    """Forward time of each backend on each configuration; one row per (config, causal, backend).

    Built for the many configurations a predictor needs: inputs are drawn once per configuration
    on the device and only the forward is timed (with :func:`labkit.bench.time_fn`), whereas
    :func:`labkit.bench.attention_sweep` also measures memory and error on fresh inputs per row.
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


# ----------------------------------------------------------------------------- time predictor

FEATURES = ("matmul_flop", "score_elems", "token_elems", "const")


def time_features(df: pd.DataFrame) -> np.ndarray:
    """[rows, 4] features of a forward: matmul FLOPs 4*B*H*N^2*D (halved if causal), score
    elements B*H*N^2 (halved if causal; softmax work), token elements B*H*N*D (loading Q, K, V,
    writing O), and a constant (launch overhead)."""
    B, H, N, D = (df[k].to_numpy(dtype=float) for k in "BHND")
    c = np.where(df["causal"].to_numpy(dtype=bool), 0.5, 1.0) if "causal" in df else 1.0
    return np.stack([4 * B * H * N * N * D * c, B * H * N * N * c, B * H * N * D, np.ones_like(B)], axis=1)


def fit_time_model(X, y, *, nonnegative: bool = True) -> np.ndarray:
    """Least squares on relative error: minimize sum(((X @ coef) - y) / y)^2.

    Columns are rescaled for conditioning. With ``nonnegative`` a coefficient that comes out
    negative (a "cost" below zero) is dropped and the rest refitted, until all are >= 0.

    Args:
        X: [rows, features]; y: [rows] measured times (> 0).

    Returns:
        coef: [features].
    """
    X, y = np.asarray(X, dtype=float), np.asarray(y, dtype=float)
    if X.ndim != 2 or y.shape != (X.shape[0],):
        raise ValueError(f"X must be [rows, features] and y [rows]; got {X.shape} and {y.shape}.")
    if X.shape[0] < X.shape[1] or not np.all(y > 0):
        raise ValueError("need at least as many rows as features and every y > 0; measure more configurations.")
    A = X / y[:, None]
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    active = list(range(X.shape[1]))
    while True:
        coef = np.zeros(X.shape[1])
        coef[active] = np.linalg.lstsq(A[:, active] / scale[active], np.ones(len(y)), rcond=None)[0] / scale[active]
        if not nonnegative or (coef >= 0).all() or len(active) == 1:
            return coef
        active.remove(int(np.argmin(coef)))


def mape(pred, true) -> float:
    """Mean absolute percentage error, in percent."""
    pred, true = np.asarray(pred, dtype=float), np.asarray(true, dtype=float)
    if pred.shape != true.shape or true.size == 0:
        raise ValueError(f"pred {pred.shape} and true {true.shape} must be non-empty and of one shape.")
    return float(100 * np.mean(np.abs(pred - true) / np.abs(true)))


class TimePredictor:
    """One relative least-squares time model (:func:`fit_time_model`) per (backend, causal, mode)."""

    GROUP = ["backend", "causal", "mode"]

    def __init__(self, *, nonnegative: bool = True):
        self.nonnegative = nonnegative
        self.coef: dict[tuple, np.ndarray] = {}

    def fit(self, df: pd.DataFrame) -> "TimePredictor":
        """Fit every group of ``df`` (rows with status "ok") that has more rows than features."""
        ok = df[df["status"] == "ok"]
        for key, g in ok.groupby(self.GROUP):
            if len(g) > len(FEATURES):
                self.coef[key] = fit_time_model(time_features(g), g["ms"], nonnegative=self.nonnegative)
        if not self.coef:
            raise ValueError(f"no group had more than {len(FEATURES)} ok rows; measure more configurations.")
        return self

    def predict(self, df: pd.DataFrame) -> np.ndarray:
        """Predicted ms per row (NaN for a group that was not fitted)."""
        X = time_features(df)
        keys = df[self.GROUP].itertuples(index=False, name=None)
        return np.array([x @ self.coef[k] if k in self.coef else np.nan for x, k in zip(X, keys)])

    def evaluate(self, df: pd.DataFrame) -> pd.DataFrame:
        """MAPE and worst error per group on ``df`` (e.g. held-out configurations)."""
        ok = df[df["status"] == "ok"].assign(pred_ms=lambda d: self.predict(d)).dropna(subset=["pred_ms"])
        ape = 100 * (ok["pred_ms"] - ok["ms"]).abs() / ok["ms"]
        out = ok.assign(ape=ape).groupby(self.GROUP)["ape"].agg(n="size", mape_pct="mean", max_ape_pct="max")
        return out.reset_index()


# ----------------------------------------------------------------------------- memory model

@dataclass(frozen=True)
class ModelShape:
    """A GPT-2-style decoder: the sizes that set its training memory."""

    n_layer: int
    n_embd: int  # hidden size h
    n_head: int
    vocab: int = 50257
    n_positions: int = 1024  # learned positions; extended to the sequence length when longer

    @classmethod
    def gpt2(cls, size: str = "small", n_positions: int = 1024) -> "ModelShape":
        """GPT-2 small / medium / large / xl."""
        sizes = {"small": (12, 768, 12), "medium": (24, 1024, 16), "large": (36, 1280, 20), "xl": (48, 1600, 25)}
        if size not in sizes:
            raise ValueError(f"unknown GPT-2 size {size!r}; choose one of {', '.join(sizes)}.")
        return cls(*sizes[size], n_positions=n_positions)

    def n_params(self, seq_len: int = 0) -> int:
        """Parameters (tied embeddings), with positions extended to ``seq_len`` when longer."""
        h, pos = self.n_embd, max(self.n_positions, seq_len)
        return self.vocab * h + pos * h + self.n_layer * (12 * h * h + 13 * h) + 2 * h


@dataclass(frozen=True)
class MemoryCoefficients:
    """Bytes per unit for bf16-autocast training with fused AdamW (fp32 master weights).

    ``hidden``, ``scores`` and ``logits`` were fitted (least squares on relative error) to the
    peaks the course measured for Hugging Face GPT-2 small on an H100 (torch 2.11, transformers
    5, dropout 0; eager and sdpa, N = 1K-64K, with and without checkpointing): all ten within 3%.
    04_performance_analysis measures the same on the reader's GPU.
    """

    weight: float = 4.0      # fp32 weights, per parameter
    grad: float = 4.0        # fp32 gradients, per parameter
    optimizer: float = 8.0   # AdamW exp_avg + exp_avg_sq, per parameter
    cast: float = 2.0        # bf16 weight copies autocast saves for backward, per parameter
    hidden: float = 94.0     # saved activations per hidden unit, token and layer
    scores: float = 6.0      # per score element and layer (standard attention only)
    lse: float = 4.0         # per head, token and layer (fused attention's fp32 log-sum-exp)
    checkpoint: float = 4.0  # per hidden unit, token and layer kept under checkpointing (fp32 input)
    logits: float = 10.4     # per vocabulary entry and token (bf16 logits, fp32 loss copy, gradient)


def training_memory(shape: ModelShape, *, batch: int, seq_len: int, attention: str = "flash",
                    checkpointing: bool = False, coef: MemoryCoefficients = MemoryCoefficients()) -> dict[str, float]:
    """Predicted peak bytes of one training step, by component.

    Args:
        attention: "standard" (or "eager", "reference", "sdpa_math": N x N scores kept per layer)
            or "flash" (or any fused backend name, "sdpa").
        checkpointing: keep only each layer's input and recompute one layer at a time.

    Returns:
        dict with weights, grads, optimizer, casts, activations, attention, logits, total (bytes).
    """
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch and seq_len must be >= 1, got {batch} and {seq_len}.")
    p, t = shape.n_params(seq_len), batch * seq_len
    h, a, L = shape.n_embd, shape.n_head, shape.n_layer
    known = STANDARD + ("flash", "sdpa", "flash_attention_2") + attn.BACKENDS
    if attention not in known:
        raise ValueError(f"unknown attention {attention!r}; use 'standard', 'flash' or one of {', '.join(known)}.")
    scores = batch * a * seq_len**2 * coef.scores if kind(attention) == "standard" else t * a * coef.lse  # per layer
    layers = 1 if checkpointing else L
    out = dict(weights=coef.weight * p, grads=coef.grad * p, optimizer=coef.optimizer * p, casts=coef.cast * p,
               activations=layers * t * coef.hidden * h + (L * t * coef.checkpoint * h if checkpointing else 0),
               attention=layers * scores, logits=t * shape.vocab * coef.logits)
    out["total"] = sum(out.values())
    return out


def recommend(shape: ModelShape, *, budget_bytes: float, seq_len: int, global_batch: int,
              attention: str = "flash", headroom: float = 0.9,
              coef: MemoryCoefficients = MemoryCoefficients()) -> pd.DataFrame:
    """Every (micro-batch, accumulation, checkpointing) that makes ``global_batch`` sequences per
    optimizer step, with its predicted peak; the ``chosen`` row fits ``headroom * budget_bytes``
    without checkpointing if possible (recomputing the forward costs ~1/3 more compute), then
    with the largest micro-batch (fewest accumulation steps). No row is chosen if none fits:
    see :func:`max_seq_len`."""
    if global_batch < 1 or budget_bytes <= 0:
        raise ValueError("global_batch must be >= 1 and budget_bytes > 0.")
    rows = []
    for ckpt in (False, True):
        for mb in (m for m in range(1, global_batch + 1) if global_batch % m == 0):
            total = training_memory(shape, batch=mb, seq_len=seq_len, attention=attention,
                                    checkpointing=ckpt, coef=coef)["total"]
            rows.append(dict(micro_batch=mb, accumulation=global_batch // mb, checkpointing=ckpt,
                             predicted_gib=total / 2**30, fits=total <= headroom * budget_bytes,
                             compute_factor=4 / 3 if ckpt else 1.0))
    df = pd.DataFrame(rows)
    fit = df[df["fits"]].sort_values(["checkpointing", "micro_batch"], ascending=[True, False])
    df["chosen"] = df.index == (fit.index[0] if len(fit) else -1)
    return df


def max_seq_len(shape: ModelShape, *, budget_bytes: float, attention: str = "flash", checkpointing: bool = False,
                batch: int = 1, headroom: float = 0.9, multiple: int = 256,
                coef: MemoryCoefficients = MemoryCoefficients()) -> int:
    """Longest sequence (a multiple of ``multiple``, at most 2**24) whose predicted peak fits; 0 if none."""
    def fits(n: int) -> bool:
        return training_memory(shape, batch=batch, seq_len=n, attention=attention, checkpointing=checkpointing,
                               coef=coef)["total"] <= headroom * budget_bytes

    lo, hi = 0, 2**24 // multiple  # in units of ``multiple``; memory grows with n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * multiple) else (lo, mid - 1)
    return lo * multiple
