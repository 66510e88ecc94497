"""The contract every graded function keeps, whatever the instance: checks a test cell runs in one line.

A student's function passes the notebook's cases and still breaks in a model when it assumes more than the
prose allows. Each check here tries one such assumption on the call the test cell already makes:

- :func:`check_views`: tensors that are views (the layout of q after ``.view(B, N, H, d).transpose(1, 2)``, or
  rows cut from a wider buffer) give the answer their contiguous copies give; :func:`check_views_once` tries every
  tensor argument as a view in one call (and that the call leaves them unchanged), for answers slow to run;
- :func:`check_inputs_unchanged`: the call leaves every tensor it was handed as it was (no ``&=``, ``mul_``);
- :func:`check_no_state`: the same call gives the same answer again, after a call configured differently
  (nothing kept on the class, in a global or in a cache keyed by less than the arguments);
- :func:`check_follows_device`: on meta tensors (no data, any machine) every tensor it makes follows the
  inputs' device, as on a GPU, where a mask built without ``device=`` fails.

:func:`check_contract` runs the first three (the fourth where the exercise is plain PyTorch). Messages name the
rule and the likely cause, in lk.grading's style.

Used in: the check modules of the notebooks (labkit/checks/nbNN*.py).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

from labkit.core import grading


def _tensors(value) -> list[torch.Tensor]:
    """The tensors in ``value`` (a tensor, or tuples, lists and dicts of them), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def _named_tensors(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the tensor arguments: ``args[i]`` by position, keyword ones by name."""
    named = [(f"第 {i + 1} 個參數", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    return named + [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]


def _replace(args: tuple, kwargs: dict, which: str, new: torch.Tensor) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with the argument named ``which`` (see :func:`_named_tensors`) replaced by ``new``."""
    if which in kwargs:
        return args, {**kwargs, which: new}
    index = int(which.split()[1]) - 1
    return args[:index] + (new,) + args[index + 1:], kwargs


def transposed_layout(t: torch.Tensor) -> torch.Tensor:
    """t [..., A, B, d] with A's and B's strides swapped (q [B, H, N, d] from ``.view(B, N, H, d).transpose(1, 2)``);
    a 2-D t [R, C] as rows of a wider buffer. Same values, same shape, not contiguous, last stride 1."""
    if t.dim() >= 3:
        return t.transpose(-3, -2).contiguous().transpose(-3, -2)
    return padded_rows(t)


def padded_rows(t: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """t [..., C] as the first C columns of a [..., C + pad] buffer (NaN, or -1, in the rest): a slice's layout."""
    fill = float("nan") if t.is_floating_point() else -1
    buffer = torch.full((*t.shape[:-1], t.shape[-1] + pad), fill, dtype=t.dtype, device=t.device)
    buffer[..., :t.shape[-1]] = t
    return buffer[..., :t.shape[-1]]


def every_other(t: torch.Tensor) -> torch.Tensor:
    """t [..., C] as every other element of a [..., 2C] buffer (NaN, or -1, between): the layout of ``lens[::2]``, a
    strided view also of a 1-D t (lengths [B]). Same values, same shape, not contiguous, last stride 2."""
    fill = float("nan") if t.is_floating_point() else -1
    buffer = torch.full((*t.shape[:-1], 2 * t.shape[-1]), fill, dtype=t.dtype, device=t.device)
    buffer[..., ::2] = t
    return buffer[..., ::2]


LAYOUTS = {"transpose 後的 view": transposed_layout, "切片（slice）的 view": padded_rows}
VECTOR_LAYOUTS = {"間隔取值（[::2]）的 view": every_other}
VIEW_HINT = ("模型傳入的 q、k、v 常是 transpose 或切片後的 view。要嘛先 .contiguous()，要嘛把每個張量自己的 .stride() 傳給 "
             "kernel；輸出用 torch.empty(形狀) 配置，或 empty_like(連續的副本)，不要用 empty_like(輸入)（它沿用輸入的 stride）；"
             "攤平或改形狀用 .reshape，.view 遇到不連續的張量會出錯。")


def _differs(got, want, atol: float | None) -> str:
    """Empty when ``got`` equals ``want`` (tensors within ``atol``, or 8 ulps of their dtype times their scale; other
    values exactly), else what differs."""
    got_t, want_t = _tensors(got), _tensors(want)
    if len(got_t) != len(want_t):
        return f"回傳了 {len(got_t)} 個張量，原本是 {len(want_t)} 個"
    if not want_t:
        return "" if got == want else f"得到 {got!r}，原本是 {want!r}"
    for i, (g, w) in enumerate(zip(got_t, want_t)):
        if g.shape != w.shape:
            return f"第 {i + 1} 個輸出的形狀 {tuple(g.shape)}，原本是 {tuple(w.shape)}"
        g64, w64 = g.detach().cpu().double(), w.detach().cpu().double()
        same_nan = torch.isnan(g64) == torch.isnan(w64)
        finite = torch.isfinite(w64)
        scale = float(w64[finite].abs().max()) if finite.any() else 1.0
        tol = atol if atol is not None else 8 * torch.finfo(w.dtype).eps * (1 + scale) if w.is_floating_point() else 0
        err = (g64 - w64).abs().nan_to_num(nan=0.0)
        err = torch.where(torch.isinf(g64) & (g64 == w64), torch.zeros_like(err), err)
        worst = float(err.max()) if err.numel() else 0.0
        if not bool(same_nan.all()) or worst > tol:
            return f"第 {i + 1} 個輸出最大誤差 {worst:.3g}（NaN 位置不同：{int((~same_nan).sum())} 個）"
    return ""


def check_views(fn: Callable, *args, name: str, atol: float | None = None, vectors: bool = False, **kwargs) -> None:
    """``fn(*args, **kwargs)`` answers the same when each tensor argument of 2+ dims comes as a view
    (:data:`LAYOUTS`: transposed storage, rows of a wider buffer) with the same values; with ``vectors``, each 1-D
    one too (:data:`VECTOR_LAYOUTS`: lengths [B] cut as ``lens[::2]``)."""
    want = fn(*args, **kwargs)
    tries = [(layout, make, 2) for layout, make in LAYOUTS.items()]
    tries += [(layout, make, 1) for layout, make in VECTOR_LAYOUTS.items()] if vectors else []
    for layout, make, dims in tries:
        for which, t in _named_tensors(args, kwargs):
            if (t.dim() < 2 if dims == 2 else t.dim() != 1) or t.numel() < 2:
                continue
            a, kw = _replace(args, kwargs, which, make(t))
            try:
                diff = _differs(fn(*a, **kw), want, atol)
            except Exception as error:  # noqa: BLE001 - e.g. .view() of a non-contiguous tensor: report the rule
                diff = f"出錯 {type(error).__name__}: {str(error)[:200]}"
            grading.check_true(not diff, name=f"{name}：輸入可以是 view", hint=VIEW_HINT, detail=(
                f"{which} 換成同值的{layout}（不連續，non-contiguous）後結果不同：{diff}。"))


def check_views_once(fn: Callable, *args, name: str, want=None, atol: float | None = None, **kwargs):
    """One call ``fn`` with every tensor argument of 2+ dims as a view (:func:`transposed_layout`) answers ``want``
    (the answer on the contiguous arguments; computed first when None) and leaves those views unchanged:
    :func:`check_views` and :func:`check_inputs_unchanged` in a single extra call (a second, on contiguous copies,
    only when the answers differ: an input changed in place through a view of it). Returns fn's result on the views."""
    if want is None:
        want = fn(*args, **kwargs)

    def view(value):
        return transposed_layout(value) if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.numel() >= 2 else value

    views, kw_views = tuple(view(a) for a in args), {k: view(v) for k, v in kwargs.items()}
    got = check_inputs_unchanged(fn, *views, name=name, **kw_views)
    which = "、".join(n for n, t in _named_tensors(args, kwargs) if t.dim() >= 2 and t.numel() >= 2)
    diff = _differs(got, want, atol)
    if diff:   # contiguous copies next: an input changed in place (a view's copy is changed, not the view) shows there
        copy = lambda value: value.clone() if isinstance(value, torch.Tensor) else value  # noqa: E731
        check_inputs_unchanged(fn, *(copy(a) for a in args), name=name, **{k: copy(v) for k, v in kwargs.items()})
    grading.check_true(not diff, name=f"{name}：輸入可以是 view", hint=VIEW_HINT, detail=(
        f"{which} 換成同值的 view（transpose 後的 view 或切片：不連續，non-contiguous）後結果不同：{diff}。"))
    return got


def check_inputs_unchanged(fn: Callable, *args, name: str, **kwargs):
    """``fn(*args, **kwargs)`` leaves every tensor in its arguments as it was (NaN where NaN; a tensor resized in place
    counts as changed). Returns fn's result."""
    named = _named_tensors(args, kwargs)
    named += [(f"{k} 內的張量", t) for k, v in kwargs.items() if not isinstance(v, torch.Tensor) for t in _tensors(v)]
    named += [(f"第 {i + 1} 個參數內的張量", t) for i, a in enumerate(args) if not isinstance(a, torch.Tensor)
              for t in _tensors(a)]
    before = [t.detach().clone() for _, t in named]
    result = fn(*args, **kwargs)
    for (which, t), old in zip(named, before):
        now = t.detach()
        if now.shape != old.shape:                   # resized in place (resize_, set_, out=): a change, not a crash
            same = torch.zeros(1, dtype=torch.bool)
        else:
            same = (now == old) | (now.isnan() & old.isnan()) if now.is_floating_point() else now == old
        grading.check_true(bool(same.all()), name=f"{name}：不修改輸入", detail=(
            f"呼叫之後，傳入的 {which} 有 {int((~same).sum())} 個元素被改了"
            f"{'' if now.shape == old.shape else f'（形狀從 {tuple(old.shape)} 變成 {tuple(now.shape)}）'}。"),
            hint="原地（in-place）運算（&=、+=、mul_、masked_fill_、.copy_）會改到呼叫端的張量；改用不帶底線的版本，或先 .clone()。")
    return result


def check_no_state(call: Callable[[], object], other: Callable[[], object], *, name: str,
                   atol: float | None = None) -> None:
    """``call()`` and ``other()`` (the same function configured differently: another base, causal or not, another
    block size; their answers must differ) each answer the same again after the other ran, and not each other's."""
    def attempt(run):
        """(run's answer, "") or (None, the error): a call that fails after another ran breaks the same rule."""
        try:
            return run(), ""
        except Exception as error:  # noqa: BLE001 - e.g. a mask cached by part of the shape no longer fits
            return None, f"出錯 {type(error).__name__}: {str(error)[:200]}"

    first = call()
    (first_other, error_other), (again, error_again), (again_other, error_again_other) = (attempt(other), attempt(call),
                                                                                           attempt(other))
    diffs = (error_again or _differs(again, first, atol),
             error_other or error_again_other or _differs(again_other, first_other, atol))
    hint = ("設定要放在區域變數或 ctx（ctx.causal = causal），不要存在 class、全域變數或只以部分參數為鍵的快取裡；"
            "輸出每次呼叫都新配置，不要重用快取起來的張量（下一次呼叫會覆寫上一次的答案）。")
    for what, diff in zip(("同一個呼叫", "另一個設定的呼叫"), diffs):
        grading.check_true(not diff, name=f"{name}：不留跨呼叫的狀態", hint=hint, detail=(
            f"{what}在中間夾了另一個呼叫之後，結果不同：{diff}。"))
    grading.check_true(bool(_differs(first_other, first, atol)), name=f"{name}：不留跨呼叫的狀態", hint=hint, detail=(
        "兩個設定不同的呼叫（應得到不同的結果）卻回傳同樣的答案：第二個呼叫沿用了第一個呼叫留下的設定或快取。"))


# What torch raises when a function reads values a meta tensor lacks (.item() under .any(), nonzero under x[mask]).
NEEDS_DATA = ("cannot be called on meta tensors", "data-dependent", "data-independent implementation")


class _DevicelessFactories(TorchFunctionMode):
    """Inside, ``tensors`` collects what torch's factory functions (those a ``torch.device`` context steers) make
    without a ``device=`` argument."""

    def __init__(self):
        super().__init__()
        self.tensors = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _device_constructors() and (kwargs or {}).get("device") is None:
            self.tensors.append(out)
        return out


def check_follows_device(fn: Callable, *args, name: str, factories: bool = False, **kwargs) -> None:
    """``fn`` on meta copies of its tensor arguments makes only meta tensors: every tensor it creates follows the
    inputs' device. For plain PyTorch answers (meta tensors hold no data: no Triton); a function that reads values
    (:data:`NEEDS_DATA`: ``.item()``, ``if t.any()``, ``x[mask]``) stops there and passes, untested. With
    ``factories``, first: ``fn`` on the real arguments returns no tensor that a factory (``torch.tensor``, ``ones``,
    ``full``, ...) made without ``device=`` (e.g. ``torch.tensor(float(amax))``: it reads a value, so the meta run
    cannot see it; on a GPU it stays on the CPU)."""
    def meta(value):
        if isinstance(value, torch.Tensor):
            return value.to("meta")
        if isinstance(value, (tuple, list)):
            return type(value)(meta(v) for v in value)
        return value

    hint = "torch.arange / ones / zeros / full / tensor 要加 device=輸入.device：不加就建在 CPU 上，輸入在 GPU 時混用兩個裝置而出錯。"
    if factories:
        with _DevicelessFactories() as made:
            result = fn(*args, **kwargs)
        off = sum(any(t is m for m in made.tensors) for t in _tensors(result))
        grading.check_true(not off, name=f"{name}：跟著輸入的裝置（device）", hint=hint, detail=(
            f"回傳的張量有 {off} 個是沒有 device= 的 torch.tensor / ones / full ... 直接建出來的（例如 "
            "torch.tensor(float(...))）：輸入在 GPU 時它們留在 CPU。"))
    try:
        result = fn(*meta(args), **{k: meta(v) for k, v in kwargs.items()})
    except Exception as error:  # noqa: BLE001 - any error on meta inputs: report it with the likely cause
        if any(words in str(error) for words in NEEDS_DATA):
            return                                  # a branch on values (.item(), .any(), x[mask]): nothing to tell
        grading.check_true(False, name=f"{name}：跟著輸入的裝置（device）", hint=hint, detail=(
            f"輸入放在另一個裝置（meta，代表 GPU）時出錯：{type(error).__name__}: {str(error)[:200]}"))
    off = [str(t.device) for t in _tensors(result) if t.device.type != "meta"]
    grading.check_true(not off, name=f"{name}：跟著輸入的裝置（device）", hint=hint, detail=(
        f"輸入放在另一個裝置（meta，代表 GPU）時，回傳的張量卻在 {sorted(set(off))} 上。"))


@contextlib.contextmanager
def new_memory_reads_nan():
    """Inside, every tensor made by ``torch.empty``/``empty_like``/``new_empty``/``empty_strided`` starts as NaN (integers
    as -1): an output an answer leaves partly unwritten then reads NaN there, whatever the allocator hands out (a
    block freed by an earlier right answer on the same inputs would otherwise still hold the right values)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    empties = {torch.ops.aten.empty_like.default, torch.ops.aten.empty.memory_format, torch.ops.aten.new_empty.default,
               torch.ops.aten.empty_strided.default}

    class _NanFill(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in empties and out.device.type != "meta":
                out.fill_(float("nan") if out.is_floating_point() else -1)
            return out

    with _NanFill():
        yield


def check_contract(fn: Callable, *args, name: str, other: Callable[[], object] | None = None, meta: bool = False,
                   atol: float | None = None, vectors: bool = False, factories: bool = False, **kwargs) -> None:
    """:func:`check_inputs_unchanged`, :func:`check_views` (1-D tensors too with ``vectors``), :func:`check_no_state`
    (when ``other`` is given) and, with ``meta``, :func:`check_follows_device` (with ``factories``), on
    ``fn(*args, **kwargs)``."""
    check_inputs_unchanged(fn, *args, name=name, **kwargs)
    check_views(fn, *args, name=name, atol=atol, vectors=vectors, **kwargs)
    if other is not None:
        check_no_state(lambda: fn(*args, **kwargs), other, name=name, atol=atol)
    if meta:
        check_follows_device(fn, *args, name=name, factories=factories, **kwargs)
