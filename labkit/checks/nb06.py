"""Visible tests of 06_triton_flashattention's exercises (its test cells call them): the fused softmax (ex1),
TritonFlashAttention (ex4), and what the kernel exercises share (a float64 reference, causal tiles skipped,
64-bit head offsets, the sm80/sm90 compile). The forward (ex2), the backward (ex3) and GQA with a window (ex5)
have their own modules: nb06_forward, nb06_backward, nb06_window.

Used in: 06_triton_flashattention (test cells of ex1, ex2, ex3, ex4, ex5)
"""
from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from labkit.checks import contract
from labkit.core import grading
from labkit.engine import attention
from labkit.tritonlab import bounds as tritonbounds, compile as tritoncompile, mode as tritonmode

LOG2E = 1.4426950408889634
RULE_SOFTMAX = "最大值、指數與總和以 fp32 計算（讀進來就 .to(tl.float32)），只在存回時轉成輸入的 dtype"
HINT_SOFTMAX_IR = ("讀進來就 .to(tl.float32)，之後的 tl.max、x - m、tl.exp、tl.sum 與除法都在 fp32 中做；只有 tl.store 之前的 "
                   "y.to(y_ptr.dtype.element_ty) 轉成輸入的 dtype：不要把 m、x - m 或 e 轉成 bf16（.to(tl.bfloat16)、.to(x.dtype) 都一樣）。")
HINT_COMPILE = ("\n若是編譯失敗，最常見的原因：核心或它呼叫的 @triton.jit 輔助函式讀了一般的 Python 全域變數（例如第一格的 LOG2E）："
                "直接寫數字、改成 tl.constexpr(...) 全域常數，或當參數傳入（見工具箱）。")


@triton.jit
def _tile_range_probe(out_ptr, N_Q, N_K, RANGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      CAUSAL: tl.constexpr, PER_KEY_TILE: tl.constexpr):
    tile = tl.program_id(0)
    a, b = RANGE(tile * (BLOCK_N if PER_KEY_TILE else BLOCK_M), N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    tl.store(out_ptr + 2 * tile, a)
    tl.store(out_ptr + 2 * tile + 1, b)


def tile_ranges(range_fn, n: int, nk: int, bm: int, bn: int, causal: bool, device, per_key_tile: bool = False) -> list:
    """[(a, b)] that the @triton.jit ``range_fn(start, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)`` returns for every query
    tile (start = tile * bm; _key_range's (mid, hi)) or, per_key_tile, every key tile (_query_range's (lo, mid))."""
    got = torch.full((triton.cdiv(nk if per_key_tile else n, bn if per_key_tile else bm), 2), -10**6, dtype=torch.int32,
                     device=device)
    _tile_range_probe[(got.shape[0],)](got, n, nk, RANGE=range_fn, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal,
                                       PER_KEY_TILE=per_key_tile)
    return got.tolist()


class LargestNewTensor(torch.overrides.TorchFunctionMode):
    """The most elements of any tensor a torch call returns inside the block (a function mode: the calls the answer
    makes, not the interpreter's own copies that a dispatch mode such as grading.largest_new_tensor also sees).
    Tensors that Triton itself makes are not counted: on a GPU, ``@triton.autotune`` times its configurations at the
    first call with a 256 MiB buffer that flushes L2 (67,108,864 int32 in Triton 3.6), not the answer's tensor."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest and not _made_by_triton():
                self.largest = t.numel()
        return out


def _made_by_triton() -> bool:
    """Whether the torch call being made comes from inside Triton's own code (its autotuner, do_bench)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").partition(".")[0] == "triton":
            return True
        frame = frame.f_back
    return False


def attention64(q, k, v, causal):
    """float64 attention, bottom-right aligned causal mask: o and lse (-inf, o = 0 on a row that sees no key)."""
    return attention.reference_attention(q.double(), k.double(), v.double(), causal=causal)


def softmax_padding_not_stored(softmax_kernel, device) -> None:
    """softmax_kernel launched by hand on one row of 50 (BLOCK = 64) into an output [1, 50] followed by a spare row:
    the 14 padded lanes are not stored (first: an unmasked store corrupts memory in the interpreter)."""
    torch.manual_seed(1)
    x = torch.randn(2, 7, 50, device=device)
    y_room, y_one = grading.with_spare_rows(torch.empty(1, 50, device=device))
    softmax_kernel[(1,)](x[0, :1].contiguous(), y_one, 50, BLOCK=64)
    grading.check_spare_rows(y_room, 1, name="softmax_kernel（一列 50 個，BLOCK = 64）：遮罩外的 14 個位置沒有寫出去",
                             hint="tl.store 也要 mask=cols < n_cols：BLOCK 補到 2 的次方，多出來的位置不屬於這一列，"
                                  "寫出去會蓋掉下一列或別的資料（在直譯器裡會弄壞記憶體，讓 notebook 的核心當掉）。")


def softmax_values(softmax, device) -> None:
    """softmax(x) [..., n] launches softmax_kernel, calls no torch.softmax, and matches torch.softmax (atol 1e-6) on
    rows of 50 (a masked tail), also on x as a transposed view (left unchanged), logits in the hundreds and logits near
    -200; bf16 in -> bf16 out, same shape."""
    torch.manual_seed(1)
    x = torch.randn(2, 7, 50, device=device)
    with tritonmode.launches() as launched:
        y = softmax(x)
    grading.check_true(launched["softmax_kernel"] >= 1, name="softmax: Triton kernel launched",
                       detail=f"softmax 沒有啟動 softmax_kernel（啟動紀錄：{dict(launched)}）。",
                       hint="softmax_kernel[(n_rows,)](...)：一個程式實例處理一列。")
    grading.check_own_code(softmax, name="softmax: your own kernel, no torch.softmax",
                           forbid=(torch.softmax, torch.Tensor.softmax, F.softmax))
    grading.check_tensor(y, torch.softmax(x, dim=-1), name="softmax: values (rows of 50, a masked tail)", atol=1e-6,
                         hint="BLOCK = triton.next_power_of_2(列長)；遮罩外讀成 -inf（不是 0），exp(-inf) = 0 才不影響總和。")
    contract.check_views_once(softmax, x, name="softmax", want=y)               # x as q's transposed layout, once
    big = torch.randn(3, 50, device=device) * 300                                  # logits in the hundreds
    grading.check_tensor(softmax(big), torch.softmax(big, dim=-1), name="softmax: logits in the hundreds (no overflow)",
                         atol=1e-6, hint="數值穩定：先減去每列的最大值再取 exp（e^300 在 fp32 是 inf，inf/inf = NaN）。")
    low = torch.randn(2, 50, device=device) - 200                                  # every logit near -200
    grading.check_tensor(softmax(low), torch.softmax(low, dim=-1), name="softmax: every logit near -200 (rows of 50)",
                         atol=1e-6, hint="每列的最大值只能取這一列真的元素：遮罩外的位置讀成 -inf（other=float(\"-inf\")），取最大值時也要是 -inf；"
                                         "當成 0 的話最大值是 0，e^(-200) 在 fp32 下溢成 0，0 / 0 = NaN。")
    xb = torch.randn(5, 20, device=device).to(torch.bfloat16)
    yb = softmax(xb)
    grading.check_true(isinstance(yb, torch.Tensor) and yb.dtype == torch.bfloat16 and yb.shape == xb.shape,
                       name="softmax: bf16 in, bf16 out, same shape",
                       detail=f"輸出應為 bf16 {tuple(xb.shape)}，卻是 {getattr(yb, 'dtype', type(yb))} "
                              f"{tuple(getattr(yb, 'shape', ()))}。",
                       hint="y = torch.empty_like(x2)（與輸入同 dtype）；核心裡以 fp32 計算，存回前 .to(y_ptr.dtype.element_ty)。")


def softmax_block_follows_row(softmax, device) -> None:
    """softmax launches softmax_kernel with BLOCK = next_power_of_2(n) for rows [3, n] of 50, of 64 and of 300, and
    for one row of 5000 (past caps of 1024 and 4096), whose values match torch.softmax (new tensors start as NaN, so
    columns left unwritten show)."""
    for rows, n_cols in ((3, 50), (3, 64), (3, 300), (1, 5000)):
        x = torch.randn(rows, n_cols, device=device)
        with tritoncompile.recorded() as launched, contract.new_memory_reads_nan():
            y = softmax(x)
        blocks = sorted({launch.args.get("BLOCK") for launch in launched if launch.kernel == "softmax_kernel"})
        hint = ("BLOCK = triton.next_power_of_2(x2.shape[1])：隨列長而變，不要寫死，也不要設上限（寫死 64 的核心只看得到每列的前 64 個；"
                "上限 1024 或 4096 的核心在 5000 的列留下沒寫的欄）。")
        grading.check_true(blocks == [triton.next_power_of_2(n_cols)], name=f"softmax: BLOCK for rows of {n_cols}", hint=hint,
                           detail=f"列長 {n_cols} 時 softmax_kernel 以 BLOCK = {blocks} 啟動，應為 "
                                  f"{triton.next_power_of_2(n_cols)}（大於等於列長的最小 2 的次方）。")
    grading.check_tensor(y, torch.softmax(x, dim=-1), name="softmax: one row of 5000 (longer than 4096)", atol=1e-6,
                         hint=hint)


def softmax_offsets_64bit(softmax_kernel, device) -> None:
    """In the interpreter (else nothing): softmax_kernel launched by hand on one row of 50 with the row's program id
    raised past 2^26 (row * n_cols past 2^31 elements, as 16K tokens of a 128K vocabulary reach) makes no int32
    overflow."""
    x, y = torch.randn(1, 50, device=device), torch.empty(1, 50, device=device)
    head_offsets_64bit(lambda: softmax_kernel[(1,)](x, y, 50, BLOCK=64), (x, y), axis=0, pid=2**26,
                       name="softmax_kernel: 64-bit row offsets (row past 2^26, rows of 50)",
                       detail="列編號 2^26 起（row * n_cols 超過 2^31），核心裡有 {overflows} 個 int32 加減乘的結果溢位。",
                       hint="先把列的程式實例編號 tl.program_id(0) 轉成 tl.int64，再乘 n_cols（同練習 2–5 的 head 偏移量）；32 位元在 GPU 上會悄悄繞回，"
                            "讀寫到別的列（16K 個詞元、128K 的詞彙表，logits 就超過 2^31 個元素）。")


def softmax_ir_fp32(softmax, device, shape=(3, 50), dtypes=(torch.bfloat16, torch.float16),
                    name="softmax: bf16 and fp16 rows in the compiled Triton IR") -> None:
    """The Triton IR of softmax's launches on rows ``shape`` of ``dtypes`` (the compiler's front end, no GPU) holds no
    arithmetic, exp or sum on bf16/fp16 values; a value converted to the input dtype is only stored."""
    tritoncompile.check_fp32_statistics(lambda: [softmax(torch.randn(*shape, device=device).to(dtype)) for dtype in dtypes],
                                        name=name, rule=RULE_SOFTMAX, hint=HINT_SOFTMAX_IR)


def softmax_within_2x(softmax, device) -> None:
    """bf16 and fp16 rows [4, 300] (logits ~ +-10): the error vs a float64 softmax at most 2x torch.softmax's in that dtype."""
    for dtype in grading.LOW_PRECISION:
        xl = (torch.randn(4, 300, device=device) * 4).to(dtype)
        grading.check_within_2x(softmax(xl), torch.softmax(xl.double(), dim=-1), torch.softmax(xl, dim=-1),
                                name=f"softmax: {dtype} values (rows of 300)", rule=RULE_SOFTMAX,
                                hint="低精度的 e^x 或總和會累積捨入誤差：載入後先 .to(tl.float32)，tl.sum 在 fp32 中做，"
                                     "最後 y.to(y_ptr.dtype.element_ty) 才轉回。")


def causal_tiles_skipped(run: Callable[[bool], object], *, ratio: float, name: str, detail: str, hint: str = "") -> None:
    """In the interpreter (else nothing): ``run(causal)`` for causal False and True; a causal run loads at most
    ``ratio`` of the elements a non-causal one loads. ``detail`` formats {causal}, {plain} and {share}."""
    if tritonmode.current() != "interpreter":
        return
    loaded = {}
    for causal in (False, True):
        with tritonmode.loaded_elements() as count:
            run(causal)
        loaded[causal] = count["elements"]
    grading.check_true(loaded[True] <= ratio * loaded[False], name=name, hint=hint,
                       detail=detail.format(causal=loaded[True], plain=loaded[False], share=loaded[True] / loaded[False]))


def head_offsets_64bit(launch: Callable[[], object], keep: tuple, *, name: str, detail: str, hint: str,
                       pid: int = 2**23, axis: int = 1) -> None:
    """In the interpreter (else nothing): ``launch()`` with the program id of grid ``axis`` (the head's) raised by
    ``pid`` (offsets past 2^31 elements on tiny tensors ``keep``) makes no int32 +, -, * overflow. ``detail`` formats
    {overflows}."""
    if tritonmode.current() != "interpreter":
        return
    with tritonbounds.int32_overflows(keep=keep, pid_offset=tuple(pid if i == axis else 0 for i in range(3))) as seen:
        launch()
    grading.check_true(seen["overflows"] == 0, name=name, detail=detail.format(overflows=seen["overflows"]), hint=hint)


def compiles_without_tf32(run: Callable[[], object], *, name: str, hint: str) -> None:
    """The kernels ``run()`` launches (fp32 inputs) compile for sm80 and sm90, with no TF32 mma / wgmma."""
    try:
        reports = tritoncompile.check_compiles(run, name=name, archs=(80, 90))
    except AssertionError as err:
        raise AssertionError(f"{err}{HINT_COMPILE}") from None
    tritoncompile.check_no_tf32(reports, name=f"{name}（fp32 輸入）", hint=hint)


def function_matches_autograd(function, device, saved_hint: str = "") -> None:
    """function.apply(q, k, v, causal), q [2, 2, 70, 16], k, v [2, 2, 50, 16] (N != N_k) fp32, causal and not: forward
    returns o only, Triton kernels run forward and backward, o (atol 1e-5), the one saved lse [2, 2, 70] and the
    gradients (atol 1e-4) match autograd through labkit's reference; both forwards run before both backwards (no state
    kept between calls)."""
    torch.manual_seed(9)
    q = torch.randn(2, 2, 70, 16, device=device, requires_grad=True)
    k, v = (torch.randn(2, 2, 50, 16, device=device, requires_grad=True) for _ in range(2))   # N != N_k
    do = torch.randn(2, 2, 70, 16, device=device)
    outs = {}
    with tritonmode.launches() as launched:   # both forwards, then both backwards: is_causal kept per call, on ctx
        for causal in (False, True):
            outs[causal] = function.apply(q, k, v, causal)
        grads = {causal: torch.autograd.grad(outs[causal], (q, k, v), do, retain_graph=True) for causal in (False, True)}
    for causal, o in outs.items():
        grading.check_true(isinstance(o, torch.Tensor), name="TritonFlashAttention.forward: returns o only",
                           detail=f"forward 應只回傳 o（一個張量），卻回傳 {type(o).__name__}。")
        grading.check_true(launched["_fwd_kernel"] >= 1 and launched["_bwd_dkdv_kernel"] >= 1,
                           name="TritonFlashAttention: Triton kernels launched", detail=f"啟動紀錄：{dict(launched)}。",
                           hint="forward 呼叫 flash_attention_forward，backward 呼叫 flash_attention_backward。")
        o_ref, lse_ref = attention.reference_attention(q, k, v, causal=causal)
        grading.check_tensor(o, o_ref, name=f"TritonFlashAttention: o (causal={causal})", atol=1e-5)
        saved = o.grad_fn.saved_tensors
        lse_like = [t for t in saved if tuple(t.shape) == tuple(q.shape[:-1])]
        grading.check_true(len(lse_like) == 1, name="TritonFlashAttention: saved log-sum-exp",
                           detail=f"save_for_backward 應恰好存一個形狀 {tuple(q.shape[:-1])} 的 lse，"
                                  f"實際存了：{[tuple(t.shape) for t in saved]}。",
                           hint=saved_hint)
        grading.check_tensor(lse_like[0], lse_ref, name="TritonFlashAttention: saved lse values", atol=1e-5)
        grads_ref = torch.autograd.grad(o_ref, (q, k, v), do)
        for name, g, e in zip(("dq", "dk", "dv"), grads[causal], grads_ref):
            grading.check_tensor(g, e, name=f"TritonFlashAttention: {name} (causal={causal}; two forwards, then two backwards)",
                                 atol=1e-4, hint="backward 要用這一次呼叫存在 ctx 上的 is_causal（ctx.is_causal = is_causal）："
                                                 "存在 class 或全域變數上，兩次 forward 之後再做 backward 時，前一次的反向會用到後一次的設定。")


def function_layouts_and_bf16(function, device) -> None:
    """[batch, n, d] inputs q [2, 48, 16], k, v [2, 40, 16] (N != N_k; inputs left unchanged; one saved lse [2, 48]; o
    and gradients vs labkit's reference), then bf16 [1, 2, 40, 16] in -> bf16 out and bf16 gradients."""
    q = torch.randn(2, 48, 16, device=device, requires_grad=True)
    k, v = (torch.randn(2, 40, 16, device=device, requires_grad=True) for _ in range(2))
    o = contract.check_inputs_unchanged(function.apply, q, k, v, False, name="TritonFlashAttention")
    lse_like = [t for t in o.grad_fn.saved_tensors if tuple(t.shape) == (2, 48)]
    grading.check_true(len(lse_like) == 1, name="TritonFlashAttention: [batch, n, d] input saves one lse [batch, n]",
                       detail=f"找到 {len(lse_like)} 個形狀 (2, 48) 的張量。", hint="lse 的形狀是 q.shape[:-1]，不要假設 4 維。")
    o_ref, _ = attention.reference_attention(q, k, v)
    grading.check_tensor(o, o_ref, name="TritonFlashAttention: [batch, n, d] o (N = 48, N_k = 40)", atol=1e-5)
    ones = torch.ones_like(o)
    grads = torch.autograd.grad(o, (q, k, v), ones)
    for name, g, e in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(o_ref, (q, k, v), ones)):
        grading.check_true(tuple(g.shape) == tuple(e.shape), name=f"TritonFlashAttention: [batch, n, d] {name} shape (N = 48, N_k = 40)",
                           detail=f"{name} 應為 {tuple(e.shape)}（與輸入同形狀），得到 {tuple(g.shape)}。",
                           hint="dk、dv 的形狀是 k、v 的（N_k 可以不等於 N），不是 q 的：直接回傳 flash_attention_backward 的 dq, dk, dv。")
        grading.check_tensor(g, e, name=f"TritonFlashAttention: [batch, n, d] {name} (N = 48, N_k = 40)", atol=1e-4)
    qb, kb, vb = (torch.randn(1, 2, 40, 16, device=device).to(torch.bfloat16).requires_grad_() for _ in range(3))
    ob = function.apply(qb, kb, vb, True)
    grading.check_true(ob.dtype == torch.bfloat16, name="TritonFlashAttention: bf16 in -> bf16 out",
                       detail=f"o 是 {ob.dtype}。", hint="直接回傳 flash_attention_forward 的 o（已是 q 的 dtype），不要轉成 fp32。")
    gb = torch.autograd.grad(ob, (qb, kb, vb), torch.ones_like(ob))
    grading.check_true(all(g.dtype == torch.bfloat16 for g in gb), name="TritonFlashAttention: bf16 gradients",
                       detail=f"梯度 {[g.dtype for g in gb]}。")


def function_within_2x(function, device, saved_hint: str = "") -> None:
    """bf16 and fp16 inputs [1, 2, 70, 32], causal: one fp32 lse saved; o and the gradients vs float64 at most 2x
    plain attention's error in that dtype (gradients: plus the rounding of the exact gradient to that dtype)."""
    rule = "log-sum-exp 以 fp32 存下（save_for_backward 存 flash_attention_forward 回傳的 fp32 lse，不轉型）"
    torch.manual_seed(15)
    for dtype in grading.LOW_PRECISION:
        ql, kl, vl, dol = (torch.randn(1, 2, 70, 32, device=device).to(dtype) for _ in range(4))
        ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
        ol = function.apply(ql, kl, vl, True)
        saved = [t for t in ol.grad_fn.saved_tensors if tuple(t.shape) == (1, 2, 70)]
        grading.check_true(len(saved) == 1 and saved[0].dtype == torch.float32,
                           name=f"TritonFlashAttention: {str(dtype)[6:]} inputs save an fp32 lse",
                           detail=f"存下的 lse：{[t.dtype for t in saved]}；應為一個 fp32 的 [..., N]。違反的精度規則：{rule}。",
                           hint=saved_hint)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (ql, kl, vl))
        o64 = attention.reference_attention(q64, k64, v64, causal=True)[0]
        qp, kp, vp = (t.detach().clone().requires_grad_() for t in (ql, kl, vl))
        op = attention.reference_attention(qp, kp, vp, causal=True)[0]
        name = f"TritonFlashAttention: {str(dtype)[6:]} inputs [1, 2, 70, 32], causal"
        grading.check_within_2x(ol, o64, op, name=name + ": o", rule=rule)
        for g, got, want, base in zip(("dq", "dk", "dv"), torch.autograd.grad(ol, (ql, kl, vl), dol),
                                      torch.autograd.grad(o64, (q64, k64, v64), dol.double()),
                                      torch.autograd.grad(op, (qp, kp, vp), dol)):
            grading.check_within_2x(got, want, base, name=f"{name}: {g}", rule=rule,
                                    floor=(want.to(dtype).double() - want).abs().max().item(),
                                    hint="forward 存下 flash_attention_forward 回傳的 fp32 lse；backward 直接交給 flash_attention_backward。")
