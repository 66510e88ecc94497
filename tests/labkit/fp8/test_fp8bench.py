"""Tests for labkit.fp8.bench, .ceilings and .benchview on a CPU: tiny shapes, torch stand-ins for the kernels.

The sweep's columns and rows, the FLOP count (causal at half), the unavailable and failing paths, the goal
verdicts with the timing spread, the GEMM calls' products and the CPU refusal of gemm_ceiling, the plot and the
report in lk.reference's stored form.
"""
from __future__ import annotations

import base64
import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from labkit.course import reference
from labkit.engine import attention as attn
from labkit.fp8 import bench, benchview, ceilings

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
E4M3 = torch.float8_e4m3fn
TINY = [dict(B=2, H=2, N=32, D=16)]


def quantize(x):
    descale = x.float().abs().amax() / 448
    return (x.float() / descale).clamp(-448, 448).to(E4M3), descale


def dequantized(q8, k8, v8, qd, kd, vd):
    return q8.float() * qd, k8.float() * kd, v8.float() * vd


class StandIn:
    """fp8_attention on dequantized inputs through SDPA; records what each call received."""

    def __init__(self):
        self.seen = []

    def __call__(self, q8, k8, v8, qd, kd, vd, causal, **kwargs):
        self.seen.append((q8.dtype, k8.dtype, v8.dtype, qd.dim(), causal, kwargs))
        o = F.scaled_dot_product_attention(*dequantized(q8, k8, v8, qd, kd, vd), is_causal=causal)
        return o.bfloat16(), torch.zeros(o.shape[:-1])


def bf16_forward(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def test_default_shapes_fix_the_tokens_and_the_width_with_d128_first():
    shapes = bench.default_shapes()
    assert [s["D"] for s in shapes[:4]] == [128] * 4 and {s["D"] for s in shapes} == {64, 128}
    assert sorted({s["N"] for s in shapes}) == [4096, 8192, 16384, 32768]
    assert all(s["B"] * s["N"] == 16384 for s in shapes if s["N"] <= 16384)
    assert all(s["H"] * s["D"] == 2048 for s in shapes)
    assert bench.default_shapes({64: [8192]}) == [dict(B=2, H=32, N=8192, D=64)]


@pytest.fixture(scope="module")
def tiny_sweep():
    kernel, rows = StandIn(), []
    df = bench.sweep(kernel, quantize, bf16_forward=bf16_forward, shapes=TINY, kernel_kwargs=dict(block_m=16),
                     target_ms=2.0, device="cpu", on_row=rows.append)
    return df, kernel, rows


def test_sweep_rows_columns_and_statuses(tiny_sweep):
    df, kernel, rows = tiny_sweep
    assert list(df.columns) == bench.COLUMNS
    assert len(df) == 2 * (2 + len(bench.LIBRARY))                       # causal and not: mine x 2 + library
    pd.testing.assert_frame_equal(pd.DataFrame(rows, columns=bench.COLUMNS), df)   # each row handed out as measured
    by = df.set_index(["causal", "backend"])
    for causal in (False, True):
        assert by.loc[(causal, "fp8_mine"), "status"] == "ok" and by.loc[(causal, "bf16_mine"), "status"] == "ok"
        for name in ("sdpa_cudnn", "fa4"):                                # off a GPU: said, not timed
            assert by.loc[(causal, name), "status"].startswith("unavailable: needs a CUDA GPU")
        assert by.loc[(causal, "sdpa_fp8"), "status"].startswith("unavailable:")
        assert "Float8" in by.loc[(causal, "flex_fp8"), "status"]         # no fp8 kernel for flex on a CPU
    assert set(df.loc[df["backend"].isin(bench.FP8_INPUTS), "inputs"]) == {"e4m3"}
    assert set(df.loc[~df["backend"].isin(bench.FP8_INPUTS), "inputs"]) == {"bf16"}
    assert df.loc[df["status"] != "ok", "ms"].isna().all()


def test_sweep_gives_the_kernel_quantized_inputs_and_its_arguments(tiny_sweep):
    _, kernel, _ = tiny_sweep
    assert {s[:4] for s in kernel.seen} == {(E4M3, E4M3, E4M3, 0)}
    assert {s[4] for s in kernel.seen} == {False, True}
    assert all(s[5] == dict(block_m=16) for s in kernel.seen)


def test_sweep_counts_the_engines_flops_causal_at_half(tiny_sweep):
    df, _, _ = tiny_sweep
    ok = df[df["status"] == "ok"]
    assert (ok["ms"] > 0).all() and (ok["p20_ms"] <= ok["ms"]).all() and (ok["ms"] <= ok["p80_ms"]).all()
    s = TINY[0]
    work = ok["tflops"] * ok["ms"] * 1e9                                   # FLOPs back from TFLOP/s and ms
    expected = [attn.flops(s["B"], s["H"], s["N"], s["D"], causal=c) for c in ok["causal"]]
    assert work.tolist() == pytest.approx(expected)
    assert expected[0] != expected[-1] and 4.0 * 2 * 2 * 32 * 32 * 16 / 2 in expected
    assert ok["pct_peak"].tolist() == pytest.approx((100 * ok["tflops"] / 1979).tolist())
    assert ok["pct_fp8_gemm"].isna().all()                                 # no ceilings given


def test_sweep_share_of_the_fp8_gemm_and_a_failing_kernel():
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    roofs = {"tflops": {"bf16_matmul": 800.0, "fp8_tensorwise": 1200.0, "fp8_rowwise": 1300.0,
                        "fp8_rowwise_fast_accum": None}}
    df = bench.sweep(broken, quantize, bf16_forward=bf16_forward, shapes=TINY, causal=(False,), library=(),
                     ceilings=roofs, target_ms=2.0, device="cpu")
    by = df.set_index("backend")
    assert by.loc["fp8_mine", "status"] == "error: CUDA error: an illegal memory access was encountered"
    assert by.loc["bf16_mine", "status"] == "ok"
    assert by.loc["bf16_mine", "pct_fp8_gemm"] == pytest.approx(100 * by.loc["bf16_mine", "tflops"] / 1300.0)
    with pytest.raises(ValueError, match="unknown library backend 'fa3'"):
        bench.sweep(broken, quantize, bf16_forward=None, shapes=TINY, library=("fa3",), device="cpu")


@pytest.mark.parametrize("causal", [False, True])
def test_flex_fp8_attention_folds_the_descales(causal):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 16, generator=gen) for _ in range(3))
    qd, kd, vd = torch.tensor(0.5), torch.tensor(0.25), torch.tensor(2.0)
    o = bench.flex_fp8_attention(q / qd, k / kd, v / vd, qd, kd, vd, causal)   # fp32 stands in for e4m3 here
    assert o.dtype == torch.bfloat16
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert torch.allclose(o.float(), want, atol=2e-2)


def test_sdpa_fp8_problem_names_what_is_missing(monkeypatch):
    problem = bench.sdpa_fp8_problem()
    assert problem is None or "FA3" in problem or "flash_attn_interface" in problem
    monkeypatch.delattr(torch.nn.attention, "activate_flash_attention_impl", raising=False)
    assert "has no FA3 prototype" in bench.sdpa_fp8_problem()


def _goal_frame(fp8_ms, fp8_spread, bf16_ms, bf16_spread, *, n=8192, fp8_status="ok"):
    """Rows as sweep makes them: d=128 non-causal at N=n, plus rows the goals must ignore."""
    flop = attn.flops(1, 16, n, 128)
    rows = []
    for backend, ms, (p20, p80), status in (("fp8_mine", fp8_ms, fp8_spread, fp8_status),
                                            ("bf16_mine", bf16_ms, bf16_spread, "ok")):
        rows.append(dict(d=128, N=n, causal=False, backend=backend, status=status, ms=ms, p20_ms=p20, p80_ms=p80,
                         tflops=flop / (ms * 1e-3) / 1e12))
    ignored = [dict(rows[0], causal=True, ms=100.0), dict(rows[0], d=64), dict(rows[0], N=4096)]
    return pd.DataFrame(rows + ignored)


def test_goal_rows_ok_when_the_medians_meet_both_goals():
    flop_ms = attn.flops(1, 16, 8192, 128) / 700e12 * 1e3                   # 700 TFLOP/s
    g = bench.goal_rows(_goal_frame(flop_ms, (0.99 * flop_ms, 1.01 * flop_ms), 1.5 * flop_ms,
                                    (1.49 * flop_ms, 1.51 * flop_ms)))
    assert len(g) == 1 and g.loc[0, "N"] == 8192
    assert g.loc[0, "speedup"] == pytest.approx(1.5) and g.loc[0, "fp8_tflops"] == pytest.approx(700)
    assert (g.loc[0, "speedup_verdict"], g.loc[0, "tflops_verdict"]) == ("ok", "ok")


def test_goal_rows_judge_with_the_timing_spread():
    ms = attn.flops(1, 16, 8192, 128) / 590e12 * 1e3                        # 590 TFLOP/s: below 600 ...
    g = bench.goal_rows(_goal_frame(ms, (0.97 * ms, 1.05 * ms), 1.35 * ms, (1.3 * ms, 1.42 * ms)))
    assert g.loc[0, "speedup"] == pytest.approx(1.35)
    assert g.loc[0, "speedup_low"] == pytest.approx(1.3 / 1.05)
    assert g.loc[0, "speedup_high"] == pytest.approx(1.42 / 0.97)             # ... but 1.46x at the spread's end
    assert g.loc[0, "tflops_high"] == pytest.approx(590 / 0.97)
    assert (g.loc[0, "speedup_verdict"], g.loc[0, "tflops_verdict"]) == ("ok within the timing spread",) * 2
    tight = bench.goal_rows(_goal_frame(ms, (0.99 * ms, 1.01 * ms), 1.2 * ms, (1.19 * ms, 1.21 * ms)))
    assert (tight.loc[0, "speedup_verdict"], tight.loc[0, "tflops_verdict"]) == ("below goal", "below goal")


def test_goal_rows_say_not_measured_when_the_kernel_failed():
    g = bench.goal_rows(_goal_frame(1.0, (1.0, 1.0), 1.5, (1.5, 1.5), n=16384, fp8_status="error: boom"))
    assert g.loc[0, "N"] == 16384 and math.isnan(g.loc[0, "speedup"])
    assert (g.loc[0, "speedup_verdict"], g.loc[0, "tflops_verdict"]) == ("not measured", "not measured")


def test_gemm_calls_compute_the_product_in_every_variant():
    calls = ceilings._gemm_calls(64, torch.device("cpu"))
    assert list(calls) == [ceilings.BF16, *ceilings.FP8_VARIANTS]
    gen = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(64, 64, generator=gen) for _ in range(2))
    for name, call in calls.items():
        out = call()
        assert out.shape == (64, 64) and out.dtype == torch.bfloat16
        dt = torch.bfloat16 if name == ceilings.BF16 else E4M3
        want = a.to(dt).float() @ b.to(dt).float()
        assert torch.allclose(out.float(), want, rtol=2e-2, atol=0.3), name


def test_gemm_ceiling_refuses_a_cpu_and_a_bad_n():
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        ceilings.gemm_ceiling(64, device="cpu")
    for n in (8, 100, 64.0, True):
        with pytest.raises(ValueError, match="multiple of 16"):
            ceilings.gemm_ceiling(n, device="cpu")


def test_ceiling_helpers_pick_the_fastest_fp8_and_the_bf16_matmul():
    roofs = {"tflops": {"bf16_matmul": 780.0, "fp8_tensorwise": 1200.0, "fp8_rowwise_fast_accum": 1350.0,
                        "fp8_rowwise": None}}
    assert ceilings.fp8_ceiling(roofs) == 1350.0 and ceilings.bf16_ceiling(roofs) == 780.0
    assert math.isnan(ceilings.fp8_ceiling(None)) and math.isnan(ceilings.bf16_ceiling({"tflops": {}}))


def test_plot_draws_each_kernel_under_the_two_ceilings(tiny_sweep):
    df, _, _ = tiny_sweep
    roofs = {"n": 64, "device": "cpu", "tflops": {"bf16_matmul": 780.0, "fp8_tensorwise": 1300.0},
             "status": {"bf16_matmul": "ok", "fp8_tensorwise": "ok"}}
    fig = benchview.plot(df, roofs)
    assert len(fig.axes) == 2                                              # d=16: non-causal, causal
    for ax in fig.axes:
        kernels = {line.get_label() for line in ax.get_lines() if line.get_linestyle() == "-"}
        assert kernels == set(df.loc[df["status"] == "ok", "backend"])
        roofs_drawn = sorted((line.get_ydata()[0], line.get_linestyle()) for line in ax.get_lines()
                             if line.get_linestyle() != "-")
        assert roofs_drawn == [(780.0, "--"), (1300.0, "-.")]
    assert len(benchview.plot(df).axes[0].get_lines()) == 2                # no ceilings: the kernels alone


def test_report_is_in_the_reference_runs_form(tiny_sweep, capsys):
    df, _, _ = tiny_sweep
    outputs = benchview.report(df, None)
    kinds = [next(iter(o)) for o in outputs]
    assert kinds == ["text", "text/html", "text", "text/html", "text", "image/png"]
    assert "not measured" in outputs[0]["text"] and "1,979" in outputs[0]["text"]
    assert "fp8_mine" in outputs[1]["text/html"] and "unavailable: needs a CUDA GPU" in outputs[2]["text"]
    assert base64.b64decode(outputs[-1]["image/png"])[:4] == b"\x89PNG"
    reference.display_outputs([o for o in outputs if "text" in o])
    assert "did not run:" in capsys.readouterr().out
