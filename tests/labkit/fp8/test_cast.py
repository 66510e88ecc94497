"""labkit.fp8.cast: to_e4m3 gives torch's bits (``x.clamp(-448, 448).to(float8_e4m3fn)``) for every fp32 input
that matters, in the interpreter (EXACT) as on a GPU; a kernel of another module calls it by an imported name and
through a module attribute chain, in the interpreter and compiled for sm90."""
from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

import labkit as lk  # before triton: sets TRITON_INTERPRET=1 here (no CUDA in CI)

MODE = lk.tritonmode.setup()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from labkit.fp8 import cast  # noqa: E402
from labkit.fp8.cast import to_e4m3  # noqa: E402

fp8 = types.SimpleNamespace(cast=cast)   # an attribute chain, as the notebook's lk.fp8cast.to_e4m3


@triton.jit
def _cast_kernel(x_ptr, y_ptr, n, EXACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr + offs, to_e4m3(x, EXACT), mask=offs < n)


@triton.jit
def _cast_kernel_chain(x_ptr, y_ptr, n, EXACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr + offs, fp8.cast.to_e4m3(x, EXACT), mask=offs < n)


def _bits(kernel, x: torch.Tensor, exact: bool) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), EXACT=exact, BLOCK=1024)
    return y.view(torch.uint8)


def _torch_bits(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)


def _next(x: torch.Tensor, toward: float) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, toward))


def _inputs() -> dict[str, torch.Tensor]:
    """Every e4m3 value, the midpoints between neighbours (ties), one fp32 ulp on each side of them, subnormals,
    zeros, values past 448 and random P * 256 values, positive and negative."""
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = every[every.isfinite()].unique()                              # -448 .. 448, 253 values (one 0)
    mids = (values[1:] + values[:-1]) / 2                                  # exact in fp32
    gen = torch.Generator().manual_seed(0)
    p = torch.rand(20000, generator=gen) * torch.rand(20000, generator=gen).pow(8)   # P in [0, 1), many tiny
    return {
        "every e4m3 value": values,
        "midpoints (ties to even)": mids,
        "one ulp above the midpoints": _next(mids, float("inf")),
        "one ulp below the midpoints": _next(mids, float("-inf")),
        "subnormal range": torch.linspace(-2.0 ** -6, 2.0 ** -6, 4097),
        "below the smallest subnormal": torch.tensor([2.0 ** -10, 2.0 ** -10 * 1.0001, 2.0 ** -11, 1e-30, 1e-45,
                                                      -(2.0 ** -10), -(2.0 ** -10) * 1.0001, -1e-30]),
        "zeros": torch.tensor([0.0, -0.0]),
        "past 448": torch.tensor([448.5, 464.0, 464.1, 479.9, 480.0, 500.0, 1e6, 3e38, -464.0, -464.1, -1e6, -3e38]),
        "random P * 256": p * 256,
        "random P * 1": p,
        "random normal x 100": torch.randn(20000, generator=gen) * 100,
    }


@pytest.mark.skipif(MODE != "interpreter", reason="EXACT pre-rounds for the interpreter's cast")
@pytest.mark.parametrize("what", list(_inputs()))
def test_to_e4m3_matches_torch_bits(what):
    x = _inputs()[what].contiguous()
    got, want = _bits(_cast_kernel, x, cast.exact()), _torch_bits(x)
    wrong = (got != want).nonzero().flatten()
    assert wrong.numel() == 0, f"{what}: {wrong.numel()} wrong, e.g. x = {x[wrong[:5]].tolist()}"


@pytest.mark.skipif(MODE != "interpreter", reason="the interpreter's own cast")
def test_interpreter_cast_alone_is_wrong_so_exact_is_needed():
    """The reason for EXACT: without the pre-rounding, Triton 3.9's interpreter misrounds (125.06 -> 64) and does
    not saturate; if a Triton upgrade fixes this, EXACT may go."""
    assert cast.exact() is True
    x = torch.tensor([125.06, 500.0, 0.3])
    assert (_bits(_cast_kernel, x, False) != _torch_bits(x)).any()


@pytest.mark.skipif(MODE != "interpreter", reason="the interpreter's launch")
def test_to_e4m3_through_a_module_attribute_chain():
    x = _inputs()["midpoints (ties to even)"].contiguous()
    assert torch.equal(_bits(_cast_kernel_chain, x, True), _torch_bits(x))


def test_to_e4m3_compiles_for_sm90_from_another_module(tmp_path):
    """Both call forms compile for sm90 (no GPU needed; Triton needs the kernels in a file): the compiled cast
    saturates and rounds in hardware (cvt.rn.satfinite ... e4m3) whether or not EXACT pre-rounds."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import types\n"
        "import triton, triton.language as tl\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "import labkit as lk\n"
        "from labkit.fp8 import cast\n"
        "from labkit.fp8.cast import to_e4m3\n"
        "lk.fp8cast = cast   # the face name notebooks use\n"
        "@triton.jit\n"
        "def by_name(x_ptr, y_ptr, EXACT: tl.constexpr):\n"
        "    offs = tl.arange(0, 128)\n"
        "    tl.store(y_ptr + offs, to_e4m3(tl.load(x_ptr + offs), EXACT))\n"
        "@triton.jit\n"
        "def by_chain(x_ptr, y_ptr, EXACT: tl.constexpr):\n"
        "    offs = tl.arange(0, 128)\n"
        "    tl.store(y_ptr + offs, lk.fp8cast.to_e4m3(tl.load(x_ptr + offs), EXACT))\n"
        "for fn in (by_name, by_chain):\n"
        "    for exact in (False, True):\n"
        "        src = ASTSource(fn, {'x_ptr': '*fp32', 'y_ptr': '*fp8e4nv', 'EXACT': 'constexpr'}, {'EXACT': exact})\n"
        "        ptx = triton.compile(src, target=GPUTarget('cuda', 90, 32)).asm['ptx']\n"
        "        print(fn.__name__, exact, 'cvt.rn.satfinite.e4m3x2.f32' in ptx)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "0"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["by_name", "False", "True", "by_name", "True", "True",
                                   "by_chain", "False", "True", "by_chain", "True", "True"], done.stdout
