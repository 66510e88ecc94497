"""labkit.tritonlab.mode: the interpreter switch, the bf16 dot fix, the launch and load counters."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

import labkit as lk  # before triton: sets TRITON_INTERPRET=1 here (no CUDA in CI)

MODE = lk.tritonmode.setup()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

pytestmark = pytest.mark.skipif(MODE != "interpreter", reason="the counters and the bf16 fix are the interpreter's")


@triton.jit
def _add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=0.0)
    tl.store(out_ptr + offs, x + tl.load(y_ptr + offs, mask=inside, other=0.0), mask=inside)


@triton.jit
def _matmul(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    """c [M, N] fp32 = a [M, K] @ b [K, N], one program (all sizes powers of 2 >= 16)."""
    rm, rk, rn = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b))


def _launch_add(n: int = 1000, block: int = 256):
    x, y = torch.randn(n), torch.randn(n)
    out = torch.empty_like(x)
    _add[(triton.cdiv(n, block),)](x, y, out, n, BLOCK=block)
    return x, y, out


def test_setup_reports_the_interpreter_and_kernels_run_on_cpu_tensors():
    assert lk.tritonmode.current() == "interpreter" and lk.tritonmode.device() == torch.device("cpu")
    x, y, out = _launch_add()
    assert torch.equal(out, x + y)


@triton.jit
def _twice(x):
    return 2 * tl.maximum(x, 0.0) + tl.sum(x, axis=0) * 0   # a helper that calls the language, and triton's own tl.sum


@triton.jit
def _helper_loop(x_ptr, out_ptr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    for _ in range(STEPS):
        x = _twice(x)
    tl.store(out_ptr + offs, x)


def test_helpers_patch_the_language_once_per_launch_and_still_compute(monkeypatch):
    """4 programs x 3 calls of _twice (which calls tl.sum): the language is patched by the launch and by the first
    call of each helper (_twice, tl.sum), not at all 24 calls; the result is right in both launches."""
    from triton.runtime import interpreter

    calls = []
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn, original=interpreter._patch_lang: calls.append(fn.__name__)
                        or original(fn))
    x = torch.randn(64)
    for _ in range(2):
        out = torch.empty_like(x)
        _helper_loop[(4,)](x, out, BLOCK=16, STEPS=3)
        assert torch.equal(out, 8 * x.clamp(min=0))
    assert sorted(calls) == sorted(["_helper_loop", "_twice", "sum"] * 2), calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dot_multiplies_numbers_in_every_dtype(dtype):
    a, b = torch.randn(16, 32).to(dtype), torch.randn(32, 16).to(dtype)
    c = torch.empty(16, 16)
    _matmul[(1,)](a, b, c, 16, 32, 16)
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-5, atol=1e-5)  # exact products, fp32 sums


@triton.jit
def _round_to(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(y_ptr.dtype.element_ty))


def test_fp32_to_bf16_rounds_to_nearest_as_the_gpu_does():
    x = torch.randn(1024) * 100
    y = torch.empty(1024, dtype=torch.bfloat16)
    _round_to[(1,)](x, y, BLOCK=1024)
    assert torch.equal(y, x.to(torch.bfloat16))       # torch rounds to nearest even, like cvt.rn.bf16.f32


def test_launches_counts_kernels_of_the_given_module_only():
    with lk.tritonmode.launches(module=__name__) as mine, lk.tritonmode.launches() as main:
        _launch_add()
        _launch_add()
    assert mine == {"_add": 2} and main == {}
    with lk.tritonmode.launches(module=__name__) as after:
        pass
    _launch_add()
    assert after == {}                                     # counting stops with the block


def test_loaded_elements_counts_unmasked_lanes():
    with lk.tritonmode.loaded_elements() as count:
        _launch_add(n=1000, block=256)                     # 4 programs x 256 lanes, 1000 inside, x and y
    assert count["elements"] == 2000 and count["lanes"] == 2 * 4 * 256   # masked-off lanes issued, not read
    with lk.tritonmode.loaded_elements() as later:
        pass
    _launch_add()
    assert later["elements"] == 0


def test_loaded_elements_counts_the_products_of_every_dot():
    a, b, c = torch.randn(16, 32), torch.randn(32, 64), torch.empty(16, 64)
    with lk.tritonmode.loaded_elements() as count:
        _matmul[(1,)](a, b, c, 16, 32, 64)
        _matmul[(1,)](a, b, c, 16, 32, 64)
    assert count["products"] == 2 * 16 * 32 * 64 and count["elements"] == 2 * (16 * 32 + 32 * 64)
    with lk.tritonmode.loaded_elements() as later:
        pass
    _matmul[(1,)](a, b, c, 16, 32, 64)
    assert later["products"] == 0                          # counting stops with the block
    torch.testing.assert_close(c, a @ b, rtol=1e-5, atol=1e-5)


@triton.autotune(configs=lk.tritonmode.tile_configs([(128, 64, 4, 3)], small=(32, 16, 4, 1)), key=["n"])
@triton.jit
def _tuned_fill(x_ptr, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(x_ptr + offs, offs.to(tl.float32), mask=offs < n)


def test_passing_a_tuned_block_size_names_the_autotuner():
    x = torch.zeros(100)
    _tuned_fill[lambda meta: (triton.cdiv(100, meta["BLOCK_M"]),)](x, 100)   # the right way
    assert torch.equal(x, torch.arange(100.0))
    launch = _tuned_fill[(4,)]
    for call in (lambda: launch(x, 100, BLOCK_M=32), lambda: launch(x, 100, 32, 16)):
        for counting in (False, True):          # inside the launch counter the error used to name it
            with (lk.tritonmode.launches(module=__name__) if counting else contextlib.nullcontext()):
                with pytest.raises(TypeError, match="BLOCK_M, BLOCK_N") as err:
                    call()
            assert "自動調校" in str(err.value) and "_tuned_fill" in str(err.value)
            assert "multiple values" not in str(err.value) and "labkit" not in str(err.value)


def test_tile_configs_follow_the_mode(monkeypatch):
    compiled, small = [(128, 64, 4, 3), (64, 64, 8, 2)], (32, 32, 4, 1)
    (one,) = lk.tritonmode.tile_configs(compiled, small=small)
    assert one.kwargs == {"BLOCK_M": 32, "BLOCK_N": 32}
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    tuned = lk.tritonmode.tile_configs(compiled, small=small)
    assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in tuned] == \
        [small, *compiled]
    with pytest.raises(RuntimeError, match="loaded_elements"):
        with lk.tritonmode.loaded_elements():
            pass


@pytest.mark.parametrize("bh, n, dtype, tuned", [
    (16, 1024, torch.bfloat16, True),      # 2^24 scores: every candidate but the small one
    (16, 1000, torch.bfloat16, False),     # just under: the first only
    (256, 4096, torch.float32, False),     # fp32 (the graded path): the first only
    (1, 100, torch.float16, False),
])
def test_tune_large_only_keeps_the_first_config_for_small_or_fp32_problems(bh, n, dtype, tuned):
    configs = ["small", "a", "b"]
    q = torch.empty(bh, n, 0, dtype=dtype)                 # no storage needed: shape and dtype only
    kept = lk.tritonmode.tune_large_only(configs, {"q_ptr": q, "N_Q": n, "N_K": n}, HEAD_DIM=64)
    assert kept == (["a", "b"] if tuned else ["small"])
    assert lk.tritonmode.tune_large_only(configs, {"q_ptr": q}, N_Q=n, N_K=n) == kept   # sizes passed by keyword


def test_setup_refuses_a_mode_triton_was_not_imported_in(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")             # triton's library here is interpreted
    with pytest.raises(RuntimeError, match="restart"):
        lk.tritonmode.setup()


def test_apply_default_sets_the_interpreter_without_cuda_and_respects_a_choice(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET")
    lk.tritonmode.apply_default()
    assert lk.tritonmode.current() == "interpreter"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    lk.tritonmode.apply_default()
    assert lk.tritonmode.current() == "compiled"


def test_triton_imported_before_labkit_is_reported():
    code = "import triton, labkit as lk\nlk.tritonmode.setup()"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode != 0 and "import labkit" in run.stderr
