"""labkit.tritonlab.bench: functions from a notebook, ratio tables, the roofline frame, autotune configs."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

import labkit as lk

MODE = lk.tritonmode.setup()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


def _notebook(path, sources):
    cells = [dict(cell_type="code", metadata={}, outputs=[], execution_count=None, source=s) for s in sources]
    path.write_text(json.dumps(dict(cells=cells + [dict(cell_type="markdown", metadata={}, source="def x(): pass")],
                                    metadata={}, nbformat=4, nbformat_minor=5)))
    return path


def test_notebook_functions_runs_only_the_cells_that_define_the_names(tmp_path):
    nb = _notebook(tmp_path / "n.ipynb", ["raise RuntimeError('not a defining cell')", "%matplotlib inline",
                                          "def helper(x):\n    return 2 * x\n",
                                          "class Twice:\n    @staticmethod\n    def apply(x):\n        return helper(x)\n",
                                          "def unrelated():\n    raise AssertionError\nraise AssertionError"])
    found = lk.tritonbench.notebook_functions(nb, ["helper", "Twice"])
    assert found["Twice"].apply(3) == 6
    with pytest.raises(KeyError, match="missing"):
        lk.tritonbench.notebook_functions(nb, ["helper", "missing"])


def _sweep(rows):
    cols = ["backend", "B", "H", "N", "D", "causal", "mode", "status", "ms", "tflops"]
    return pd.DataFrame(rows, columns=cols)


def test_ratio_table_divides_tflops_per_configuration():
    sweep = _sweep([("mine", 1, 2, 128, 64, False, "fwd", "ok", 1.0, 300.0),
                    ("sdpa_flash", 1, 2, 128, 64, False, "fwd", "ok", 1.2, 250.0),
                    ("fa4", 1, 2, 128, 64, False, "fwd", "ok", 0.5, 600.0),
                    ("mine", 1, 2, 128, 64, True, "fwd", "ok", 1.0, 100.0),
                    ("sdpa_flash", 1, 2, 128, 64, True, "fwd", "oom", np.nan, np.nan)])
    ratios = lk.tritonbench.ratio_table(sweep, "mine")
    assert list(ratios.columns) == ["vs fa4", "vs sdpa_flash"]
    assert ratios.loc[(64, False, "fwd", 128), "vs sdpa_flash"] == pytest.approx(1.2)
    assert ratios.loc[(64, False, "fwd", 128), "vs fa4"] == pytest.approx(0.5)
    assert np.isnan(ratios.loc[(64, True, "fwd", 128), "vs sdpa_flash"])     # the other did not run
    with pytest.raises(KeyError, match="fa9"):
        lk.tritonbench.ratio_table(sweep, "fa9")


def test_roofline_frame_places_forward_rows_at_compulsory_bytes():
    sweep = _sweep([("mine", 2, 4, 1024, 64, False, "fwd", "ok", 0.5, 0.0),
                    ("mine", 2, 4, 1024, 64, True, "fwd", "ok", 0.01, 0.0),
                    ("mine", 2, 4, 1024, 64, False, "fwd_bwd", "ok", 2.0, 0.0),
                    ("fa4", 2, 4, 1024, 64, False, "fwd", "oom", np.nan, np.nan)])
    pts = lk.tritonbench.roofline_frame(sweep, roof=lambda x: np.minimum(100.0, x * 1e12 / 1e12))  # 1 TB/s
    assert len(pts) == 2 and set(pts["mode"]) == {"fwd"}
    flop = 4 * 2 * 4 * 1024 * 1024 * 64
    byte = lk.roofline.compulsory_bytes(2, 4, 1024, 64)
    first = pts.iloc[0]
    assert first["intensity"] == pytest.approx(flop / byte)
    assert first["roof_tflops"] == pytest.approx(min(100.0, flop / byte))      # 1 TB/s: intensity TFLOP/s
    assert first["achieved_tflops"] == pytest.approx(flop / 0.5e-3 / 1e12) and not first["above_roof"]
    assert pts.iloc[1]["above_roof"]                                           # 0.01 ms is faster than the roof


@triton.autotune(configs=[triton.Config({"BLOCK": 128}), triton.Config({"BLOCK": 256}),
                          triton.Config({"BLOCK": 100})], key=["n"])
@triton.jit
def _scale(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)     # BLOCK=100 is not a power of 2: fails
    tl.store(out_ptr + offs, 2 * tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@pytest.mark.skipif(MODE != "interpreter", reason="times the interpreter on CPU tensors")
def test_config_table_times_every_config_and_reports_failures():
    x = torch.randn(1000)
    out = torch.empty_like(x)
    table = lk.tritonbench.config_table(_scale, lambda meta: (triton.cdiv(1000, meta["BLOCK"]),), (x, out, 1000), {},
                                        flop=1000.0, device="cpu", target_ms=5)
    assert list(table["BLOCK"]) == [128, 256, 100]
    assert list(table["status"][:2]) == ["ok", "ok"] and table["status"][2].startswith("error")
    assert (table["ms"][:2] > 0).all() and np.isnan(table["ms"][2])
    assert table["tflops"][0] == pytest.approx(1000.0 / (table["ms"][0] * 1e-3) / 1e12)
    torch.testing.assert_close(out, 2 * x)
