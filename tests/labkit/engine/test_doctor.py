"""Tests for labkit.engine.doctor and the import errors it shows: the backend table and the report."""
from __future__ import annotations

import importlib
import importlib.metadata

import pytest
import torch

import labkit as lk

CPU_BACKENDS = {"reference", "sdpa_math", "sdpa_flash"}


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_backend_table_cpu(dtype):
    table = lk.doctor.backend_table("cpu", dtype=dtype, head_dim=32)
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
    table = lk.doctor.backend_table("cpu", head_dim=12)
    row = table.set_index("backend").loc["sdpa_flash"]
    assert not row["runs here"] and "head dim 12" in row["reason"]
    assert table.set_index("backend").loc["sdpa_math", "runs here"]


def test_report_cpu(capsys):
    info = lk.doctor.report("cpu")
    out = capsys.readouterr().out
    assert info == lk.env.device_info("cpu")
    assert f"torch {torch.__version__}" in out and "CPU only" in out and "dtypes: float32=yes" in out
    assert "runs here" in out and all(b in out for b in lk.attention.BACKENDS)


@pytest.mark.gpu
def test_backend_table_cuda():
    table = lk.doctor.backend_table("cuda")
    runs = dict(zip(table["backend"], table["runs here"]))
    assert runs["reference"] and runs["sdpa_math"]
    if lk.env.device_info("cuda").sm >= 80:  # Ampere+: PyTorch's own fused kernels take bf16
        assert runs["sdpa_efficient"] and runs["sdpa_flash"], table
    assert (table.loc[~table["runs here"], "reason"] != "").all()
    assert set(table["dtype"]) == {"bfloat16"}


@pytest.fixture
def broken_import(monkeypatch):
    """Make ``import <module>`` fail with a given error and the distribution look (not) installed."""
    def setup(module: str, error: BaseException, version: str | None):
        real_import = importlib.import_module

        def fake_import(name, *a, **kw):
            if name == module:
                raise error
            return real_import(name, *a, **kw)

        def fake_version(dist):
            if version is None:
                raise importlib.metadata.PackageNotFoundError(dist)
            return version

        monkeypatch.setattr(importlib, "import_module", fake_import)
        monkeypatch.setattr(importlib.metadata, "version", fake_version)
        lk.kernels.flash_function.cache_clear()

    yield setup
    lk.kernels.flash_function.cache_clear()


def test_flash_package_not_installed_names_the_install_command(broken_import):
    broken_import("flash_attn.cute", ModuleNotFoundError("No module named 'flash_attn'"), None)
    with pytest.raises(ImportError) as err:
        lk.kernels.flash_function("fa4")
    assert "flash-attn-4, which is not installed" in str(err.value) and "pip install flash-attn-4" in str(err.value)


@pytest.mark.parametrize("error", [ModuleNotFoundError("No module named 'cutlass'"),
                                   OSError("libcuda.so.1: cannot open shared object file\nsecond line"),
                                   ImportError("cannot import name 'flash_attn_func' from partially initialized module")])
def test_installed_package_whose_import_fails_says_so_with_the_first_line(broken_import, error):
    broken_import("flash_attn.cute", error, "4.0.0b36")
    with pytest.raises(ImportError) as err:
        lk.kernels.flash_function("fa4")
    message = str(err.value)
    assert "flash-attn-4 4.0.0b36 is installed but `import flash_attn.cute` fails" in message
    assert str(error).splitlines()[0] in message and "second line" not in message
    assert "not installed" not in message


def test_a_kernel_call_names_the_failing_import(broken_import):
    broken_import("flash_attn", ModuleNotFoundError("No module named 'flash_attn_2_cuda'"), "2.8.3")
    with pytest.raises(ImportError, match="flash-attn 2.8.3 is installed but .*flash_attn_2_cuda"):
        lk.kernels.RUNNERS["flash_attn"](*(torch.zeros(1, 8, 2, 8, dtype=torch.float16) for _ in range(3)),
                                          False, None, False)


def test_auto_report_shows_auto_s_choice_for_training_and_inference(capsys):
    lk.doctor.auto_report("cpu")
    out = capsys.readouterr().out
    assert out.count("auto for [4, 12, 128, 64] causal") == 2
    assert "forward+backward" in out and "forward only" in out and "sdpa_flash" in out and "cannot run here" in out
