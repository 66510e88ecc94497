"""Visible tests of 08_decode_attention's plain-Python exercises: the KV-cache calculator (exercise 1) and the
page allocator (exercise 5). The kernels' checks live in nb08_kernels (shared), nb08_decode, nb08_split and
nb08_paged.

Used in: 08_decode_attention (test cells of ex1, ex5)
"""
from __future__ import annotations

import re

import torch

from labkit.core import grading

GPT2 = dict(layers=12, n_kv_heads=12, head_dim=64)
LLAMA_GQA = dict(layers=32, n_kv_heads=8, head_dim=128)
BUDGET = 80 * 10**9


def kv_bytes_count_each_factor(kv_bytes_per_token) -> None:
    """kv_bytes_per_token(layers, n_kv_heads, head_dim, bytes_per_element) -> int: GPT-2 small in bf16, then each
    factor on its own (K and V, layers, H_kv of a Llama-style GQA, element size)."""
    grading.check_scalar(kv_bytes_per_token(**GPT2, bytes_per_element=2), 36864, name="kv_bytes_per_token：GPT-2 small，bf16",
                         rel=0, hint="2（K 與 V）× 層數 × H_kv × d × 每個元素的位元組。")
    for name, kw, expected, hint in [
            ("K 與 V 都要算", dict(layers=1, n_kv_heads=1, head_dim=1, bytes_per_element=1), 2, "K 與 V 各存一份：乘以 2。"),
            ("每一層都要存", dict(layers=32, n_kv_heads=1, head_dim=1, bytes_per_element=1), 64, "每一層都有自己的 K/V：乘以層數。"),
            ("GQA：只存 H_kv 個 head", dict(**LLAMA_GQA, bytes_per_element=2), 131072,
             "K/V 的 head 數是 H_kv（這裡 8），不是查詢的 H_q（32）。"),
            ("元素大小（fp32 = 4 位元組）", dict(layers=1, n_kv_heads=1, head_dim=1, bytes_per_element=4), 8,
             "乘以每個元素的位元組：bf16 是 2、fp32 是 4。")]:
        grading.check_scalar(kv_bytes_per_token(**kw), expected, name=f"kv_bytes_per_token：{name}", rel=0, hint=hint)


def context_and_batch_round_down(max_context, max_batch) -> None:
    """max_context(free_bytes, batch, ...) and max_batch(free_bytes, context, ...) -> int: 80 GB of a Llama-style GQA
    cache, floors (not round, not ceil, not at least 1), the batch sharing the budget, 0 when nothing fits."""
    grading.check_scalar(max_context(BUDGET, 1, **LLAMA_GQA, bytes_per_element=2), 610351,
                         name="max_context：Llama 式 GQA，80 GB，batch 1（向下取整）", rel=0,
                         hint="free_bytes // (batch × 每個 token 的位元組)：放不下的那個 token 不算（向下取整，不是四捨五入或無條件進位）。")
    grading.check_scalar(max_context(BUDGET, 8, **LLAMA_GQA, bytes_per_element=2), 76293,
                         name="max_context：batch 8 時每條序列的上下文變成 1/8", rel=0,
                         hint="batch 條序列共用同一份預算：除以 batch × 每個 token 的位元組。")
    grading.check_scalar(max_context(1000, 1, **GPT2, bytes_per_element=2), 0, name="max_context：一個 token 都放不下時是 0",
                         rel=0, hint="向下取整：1000 位元組放不下一個 36,864 位元組的 token。")
    grading.check_scalar(max_batch(BUDGET, 4096, **LLAMA_GQA, bytes_per_element=2), 149,
                         name="max_batch：Llama 式 GQA，80 GB，每條 4096 個 token（向下取整）", rel=0,
                         hint="free_bytes // (context × 每個 token 的位元組)。")
    grading.check_scalar(max_batch(1.75 * 4096 * 131072, 4096, **LLAMA_GQA, bytes_per_element=2), 1,
                         name="max_batch：放得下 1.75 條序列時是 1（向下取整，不是四捨五入）", rel=0,
                         hint="free_bytes // (context × 每個 token 的位元組)：第二條序列放不下就不算。")
    grading.check_scalar(max_batch(5 * 10**8, 4096, **LLAMA_GQA, bytes_per_element=2), 0,
                         name="max_batch：一條序列都放不下時是 0", rel=0,
                         hint="一條 4096 個 token 的序列要 536,870,912 位元組，比 5 億位元組多：向下取整是 0，不要把結果墊成至少 1。")
    own = "用傳入的參數（context、bytes_per_element），不要寫死 notebook 例子裡的 4096 或 bf16 的 2。"
    for fn, args, expected, what in ((max_batch, (BUDGET, 1000, *LLAMA_GQA.values(), 2), 610, "每條 1000 個 token（不是 4096）"),
                                     (max_context, (BUDGET, 2, *LLAMA_GQA.values(), 1), 610351, "fp8（每個元素 1 位元組）、batch 2"),
                                     (max_batch, (BUDGET, 4096, *LLAMA_GQA.values(), 4), 74, "fp32（每個元素 4 位元組）")):
        grading.check_scalar(fn(*args), expected, name=f"{fn.__name__}{args}：{what}", rel=0, hint=own)


def weights_larger_than_memory(max_context, max_batch) -> None:
    """An 8 GB GPU minus a bf16 8B model's weights (2 x 8.03e9 bytes): a negative budget; no token, no sequence fits: 0."""
    free = 8 * 2**30 - 2 * 8.03e9
    for fn, args, what in ((max_context, (free, 1), "最長上下文"), (max_batch, (free, 4096), "最大 batch")):
        got = fn(*args, **LLAMA_GQA, bytes_per_element=2)
        grading.check_scalar(got, 0, name=f"{fn.__name__}：記憶體比權重小（8 GB 的 GPU、16 GB 的權重，預算是負的）時{what}是 0",
                             rel=0, hint="free_bytes 可以是負的（權重就放不下）：負數向下取整還是負數（例如 -56,993 個 token），"
                                         "一個 token、一條序列都放不下就是 0：最後取 max(0, ...)。")


def calculators_return_ints(kv_bytes_per_token, max_context, max_batch) -> None:
    """The three calculators return Python ints, also for float budgets (as the notebook's next cell passes)."""
    for fn, args in ((kv_bytes_per_token, (12, 12, 64, 2)), (max_context, (BUDGET, 3, 12, 12, 64, 2)),
                     (max_batch, (BUDGET, 1000, 12, 12, 64, 2)), (max_context, (80e9 - 2 * 124e6, 1, 12, 12, 64, 2)),
                     (max_batch, (80e9 - 2 * 8.03e9, 4096, 32, 8, 128, 2))):
        value = fn(*args)
        grading.check_true(type(value) is int, name=f"{fn.__name__}{args}：回傳 Python int",
                           detail=f"得到 {type(value).__name__}（{value!r}）。",
                           hint="用整數除法 //（/ 得到 float）；free_bytes 可能是 float 時，最後用 int(...) 轉成整數。")


def expected_slots(alloc, seq, start: int, n: int) -> torch.Tensor:
    """Slots (int64 [n]) of tokens start..start+n-1 of seq, read off the allocator's page list."""
    pages = alloc.pages(seq)
    return torch.tensor([pages[t // alloc.page_size] * alloc.page_size + t % alloc.page_size for t in range(start, start + n)],
                        dtype=torch.int64)


def allocator_state_holds(alloc, lengths: dict, what: str) -> None:
    """Every sequence of ``lengths`` (seq -> tokens) holds ceil(length / page_size) pages, no page twice, the rest free."""
    held = [p for s in lengths for p in alloc.pages(s)]
    for s, n in lengths.items():
        grading.check_true(alloc.length(s) == n, name=f"{what}：序列 {s!r} 的長度", detail=f"應為 {n}，得到 {alloc.length(s)}。",
                           hint="length(seq) 是這條序列所有 append 的 n 的總和。")
        want = -(-n // alloc.page_size)
        grading.check_true(len(alloc.pages(s)) == want, name=f"{what}：序列 {s!r} 佔 ceil({n} / {alloc.page_size}) = {want} 頁",
                           detail=f"得到 {len(alloc.pages(s))} 頁：{alloc.pages(s)}。",
                           hint="只在最後一頁滿了才配置新頁：需要的頁數是 ceil((舊長度 + n) / page_size) - 已有的頁數"
                                "（長度剛好是 page_size 的倍數時不要多配一頁）。")
    grading.check_true(len(held) == len(set(held)) and all(0 <= p < alloc.num_pages for p in held),
                       name=f"{what}：沒有一頁同時屬於兩個地方", detail=f"各序列的頁：{ {s: alloc.pages(s) for s in lengths} }。",
                       hint="配置時把頁從空閒池拿走（pop），不要重複發出同一頁。")
    grading.check_true(alloc.num_free() == alloc.num_pages - len(held), name=f"{what}：空閒頁數 = 總頁數 - 使用中",
                       detail=f"num_free() = {alloc.num_free()}，使用中 {len(held)} 頁，共 {alloc.num_pages} 頁。",
                       hint="配置時從空閒池移除，free 時放回。")


def one_sequence_grows(PageAllocator) -> None:
    """PageAllocator(8, 4): one sequence of 6 tokens, then 2 and 1 more (over page boundaries); slots int64 [n]."""
    a = PageAllocator(8, 4)
    slots = a.append("x", 6)
    grading.check_true(isinstance(slots, torch.Tensor) and slots.dtype == torch.int64 and slots.shape == (6,),
                       name="append：回傳 int64 的一維張量，長度 n", detail=f"得到 {slots!r}。",
                       hint="torch.int64 的張量，一個新 token 一個槽位。")
    allocator_state_holds(a, {"x": 6}, "一條序列 6 個 token")
    grading.check_tensor(slots, expected_slots(a, "x", 0, 6), name="append：槽位 = page × page_size + t % page_size", atol=0,
                         hint="第 t 個 token 在 pages[t // page_size] 這一頁的第 t % page_size 個位置：slot = page * page_size + t % page_size。")
    for n, total in ((2, 8), (1, 9)):
        start = a.length("x")
        slots = a.append("x", n)
        allocator_state_holds(a, {"x": total}, f"再加 {n} 個，共 {total} 個（頁的邊界）")
        grading.check_tensor(slots, expected_slots(a, "x", start, n), name=f"append：第 {start}..{total - 1} 個 token 的槽位", atol=0,
                             hint="新 token 從舊長度接著編號：t = 舊長度 .. 舊長度 + n - 1。")


def sequences_interleave(PageAllocator) -> None:
    """Two sequences growing in turns (each by its own pages); append(seq, 0) allowed; append(seq, -1) a ValueError."""
    b = PageAllocator(8, 4)
    lengths = {0: 0, 1: 0}
    for seq, n in ((0, 3), (1, 5), (0, 2), (1, 4), (0, 4)):
        slots = b.append(seq, n)
        grading.check_tensor(slots, expected_slots(b, seq, lengths[seq], n), atol=0,
                             name=f"兩條序列交錯長大：序列 {seq} 再加 {n} 個 token 的槽位",
                             hint="每條序列有自己的頁表：槽位由這條序列自己的頁算出，不是連續的位置。")
        lengths[seq] += n
    allocator_state_holds(b, lengths, "兩條序列交錯長大")
    empty = b.append("new", 0)
    grading.check_true(isinstance(empty, torch.Tensor) and empty.numel() == 0 and b.length("new") == 0 and b.pages("new") == [],
                       name="append(seq, 0)：合法，沒有新頁", detail=f"得到 {empty!r}，頁 {b.pages('new')}。",
                       hint="n = 0 時需要 ceil(0 / page_size) = 0 頁，回傳空的 int64 張量。")
    grading.check_raises(lambda: b.append(0, -1), ValueError, name="append(seq, -1)：拋出 ValueError",
                         hint="n < 0 沒有意義：raise ValueError(...)。")


def out_of_order_free(PageAllocator) -> None:
    """PageAllocator(7, 3) (pages of 3, not 4): a, b, c hold 2, 2 and 1 pages; a, the first, is freed (not the last
    allocated); d takes 3 pages, then c is freed and b grows: no page held twice, the slots by each sequence's own pages."""
    e = PageAllocator(7, 3)
    lengths = {}
    for seq, n in (("a", 5), ("b", 6), ("c", 2)):
        e.append(seq, n)
        lengths[seq] = n
    allocator_state_holds(e, lengths, "頁大小 3：a、b、c 各 5、6、2 個 token")
    for step, (seq, n) in enumerate((("d", 7), ("b", 4))):
        gone = ("a", "c")[step]
        e.free(gone)
        del lengths[gone]
        start = lengths.get(seq, 0)
        slots = e.append(seq, n)
        lengths[seq] = start + n
        what = f"free({gone!r})（不是最後配置的序列）之後，{seq} 再加 {n} 個 token"
        allocator_state_holds(e, lengths, what)
        grading.check_tensor(slots, expected_slots(e, seq, start, n), name=f"{what}：槽位", atol=0,
                             hint="空閒的頁是一個集合（例如 list 當堆疊），不是「用到第幾頁」的計數器：先配置的序列先還時，"
                                  "還回來的頁不在尾端，從計數器接著發會發出別的序列正在用的頁。")


def _unchanged(alloc, before: tuple, name: str, hint: str) -> None:
    after = (alloc.pages("a"), alloc.length("a"), alloc.num_free())
    grading.check_true(after == before, name=name, detail=f"之前（頁、長度、空閒）= {before}，之後 = {after}。", hint=hint)


def out_of_pages_then_free(PageAllocator) -> None:
    """Pools of 3 pages of 4: MemoryError naming the pages needed and free, nothing changed (also with room left in
    the last page); then pages used up exactly, freed (the sequence forgotten), reused by a tuple-named sequence;
    KeyError for unknown sequences."""
    c = PageAllocator(3, 4)
    c.append("a", 8)
    before = (c.pages("a"), c.length("a"), c.num_free())
    grading.check_raises(lambda: c.append("b", 5), MemoryError, name="頁面不夠（新序列要 2 頁、只剩 1 頁）：拋出 MemoryError",
                         hint="先算需要幾頁，比空閒頁多就 raise MemoryError（說明需要幾頁、剩幾頁）。")
    try:
        c.append("b", 5)
    except MemoryError as err:
        said = {int(x) for x in re.findall(r"\d+", str(err))}
        grading.check_true({2, 1} <= said, name="MemoryError 的訊息說明需要幾頁（2）、還剩幾頁（1）",
                           detail=f"訊息：{str(err)!r}。",
                           hint="例如 raise MemoryError(f\"序列 {seq!r} 需要 {need} 頁，只剩 {free} 頁\")：使用者才知道缺多少。")
    grading.check_raises(lambda: c.append("a", 5), MemoryError, name="頁面不夠（序列 a 再 5 個要 2 頁、只剩 1 頁）：拋出 MemoryError",
                         hint="先算需要幾頁，比空閒頁多就 raise MemoryError。")
    _unchanged(c, before, "MemoryError 之後什麼都沒變", "先檢查、再配置：在 raise 之前不要改長度、不要 pop 空閒頁、不要登記新序列。")
    grading.check_raises(lambda: c.length("b"), KeyError, name="MemoryError 之後，失敗的新序列沒有被登記",
                         hint="新序列在配置成功之後才登記。")
    d = PageAllocator(3, 4)
    d.append("a", 6)                                   # 2 pages, 2 free slots left in the last one; 1 free page
    before = (d.pages("a"), d.length("a"), d.num_free())
    grading.check_raises(lambda: d.append("a", 7), MemoryError,
                         name="頁面不夠（序列 a 有 6 個 token，再 7 個要 2 頁、只剩 1 頁）：拋出 MemoryError",
                         hint="需要的頁數是 ceil((舊長度 + n) / page_size) - 已有的頁數，比空閒頁多就 raise MemoryError。")
    _unchanged(d, before, "MemoryError 之後什麼都沒變（最後一頁還有空位時也一樣）",
               "不要先填滿最後一頁的空位、或先配置拿得到的頁，才發現不夠：先算出總共需要幾頁，夠了才改任何東西。")
    slots = d.append("a", 2)
    allocator_state_holds(d, {"a": 8}, "MemoryError 之後，再加 2 個 token 填滿最後一頁")
    grading.check_tensor(slots, expected_slots(d, "a", 6, 2), name="MemoryError 之後：第 6、7 個 token 的槽位", atol=0,
                         hint="被拒絕的 append 不能留下任何痕跡：長度仍是 6，新 token 接在第 6 個位置。")
    c.append("a", 4)
    allocator_state_holds(c, {"a": 12}, "剛好用完的頁（12 個 token，3 頁）")
    c.free("a")
    grading.check_true(c.num_free() == 3, name="free：所有頁回到空閒池", detail=f"num_free() = {c.num_free()}。",
                       hint="free 要把這條序列的每一頁放回空閒池。")
    grading.check_raises(lambda: c.length("a"), KeyError, name="free 之後，這條序列被忘記（length 拋出 KeyError）",
                         hint="free 要刪掉這條序列的長度與頁表。")
    c.append(("req", 7), 10)
    allocator_state_holds(c, {("req", 7): 10}, "free 之後頁面再利用；序列名稱是 tuple")
    grading.check_raises(lambda: c.free("nobody"), KeyError, name="free 不認識的序列：KeyError",
                         hint="dict 的 pop(seq)（不給預設值）遇到不認識的鍵本身就會拋出 KeyError。")
    grading.check_raises(lambda: c.pages("nobody"), KeyError, name="pages 不認識的序列：KeyError", hint="不要回傳空 list：不認識就是錯誤。")
