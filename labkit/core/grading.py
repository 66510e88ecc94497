"""Assertion helpers for nbgrader test cells, with messages in Traditional Chinese.

Each check raises ``AssertionError`` whose message says what was expected, what came back and what to look at; on
success it returns quietly. Test cells end with :func:`passed`. LOW_PRECISION: the dtypes the 2x rule judges.

Used in: every notebook's test cells.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable

import torch

from labkit.core import codereach

LOW_PRECISION = (torch.bfloat16, torch.float16)


def _fail(what: str, detail: str, hint: str = "") -> None:
    msg = f"[{what}] {detail}"
    if hint:
        msg += f"\n提示（hint）：{hint}"
    raise AssertionError(msg)


def check_tensor(actual, expected: torch.Tensor, *, name: str, atol: float, rtol: float = 0.0, hint: str = "") -> None:
    """``actual`` is a tensor of ``expected``'s shape with |actual - expected| <= atol + rtol*|expected|."""
    if not isinstance(actual, torch.Tensor):
        _fail(name, f"應回傳 torch.Tensor，卻得到 {type(actual).__name__}。", hint)
    if tuple(actual.shape) != tuple(expected.shape):
        _fail(name, f"形狀（shape）應為 {tuple(expected.shape)}，卻得到 {tuple(actual.shape)}。",
              hint or "檢查 transpose、keepdim 與 reshape。")
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if (~torch.isfinite(a) & torch.isfinite(e)).any():  # NaN/Inf where a finite value is expected
        _fail(name, "結果含有 NaN 或 Inf。", hint or "減去每列最大值再取 exp，避免溢位。")
    if (torch.isnan(a) & ~torch.isnan(e)).any():  # NaN where +-inf is expected (NaN > atol is False)
        _fail(name, f"結果在應為 ±inf 的位置有 {int((torch.isnan(a) & ~torch.isnan(e)).sum())} 個 NaN。",
              hint or "-inf - (-inf) = NaN：一個值都沒有的列，最大值改用 0。")
    both_inf = torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))
    err = torch.where(both_inf, torch.zeros_like(a), (a - e).abs())
    allowed = atol + rtol * e.abs().nan_to_num(posinf=0.0, neginf=0.0)
    bad = err > allowed
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        _fail(name, f"數值不符：最大誤差 {float(err.max()):.3g}（容許 atol={atol:g}, rtol={rtol:g}）；"
                    f"例如位置 {idx}：得到 {float(a[idx]):.6g}，應為 {float(e[idx]):.6g}。", hint)


def check_scalar(actual, expected: float, *, name: str, rel: float = 1e-6, abs_tol: float = 0.0,
                 hint: str = "") -> None:
    """``actual`` is a real number within ``rel`` (relative) or ``abs_tol`` of ``expected``."""
    if isinstance(actual, torch.Tensor) and actual.numel() == 1:
        actual = actual.item()
    if isinstance(actual, bool) or not isinstance(actual, numbers.Real):  # numpy scalars are Real
        _fail(name, f"應回傳一個數字，卻得到 {type(actual).__name__}。", hint)
    if not math.isclose(float(actual), float(expected), rel_tol=rel, abs_tol=abs_tol):
        _fail(name, f"應為 {_shown(expected)}，卻得到 {_shown(actual)}。", hint)


def _shown(x) -> str:
    """A number for a message: whole numbers exactly (an off-by-one stays visible), others to 6 digits."""
    return f"{int(x):,}" if float(x).is_integer() and abs(x) < 2**63 else f"{float(x):.6g}"


def check_within_2x(actual, reference: torch.Tensor, baseline: torch.Tensor, *, name: str, rule: str,
                    hint: str = "", floor: float = 0.0) -> None:
    """The course's 2x rule: max|actual - reference| <= 2 * max|baseline - reference| (+ ``floor``).

    Args:
        actual: the student's result, computed from low-precision (bf16/fp16) inputs; any shape.
        reference: the same result from those inputs upcast to fp32/float64 (the exact answer), same shape.
        baseline: the plain low-precision computation (what PyTorch gives in that dtype), same shape.
        rule: the precision rule the prose states (say, "softmax 統計量（max、sum、lse）以 fp32 保存"),
            named in the message so a failure says which rule and its likely cause.
        floor: an absolute slack for results whose baseline error is ~0 (exactly representable values).
    """
    if not isinstance(actual, torch.Tensor):
        _fail(name, f"應回傳 torch.Tensor，卻得到 {type(actual).__name__}。", hint)
    if tuple(actual.shape) != tuple(reference.shape):
        _fail(name, f"形狀（shape）應為 {tuple(reference.shape)}，卻得到 {tuple(actual.shape)}。", hint)
    ref = reference.detach().double().cpu()
    err = float((actual.detach().double().cpu() - ref).abs().nan_to_num(nan=math.inf).max())
    base = float((baseline.detach().double().cpu() - ref).abs().max())
    if not err <= 2 * base + floor:
        _fail(name, f"低精度（bf16/fp16）輸入下的誤差 {err:.3g} 超過 2 倍規則：同精度的 PyTorch 基準誤差為 "
                    f"{base:.3g}，容許 {2 * base + floor:.3g}。違反的精度規則：{rule}。",
              hint or "統計量與累加器是否留在低精度？先用 .float() 升到 fp32 再計算，最後才轉回輸入的 dtype。")


def check_true(condition: bool, *, name: str, detail: str, hint: str = "") -> None:
    """``condition`` holds; otherwise fail with ``detail``."""
    if not condition:
        _fail(name, detail, hint)


def check_raises(fn: Callable[[], object], error: type[BaseException], *, name: str, hint: str = "") -> None:
    """``fn()`` raises ``error``."""
    try:
        fn()
    except error:
        return
    except Exception as err:  # noqa: BLE001 - report what was raised instead
        _fail(name, f"應拋出 {error.__name__}，卻拋出 {type(err).__name__}: {err}", hint)
    _fail(name, f"應拋出 {error.__name__}，但沒有拋出任何錯誤。", hint)


def largest_new_tensor(fn: Callable[[], object]) -> tuple[int, str]:
    """(elements, op) of the largest tensor an operation creates while ``fn()`` runs, backward passes included.

    A tiled algorithm's check: FlashAttention builds no [..., N, Nk] tensor, so the largest it creates is an
    input's size or one tile. A dispatch mode sees the operations autograd runs too (a custom Function's
    backward, or autograd through the standard formula inside it), which a function mode does not.

    Used in: 01_setup_and_comparison.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    largest = [0, ""]

    class _Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.numel() > largest[0]:
                    largest[:] = [t.numel(), str(func.overloadpacket.__name__)]
            return out

    with _Probe():
        fn()
    return largest[0], largest[1]


SPARE = 7.0   # what the extra rows of with_spare_rows hold


def with_spare_rows(t: torch.Tensor, spare: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """A buffer holding t [R, ...] followed by ``spare`` rows of :data:`SPARE`: (the buffer, t's view in it).

    A kernel handed the view that reads or writes past its R rows (the padded rows of its last tile, an
    unmasked ``tl.store``) lands in the spare rows, where :func:`check_spare_rows` sees it, instead of in
    memory it would corrupt: under Triton's interpreter such a store corrupts the process's heap, which
    aborts (the notebook's kernel dies) before any check can say why.
    """
    room = torch.full((t.shape[0] + spare, *t.shape[1:]), SPARE, dtype=t.dtype, device=t.device)
    room[:t.shape[0]] = t
    return room, room[:t.shape[0]]


def check_spare_rows(room: torch.Tensor, rows: int, *, name: str, hint: str) -> None:
    """The rows of ``room`` (from :func:`with_spare_rows`) after its first ``rows`` still hold SPARE."""
    written = (room[rows:] != SPARE).reshape(room.shape[0] - rows, -1).any(1)
    check_true(not bool(written.any()), name=name, hint=hint,
               detail=f"輸出之後的 {room.shape[0] - rows} 列備用列被寫了 {int(written.sum())} 列：有程式實例寫到輸出的範圍之外。")


def passed(exercise: str) -> None:
    """Print the success line a test cell ends with."""
    print(f"✅ {exercise}：通過所有可見測試（visible tests）。")


def answered(needs: dict[str, Callable[[], object]]) -> bool:
    """True when every exercise a later cell uses has an answer; else print one line naming those to finish.

    ``needs``: exercise label ("練習 2") -> a call of its answer on a tiny input. A call that raises
    ``NotImplementedError`` (the blank release), or an error naming one (Triton wraps a blank kernel's in its
    own ``InterpreterError`` or ``CompilationError``), marks the exercise unfinished; other errors propagate.
    Cells run their body under ``if lk.grading.answered({...}):``, so a blank answer gives one line, not a traceback.

    Used in: 04_performance_analysis, 05_precision_analysis, 07_context_parallel, 08_decode_attention.
    """
    todo = []
    for label, call in needs.items():
        try:
            call()
        except Exception as err:  # noqa: BLE001 - only a blank answer's error is caught, the rest re-raised
            if not isinstance(err, NotImplementedError) and "NotImplementedError" not in f"{err!r} {err.__cause__!r}":
                raise
            todo.append(label)
    if todo:
        print(f"先完成{'、'.join(todo)}，再執行這一格：它用到{'這些練習' if len(todo) > 1 else '這個練習'}的答案。")
    return not todo


def check_own_code(fn: Callable, *, name: str, forbid: tuple = (), allow: tuple = ()) -> None:
    """``fn`` is the student's own code: it calls no labkit, nor the library functions in ``forbid``.

    labkit: the source names no ``lk`` or ``labkit``, and nothing ``fn`` reaches (the globals it
    loads, its closure and defaults, and, through them, the functions defined beside it) is a labkit
    module, function or class, however it was imported or renamed (``from labkit.perf.memory import
    training_memory as tm`` in another cell); see :mod:`labkit.core.codereach`.

    ``forbid``: library functions or classes the exercise asks the student to write
    (``torch.softmax``, ``F.scaled_dot_product_attention``, ``F.layer_norm``). ``fn`` may neither
    reach one of them under any name nor read an attribute of that name (``x.softmax(-1)``,
    ``torch.nn.functional.layer_norm``).

    ``allow``: labkit modules or functions the exercise gives, that are no library attention (notebook 10's
    ``lk.fp8cast``, the e4m3 cast its kernel needs). ``fn`` may reach them (``lk.fp8cast.exact()``, or a name
    bound to one; a given module: its functions too) and nothing else of labkit: ``lk`` in the source is read
    through the attributes the code takes of it (``lk.attention.flops`` fails, as does a bare ``getattr(lk, ...)``).
    """
    import inspect

    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        _fail(name, "找不到函式原始碼；請在 notebook 的儲存格中定義它。")
    given = [a.__name__ if inspect.ismodule(a) else f"{a.__module__}.{a.__name__}" for a in allow]

    def labkit(obj) -> bool:   # labkit, less what the exercise gives (a given module's functions and classes too)
        if not codereach.is_labkit(obj):
            return False
        home = obj.__name__ if inspect.ismodule(obj) else getattr(getattr(obj, "__func__", obj), "__module__", None)
        return not any(obj is a or (inspect.ismodule(a) and home == a.__name__) for a in allow)

    unfold = (lambda m: inspect.ismodule(m) and labkit(m)) if allow else None   # lk: what the code takes of it
    reached = codereach.first_reached(fn, labkit, unfold=unfold)
    if ({"labkit"} if allow else {"labkit", "lk"}) & codereach.names(source) or reached:
        but = f"（練習給定的 {', '.join(given)} 除外）" if given else ""
        _fail(name, f"此練習要求自行實作：函式內不可呼叫 labkit（lk.*）{but}" + (f"（經由 {reached}）。" if reached else "。"),
              "labkit 的版本只用來檢查答案；請用 torch 寫出計算步驟。")
    if forbid:
        banned_names = {getattr(f, "__name__", str(f)) for f in forbid}
        banned = codereach.first_reached(fn, lambda obj: any(obj is f for f in forbid), attributes=banned_names)
        if banned:
            _fail(name, f"此練習要求自己寫出這個計算：不可呼叫 {', '.join(sorted(banned_names))}（經由 {banned}）。",
                  "這些函式正是練習要你寫的東西；請用 exp、max、sum、矩陣乘法等基本運算自己組出來。")
