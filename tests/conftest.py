"""Shared fixtures and hooks: seeded input builders, the `gpu` marker, guarded notebook kernels.

Tests marked ``@pytest.mark.gpu`` need CUDA; they are skipped automatically where
``torch.cuda.is_available()`` is False (CI, laptops) and run on the GPU machine.
"""
from __future__ import annotations

import collections
import contextlib
import os
import re

os.environ.setdefault("MPLBACKEND", "Agg")  # before anything imports matplotlib: no display in tests

import pytest  # noqa: E402
import torch  # noqa: E402

# The unit tests use tiny tensors: one intra-op thread avoids the thread spin-waiting that makes
# them 10-50x slower on a small machine shared with other jobs (2 cores on CI).
torch.set_num_threads(1)


def pytest_configure(config):
    """Kernels started by this run (nbgrader's autograde, which executes every solution notebook) are guarded.

    They inherit IPYTHONDIR, whose startup file installs labkit.course.runguard: a network access or a
    DeprecationWarning/FutureWarning from torch, transformers, labkit or the notebook fails the cell.
    """
    from labkit.course.execute import guard_startup_dir

    stack = contextlib.ExitStack()
    os.environ["IPYTHONDIR"] = stack.enter_context(guard_startup_dir())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config.add_cleanup(stack.close)


def pytest_collection_modifyitems(config, items):
    """Skip every item marked ``gpu`` when CUDA is unavailable."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


# The slowest work units of `make test` (pytest -n 2 --dist loadfile), slowest first: started first, so that the
# two workers end together instead of one starting a long unit after the other ran out of work. Measured on the
# 2-core CI machine; a unit not listed starts after these, the larger ones (more items) first.
SLOWEST_FIRST = ("tests/course/test_notebooks.py",   # one autograde of every notebook
                 "tests/course/test_grader_strength.py::nb06", "tests/course/test_grader_strength.py::nb09",
                 "tests/course/test_grader_strength.py::nb08", "tests/labkit/board/test_board.py",
                 "tests/course/test_browser.py", "tests/course/test_grading_robustness.py",
                 "tests/course/test_nbgrader_term.py")


def work_unit(nodeid: str) -> str:
    """The unit an item runs in: its file (a module's fixtures are built once), except that test_grader_strength.py
    splits by notebook (``...::nb06``: each notebook graded once, on one worker), so that its slowest notebooks run
    on both workers."""
    file, _, rest = nodeid.partition("::")
    notebook = re.search(r"\[(nb\d\d)\]$", rest)
    return f"{file}::{notebook.group(1)}" if file.endswith("test_grader_strength.py") and notebook else file


@pytest.hookimpl(optionalhook=True)   # pytest-xdist's hook: unknown (and skipped) without xdist
def pytest_xdist_make_scheduler(config, log):
    """For ``--dist loadfile``: xdist's scheduling by file, with :func:`work_unit`'s units in SLOWEST_FIRST order."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    def rank(unit: str) -> int:
        return next((i for i, slow in enumerate(SLOWEST_FIRST) if unit.startswith(slow)), len(SLOWEST_FIRST))

    class ByUnit(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _assign_work_unit(self, node) -> None:
            if not getattr(self, "ordered", False):   # the first assignment: slowest units first, then larger ones
                self.workqueue = collections.OrderedDict(
                    sorted(self.workqueue.items(), key=lambda unit: (rank(unit[0]), -len(unit[1]))))
                self.ordered = True
            super()._assign_work_unit(node)

    return ByUnit(config, log)


def seeded_randn(*shape: int, seed: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """N(0, 1) numbers drawn in float64 on the CPU from ``seed``, then cast and moved.

    Drawing in one dtype on one device makes the values identical across dtypes and devices,
    so a low-precision run and its float64 reference see the same inputs (up to rounding).
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)


@pytest.fixture
def randn():
    """``randn(*shape, seed=..., dtype=..., device=...)``: see :func:`seeded_randn`."""
    return seeded_randn


@pytest.fixture
def make_qkv():
    """Builder of seeded q, k, v in a named layout.

    ``make_qkv(B, H, N, D, Nk=None, dtype=float32, device="cpu", layout="bhnd",
    requires_grad=False, seed=0)`` returns q [B, H, N, D] and k, v [B, H, Nk, D] for "bhnd",
    or [B, N, H, D] / [B, Nk, H, D] for "bnhd"; each tensor is a leaf.
    """

    def build(B: int, H: int, N: int, D: int, *, Nk: int | None = None, dtype=torch.float32,
              device="cpu", layout: str = "bhnd", requires_grad: bool = False, seed: int = 0):
        Nk = N if Nk is None else Nk
        out = []
        for i, n in enumerate((N, Nk, Nk)):
            shape = (B, H, n, D) if layout == "bhnd" else (B, n, H, D)
            t = seeded_randn(*shape, seed=seed * 3 + i, dtype=dtype, device=device)
            out.append(t.requires_grad_(requires_grad))
        return tuple(out)

    return build


@pytest.fixture
def cuda_device() -> torch.device:
    """The current CUDA device (tests using it must also be marked ``gpu``)."""
    return torch.device("cuda", torch.cuda.current_device())
