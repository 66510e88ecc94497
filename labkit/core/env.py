"""Device facts: the device, its compute capability and the dtypes it computes in.

Part of labkit's bottom floor (imports no other labkit module). Which attention backends run
here is :mod:`labkit.engine.doctor`'s question. Nothing here hard-codes a GPU's speed; peaks are
measured in :mod:`labkit.engine.bench`.

Used in: every notebook (``lk.env.gpu_only``, ``lk.env.device_info``).
"""
from __future__ import annotations

import platform
import importlib
import warnings
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


GPU_ONLY_PREFIX = "[GPU only]"


def gpu_only(message: str) -> None:
    """Print why a cell shows less here than on a GPU, marked so ``make execute`` can list it."""
    print(f"{GPU_ONLY_PREFIX} {message}")


# torch's own modules that warn when imported: torch.utils.mkldnn applies the deprecated torch.jit.script_method
# (torch 2.11 and 2.13), and inductor imports it at a process's first torch.compile, so a notebook cell that compiles
# would print fourteen DeprecationWarnings about torch's code, not the student's.
QUIET_IMPORTS = {"torch.utils.mkldnn": r"`torch.jit.script_method` is deprecated"}


def import_torch_modules_quietly() -> None:
    """Import :data:`QUIET_IMPORTS` once with their known warning silenced (later imports find them loaded)."""
    for module, message in QUIET_IMPORTS.items():
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=message, category=DeprecationWarning)
            importlib.import_module(module)
