"""Tests for labkit.core.grading: each helper passes on right answers and explains wrong ones in Chinese."""
from __future__ import annotations

import importlib
import re

import numpy as np
import pytest
import torch

import labkit as lk

G = lk.grading
CJK = re.compile(r"[\u4e00-\u9fff]")


def fails(fn, *args, **kwargs) -> str:
    """Run a check that must fail; return its message after checking it is Chinese and tagged."""
    with pytest.raises(AssertionError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert CJK.search(msg), f"message should be in Chinese: {msg}"
    assert msg.startswith(f"[{kwargs['name']}] "), f"message should name the exercise: {msg}"
    return msg


# ----------------------------------------------------------------------------- check_tensor

def test_check_tensor_passes():
    e = torch.tensor([[1.0, -2.0], [float("-inf"), 4.0]])
    G.check_tensor(e + 1e-4, e, name="t", atol=1e-3)
    G.check_tensor((e * 1.01).half(), e, name="t", atol=0, rtol=0.02)  # rtol and any float dtype
    G.check_tensor(e.clone().requires_grad_(), e, name="t", atol=0)  # autograd tensors are fine


def test_check_tensor_wrong_type():
    msg = fails(G.check_tensor, [[1.0, 2.0]], torch.ones(1, 2), name="ex1", atol=1e-3)
    assert "應回傳 torch.Tensor" in msg and "list" in msg


def test_check_tensor_wrong_shape():
    msg = fails(G.check_tensor, torch.ones(2, 3), torch.ones(3, 2), name="ex1", atol=1e-3)
    assert "形狀（shape）應為 (3, 2)" in msg and "(2, 3)" in msg and "transpose" in msg
    msg = fails(G.check_tensor, torch.ones(2, 3, 1), torch.ones(2, 3), name="ex1", atol=1e-3, hint="看 keepdim")
    assert "提示（hint）：看 keepdim" in msg


def test_check_tensor_wrong_values():
    e = torch.zeros(3, 4)
    a = e.clone()
    a[1, 2] = 0.5
    msg = fails(G.check_tensor, a, e, name="ex2", atol=1e-2, hint="檢查縮放")
    assert "數值不符" in msg and "0.5" in msg and "(1, 2)" in msg and "atol=0.01" in msg
    assert "提示（hint）：檢查縮放" in msg
    fails(G.check_tensor, e + 0.011, e, name="ex2", atol=1e-2)  # just outside atol


def test_check_tensor_nan_where_inf_expected():
    e = torch.tensor([0.5, float("-inf")])
    msg = fails(G.check_tensor, torch.tensor([0.5, float("nan")]), e, name="lse", atol=1e-3)
    assert "NaN" in msg and "-inf" in msg


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_check_tensor_nan(bad):
    e = torch.ones(4)
    a = e.clone()
    a[2] = bad
    msg = fails(G.check_tensor, a, e, name="ex3", atol=1e-3)
    assert "NaN 或 Inf" in msg and "exp" in msg


def test_check_tensor_nan_where_expected_has_inf_elsewhere():
    # An lse row can legitimately be -inf (a fully masked row); a NaN next to it is still wrong.
    e = torch.tensor([float("-inf"), 1.0])
    fails(G.check_tensor, torch.tensor([float("-inf"), float("nan")]), e, name="lse", atol=1e-3)
    fails(G.check_tensor, torch.tensor([float("inf"), 1.0]), e, name="lse", atol=1e-3)  # wrong-sign inf
    G.check_tensor(torch.tensor([float("-inf"), 1.0]), e, name="lse", atol=0)


# ----------------------------------------------------------------------------- check_scalar

@pytest.mark.parametrize("value", [2.0, 2, torch.tensor(2.0), torch.tensor([2.0]), np.float32(2.0), np.int64(2)])
def test_check_scalar_passes(value):
    G.check_scalar(value, 2.0, name="s", rel=1e-6)


def test_check_scalar_tolerances():
    G.check_scalar(1.05, 1.0, name="s", rel=0.1)
    G.check_scalar(1e-9, 0.0, name="s", abs_tol=1e-8)
    msg = fails(G.check_scalar, 1.2, 1.0, name="s", rel=0.1, hint="FLOPs 要乘 4")
    assert "應為 1" in msg and "1.2" in msg and "FLOPs 要乘 4" in msg


def test_check_scalar_shows_whole_numbers_exactly():
    msg = fails(G.check_scalar, 3009731, 3009730, name="s", rel=0)   # %g would print both as 3.00973e+06
    assert "應為 3,009,730" in msg and "卻得到 3,009,731" in msg
    assert "0.333333" in fails(G.check_scalar, 1 / 3, 0.5, name="s", rel=0)


@pytest.mark.parametrize("value", ["2.0", None, True, torch.ones(2), [2.0]])
def test_check_scalar_wrong_type(value):
    assert "應回傳一個數字" in fails(G.check_scalar, value, 2.0, name="s")


def test_check_scalar_nan():
    assert "nan" in fails(G.check_scalar, float("nan"), 2.0, name="s", rel=1.0)


# ----------------------------------------------------------------------------- the others

def test_check_true():
    G.check_true(True, name="c", detail="x")
    msg = fails(G.check_true, False, name="c", detail="記憶體應該更少", hint="用 peak_memory")
    assert "記憶體應該更少" in msg and "用 peak_memory" in msg


def test_check_raises():
    G.check_raises(lambda: int("x"), ValueError, name="r")
    msg = fails(G.check_raises, lambda: None, ValueError, name="r")
    assert "ValueError" in msg and "沒有拋出" in msg
    msg = fails(G.check_raises, lambda: {}["k"], ValueError, name="r")
    assert "KeyError" in msg and "ValueError" in msg


def test_passed(capsys):
    G.passed("練習 1")
    out = capsys.readouterr().out
    assert "練習 1" in out and "通過" in out


def test_answered_names_the_blank_exercises_in_one_line(capsys):
    def blank():
        raise NotImplementedError

    assert G.answered({"練習 1": lambda: 1, "練習 2": lambda: 2}) and capsys.readouterr().out == ""
    assert not G.answered({"練習 1": lambda: 1, "練習 2": blank, "練習 3": blank})
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "練習 2、練習 3" in out and "練習 1" not in out
    with pytest.raises(ZeroDivisionError):  # a wrong answer still shows its error
        G.answered({"練習 1": lambda: 1 / 0})


# ----------------------------------------------------------------------------- check_own_code

def calls_lk(q, k, v):
    return lk.attention.reference_attention(q, k, v)[0]


def imports_labkit(q, k, v):
    from labkit.engine.attention import reference_attention
    return reference_attention(q, k, v)[0]


def aliases_labkit(q, k, v):
    import labkit as kit
    return kit.attention.reference_attention(q, k, v)[0]


def own_code(q, k, v):
    """Unlike lk.attention.reference_attention, this is written out (docstrings do not count)."""
    q_blk = q  # names such as q_blk. or bulk. are not lk. (nor are comments)
    s = q_blk.matmul(k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    return torch.softmax(s, dim=-1) @ v


class Solution:
    def method(self, x):
        return lk.attention.flops(1, 1, x, 8)


renamed_function = lk.attention.reference_attention  # imported in another cell under a name without lk
renamed_module = importlib.import_module("labkit.engine.attention")


def uses_renamed_function(q, k, v):
    return renamed_function(q, k, v)[0]


def uses_renamed_module(q, k, v):
    return [renamed_module.reference_attention(q, k, v)[0] for _ in range(1)][0]  # inside a comprehension


def through_a_helper(q, k, v):
    return uses_renamed_function(q, k, v)


def closes_over(reference):
    def answer(q, k, v):
        return reference(q, k, v)[0]
    return answer


def with_default(q, k, v, reference=renamed_function):
    return reference(q, k, v)[0]


def imports_by_string(q, k, v):
    return __import__("labkit.engine.attention").attention.reference_attention(q, k, v)[0]


@pytest.mark.parametrize("fn", [calls_lk, imports_labkit, aliases_labkit, Solution().method,
                                lambda n: lk.attention.flops(1, 1, n, 8), uses_renamed_function,
                                uses_renamed_module, through_a_helper, closes_over(renamed_function), with_default,
                                imports_by_string])
def test_check_own_code_rejects_labkit(fn):
    msg = fails(G.check_own_code, fn, name="attn")
    assert "不可呼叫 labkit" in msg


def test_check_own_code_names_the_route():
    assert "uses_renamed_function -> renamed_function" in fails(G.check_own_code, through_a_helper, name="attn")


shape = lk.perfmodel.ModelShape.gpt2("small")  # a labkit instance as data, and a global named like an attribute


def reads_attributes(q, k, v):
    """Written without labkit (a docstring or a string may say "labkit")."""
    note = "labkit is not used here"
    return own_code(q, k, v).reshape(q.shape) * (shape.n_embd > 0) * (len(note) > 0)


def test_check_own_code_accepts_own_code():
    G.check_own_code(own_code, name="attn")
    G.check_own_code(reads_attributes, name="attn")  # labkit data and attribute names are not labkit calls
    G.check_own_code(lambda x: x.sum(), name="attn")


def test_check_own_code_without_source():
    assert "找不到函式原始碼" in fails(G.check_own_code, len, name="attn")


# ----------------------------------------------------------------------------- check_own_code(forbid=...)
import torch.nn.functional as F  # noqa: E402
from torch.nn.functional import layer_norm as renamed_layer_norm  # noqa: E402

FORBID = (torch.softmax, torch.Tensor.softmax, F.softmax, F.scaled_dot_product_attention)


def softmax_by_function(x):
    return torch.softmax(x, dim=-1)


def softmax_by_method(x):
    return x.softmax(-1)


def sdpa_through_a_helper(q, k, v):
    return sdpa_helper(q, k, v)


def sdpa_helper(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def layer_norm_renamed(x):
    return renamed_layer_norm(x, x.shape[-1:])


def softmax_by_hand(x):
    e = (x - x.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


@pytest.mark.parametrize("fn, route", [(softmax_by_function, ".softmax"), (softmax_by_method, ".softmax"),
                                       (sdpa_through_a_helper, "sdpa_helper -> .scaled_dot_product_attention")])
def test_check_own_code_refuses_the_library_function_the_exercise_is_about(fn, route):
    msg = fails(G.check_own_code, fn, name="softmax", forbid=FORBID)
    assert "不可呼叫" in msg and route in msg and "softmax" in msg


def test_check_own_code_refuses_a_forbidden_function_under_another_name():
    assert "renamed_layer_norm" in fails(G.check_own_code, layer_norm_renamed, name="ln", forbid=(F.layer_norm,))


def layer_norm_imported_inside(x):
    from torch.nn.functional import layer_norm as ln
    return ln(x, x.shape[-1:])


def test_check_own_code_refuses_a_forbidden_function_imported_inside_the_answer():
    assert ".layer_norm" in fails(G.check_own_code, layer_norm_imported_inside, name="ln", forbid=(F.layer_norm,))


def test_check_own_code_accepts_the_computation_written_out():
    G.check_own_code(softmax_by_hand, name="softmax", forbid=FORBID)
    G.check_own_code(softmax_by_function, name="softmax")  # nothing forbidden: only labkit is refused


# ----------------------------------------------------------------------------- check_own_code(allow=...)
GIVEN = (lk.fp8cast,)   # notebook 10's given cast: a labkit module an answer may call
given_cast = lk.fp8cast.exact   # bound in another cell, under another name


def uses_the_given_cast(x):
    return x * lk.fp8cast.exact() + lk.fp8cast.exact.__doc__.count("e4m3") * 0


def uses_the_given_cast_renamed(x):
    return x * given_cast()


def uses_the_cast_and_attention(x):
    return lk.fp8cast.exact() and lk.attention.flops(1, 1, x, 8)


def reaches_lk_bare(x):
    return getattr(lk, "attention").flops(1, 1, x, 8)


def keeps_a_module_of_lk(x):
    engine = lk.engine
    return engine.attention.flops(1, 1, x, 8)


def imports_labkit_inside(x):
    import labkit
    return labkit.fp8cast.exact()


def test_check_own_code_allows_only_what_the_exercise_gives():
    G.check_own_code(uses_the_given_cast, name="fp8", allow=GIVEN)
    G.check_own_code(uses_the_given_cast_renamed, name="fp8", allow=GIVEN)
    G.check_own_code(uses_the_given_cast_renamed, name="fp8", allow=(lk.fp8cast.exact,))   # one function given
    assert "不可呼叫 labkit" in fails(G.check_own_code, uses_the_given_cast, name="fp8"), "nothing given: refused"
    for fn, route in [(uses_the_cast_and_attention, "lk.attention.flops"), (reaches_lk_bare, "（經由 lk）"),
                      (keeps_a_module_of_lk, "lk.engine"), (through_a_helper, "renamed_function")]:
        msg = fails(G.check_own_code, fn, name="fp8", allow=GIVEN)
        assert "labkit.fp8.cast 除外" in msg and route in msg, msg
    assert "不可呼叫 labkit" in fails(G.check_own_code, imports_labkit_inside, name="fp8", allow=GIVEN)
    assert ".softmax" in fails(G.check_own_code, softmax_by_method, name="fp8", forbid=FORBID, allow=GIVEN)


def test_spare_rows_catch_a_write_past_the_output_and_name_how_many():
    """with_spare_rows hands out a view whose buffer continues with SPARE rows; check_spare_rows fails (in
    Chinese, with the count) once anything past the output's rows changed, and passes when nothing did."""
    room, view = lk.grading.with_spare_rows(torch.arange(6.0).reshape(3, 2), spare=4)
    assert room.shape == (7, 2) and torch.equal(view, torch.arange(6.0).reshape(3, 2))
    assert view.data_ptr() == room.data_ptr() and bool((room[3:] == lk.grading.SPARE).all())
    lk.grading.check_spare_rows(room, 3, name="nothing past the output", hint="")
    room.view(-1)[6:9] = 0.0                                  # a store of 3 elements past the 6 (rows 3 and 4)
    with pytest.raises(AssertionError, match="被寫了 2 列"):
        lk.grading.check_spare_rows(room, 3, name="padded rows", hint="mask the store")


def test_largest_new_tensor_sees_the_backward_a_custom_function_runs():
    """largest_new_tensor reports the largest tensor created, autograd's backward included: a Function whose
    backward runs autograd through materialized scores shows the [N, N] tensor, a matmul of tiles does not."""
    q = torch.randn(2, 64, 8, requires_grad=True)

    class ThroughScores(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            with torch.enable_grad():
                x = x.detach().requires_grad_()
                return torch.autograd.grad(torch.softmax(x @ x.transpose(-2, -1), -1) @ x, x, grad)[0]

    out = ThroughScores.apply(q)
    size, op = G.largest_new_tensor(lambda: torch.autograd.grad(out, q, torch.ones_like(out)))
    assert size == 2 * 64 * 64 and op
    assert G.largest_new_tensor(lambda: q[:, :16] @ q[:, :16].transpose(-2, -1))[0] == 2 * 16 * 16


def test_check_within_2x_passes_twice_the_baseline_error_and_names_the_rule():
    ref = torch.linspace(0, 1, 50, dtype=torch.float64)
    base = ref + 1e-3
    G.check_within_2x(ref + 1.9e-3, ref, base, name="lse", rule="統計量以 fp32 保存")
    msg = fails(G.check_within_2x, ref + 3e-3, ref, base, name="lse", rule="統計量以 fp32 保存")
    assert "統計量以 fp32 保存" in msg and "2 倍" in msg
