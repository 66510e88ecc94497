"""labkit.engine.explain: auto's choice, and every backend's role in it, as a student reads it."""
from __future__ import annotations

import math

import pytest
import torch

from labkit.engine import attention as A
from labkit.engine import explain


def qkv(b=1, h=2, n=32, d=16, nk=None, seed=0, grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=gen)
    k, v = (torch.randn(b, h, nk or n, d, generator=gen) for _ in range(2))
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(A, "_AUTO_CACHE", {})
    monkeypatch.setattr(A, "_AUTO_TIMINGS", {})


def test_every_backend_has_one_role_and_a_reason():
    table = explain.auto(*qkv())
    assert list(table["backend"]) == list(A.BACKENDS)
    assert set(table["role"]) <= set(explain.ROLES) and (table["why"].str.len() > 0).all()
    assert (table["role"] == "chosen").sum() == 1
    assert table.attrs["chosen"] == table.loc[table["role"] == "chosen", "backend"].item() == A.auto_choice(*qkv())


def test_a_cpu_has_one_fused_candidate_taken_without_timing():
    table = explain.auto(*qkv()).set_index("backend")
    assert table.attrs["chosen"] == "sdpa_flash" and "only candidate" in table.loc["sdpa_flash", "why"]
    assert table.loc["sdpa_math", "role"] == "not a candidate" and "fused" in table.loc["sdpa_math", "why"]
    assert table.loc["reference", "role"] == "not a candidate"
    assert table.loc["sdpa_cudnn", "role"] == "cannot run here" and "CUDA" in table.loc["sdpa_cudnn", "why"]
    assert table["median_ms"].isna().all() and "no timing" in table.attrs["situation"]
    assert "forward only" in table.attrs["situation"]


def test_causal_with_more_keys_than_queries_falls_back_to_the_reference_on_a_cpu():
    table = explain.auto(*qkv(n=8, nk=24), causal=True).set_index("backend")
    assert table.attrs["chosen"] == "reference"
    assert table.loc["sdpa_flash", "role"] == "cannot run here"


def test_timed_candidates_show_their_times_and_the_fastest_is_chosen(monkeypatch):
    monkeypatch.setattr(A, "auto_candidates", lambda *a, **kw: ["sdpa_flash", "sdpa_math"])
    table = explain.auto(*qkv(grad=True), causal=True).set_index("backend")
    timed = table[table["role"].isin(["chosen", "timed"])]
    assert sorted(timed.index) == ["sdpa_flash", "sdpa_math"]
    assert timed["median_ms"].gt(0).all() and timed["median_ms"].idxmin() == table.attrs["chosen"]
    loser = timed.index[timed.index != table.attrs["chosen"]][0]
    assert table.loc[loser, "vs_chosen"] >= 1 and f"{table.loc[loser, 'vs_chosen']:.2f}x" in table.loc[loser, "why"]
    assert table.loc[table.attrs["chosen"], "vs_chosen"] == 1
    assert "forward+backward" in table.attrs["situation"] and "timed in turns" in table.attrs["situation"]


def test_a_candidate_that_fails_while_timed_says_why(monkeypatch):
    def broken(*args):
        raise RuntimeError("no kernel for this shape\nsecond line")

    monkeypatch.setitem(A.RUNNERS, "sdpa_efficient", broken)
    monkeypatch.setattr(A, "auto_candidates", lambda *a, **kw: ["sdpa_flash", "sdpa_efficient"])
    table = explain.auto(*qkv()).set_index("backend")
    assert table.attrs["chosen"] == "sdpa_flash"
    assert table.loc["sdpa_efficient", "role"] == "failed while timing"
    assert table.loc["sdpa_efficient", "why"] == "no kernel for this shape"
    assert math.isnan(table.loc["sdpa_efficient", "median_ms"])


def test_bad_input_is_refused_with_the_attention_entry_point_s_message():
    q, k, v = qkv()
    with pytest.raises(A.AttentionInputError, match="layout"):
        explain.auto(q, k, v, layout="bshd")
    with pytest.raises(A.AttentionInputError, match="head dim"):
        explain.auto(q, k[..., :8], v[..., :8])
