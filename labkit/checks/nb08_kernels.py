"""What 08_decode_attention's kernel exercises check alike: padded query rows not written, the precision rules
(2x rule, fp32 in the compiled Triton IR, every score near -240), 64-bit offsets, own code and compilation.

The notebook's own test helpers come in one :class:`Helpers` (its setup cell builds it): the seeded inputs, the
float64 reference, plain attention in the input dtype, the kernels' device and key block.

Used in: 08_decode_attention (test cells of ex2, ex3, ex4, ex6, through nb08_decode, nb08_split, nb08_paged)
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from labkit.core import grading
from labkit.tritonlab import bounds as tritonbounds, compile as tritoncompile, mode as tritonmode

QK_SCALE_16 = 16 ** -0.5 * math.log2(math.e)    # qk_scale of the hand launches (d = 16)
RULE_DECODE = "acc、m、l 以 fp32 保存與累加（p 只在 tl.dot 之前轉成 v 的 dtype），只在存回時轉成輸出的 dtype"
NEG_HINT = ("m_i 從 -inf 開始（tl.full([BLOCK_G], float(\"-inf\"), tl.float32)），不是 0；每列的最大值在 tl.where(keep, s, -inf) 之後才取"
            "（遮罩外的鍵讀成 0，分數 0 比每個真的分數都大）。否則所有分數都很負時 exp2(s - m) 全部下溢成 0，l = 0。")
GLOBALS_WHY = "最常見的原因：核心讀了一般的 Python 全域變數：直接寫數字或當參數傳入。"


class Helpers(NamedTuple):
    """The notebook's test helpers: inputs(b, hq, hkv, n, d, dtype=, seed=, scale=) -> q [B, H_q, d], k, v [B, N, H_kv, d];
    reference(q, k, v, lo=None, hi=None) -> float64 (o [B, H_q, d], lse [B, H_q]) over keys lo[b] <= j < hi[b];
    plain(q, k, v) -> o in q's dtype; device; block_n (the kernels' key block)."""

    inputs: Callable
    reference: Callable
    plain: Callable
    device: torch.device
    block_n: int


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (the checks that count loads or overflows need it)."""
    return tritonmode.current() == "interpreter"


@contextlib.contextmanager
def shapes_named(name: str, hint: str):
    """A kernel whose tiles do not fit together at these sizes fails with the check's name and hint, not a traceback."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - Triton's InterpreterError or CompilationError
        if "shape" not in str(err).lower():
            raise
        grading.check_true(False, name=name + "：區塊的形狀", hint=hint,
                           detail=f"核心在這些大小下形狀對不上：{str(err).splitlines()[0][:160]}")


def launched_once(launched, kernel: str, name: str, hint: str = "") -> None:
    """``launched`` (from lk.tritonmode.launches) counted one launch of ``kernel``."""
    grading.check_true(launched[kernel] == 1, name=f"{name}：啟動了 {kernel}", detail=f"啟動紀錄：{dict(launched)}。", hint=hint)


def padded_rows_not_written(launch: Callable, H: Helpers, *, n: int, rows: int, spare: int, name: str, hint: str) -> None:
    """g = 3 query heads per KV head (2 KV heads, d = 16, N = n keys) padded to 16 rows: ``launch(q, k, v, o, lse)``
    writes o [rows, 16] and lse [rows] (views of buffers followed by ``spare`` spare rows) and no spare row."""
    q, k3, v3 = H.inputs(1, 6, 2, n, 16, seed=2)
    _, q3 = grading.with_spare_rows(q[0])
    o_room, o3 = grading.with_spare_rows(torch.empty(rows, 16, device=H.device), spare=spare)
    lse_room, lse3 = grading.with_spare_rows(torch.empty(rows, device=H.device), spare=spare)
    launch(q3.view(1, 6, 16), k3, v3, o3, lse3)
    for room in (o_room, lse_room):
        grading.check_spare_rows(room, rows, name=name, hint=hint)


def acc_stays_fp32(run: Callable, H: Helpers, *, name: str, seed: int, n: int = 1000) -> None:
    """The 2x rule for bf16 and fp16 inputs (seeds ``seed``, ``seed + 1``; v with mean 1, so o is not near 0): q [1, 8, 32],
    a cache [1, n, 2, 32]; ``run(q, k, v)`` -> o [1, 8, 32] over its first 1000 keys. ``name`` has a {dtype} field."""
    for dtype, s in ((torch.bfloat16, seed), (torch.float16, seed + 1)):
        ql, kl, vl = H.inputs(1, 8, 2, n, 32, dtype=dtype, seed=s)
        vl = (vl.float() + 1.0).to(dtype)
        grading.check_within_2x(run(ql, kl, vl), H.reference(ql, kl[:, :1000], vl[:, :1000])[0],
                                H.plain(ql, kl[:, :1000], vl[:, :1000]), name=name.format(dtype=str(dtype)[6:]), rule=RULE_DECODE,
                                hint="acc 在整個迴圈裡都是 fp32：acc = acc·alpha + tl.dot(p.to(v.dtype), v)，不要在迴圈裡把 acc 轉成輸入的 dtype"
                                     "（每塊捨入一次，誤差隨區塊數累積）。")


def partials_fp32_in_ir(run: Callable, name: str) -> None:
    """The Triton IR of the bf16 and fp16 launches ``run()`` makes: statistics in fp32, partials o_s, lse_s stored as fp32."""
    tritoncompile.check_fp32_statistics(
        run, name=name, rule=RULE_DECODE + "；部分結果 o_s、lse_s 以 fp32 存",
        hint="部分結果 o_part、lse_part 是 fp32：o 與 lse 原樣存回，不要 .to(q.dtype) 或轉成輸入的 dtype；acc 在 _finish 之前也不要轉型（bf16 輸入的 o_s 經過一次 bf16，合併之後的 o 就捨入了兩次）。")


def very_negative_scores(run: Callable, H: Helpers, *, name: str, n: int, seed: int, out: str = "o") -> None:
    """Every score near -240 (q near +8, K near -8; fp32, length 37 with a tail): ``run(q, k, v)`` with q [1, 4, 16],
    k, v [1, n, 2, 16] -> (o [1, 4, 16], lse [1, 4]) over the first 37 keys; checked as ``out`` and ``out``'s lse."""
    q, k, v = H.inputs(1, 4, 2, n, 16, seed=seed)
    q, k = q * 0.5 + 8.0, k * 0.5 - 8.0
    o, lse = run(q, k, v)
    o_ref, lse_ref = H.reference(q, k, v, hi=[37])
    lse_name = "lse" + out[1:]
    grading.check_tensor(o.double(), o_ref, name=f"{name}：每個分數都約 -240 時的 {out}", atol=1e-3, hint=NEG_HINT)
    grading.check_tensor(lse.double(), lse_ref, name=f"{name}：每個分數都約 -240 時的 {lse_name}", atol=1e-3, hint=NEG_HINT)


def no_int32_overflow(launch: Callable, keep: tuple, *, name: str, where: str, hint: str, pid_offset=(0, 0, 0)) -> None:
    """Under the interpreter, ``launch()`` computes no address with an int32 overflow (``keep``: the tensors it is given)."""
    with tritonbounds.int32_overflows(keep=keep, pid_offset=pid_offset) as seen:
        launch()
    grading.check_true(seen["overflows"] == 0, name=name, hint=hint,
                       detail=f"位址的計算裡有 {seen['overflows']:,} 個 int32 乘法或加法溢位：GPU 上它們默默繞回，{where}。")


def other_block(H: Helpers) -> int:
    """A key block (or chunk step) other than the notebook's B_N and the hand launches' d = 16 and B_G = 16: 32, or 64
    where B_N is 32."""
    return 64 if H.block_n == 32 else 32


def own_kernel(fn: Callable, H: Helpers, name: str, forbid: tuple = (F.scaled_dot_product_attention, torch.softmax, F.softmax)) -> None:
    """``fn`` is the student's own code: no labkit, none of ``forbid`` and not the notebook's reference."""
    grading.check_own_code(fn, name=name, forbid=forbid + (H.reference,))


def compiles(run: Callable, kernel: str, why: str = GLOBALS_WHY) -> list:
    """The kernels ``run()`` launches compile for sm80 and sm90; a failure says ``why`` it most often happens."""
    try:
        return tritoncompile.check_compiles(run, name=kernel, archs=(80, 90))
    except AssertionError as err:
        raise AssertionError(f"{err}\n{why}") from None
