"""Tests for labkit.env: device description, dtype support and the backend table."""
from __future__ import annotations

import pytest
import torch

import labkit as lk

CPU_BACKENDS = {"reference", "sdpa_math", "sdpa_flash"}


def test_device_info_cpu():
    info = lk.env.device_info("cpu")
    assert info.device == "cpu" and isinstance(info.name, str) and info.name
    assert info.capability is None and info.sm is None and info.memory_gib is None
    assert info.torch_version == torch.__version__ and info.cuda_version is None
    assert lk.env.device_info(torch.device("cpu")) == info


def test_default_device():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert lk.env.default_device().type == expected
    assert lk.env.device_info().device == expected


def test_supported_dtypes_cpu():
    d = lk.env.supported_dtypes("cpu")
    assert set(d) == {"float32", "float16", "bfloat16", "tf32", "float8_e4m3fn"}
    assert d["float32"] is True and d["bfloat16"] is True  # torch >= 2.4 computes bf16 matmuls on CPU
    assert d["tf32"] is False and d["float8_e4m3fn"] is False, "tf32/fp8 are GPU tensor-core formats"
    assert all(isinstance(v, bool) for v in d.values())


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_backend_table_cpu(dtype):
    table = lk.env.backend_table("cpu", dtype=dtype, head_dim=32)
    assert list(table["backend"]) == list(lk.attention.BACKENDS)
    assert list(table.columns) == ["backend", "runs here", "reason", "dtype", "head_dim"]
    runs = dict(zip(table["backend"], table["runs here"]))
    assert runs["reference"] and runs["sdpa_math"]
    assert {b for b, ok in runs.items() if ok} == CPU_BACKENDS
    for _, row in table.iterrows():
        assert (row["reason"] == "") == bool(row["runs here"]), row.to_dict()
        if not row["runs here"]:
            assert "CUDA" in row["reason"], row["reason"]
    assert set(table["dtype"]) == {"float32" if dtype is None else "bfloat16"} and set(table["head_dim"]) == {32}


def test_backend_table_reason_for_unsupported_head_dim():
    table = lk.env.backend_table("cpu", head_dim=12)
    row = table.set_index("backend").loc["sdpa_flash"]
    assert not row["runs here"] and "head dim 12" in row["reason"]
    assert table.set_index("backend").loc["sdpa_math", "runs here"]


def test_report_cpu(capsys):
    info = lk.env.report("cpu")
    out = capsys.readouterr().out
    assert info == lk.env.device_info("cpu")
    assert f"torch {torch.__version__}" in out and "CPU only" in out and "dtypes: float32=yes" in out
    assert "runs here" in out and all(b in out for b in lk.attention.BACKENDS)


@pytest.mark.gpu
def test_device_info_and_dtypes_cuda():
    info = lk.env.device_info("cuda")
    assert info.device == "cuda" and info.sm >= 50 and info.memory_gib > 1 and info.cuda_version
    d = lk.env.supported_dtypes("cuda")
    assert d["float32"] and d["float16"] and (d["bfloat16"] or info.sm < 80)
    assert d["tf32"] == (info.sm >= 80) and d["float8_e4m3fn"] == (info.sm >= 89)


@pytest.mark.gpu
def test_backend_table_cuda():
    table = lk.env.backend_table("cuda")
    runs = dict(zip(table["backend"], table["runs here"]))
    assert runs["reference"] and runs["sdpa_math"]
    if lk.env.device_info("cuda").sm >= 80:  # Ampere+: PyTorch's own fused kernels take bf16
        assert runs["sdpa_efficient"] and runs["sdpa_flash"], table
    assert (table.loc[~table["runs here"], "reason"] != "").all()
    assert set(table["dtype"]) == {"bfloat16"}
