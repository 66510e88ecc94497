"""labkit.determinism.switches: the switch restored after the block; SDPA's table on this CPU (CPU backends ran and
are reproducible, the CUDA-only ones raise); torch's source lines found, a missing file said so; flash-attn's flag."""
from __future__ import annotations

import torch

from labkit.determinism import switches


def test_the_setting_is_restored():
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    with switches.deterministic(True, warn_only=True):
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    assert (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) == before


def test_sdpa_table_on_this_cpu():
    table = switches.sdpa_backward_table("cpu", torch.float32, runs=2, shape=(1, 1, 16, 8))
    assert len(table) == 4 * len(switches.SETTINGS)
    math = table[table.backend == "math"]
    assert (math.outcome == "ran").all() and (math[["distinct_dq", "distinct_dk", "distinct_dv"]] == 1).all().all()
    cuda_only = table[table.backend.isin(["efficient_attention", "cudnn_attention"])]
    assert cuda_only.outcome.str.startswith("raised").all() and cuda_only.distinct_dq.isna().all()


def test_source_lines(tmp_path):
    found = switches.source_lines()
    assert set(found.file) == set(switches.SOURCES) and found.line.notna().any()
    (tmp_path / "nn" / "attention").mkdir(parents=True)
    (tmp_path / "nn" / "attention" / "_fa3.py").write_text("x = 1\nd = torch.are_deterministic_algorithms_enabled()\n")
    fake = switches.source_lines(tmp_path)
    assert fake[fake.file == "nn/attention/_fa3.py"].line.tolist() == [2]
    assert (fake[fake.file != "nn/attention/_fa3.py"].code == "(not in this torch)").all()


def test_flash_attn_flag_says_where_or_what():
    table = switches.flash_attn_flag(("labkit_no_such_package", "labkit_no_such.pkg"))
    assert not table.installed.any() and table.deterministic.str.contains("deterministic").all()


def test_documented_reads_this_torchs_docstring():
    sentences, names_sdpa = switches.documented()
    assert any("warn_only" in s for s in sentences) and any("RuntimeError" in s for s in sentences)
    assert isinstance(names_sdpa, bool)
