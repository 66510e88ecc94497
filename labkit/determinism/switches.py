"""torch's determinism switches, checked on this machine rather than told.

- :func:`documented`: what this torch's docstring of ``torch.use_deterministic_algorithms`` says the switch and
  ``warn_only`` do, and whether its list of covered operations names SDPA.
- :func:`deterministic`: ``torch.use_deterministic_algorithms(mode, warn_only=...)`` for a block, restored after.
- :func:`sdpa_backward_table`: SDPA's backward per backend under three settings (off; on with ``warn_only=True``; on
  with ``warn_only=False``): whether it ran or raised, the warnings it gave, and how many distinct dq / dk / dv bit
  patterns ``runs`` identical calls produced. On a CPU only the CPU backends run; the GPU facts come from a GPU run.
- :func:`source_lines`: the lines of the installed torch that read the switch (FlexAttention's FLASH backend, the
  FA3 / FA4 wrappers) or that store FlexAttention's dQ: what the library does, read from the library.
- :func:`flash_attn_flag`: flash-attn's ``deterministic=`` argument, read from its signature where it is installed.

Used in: 11_determinism.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import re
import warnings
from pathlib import Path
from typing import Iterator

import pandas as pd
import torch
import torch.nn.functional as F

from labkit.determinism import reduce as detreduce

SETTINGS = {"off": (False, False), "on, warn_only=True": (True, True), "on, warn_only=False": (True, False)}
WHERE = {  # package -> where its deterministic argument lives, said when the package is not installed here
    "flash_attn": "flash_attn/flash_attn_interface.py: flash_attn_func(..., deterministic=False)",
    "flash_attn.cute": "FlashAttention-4 (flash_attn.cute); torch's nn/attention/_fa4.py passes it deterministic= from the switch",
}
SOURCES = {  # installed torch file -> pattern of the lines that matter
    "nn/attention/_fa3.py": r"are_deterministic_algorithms_enabled",
    "nn/attention/_fa4.py": r"are_deterministic_algorithms_enabled",
    "_inductor/kernel/flex/flex_flash_attention.py": r"deterministic_algorithms|warn_only =|Running non-deterministic",
    "_inductor/kernel/flex/templates/flex_backwards.py.jinja": r"THIS BLOCK DOES DQ|tl\.store\(dq_ptrs|atomic",
}


def documented() -> tuple[list[str], bool]:
    """(the sentences of ``torch.use_deterministic_algorithms.__doc__`` that say what is thrown, whether the docstring
    names ``scaled_dot_product_attention`` anywhere)."""
    doc = " ".join((torch.use_deterministic_algorithms.__doc__ or "").split())
    sentences = [s for s in re.split(r"(?<=\.)\s", doc) if "throw" in s and len(s) < 250]
    return sentences, "scaled_dot_product" in doc


@contextlib.contextmanager
def deterministic(mode: bool, warn_only: bool = False) -> Iterator[None]:
    """``torch.use_deterministic_algorithms(mode, warn_only=warn_only)`` inside the block; the previous setting after."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _sdpa_grads(q, k, v, do, backend) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of SDPA forced to one backend (torch.nn.attention.sdpa_kernel)."""
    from torch.nn.attention import sdpa_kernel

    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q, k, v)
    return torch.autograd.grad(out, (q, k, v), do)


def sdpa_backward_table(device, dtype=torch.bfloat16, *, runs: int = 5, shape=(2, 8, 1024, 64), seed: int = 0):
    """SDPA's backward on every backend under :data:`SETTINGS`: one row per (backend, setting).

    Columns: backend, setting, outcome ("ran" or the error's first line), warning (the first warning's first line),
    distinct_dq, distinct_dk, distinct_dv (distinct bit patterns over ``runs`` identical calls; 1 = reproducible).
    q, k, v, do [B, H, N, D] standard normal in ``dtype`` on ``device``.
    """
    from torch.nn.attention import SDPBackend

    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(*shape, generator=gen).to(dtype).to(device) for _ in range(4))
    rows = []
    for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        for setting, (mode, warn_only) in SETTINGS.items():
            row = {"backend": backend.name.lower(), "setting": setting, "outcome": "ran", "warning": ""}
            with warnings.catch_warnings(record=True) as caught, deterministic(mode, warn_only):
                warnings.simplefilter("always")
                try:
                    grads = [_sdpa_grads(q, k, v, do, backend) for _ in range(runs)]
                except RuntimeError as err:
                    row["outcome"], grads = f"raised: {str(err).splitlines()[0][:110]}", []
            row["warning"] = next((str(w.message).splitlines()[0][:110] for w in caught), "")
            for i, g in enumerate(("dq", "dk", "dv")):
                row[f"distinct_{g}"] = len(detreduce.distinct([r[i] for r in grads])) if grads else None
            rows.append(row)
    return pd.DataFrame(rows)


def source_lines(root: Path | None = None) -> pd.DataFrame:
    """The lines of the installed torch (under ``root``, default torch's folder) that :data:`SOURCES` names: columns
    file, line, code. A file this torch lacks gives one row saying so."""
    root = Path(torch.__file__).parent if root is None else root
    rows = []
    for name, pattern in SOURCES.items():
        path = root / name
        if not path.exists():
            rows.append({"file": name, "line": None, "code": "(not in this torch)"})
            continue
        rows += [{"file": name, "line": i, "code": line.strip()[:120]}
                 for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if re.search(pattern, line)]
    return pd.DataFrame(rows)


def flash_attn_flag(modules=("flash_attn", "flash_attn.cute")) -> pd.DataFrame:
    """flash-attn's ``deterministic`` argument of ``flash_attn_func`` per package: its default where the package is
    installed (read from the signature), else where it lives. Columns: package, installed, deterministic."""
    rows = []
    for name in modules:
        try:
            installed = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:     # a parent package missing
            installed = False
        flag = f"not installed here: {WHERE.get(name, 'flash_attn_func(..., deterministic=...)')}"
        if installed:
            try:
                params = inspect.signature(importlib.import_module(name).flash_attn_func).parameters
                flag = (f"deterministic={params['deterministic'].default!r}" if "deterministic" in params
                        else "flash_attn_func has no deterministic argument")
            except Exception as err:   # noqa: BLE001 - an import that fails here (no GPU, a missing library): say why
                flag = f"import failed: {type(err).__name__}: {str(err).splitlines()[0][:80]}"
        rows.append({"package": name, "installed": installed, "deterministic": flag})
    return pd.DataFrame(rows)
