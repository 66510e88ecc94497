"""labkit.flexlib and labkit.flexbench: flex_attention across versions, a block mask's lists and plot, the GPU sweep."""
from __future__ import annotations

import math

import matplotlib
import pytest
import torch

from labkit import flexbench, flexlib, plots

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

    assert flexbench._kwargs(fn, window_size=(4, 0), is_causal=True) == {"window_size": (4, 0)}


@pytest.mark.gpu
def test_sweep_times_every_backend_or_says_why_not():
    def mine(q, k, v, lists, block, case, N):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    cases = [dict(name="causal", kind="causal", rule=lambda N: causal)]
    df = flexbench.sweep(cases, [1024], mine=mine, H=2, d=64, target_ms=2)
    assert {"mine", "flex_triton", "sdpa_mask"} <= set(df["backend"])
    assert (df.loc[df["backend"] == "mine", "status"] == "ok").all()
