"""The doctor: what this machine can run, as ``python -m labkit doctor`` prints it.

:func:`report` (the first cell of every notebook) prints the device, its dtypes and
:func:`backend_table`: every attention backend and why it does not run here, if it does not.
:func:`auto_report` (``python -m labkit doctor`` only: it times kernels) adds what ``backend="auto"``
picks for one GPT-2 small layer, training and inference, and why (:func:`labkit.engine.explain.auto`).

Used in: every notebook (``lk.doctor.report()``), 01_setup_and_comparison.
"""
from __future__ import annotations

import platform

import torch

from labkit.engine import kernels
from labkit.core.env import DeviceInfo, default_device, device_info, supported_dtypes


def backend_table(device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                  head_dim: int = 64):
    """Every attention backend and whether it runs here, as a DataFrame.

    Each backend is tried on a small causal forward and backward pass of shape
    [1, 2, 128, head_dim]; the reason column holds the error when it does not run.
    """
    import pandas as pd

    dev = torch.device(device or default_device())
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    rows = []
    for name in kernels.BACKENDS:
        reason = kernels.why_not(name, device=dev, dtype=dtype, head_dim=head_dim)
        rows.append({"backend": name, "runs here": reason is None, "reason": reason or "",
                     "dtype": str(dtype).replace("torch.", ""), "head_dim": head_dim})
    return pd.DataFrame(rows)


def report(device: str | torch.device | None = None) -> DeviceInfo:
    """Print the device, its dtypes and the attention-backend table; return the DeviceInfo."""
    info = device_info(device)
    print(f"torch {info.torch_version}  CUDA {info.cuda_version or '-'}  Python {platform.python_version()}")
    if info.device == "cuda":
        print(f"GPU: {info.name}  sm{info.sm}  {info.memory_gib:.1f} GiB")
    else:
        print(f"CPU only ({info.name}): the notebooks use their small 'cpu' profile.")
    dtypes = supported_dtypes(info.device)
    print("dtypes:", ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in dtypes.items()))
    table = backend_table(info.device)
    with _wide_pandas():
        print(table.to_string(index=False))
    return info


def auto_report(device: str | torch.device | None = None) -> None:
    """Print auto's choice, and each backend's role in it, for one GPT-2 small attention layer (B 4, H 12,
    D 64, causal; N 1024 on a GPU in bf16, 128 on a CPU in fp32): forward+backward, then forward only."""
    from labkit.engine import explain

    dev = torch.device(device or default_device())
    dtype, n = (torch.bfloat16, 1024) if dev.type == "cuda" else (torch.float32, 128)
    for grad in (True, False):
        q, k, v = (torch.randn(4, 12, n, 64, device=dev, dtype=dtype, requires_grad=grad) for _ in range(3))
        table = explain.auto(q, k, v, causal=True)
        print(f"\nauto for [4, 12, {n}, 64] causal ({table.attrs['situation']}): {table.attrs['chosen']}")
        with _wide_pandas():
            print(table.to_string(index=False, float_format=lambda x: f"{x:.3f}"))


def _wide_pandas():
    import pandas as pd

    return pd.option_context("display.max_colwidth", 90, "display.width", 160)
