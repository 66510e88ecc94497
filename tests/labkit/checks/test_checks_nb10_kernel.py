"""Unit tests of labkit.checks.nb10_kernel: each visible check of 10_fp8_attention's exercise 3 passes the solution's
kernel and, on a known wrong answer, raises AssertionError naming the rule it breaks; right answers written another
way pass every check. Through the interpreter on a CPU (the PTX check compiles for sm90, no GPU).

The answer comes from the solution notebook, the mistakes from tests/mutants/nb10.py; CAUGHT names the check that
must catch each.
"""
from __future__ import annotations

import pytest
from mutants import load
from notebook_grader import NotebookRunner, exercises

from labkit.checks import nb10_kernel

SETUP = "import math\nimport torch\nimport labkit as lk\nMODE = lk.tritonmode.setup()\nimport triton\nimport triton.language as tl\n"
SPEC = load("nb10")
ANSWER = next(e.answer for e in exercises(SPEC.ASSIGNMENT) if e.grade_id == "ex3_fp8_kernel")
CAUGHT = {  # mistake -> the visible check of labkit.checks.nb10_kernel that catches it
    "the head size fixed at the visible tests' 32": 'reverse_and_p_scale',
    'k descale left out': 'matches_dequantized',
    'v descale left out': 'matches_dequantized',
    'q descale of the first tile for every query tile': 'matches_dequantized',
    'o not divided by p_scale': 'matches_dequantized',
    'GQA: query head h reads kv head h % Hkv': 'matches_dequantized',
    'acc not rescaled by alpha': 'matches_dequantized',
    'scores not scaled by D^-0.5': 'matches_dequantized',
    'causal top-left aligned (j <= i)': 'matches_dequantized',
    'lse left in log2 units': 'matches_dequantized',
    'rows that see no key shifted by -inf (NaN)': 'empty_rows',
    'causal tiles masked, not skipped': 'causal_tiles_skipped',
    'reverse ignored': 'reverse_and_p_scale',
    'P cast to bf16 (V widened to bf16 for the dot)': 'p_cast_in_fp8',
    'o stored without the row mask': 'matches_dequantized',
    'Hq % Hkv not checked': 'bad_input_raises',
    'strides assumed contiguous (no .contiguous())': 'contract_kept',
    'e5m2 operands accepted': 'bad_input_raises',
    'the kernel launched with BLOCK_N = block_m': 'matches_dequantized',
    'o from SDPA on the dequantized inputs': 'own_code',
}
MISTAKES = {name: (old, new, CAUGHT[name]) for name, old, new in SPEC.MISTAKES["ex3_fp8_kernel"]}


def test_every_mistake_names_its_check():
    assert set(CAUGHT) == set(MISTAKES)


def _namespace(answer: str) -> dict:
    """The notebook's namespace with ``answer`` run."""
    runner = NotebookRunner()
    runner.run(SETUP)
    runner.run(answer)
    return runner.namespace


def _run_check(check: str, ns: dict) -> None:
    if check == "fp8_mma_in_ptx":
        f = ns["fp8_attention"]
        nb10_kernel.fp8_mma_in_ptx(lambda: f(*nb10_kernel.fp8_inputs(1, 1, 1, 16, 16, 32, False, 16, 16), False))
    else:
        getattr(nb10_kernel, check)(ns["fp8_attention"])


CHECKS = ["own_code", "matches_dequantized", "empty_rows", "causal_tiles_skipped", "reverse_and_p_scale",
          "p_cast_in_fp8", "bad_input_raises", "contract_kept"]


@pytest.fixture(scope="module")
def solution():
    return _namespace(ANSWER)


@pytest.mark.parametrize("check", CHECKS + ["fp8_mma_in_ptx"])
def test_solution_passes(check, solution):
    _run_check(check, solution)


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_mistake_fails_its_check(mistake):
    old, new, check = MISTAKES[mistake]
    assert ANSWER.count(old) == 1, f"{mistake}: the text to replace is not in the answer once"
    with pytest.raises(AssertionError, match="fp8_attention|_fp8_fwd_kernel"):
        _run_check(check, _namespace(ANSWER.replace(old, new)))


@pytest.mark.parametrize("accepted", [a[0] for a in SPEC.ACCEPTED["ex3_fp8_kernel"]])
def test_accepted_answer_passes(accepted):
    old, new = next((o, n) for name, o, n in SPEC.ACCEPTED["ex3_fp8_kernel"] if name == accepted)
    assert ANSWER.count(old) == 1
    ns = _namespace(ANSWER.replace(old, new))
    for check in CHECKS:
        _run_check(check, ns)


def test_p_cast_mistake_fails_the_ptx_check():
    """The bf16 P mistake compiles to a bf16 MMA for PV on sm90: the PTX check names it."""
    old, new, _ = MISTAKES["P cast to bf16 (V widened to bf16 for the dot)"]
    with pytest.raises(AssertionError, match="wgmma"):
        _run_check("fp8_mma_in_ptx", _namespace(ANSWER.replace(old, new)))


def test_bound_is_tight_and_holds():
    """o_bound holds for a kernel-like model (P cast to e4m3 with the final max) and is not loose: the model's
    error reaches at least a tenth of it somewhere, and a missing factor 256 or a 10% change of V breaks it."""
    import torch

    inputs = nb10_kernel.fp8_inputs(1, 2, 1, 40, 48, 32, True, 16, 16)
    o64, _, w, v, visible = nb10_kernel.attention64(*inputs, False, 16, 16)
    bound = nb10_kernel.o_bound(o64, w, v, visible, 256.0)
    p8 = (w / w.amax(-1, keepdim=True) * 256).float().to(torch.float8_e4m3fn).double() / 256
    model = (p8 @ v) / (w / w.amax(-1, keepdim=True)).sum(-1, keepdim=True)
    err = (model - o64).abs()
    assert (err <= bound).all() and (err / bound).max() > 0.1
    assert not ((o64 * 256 - o64).abs() <= bound).all()
    assert not (((w @ (v * 1.1)) - o64).abs() <= bound).all()
