"""Tests for labkit.core.env: device description and dtype support."""
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


@pytest.mark.gpu
def test_device_info_and_dtypes_cuda():
    info = lk.env.device_info("cuda")
    assert info.device == "cuda" and info.sm >= 50 and info.memory_gib > 1 and info.cuda_version
    d = lk.env.supported_dtypes("cuda")
    assert d["float32"] and d["float16"] and (d["bfloat16"] or info.sm < 80)
    assert d["tf32"] == (info.sm >= 80) and d["float8_e4m3fn"] == (info.sm >= 89)


def test_torch_compile_imports_print_no_deprecation_of_torch_code():
    """After ``import labkit``, importing what inductor imports at the first torch.compile raises no warning (the
    script_method one torch.utils.mkldnn gives; without labkit, the same import warns: checked as the control)."""
    import subprocess
    import sys

    probe = "import warnings; warnings.simplefilter('error', DeprecationWarning); {first}import torch.fx.experimental.optimization"
    with_labkit = subprocess.run([sys.executable, "-c", probe.format(first="import labkit; ")], capture_output=True, text=True)
    assert with_labkit.returncode == 0, with_labkit.stderr[-1500:]
    without = subprocess.run([sys.executable, "-c", probe.format(first="import torch; ")], capture_output=True, text=True)
    assert without.returncode != 0 and "script_method" in without.stderr, "the control no longer warns: drop QUIET_IMPORTS' entry"
