"""labkit.tritonlab.compile: kernels run by the interpreter are compiled for sm80 and sm90 with no GPU.

The kernels here run in the interpreter (``import labkit`` sets it on a CPU) and are recorded,
then compiled by Triton in a separate process: what a notebook 06 test cell does.
"""
from __future__ import annotations

import pytest
import torch

import labkit as lk
from labkit.tritonlab import compile as tritoncompile

lk.tritonmode.setup()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

pytestmark = pytest.mark.slow
SCALE: tl.constexpr = tl.constexpr(2.0)   # a constexpr global: allowed in a kernel
PLAIN_SCALE = 2.0                          # a plain global: the interpreter reads it, the compiler refuses


@triton.jit
def _sum_and_product(a, b):
    return a + b, a * b


@triton.jit
def _matmul_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tile = offs[:, None] * BLOCK + offs[None, :]
    x = tl.load(x_ptr + tile, mask=offs[:, None] < n, other=0.0)
    s, _ = _sum_and_product(x, x)
    z = tl.dot(x, tl.trans(x)) * SCALE + s
    tl.store(y_ptr + tile, z.to(y_ptr.dtype.element_ty), mask=offs[:, None] < n)


@triton.jit
def _global_kernel(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) * PLAIN_SCALE)


def launch_matmul():
    x = torch.randn(64, 64).half()
    y = torch.empty_like(x)
    _matmul_kernel[(1,)](x, y, 64, BLOCK=64)
    return x, y


def test_a_launch_is_recorded_with_its_arguments():
    with tritoncompile.recorded(module=__name__) as launches:
        x, y = launch_matmul()
    assert [launch.kernel for launch in launches] == ["_matmul_kernel"]
    assert launches[0].args["BLOCK"] == 64 and launches[0].args["x_ptr"] is x
    ref = (x.float() @ x.float().T) * 2.0 + 2 * x.float()
    torch.testing.assert_close(y.float(), ref, atol=0.1, rtol=1e-2)  # the kernel still ran (fp16 output)


def test_compiles_for_ampere_and_hopper_with_their_tensor_core_instructions():
    with tritoncompile.recorded(module=__name__) as launches:
        launch_matmul()
    reports = {r.arch: r for r in tritoncompile.compile_launches(launches, archs=(80, 90))}
    assert all(r.ok for r in reports.values()), [r.error for r in reports.values()]
    assert reports[80].mma == "mma.sync" and reports[90].mma == "wgmma"
    assert all(r.registers and r.registers > 0 and r.spills == 0 for r in reports.values())
    table = tritoncompile.report_table(list(reports.values()))
    assert list(table["tl.dot became"]) == ["mma.sync", "wgmma"] and table["compiles"].all()


@triton.jit
def _fp32_dot_kernel(x_ptr, y_ptr, PREC: tl.constexpr):
    offs = tl.arange(0, 16)
    x = tl.load(x_ptr + offs[:, None] * 16 + offs[None, :])
    tl.store(y_ptr + offs[:, None] * 16 + offs[None, :], tl.dot(x, x, input_precision=PREC))


@pytest.mark.parametrize("prec", ["ieee", "tf32"])
def test_tf32_products_of_fp32_inputs_are_seen_in_the_compiled_code(prec):
    x = torch.randn(16, 16)
    with tritoncompile.recorded(module=__name__) as launches:
        _fp32_dot_kernel[(1,)](x, torch.empty_like(x), PREC=prec)
    reports = tritoncompile.compile_launches(launches, archs=(80, 90))
    assert all(r.ok for r in reports) and [r.tf32 for r in reports] == [prec == "tf32"] * 2
    if prec == "tf32":
        with pytest.raises(AssertionError, match="IEEE fp32"):
            tritoncompile.check_no_tf32(reports, name="fp32", hint="PREC")
    else:
        tritoncompile.check_no_tf32(reports, name="fp32", hint="PREC")


def test_a_plain_global_runs_in_the_interpreter_but_fails_to_compile_with_the_reason():
    x = torch.ones(16)
    _global_kernel[(1,)](x, BLOCK=16)
    assert torch.equal(x, torch.full((16,), 2.0))  # the interpreter does not mind
    with pytest.raises(AssertionError) as err:
        tritoncompile.check_compiles(lambda: _global_kernel[(1,)](torch.ones(16), BLOCK=16), name="kernel",
                                     archs=(90,), module=__name__)
    msg = str(err.value)
    assert "_global_kernel" in msg and "PLAIN_SCALE" in msg and "tl.constexpr" in msg and "sm90" in msg


def test_check_compiles_fails_when_no_notebook_kernel_is_launched():
    with pytest.raises(AssertionError, match="沒有啟動任何"):
        tritoncompile.check_compiles(lambda: torch.softmax(torch.ones(4), 0), name="softmax")


def test_config_overrides_the_recorded_tiles():
    with tritoncompile.recorded(module=__name__) as launches:
        launch_matmul()
    recorded_tiles, = tritoncompile.compile_launches(launches, archs=(80,))
    larger_tiles, = tritoncompile.compile_launches(launches, archs=(80,), config={"BLOCK": 128, "num_stages": 2})
    assert recorded_tiles.ok and larger_tiles.ok
    assert larger_tiles.shared_bytes > recorded_tiles.shared_bytes  # 128x128 fp16 tiles staged, not 64x64


@triton.jit
def _reads_global_in_helper(x):
    return x * PLAIN_SCALE


@triton.jit
def _helper_global_kernel(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, _reads_global_in_helper(tl.load(x_ptr + offs)))


def test_a_global_read_in_a_helper_is_named_too():
    with pytest.raises(AssertionError) as err:
        tritoncompile.check_compiles(lambda: _helper_global_kernel[(1,)](torch.ones(16), BLOCK=16), name="kernel",
                                     archs=(90,), module=__name__)
    assert "PLAIN_SCALE" in str(err.value) and "PLAIN_SCALE = tl.constexpr(...)" in str(err.value)


@triton.jit
def _row_softmax_kernel(x_ptr, y_ptr, MODE: tl.constexpr):
    offs = tl.arange(0, 16)
    x = tl.load(x_ptr + offs).to(tl.float32)
    if MODE == 1:                                         # the row max rounded to the input dtype, widened again
        m = tl.max(x, axis=0).to(x_ptr.dtype.element_ty)
    else:
        m = tl.max(x, axis=0)
    e = tl.exp(x - m)
    if MODE == 2:                                         # the sum taken in the input dtype
        s = tl.sum(e.to(x_ptr.dtype.element_ty), axis=0)
    else:
        s = tl.sum(e, axis=0)
    tl.store(y_ptr + offs, (e / s).to(y_ptr.dtype.element_ty))


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_statistics_kept_in_bf16_are_seen_in_the_triton_ir(mode):
    def run():
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.randn(16).to(dtype)
            _row_softmax_kernel[(1,)](x, torch.empty_like(x), MODE=mode)

    if mode == 0:
        reports = tritoncompile.check_fp32_statistics(run, name="softmax", rule="RULE", hint="HINT", module=__name__)
        assert len(reports) == 2 and all(r.ok and not r.low_precision for r in reports)  # one per input dtype
        return
    with pytest.raises(AssertionError) as err:
        tritoncompile.check_fp32_statistics(run, name="softmax", rule="RULE", hint="HINT", module=__name__)
    statement = "m = tl.max(x, axis=0).to(" if mode == 1 else "s = tl.sum(e.to("
    assert "RULE" in str(err.value) and "bf16" in str(err.value) and statement in str(err.value)
