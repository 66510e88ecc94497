"""labkit.fp8.formats: the FP8 facts are torch's, the e4m3 table decodes all 128 patterns, casts as measured."""
from __future__ import annotations

import math

import pytest
import torch

from labkit.fp8 import formats


def test_facts_are_the_fp8_rows_of_format_table_with_spacings():
    facts = formats.fp8_facts().set_index("format")
    e4m3, e5m2 = facts.loc["fp8_e4m3fn"], facts.loc["fp8_e5m2"]
    assert (e4m3["max"], e4m3["smallest_normal"], e4m3["smallest_subnormal"], e4m3["epsilon"]) == (448, 2**-6, 2**-9, 2**-3)
    assert (e5m2["max"], e5m2["smallest_subnormal"], e5m2["epsilon"]) == (57344, 2**-16, 2**-2)
    assert (e4m3["spacing_near_1"], e4m3["spacing_near_256"], e4m3["spacing_near_max"]) == (0.125, 32, 32)
    assert (e5m2["spacing_near_1"], e5m2["spacing_near_256"], e5m2["spacing_near_max"]) == (0.25, 64, 8192)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("value", [2**-8, 0.01, 1.0, 3.0, 256.0, 416.0])
def test_spacing_is_the_gap_to_the_next_value_up(dtype, value):
    x = torch.tensor(value).to(dtype).float().item()
    up = torch.tensor(x + formats.spacing(dtype, x)).to(dtype).float().item()
    assert up > x and torch.tensor((x + up) / 2 * 0.999).to(dtype).float().item() == x   # nothing in between


def test_spacing_refuses_values_out_of_range():
    with pytest.raises(ValueError, match="value must be in"):
        formats.spacing(torch.float8_e4m3fn, 500.0)


def test_e4m3_table_decodes_every_non_negative_pattern():
    table = formats.e4m3_values()
    assert len(table) == 128 and table["kind"].value_counts().to_dict() == {"normal": 119, "subnormal": 7, "zero": 1,
                                                                           "nan": 1}
    finite = table["value"].dropna()
    assert finite.is_monotonic_increasing and finite.iloc[-1] == 448 and table["value"][1] == 2**-9
    assert table.loc[table["bits"] == "0x38", "value"].item() == 1.0         # exponent 7 = bias, mantissa 0
    assert table.loc[table["value"] == 1.0, "spacing"].item() == 0.125
    assert math.isnan(table["value"].iloc[-1]) and math.isnan(table["spacing"].iloc[-2])


def test_cast_table_shows_this_torch_and_the_clamped_cast():
    table = formats.cast_table((500.0, 464.0, 61440.0, float("inf"))).set_index("x")
    assert (table["e4m3fn_clamped"] == 448).all() and (table["e5m2_clamped"].iloc[2:] == 57344).all()
    assert table.loc[61440.0, "e5m2"] == math.inf                           # e5m2 overflows to inf
    plain = table.loc[500.0, "e4m3fn"]                                      # torch 2.13 CPU saturates; 2.11 CUDA: NaN
    assert plain == 448 or math.isnan(plain)


def test_grid_plot_draws_the_positive_values():
    ax = formats.grid_plot()
    xs = [x for line in ax.get_lines() for x in line.get_xdata()]
    assert len(xs) == 125 and min(xs) == 2**-9 and ax.get_xscale() == "log"    # 126 positive finite, 448 has no gap
