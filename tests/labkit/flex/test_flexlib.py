"""labkit.flex.lib and labkit.flex.bench: flex_attention across versions, a block mask's lists and plot, the GPU sweep."""
from __future__ import annotations

import math
import warnings

import matplotlib
import pandas as pd
import pytest
import torch

from labkit.core import plots
from labkit.flex import bench as flexbench, lib as flexlib, varlen

matplotlib.use("Agg")


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def dense(q, k, v, allowed):
    s = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1).nan_to_num() @ v.double(), lse


@pytest.mark.parametrize("Nq, Nk", [(20, 20), (20, 33)])
def test_flex_returns_o_and_lse_of_the_masked_scores(Nq, Nk):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for n in (Nq, Nk, Nk))
    o, lse = flexlib.flex(q, k, v, mask_mod=causal, block=16)
    o_ref, lse_ref = dense(q, k, v, torch.arange(Nq).view(Nq, 1) >= torch.arange(Nk).view(1, Nk))
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(lse, lse_ref)


def test_flex_gives_zero_and_minus_inf_for_a_row_that_sees_nothing():
    q = torch.randn(1, 1, 8, 4, dtype=torch.float64)
    o, lse = flexlib.flex(q, q, q, mask_mod=lambda b, h, q_idx, kv_idx: (q_idx >= 3) & (q_idx >= kv_idx), block=8)
    assert torch.equal(o[..., :3, :], torch.zeros_like(o[..., :3, :])) and torch.isneginf(lse[..., :3]).all()
    assert torch.isfinite(o).all()


def test_torch_lists_and_state_grid_of_causal_with_a_tail_block():
    lists = flexlib.torch_lists(causal, 40, 40, 16)
    assert set(lists) == set(flexlib.LIST_NAMES)
    grid = flexlib.state_grid(lists["kv_num_blocks"], lists["kv_indices"], lists["full_kv_num_blocks"],
                              lists["full_kv_indices"])
    # diagonal partial, below full, above empty; the tail query block (rows 32..47, only 32..39 real) is never full
    assert grid.tolist() == [[1, 0, 0], [2, 1, 0], [1, 1, 1]]


def test_plot_grids_draws_one_panel_per_mask():
    plots.use_theme()   # Chinese labels only with a CJK font in rcParams
    grids = {"a": torch.tensor([[1, 0], [2, 1]]), "b": torch.tensor([[2, 2], [0, 1]])}
    fig = flexlib.plot_grids(grids, title="t")
    assert len(fig.axes) == 2


def test_kwargs_keeps_only_what_a_function_accepts():
    def fn(q, window_size=None):
        return q

    assert varlen.kwargs_accepted(fn, window_size=(4, 0), is_causal=True) == {"window_size": (4, 0)}


def sweep_rows(rows):
    import pandas as pd

    cols = ("d", "N", "mask", "density", "backend", "pass", "ms")
    return pd.DataFrame([dict(zip(cols, r), status="ok", first_call_s=0.0) for r in rows])


def test_ratios_and_density_speedup_read_the_sweep_per_pass():
    df = sweep_rows([(128, 8192, "causal", 0.5, "mine", "fwd", 1.0), (128, 8192, "causal", 0.5, "flex_triton", "fwd", 0.9),
                     (128, 8192, "causal", 0.5, "mine", "fwd+bwd", 4.0),
                     (128, 8192, "causal", 0.5, "flex_triton", "fwd+bwd", 6.0),
                     (128, 8192, "docs", 0.05, "mine", "fwd", 0.1), (128, 8192, "docs", 0.05, "mine", "fwd+bwd", 0.8)])
    r = flexbench.ratios(df)
    assert r.loc[(128, 8192, "causal"), "flex_triton / mine fwd"] == pytest.approx(0.9)
    assert r.loc[(128, 8192, "causal"), "flex_triton / mine fwd+bwd"] == pytest.approx(1.5)
    s = flexbench.density_speedup(df, "causal", "docs")
    assert s.loc[(128, 8192)].to_dict() == pytest.approx({"speed-up fwd": 10.0, "speed-up fwd+bwd": 5.0,
                                                          "density ratio": 10.0})


def test_variant_cost_gives_the_median_extra_and_the_range_the_spread_allows():
    df = sweep_rows([(128, 8192, "causal", 0.5, "mine", "fwd", 1.00), (128, 8192, "causal", 0.5, "mine_sink", "fwd", 1.06),
                     (128, 8192, "causal", 0.5, "mine", "fwd+bwd", 4.0)])
    df["p20_ms"] = df["ms"] * 0.98
    df["p80_ms"] = df["ms"] * 1.02
    cost = flexbench.variant_cost(df, "mine_sink").loc[(128, 8192, "causal")]
    assert cost["extra"] == pytest.approx(0.06)
    assert cost["low"] == pytest.approx(1.06 * 0.98 / 1.02 - 1) and cost["high"] == pytest.approx(1.06 * 1.02 / 0.98 - 1)
    assert cost["low"] < 0.05 < cost["extra"]   # a median past a +5% goal whose spread still reaches under it


def test_calls_time_both_passes_and_refused_backends_become_a_status():
    """On a CPU: every backend gets a fwd and a fwd+bwd call; SDPA's fwd+bwd gives autograd's gradients."""
    from torch.nn.attention.flex_attention import create_block_mask

    torch.manual_seed(0)
    N = 32
    q, k, v = (torch.randn(1, 2, N, 8, dtype=torch.float64) for _ in range(3))
    bm = create_block_mask(causal, None, None, N, N, device="cpu", BLOCK_SIZE=16)
    lists = {name: getattr(bm, name)[0, 0] for name in flexbench.LIST_NAMES}
    seen = []

    def mine(q, k, v, lists, block, case, N):
        seen.append(sorted(lists))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o, torch.zeros(q.shape[:-1])

    def mine_backward(q, k, v, o, lse, do, lists, block, case, N):
        return q, k, v

    calls, failed = flexbench._calls(q, k, v, lists, dict(name="causal", kind="causal"), N, bm, causal, mine=mine,
                                     mine_backward=mine_backward, also=None, passes=flexbench.PASSES, dense_limit=N)
    built = set(calls) | set(failed)
    for name in ("mine", "flex_triton", "flex_flash", "sdpa_mask", "fa4"):
        assert {(name, "fwd"), (name, "fwd+bwd")} <= built, name
    calls[("mine", "fwd+bwd")]()
    assert seen[-1] == sorted(flexbench.LIST_NAMES)   # the backward's transposed lists are passed too
    torch.manual_seed(1)
    got = calls[("sdpa_mask", "fwd+bwd")]()                  # dO drawn at the first call
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
    torch.manual_seed(1)
    o.backward(torch.randn_like(o))
    for g, want in zip(got, (qg.grad, kg.grad, vg.grad)):
        torch.testing.assert_close(g, want)
    if not torch.cuda.is_available():
        assert all(status for status in failed.values())


@pytest.mark.parametrize("params, want", [({"window_size": (-1, -1)}, {"window_size": (-1, 0)}),
                                          ({"is_causal": False}, {"is_causal": True})])
def test_varlen_attend_reads_the_causal_keyword_off_the_installed_signature(monkeypatch, params, want):
    import torch.nn.attention.varlen as torch_varlen

    got = {}
    name, default = next(iter(params.items()))
    exec(f"def fake(q, k, v, cu_q, cu_k, max_q, max_k, *, {name}={default!r}):\n"
         f"    got.update({name}={name}, max=max_q)\n    return q", {"got": got}, scope := {})
    monkeypatch.setattr(torch_varlen, "varlen_attn", scope["fake"])
    q = torch.randn(6, 2, 4)
    assert varlen.varlen_attend(q, q, q, torch.tensor([0, 2, 6], dtype=torch.int32), 4) is q
    assert got == {**want, "max": 4}


def test_sweep_on_a_cpu_gives_a_row_per_backend_and_pass_with_a_status(monkeypatch):
    """The sweep end to end at a toy size (flex eager: torch.compile would take ~20 s on a CPU)."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)

    def mine(q, k, v, lists, block, case, N):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), torch.zeros(q.shape[:-1])

    def mine_backward(q, k, v, o, lse, do, lists, block, case, N):
        return q, k, v

    cases = [dict(name="causal", kind="causal", rule=lambda N: causal),
             dict(name="2 documents", kind="document", document_id=lambda N: torch.arange(N) * 2 // N,
                  rule=lambda N: lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & ((q_idx * 2 // N) == (kv_idx * 2 // N)))]
    df = flexbench.sweep(cases, {16: [256]}, mine=mine, mine_backward=mine_backward, H=2, dtype=torch.float32,
                         target_ms=1, dense_limit=256, progress=False, device="cpu")   # two blocks of 128
    assert set(df["pass"]) == set(flexbench.PASSES) and set(df["mask"]) == {"causal", "2 documents"}
    ok = df[df["status"] == "ok"]
    assert (ok["p20_ms"] <= ok["ms"]).all() and (ok["ms"] <= ok["p80_ms"]).all()
    assert {("mine", "fwd"), ("mine", "fwd+bwd"), ("sdpa_mask", "fwd+bwd"), ("flex_triton", "fwd")} <= set(
        zip(ok["backend"], ok["pass"])) and (ok["ms"] > 0).all()
    flex_bwd = df[(df["backend"] == "flex_triton") & (df["pass"] == "fwd+bwd")]["status"]
    assert flex_bwd.str.contains("backward on CPU").all()   # a backend's failure is its row's status
    assert df.groupby("mask")["density"].first()["2 documents"] < df.groupby("mask")["density"].first()["causal"]


def test_sweep_notes_a_block_mask_that_could_not_be_built_and_goes_on(monkeypatch):
    def too_big(rule, N, device):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(flexbench, "build_block_mask", too_big)
    cases = [dict(name="huge", kind="causal", rule=lambda N: causal)]
    df = flexbench.sweep(cases, {16: [256]}, mine=None, H=1, progress=False, device="cpu")
    assert df["backend"].tolist() == ["create_block_mask"] and (df["status"] == "oom").all()


def test_build_block_mask_compiles_only_when_the_eager_build_runs_out_of_memory(monkeypatch):
    import torch.nn.attention.flex_attention as fa

    real, calls = fa.create_block_mask, []

    def eager_too_big(rule, B, H, Nq, Nk, device, BLOCK_SIZE, _compile=False):
        calls.append("eager")
        assert not _compile, "the deprecated _compile flag warns: compile with torch.compile(create_block_mask)"
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    def compiled(fn):
        assert fn is eager_too_big
        calls.append("torch.compile")
        return lambda rule, B, H, Nq, Nk, device, BLOCK_SIZE: real(rule, B, H, Nq, Nk, device=device,
                                                                   BLOCK_SIZE=BLOCK_SIZE)   # the compiled build

    assert flexbench.build_block_mask(causal, 256, "cpu").kv_num_blocks.shape[-1] == 2 and calls == []
    monkeypatch.setattr(fa, "create_block_mask", eager_too_big)
    monkeypatch.setattr(torch, "compile", compiled)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bm = flexbench.build_block_mask(causal, 384, "cpu")
    assert calls == ["eager", "torch.compile"] and bm.full_kv_num_blocks[0, 0].tolist() == [0, 1, 2]

    def broken(rule, B, H, Nq, Nk, device, BLOCK_SIZE, _compile=False):
        calls.append("eager")
        raise ValueError("a rule with a bug")

    monkeypatch.setattr(fa, "create_block_mask", broken)
    calls.clear()
    with pytest.raises(ValueError, match="bug"):   # only out of memory falls through to the compiled build
        flexbench.build_block_mask(causal, 256, "cpu")
    assert calls == ["eager"]


def test_block_mask_cost_times_each_rule_and_an_oom_rule_reads_oom():
    def too_big(b, h, q_idx, kv_idx):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    df = flexbench.block_mask_cost({"causal": causal, "huge": too_big}, 256, reps=2, device="cpu")
    rows = df.set_index("mask")
    assert rows.loc["causal", "status"] == "ok" and rows.loc["causal", "first_ms"] > 0 < rows.loc["causal", "later_ms"]
    assert rows.loc["huge", "status"] == "oom" and pd.isna(rows.loc["huge", "first_ms"])


@pytest.mark.gpu
def test_sweep_times_every_backend_or_says_why_not():
    def mine(q, k, v, lists, block, case, N):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o, torch.zeros(q.shape[:-1], device=q.device)

    def mine_backward(q, k, v, o, lse, do, lists, block, case, N):
        return q, k, v

    cases = [dict(name="causal", kind="causal", rule=lambda N: causal)]
    df = flexbench.sweep(cases, {64: [1024]}, mine=mine, mine_backward=mine_backward, H=2, target_ms=2)
    assert {"mine", "flex_triton", "sdpa_mask"} <= set(df["backend"]) and set(df["pass"]) == set(flexbench.PASSES)
    assert (df.loc[df["backend"] == "mine", "status"] == "ok").all()


def test_sweep_times_the_forwards_together_and_the_forward_backwards_together(monkeypatch):
    """A 0.2-ms forward timed in turns with 15-ms forward+backwards would pay for what they leave behind."""
    groups, min_reps = [], []

    def fake(fns, **kwargs):
        groups.append(sorted(fns))
        min_reps.append(kwargs["min_reps"])
        return {key: key[0] for key in fns}, {}
    monkeypatch.setattr(flexbench.measure, "time_interleaved", fake)
    calls = {(name, p): None for name in ("mine", "flex_triton") for p in flexbench.PASSES}
    calls[("mine_sink", "fwd")] = None
    timings, errors = flexbench._timed_by_pass(calls, "cpu", 30.0)
    assert groups == [[("flex_triton", "fwd"), ("mine", "fwd"), ("mine_sink", "fwd")],
                      [("flex_triton", "fwd+bwd"), ("mine", "fwd+bwd")]]
    assert timings == {key: key[0] for key in calls} and errors == {}
    assert min_reps == [6, 5], "a slow call is timed for a whole balanced round of turns (3 calls: 6; never below 5)"
