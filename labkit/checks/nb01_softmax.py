"""Visible tests of exercise 3 of 01_setup_and_comparison: ``online_softmax(x, block_size)``.

x is [..., N]; the answer reads it one block of <= block_size columns at a time and must equal
``torch.softmax(x, dim=-1)`` in x's shape and dtype: fp32 to ~1e-7 (atol=1e-6), float64 to rounding, and
bf16/fp16 within the course's 2x rule against float64 (the baseline: torch.softmax in the same dtype).

Used in: 01_setup_and_comparison (test cells of ex3)
"""
from __future__ import annotations

import torch

from labkit.checks import contract, nb01
from labkit.core import grading

SAME_HINT = "m_new 為 -inf 時，用 0 當平移量，避免 (-inf) - (-inf) = NaN。"


def _close(online_softmax, x, block_size, *, name, atol=1e-6, hint=""):
    """online_softmax(x, block_size) equals torch.softmax(x, dim=-1) to ``atol``; returns the answer's result."""
    y = online_softmax(x, block_size)
    grading.check_tensor(y, torch.softmax(x, dim=-1), name=name, atol=atol, hint=hint)
    return y


def within_2x(online_softmax, x, block_size, *, name, rule, hint="", view=lambda p: p):
    """2x rule on ``view`` of the probabilities (say their log, or each row's sum): x in bf16/fp16 [..., N]."""
    grading.check_within_2x(view(online_softmax(x, block_size).double()), view(torch.softmax(x.double(), dim=-1)),
                            view(torch.softmax(x, dim=-1).double()), name=name, rule=rule, hint=hint)


def writes_its_own_softmax(online_softmax) -> None:
    """No softmax, log_softmax or logsumexp (nor labkit) anywhere the function reaches."""
    grading.check_own_code(online_softmax, name="online_softmax: 自己寫 softmax",
                           forbid=(torch.softmax, torch.Tensor.softmax, torch.nn.functional.softmax, torch.logsumexp,
                                   torch.Tensor.logsumexp, torch.log_softmax, torch.Tensor.log_softmax,
                                   torch.nn.functional.log_softmax))


def matches_softmax(online_softmax) -> None:
    """fp32 [4, 7, 100] with block sizes that do (100) and do not (16, 32, 128) divide N; result in x's dtype."""
    torch.manual_seed(3)
    x = torch.randn(4, 7, 100)
    for block_size in (16, 32, 100, 128):
        y = _close(online_softmax, x, block_size, name=f"online_softmax(block_size={block_size})",
                   hint="m_new = max(m, 區塊最大值)；l = l * exp(m - m_new) + sum(exp(x_b - m_new))。")
    grading.check_true(y.dtype == x.dtype, name="online_softmax: dtype", detail=f"dtype 應為 {x.dtype}，卻是 {y.dtype}。")


def keeps_the_contract(online_softmax) -> None:
    """On fp32 x [2, 3, 40] in blocks of 16: x left unchanged (no in-place xb -= m on a block of x), views of x
    (transposed storage, rows of a wider buffer) give the same result, and on meta x every tensor it makes follows
    x's device (torch.full / zeros with device=x.device)."""
    torch.manual_seed(34)
    contract.check_contract(online_softmax, torch.randn(2, 3, 40), 16, name="online_softmax", meta=True)


def keeps_a_running_max(online_softmax) -> None:
    """Values ~1e4 of both signs (exp overflows without the running max); rows near -1e4 only (the running max
    starts at -inf, not 0; atol=1e-3, the fp32 spacing of an lse ~ -1e4); -inf entries, with rows whose first
    blocks are all -inf (the -inf - -inf = NaN trap)."""
    torch.manual_seed(13)
    _close(online_softmax, torch.randn(4, 60) * 1e4, 12, name="online_softmax: values ~1e4",
           hint="每一列維持目前的最大值 m（不是區塊自己的最大值），永遠減去它再取 exp；m 變大時舊的 l 乘上 exp(m - m_new)。")
    _close(online_softmax, torch.randn(3, 40) * 10 - 1e4, 12, name="online_softmax: every value near -1e4", atol=1e-3,
           hint="m 從 -inf 開始（不是 0），m_new = max(m, 區塊最大值)：整列都很負時，以 0 為平移量的 exp 全部下溢成 0。")
    x = torch.randn(4, 48)
    x[torch.rand(4, 48) < 0.25] = float("-inf")
    x[0, :24] = float("-inf")                    # blocks 0-2 of row 0 are all -inf
    x[2, :46] = float("-inf")                    # row 2: only its last block has finite values
    x[:, -2] = 0.25                              # every row keeps a finite value
    y = online_softmax(x, 8)
    grading.check_true(not y.isnan().any(), name="online_softmax: -inf entries give no NaN", detail="結果含有 NaN。",
                       hint=SAME_HINT)
    _close(online_softmax, x, 8, name="online_softmax: -inf entries", hint=SAME_HINT)


def float64_in_float64(online_softmax) -> None:
    """float64 [3, 5, 45] in: result float64, computed in float64 (error ~1e-16, atol=1e-12)."""
    x64 = torch.randn(3, 5, 45, dtype=torch.float64)
    y = online_softmax(x64, 8)
    grading.check_true(y.dtype == torch.float64, name="online_softmax: float64 dtype", detail=f"dtype 應為 float64，卻是 {y.dtype}。")
    _close(online_softmax, x64, 8, name="online_softmax: float64 accuracy", atol=1e-12,
           hint="float64 輸入要以 float64 計算：torch.promote_types(x.dtype, torch.float32)。")


def statistics_in_fp32(online_softmax) -> None:
    """bf16 rows of 2048 in blocks of 16 and fp16 rows of 1024 in blocks of 8 (a running sum kept in bf16 loses what
    each block adds); bf16 rows near 100 (spacing 0.5: a statistic rounded to bf16 moves probabilities by 28%)."""
    torch.manual_seed(18)
    for dtype, shape, block_size, spread in ((torch.bfloat16, (4, 2048), 16, 0.25), (torch.float16, (4, 1024), 8, 0.5)):
        x = (torch.randn(shape) * spread).to(dtype)
        y = online_softmax(x, block_size)
        grading.check_true(y.dtype == dtype, name=f"online_softmax: {dtype} dtype",
                           detail=f"{dtype} 輸入時結果應為 {dtype}，卻是 {y.dtype}。", hint="以 fp32 計算，寫回時轉回 x.dtype。")
        within_2x(online_softmax, x, block_size, name=f"online_softmax: {dtype}, N={shape[-1]}, block_size={block_size} (2x rule)",
                  rule="執行中的最大值 m 與總和 l 以 fp32 保存，bf16/fp16 輸入也一樣",
                  hint="acc 用 torch.promote_types(x.dtype, torch.float32)：m、l 用 acc 建立，每個區塊先 .to(acc) "
                       "再算；只有最後寫回輸出時才轉回 x.dtype。")
    within_2x(online_softmax, (100 + 2 * torch.randn(4, 40)).to(torch.bfloat16), 16,
              name="online_softmax: bf16 values near 100 (2x rule)",
              rule="執行中的最大值 m 與總和 l（或由它們合成的 log-sum-exp）以 fp32 保存，bf16/fp16 輸入也一樣",
              hint="區塊的統計量（m、l、m + log l）不要轉成 x.dtype：100 附近 bf16 的間距是 0.5。")


def block_steps_in_fp32(online_softmax) -> None:
    """x - m and each block's sum in fp32, seen where bf16 output rounding does not hide them, by the 2x rule:
    (1) each probability's relative error (its log) on bf16 rows spread over +-30 (an x - m rounded to bf16 errs
    by 6% near 16); (2) each row's sum against 1 on rows of 1000 in blocks of 48 (a block sum rounded to
    bf16/fp16 moves the whole row: 3.5-12x the baseline)."""
    torch.manual_seed(21)
    within_2x(online_softmax, (torch.randn(16, 300) * 8).to(torch.bfloat16), 16, view=torch.log,
              name="online_softmax: bf16 值分布很廣（±30），每個機率的相對誤差（log，2x rule）",
              rule="每個區塊先轉成 fp32 再減 m、取 exp：x - m 也在 fp32 計算",
              hint="x - m 若在 bf16 算（例如 x[..., s:e] - m.to(x.dtype)，之後才 .to(acc)），差值先捨入成 bf16："
                   "16 附近的間距是 0.125，機率差到 6%。先 xb = x[..., s:e].to(acc)，再算 torch.exp(xb - m)。")
    for dtype in grading.LOW_PRECISION:
        within_2x(online_softmax, (torch.randn(64, 1000) * 0.5).to(dtype), 48, view=lambda p: p.sum(-1),
                  name=f"online_softmax: {str(dtype)[6:]}，每一列輸出的總和和 1 的差（N=1000, block_size=48，2x rule）",
                  rule="總和 l 與每個區塊的和 sum(exp(x_b - m_new)) 都在 fp32 計算與累加",
                  hint="區塊的和不要先捨入成 x.dtype（例如 torch.exp(xb - m).to(x.dtype).sum(...)）：bf16 的和差到 0.4%，"
                       "整列的機率一起偏掉，總和就不再是 1。exp 與 sum 都在 acc（fp32）裡算，加進 fp32 的 l。")


class _StreamProbe(torch.Tensor):
    """A tensor that only allows metadata queries and slicing into blocks of <= block columns."""

    block, problems, reads = 0, [], []
    META = {"shape", "dtype", "device", "dim", "size", "ndim", "numel", "__len__", "layout", "is_floating_point",
            "requires_grad", "is_cuda", "element_size", "ndimension", "__repr__", "__format__"}
    LIKE = {"empty_like", "zeros_like", "ones_like", "full_like", "new_empty", "new_zeros", "new_ones", "new_full"}
    PIECES = {"__getitem__", "narrow", "split", "chunk", "tensor_split", "unbind"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name == "__get__":
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if name in cls.PIECES:
            full = args[0]
            rows = full.numel() // max(1, full.shape[-1])
            for piece in (out if isinstance(out, (tuple, list)) else [out]):
                wide = piece.shape[-1] if piece.dim() == full.dim() else piece.numel() / max(1, rows)
                if wide > cls.block:
                    cls.problems.append(f"{name} 取出寬度 {wide:g} 的區塊（> block_size={cls.block}）")
                if piece.dim() == full.dim() and piece.shape[-1] < full.shape[-1]:   # a block: (start, width)
                    with torch._C.DisableTorchFunctionSubclass():
                        start = (piece.storage_offset() - full.storage_offset()) % full.stride(-2)
                    cls.reads.append((start, piece.shape[-1]))
        elif name not in cls.META and name not in cls.LIKE:
            cls.problems.append(f"對整個 x 呼叫了 {name}")
        return out


def streamed(online_softmax, x, block_size):
    """online_softmax(x, block_size) on a probe of x [..., N]: (result, what it did to the whole x, the blocks it
    read as (first column, width), in order)."""
    _StreamProbe.block, _StreamProbe.problems, _StreamProbe.reads = block_size, [], []
    y = online_softmax(x.as_subclass(_StreamProbe), block_size)
    return torch.as_tensor(y).as_subclass(torch.Tensor), sorted(set(_StreamProbe.problems)), list(_StreamProbe.reads)


def streams_blocks_in_two_passes(online_softmax) -> None:
    """x [3, 90] is read only in slices of <= 16 columns, and each column at most twice (the prose's two passes: m
    and l updated together while the blocks stream by, then the output; in any order), and the result is right."""
    torch.manual_seed(4)
    x = torch.randn(3, 90)
    y, problems, reads = streamed(online_softmax, x, 16)
    grading.check_true(not problems, name="online_softmax: one block at a time",
                       detail="x 應只以寬度 <= block_size 的切片讀取；偵測到：" + "；".join(problems)[:300],
                       hint="用 x[..., s:s + block_size] 取區塊，不要對整個 x 做運算（包括 .float()、.max()）。")
    grading.check_tensor(y, torch.softmax(x, dim=-1), name="online_softmax: streamed result", atol=1e-6)
    counts = nb01.reads_per_index(reads, x.shape[-1])
    grading.check_true(max(counts) <= 2, name="online_softmax: two passes over x (m and l streamed together)",
                       detail=f"x 的每一欄最多應讀兩次（兩輪），卻有欄被讀了 {max(counts)} 次"
                              f"（讀取的區塊依序為 (起點, 寬度)：{reads[:12]}…）。",
                       hint="第一輪每讀一個區塊就同時更新 m 與 l（舊的 l 乘上 exp(m - m_new) 換基準），"
                            "不必先掃一輪找整列的最大值；第二輪寫出 exp(x - m) / l。區塊的順序不限。")
