"""What this machine can run: device, compute capability, dtypes and attention backends.

``python -m labkit doctor`` prints :func:`report`. Nothing here hard-codes a GPU's speed;
peaks are measured in :mod:`labkit.bench`.

Used in: 01_setup_and_comparison (and the first cell of every notebook).
"""
from __future__ import annotations

import platform
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceInfo:
    """A short description of the compute device."""

    device: str  # "cuda" or "cpu"
    name: str
    capability: tuple[int, int] | None  # (major, minor) on CUDA, None on CPU
    memory_gib: float | None
    torch_version: str
    cuda_version: str | None

    @property
    def sm(self) -> int | None:
        """Compute capability as an integer, e.g. 90 for Hopper; None on CPU."""
        return None if self.capability is None else 10 * self.capability[0] + self.capability[1]


def device_info(device: str | torch.device | None = None) -> DeviceInfo:
    """Describe ``device`` (default: CUDA when available, else CPU)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        return DeviceInfo("cuda", props.name, (props.major, props.minor), props.total_memory / 2**30,
                          torch.__version__, torch.version.cuda)
    return DeviceInfo("cpu", platform.processor() or platform.machine(), None, None,
                      torch.__version__, None)


def default_device() -> torch.device:
    """CUDA when available, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def supported_dtypes(device: str | torch.device | None = None) -> dict[str, bool]:
    """Which floating-point formats compute on ``device`` (a tiny matmul is tried)."""
    dev = torch.device(device or default_device())
    result = {}
    names = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    for name, dtype in names.items():
        try:
            x = torch.ones(8, 8, device=dev, dtype=dtype)
            result[name] = bool(torch.isfinite(x @ x).all())
        except (RuntimeError, TypeError):
            result[name] = False
    result["tf32"] = dev.type == "cuda" and (device_info(dev).sm or 0) >= 80
    result["float8_e4m3fn"] = dev.type == "cuda" and (device_info(dev).sm or 0) >= 89
    return result


def backend_table(device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                  head_dim: int = 64):
    """Every attention backend and whether it runs here, as a DataFrame.

    Each backend is tried on a small causal forward and backward pass of shape
    [1, 2, 128, head_dim]; the reason column holds the error when it does not run.
    """
    import pandas as pd

    from . import attention

    dev = torch.device(device or default_device())
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    rows = []
    for name in attention.BACKENDS:
        reason = attention.why_not(name, device=dev, dtype=dtype, head_dim=head_dim)
        rows.append({"backend": name, "runs here": reason is None, "reason": reason or "",
                     "dtype": str(dtype).replace("torch.", ""), "head_dim": head_dim})
    return pd.DataFrame(rows)


GPU_ONLY_PREFIX = "[GPU only]"


def gpu_only(message: str) -> None:
    """Print why a cell shows less here than on a GPU, marked so ``make execute`` can list it."""
    print(f"{GPU_ONLY_PREFIX} {message}")


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


def _wide_pandas():
    import pandas as pd

    return pd.option_context("display.max_colwidth", 90, "display.width", 160)
