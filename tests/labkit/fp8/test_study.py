"""labkit.fp8.study on notebook 10's reference pipeline over a torch stand-in of fp8_attention (tests/support)."""
from __future__ import annotations

import time

import pytest
import torch
from fp8_standin import fp8_attention
from nb10_answers_loader import answers

from labkit.fp8 import study


@pytest.fixture(scope="module")
def pipeline():
    return answers(fp8_attention)["fp8_pipeline"]


def test_reference_and_bf16_attention_agree_with_sdpa():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g, dtype=torch.float64) for _ in range(3))
    for causal in (False, True):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert torch.allclose(study.reference(q, k, v, causal), want, atol=1e-12)
        got = study.bf16_attention(q, k, v, causal)
        assert got.dtype == torch.bfloat16 and 0 < study.rmse(got, want) < 2e-2


def test_run_is_a_table_of_every_case_and_configuration_in_seconds(pipeline):
    start = time.perf_counter()
    df = study.run(pipeline)
    assert time.perf_counter() - start < 10                               # ~0.5 s on one core
    assert len(df) == 3 * 12 and set(df["case"]) == {"gaussian", "outliers", "sink"}
    assert (df["ratio"] == df["rmse_fp8"] / df["rmse_bf16"]).all() and (df["ratio"] > 1).all()
    gauss = df[df["case"] == "gaussian"]
    assert gauss["rmse_fp8"].max() < 2e-2                                  # e4m3 rounding of unit inputs: ~5e-3
    ax = study.plot(df)
    assert ax.get_yscale() == "log" and len(ax.patches) == 36


def test_goals_hold_for_the_reference_pipeline(pipeline):
    got = study.goals(pipeline)
    assert got["outliers"] == pytest.approx(2.95, abs=0.01) and got["sink"] == pytest.approx(4.43, abs=0.01)
    larger = study.goals(pipeline, {goal: {"seed": 0, "B": 1, "H": 2, "N": 256, "D": 64} for goal in study.GOAL_RUNS})
    assert larger["outliers"] >= 3 and larger["sink"] >= 4.5                            # measured 3.14 and 5.09


def test_goals_fail_for_a_pipeline_that_ignores_rotation_and_p_scale(pipeline):
    def careless(q, k, v, **kw):
        return pipeline(q, k, v, **{**kw, "rotate": False, "quant": "tensor", "p_scale": 1.0, "reverse": False})
    got = study.goals(careless)
    assert got["outliers"] == pytest.approx(1.0) and got["sink"] == pytest.approx(1.0)


def test_unknown_case_is_refused():
    with pytest.raises(ValueError, match="case must be one of"):
        study.case_inputs("uniform")
