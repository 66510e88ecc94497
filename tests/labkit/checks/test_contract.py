"""labkit.checks.contract: each check passes a function that keeps the contract and names the rule one breaks."""
from __future__ import annotations

import pytest
import torch

from labkit.checks import contract


def attention(q, k, v, causal=False):
    """Plain attention, q [B, H, N, d], k, v [B, H, Nk, d]: keeps every rule."""
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril(k.shape[-2] - q.shape[-2])
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1) @ v


def assumes_contiguous(q, k, v, causal=False):
    """Reads q's storage as if it were contiguous (a kernel handed q.data_ptr() without strides)."""
    flat = torch.as_strided(q, q.shape, q.new_empty(q.shape).stride())
    return attention(flat, k, v, causal)


def scales_in_place(q, k, v, causal=False):
    return attention(q.mul_(1.0), k.mul_(2.0), v, causal)


class FirstCallWins:
    """Keeps the first call's causal flag on the class, as a Function that stores it outside ctx would."""

    causal = None

    def __call__(self, q, k, v, causal=False):
        if FirstCallWins.causal is None:
            FirstCallWins.causal = causal
        return attention(q, k, v, FirstCallWins.causal)


class LastCallWins:
    causal = False

    def forward(self, q, k, v, causal=False):
        LastCallWins.causal = causal
        return self

    def backward(self, q, k, v):
        return attention(q, k, v, LastCallWins.causal)


def mask_on_cpu(q, k, v, causal=True):
    keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    return torch.softmax((q @ k.transpose(-2, -1)).masked_fill(~keep, float("-inf")), -1) @ v


@pytest.fixture
def qkv():
    torch.manual_seed(0)
    return [torch.randn(2, 3, 5, 4) for _ in range(3)]


def test_a_function_keeping_the_contract_passes(qkv):
    contract.check_contract(attention, *qkv, name="ex", causal=True, other=lambda: attention(*qkv), meta=True)


@pytest.mark.parametrize("layout", list(contract.LAYOUTS.values()))
def test_views_keep_values_and_shape_and_are_not_contiguous(layout, qkv):
    view = layout(qkv[0])
    assert torch.equal(view, qkv[0]) and not view.is_contiguous() and view.stride(-1) == 1
    assert not layout(torch.zeros(3, 4)).is_contiguous()


def test_a_function_assuming_contiguous_inputs_fails_naming_the_argument(qkv):
    with pytest.raises(AssertionError, match=r"輸入可以是 view.*第 1 個參數.*transpose 後的 view"):
        contract.check_views(assumes_contiguous, *qkv, name="ex")


def test_an_error_on_a_view_is_reported_as_the_views_rule(qkv):
    def flattens_by_view(q, k, v):
        return attention(q.view(-1, *q.shape[-2:]), k.view(-1, *k.shape[-2:]), v.view(-1, *v.shape[-2:]))

    with pytest.raises(AssertionError, match=r"(?s)輸入可以是 view.*出錯 RuntimeError.*\.reshape"):
        contract.check_views(flattens_by_view, *qkv, name="ex")


def test_an_input_changed_in_place_is_named(qkv):
    with pytest.raises(AssertionError, match=r"不修改輸入.*第 2 個參數 有 120 個元素被改了"):
        contract.check_inputs_unchanged(scales_in_place, *qkv, name="ex")


def test_an_input_resized_in_place_is_named_not_a_crash():
    def grows(ids):
        return ids.set_(torch.cat([ids, ids], dim=1))
    with pytest.raises(AssertionError, match=r"不修改輸入.*形狀從 \(2, 3\) 變成 \(2, 6\)"):
        contract.check_inputs_unchanged(grows, torch.arange(6).view(2, 3), name="ex")


def test_a_cache_that_no_longer_fits_after_another_call_is_the_state_rule(qkv):
    cache = {}

    def cached(k):                                    # a weight cached by nothing: the wider call finds the wrong one
        return cache.setdefault("w", torch.ones(k.shape[-1])) * k
    small, wide = qkv[1], torch.randn(*qkv[1].shape[:-1], qkv[1].shape[-1] + 2)
    with pytest.raises(AssertionError, match="不留跨呼叫的狀態.*出錯 RuntimeError"):
        contract.check_no_state(lambda: cached(small), lambda: cached(wide), name="ex")


def test_tensors_inside_lists_are_watched_too(qkv):
    def pops(ts):
        ts[0].zero_()
    with pytest.raises(AssertionError, match="第 1 個參數內的張量"):
        contract.check_inputs_unchanged(pops, list(qkv), name="ex")


def test_no_state_passes_a_stateless_function(qkv):
    contract.check_no_state(lambda: attention(*qkv, causal=True), lambda: attention(*qkv), name="ex")


def test_a_setting_kept_from_the_first_call_fails(qkv):
    FirstCallWins.causal = None
    remembers = FirstCallWins()
    with pytest.raises(AssertionError, match="不留跨呼叫的狀態.*沿用了第一個呼叫"):
        contract.check_no_state(lambda: remembers(*qkv, causal=True), lambda: remembers(*qkv), name="ex")


def test_a_setting_the_last_call_left_fails(qkv):
    fn = LastCallWins()

    def causal_then_plain_forward():
        saved = fn.forward(*qkv, causal=True)
        fn.forward(*qkv, causal=False)
        return saved.backward(*qkv)

    with pytest.raises(AssertionError, match="不留跨呼叫的狀態"):
        contract.check_no_state(causal_then_plain_forward, lambda: fn.forward(*qkv).backward(*qkv), name="ex")


def test_a_tensor_made_without_device_fails_on_meta(qkv):
    with pytest.raises(AssertionError, match="(?s)跟著輸入的裝置.*device="):
        contract.check_follows_device(mask_on_cpu, *qkv, name="ex")


def scale_from_a_float(x):
    """Reads a value (meta tensors lack it), then makes the result without device=: on a GPU it stays on the CPU."""
    scale = torch.tensor(float(x.abs().amax()) / 448)
    return x / scale.to(x.device), scale


def scale_from_the_input(x):
    """The same scale computed from x (it reads a value too): it follows x's device."""
    amax = x.abs().amax()
    return x * 2, amax / 448 if bool(amax > 0) else torch.ones_like(amax)


def test_a_result_made_without_device_after_reading_values_fails_with_factories():
    x = torch.randn(3, 4)
    contract.check_follows_device(scale_from_a_float, x, name="ex")           # the meta run alone cannot see it
    with pytest.raises(AssertionError, match="(?s)跟著輸入的裝置.*device="):
        contract.check_follows_device(scale_from_a_float, x, name="ex", factories=True)
    contract.check_follows_device(scale_from_the_input, x, name="ex", factories=True)


def branches_on_values(q, k, v, causal=True):
    """Right on any device, but branches on values (.any() calls .item()), which meta tensors lack."""
    out = attention(q, k, v, causal)
    return out.nan_to_num() if bool(out.isnan().any()) else out


def indexes_by_values(q, k, v, causal=True):
    """Right on any device, but a boolean index (nonzero: its size depends on the values)."""
    out = attention(q, k, v, causal)
    return out[out.abs() >= 0].reshape(out.shape)


@pytest.mark.parametrize("fn", [branches_on_values, indexes_by_values], ids=lambda f: f.__name__)
def test_an_answer_reading_values_is_not_blamed_for_the_device(fn, qkv):
    contract.check_follows_device(fn, *qkv, name="ex")


def test_differences_within_a_few_ulps_pass_and_larger_ones_fail():
    x = torch.ones(4, dtype=torch.bfloat16)
    assert contract._differs(x + 0.0078125, x, None) == ""
    assert "最大誤差 0.25" in contract._differs(x + 0.25, x, None)
    assert "NaN 位置不同：1" in contract._differs(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0]), None)
    assert contract._differs((1, "a"), (1, "a"), None) == "" and contract._differs(3, 4, None) == "得到 3，原本是 4"


def test_lengths_are_tried_as_strided_views_when_asked():
    lens = torch.tensor([3, 1, 4], dtype=torch.int32)
    view = contract.every_other(lens)
    assert torch.equal(view, lens) and view.stride() == (2,) and contract.every_other(torch.ones(2, 3)).stride(-1) == 2

    def reads_storage(lengths):
        """Reads the lengths' storage as if contiguous (a kernel handed lens.data_ptr() alone)."""
        return torch.as_strided(lengths, lengths.shape, (1,)).clone()

    contract.check_views(reads_storage, lens, name="ex")                       # 1-D tensors: only when asked
    contract.check_views(lambda lengths: lengths.contiguous() * 2, lens, name="ex", vectors=True)
    with pytest.raises(AssertionError, match=r"輸入可以是 view.*第 1 個參數.*間隔取值"):
        contract.check_views(reads_storage, lens, name="ex", vectors=True)
    with pytest.raises(AssertionError, match="間隔取值"):
        contract.check_contract(reads_storage, lens, name="ex", vectors=True)


def test_views_once_passes_a_contract_keeper_and_returns_its_answer_on_the_views(qkv):
    want = attention(*qkv, causal=True)
    got = contract.check_views_once(attention, *qkv, name="ex", want=want, causal=True)
    assert torch.allclose(got, want)
    contract.check_views_once(attention, *qkv, name="ex")                        # want computed when not given


def test_views_once_names_a_contiguity_assumption_and_an_input_changed_in_place(qkv):
    with pytest.raises(AssertionError, match=r"輸入可以是 view.*第 1 個參數、第 2 個參數、第 3 個參數 換成同值的 view"):
        contract.check_views_once(assumes_contiguous, *qkv, name="ex")
    with pytest.raises(AssertionError, match=r"不修改輸入.*第 2 個參數 有 120 個元素被改了"):
        contract.check_views_once(scales_in_place, *qkv, name="ex", want=attention(*qkv))


def test_views_once_names_an_input_changed_in_place_only_when_contiguous(qkv):
    def scales_contiguous_q(q, k, v):          # .contiguous() is q itself when q is contiguous: the caller's q doubles
        return attention(q.contiguous().mul_(2.0), k, v)
    with pytest.raises(AssertionError, match=r"不修改輸入.*第 1 個參數 有 120 個元素被改了"):
        contract.check_views_once(scales_contiguous_q, *qkv, name="ex")


def test_new_memory_reads_nan_inside_and_not_after():
    def half_written(x):
        out = torch.empty_like(x)
        out[:1] = x[:1]
        return out, x.new_empty(2, dtype=torch.int64), torch.empty_strided((2, 2), (1, 2))

    x = torch.ones(3, 4)
    with contract.new_memory_reads_nan():
        out, ints, strided = half_written(x)
    assert torch.equal(out[0], x[0]) and out[1:].isnan().all() and (ints == -1).all() and strided.isnan().all()
