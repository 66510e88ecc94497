"""Visible tests of exercises 2 to 5 of 02_gpt2_integration: an attention function inside the tiny GPT-2.

Registration under a name (ex2), the agreement check against fp32 eager (ex3), padding a batch (ex4) and greedy
decoding with a KV cache (ex5). Logits are ``[B, N, vocab]``; the tiny model's vocabulary is 256 bytes.

Used in: 02_gpt2_integration (test cells of ex2, ex3, ex4, ex5)
"""
from __future__ import annotations

import inspect
import warnings

import torch

from labkit.checks import contract
from labkit.core import grading
from labkit.models import gpt2, hf_attention


def _hf():
    """transformers' two registries and their classes, imported on first use (``import labkit`` stays fast)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS, AttentionInterface, AttentionMaskInterface, sdpa_mask


def fresh_name(prefix):
    """A name in neither table yet: what an earlier run of this cell registered cannot help an answer."""
    ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS, *_ = _hf()
    return next(f"{prefix}_{i}" for i in range(10_000)
                if f"{prefix}_{i}" not in ALL_ATTENTION_FUNCTIONS and f"{prefix}_{i}" not in ALL_MASK_ATTENTION_FUNCTIONS)


def padded_vs_alone(model, name, full, short, side):
    """Logits [len(short), vocab] of the real tokens of `short` padded on `side` in a batch beside `full` (token ids
    [L]), run with the attention registered as `name`, and of `short` alone."""
    width = len(full)
    cols = slice(width - len(short), width) if side == "left" else slice(0, len(short))
    batch, mask = torch.stack([full, torch.zeros_like(full)]), torch.ones(2, width, dtype=torch.long)
    batch[1, cols], mask[1] = short, 0
    mask[1, cols] = 1
    positions = torch.arange(width).repeat(2, 1)
    positions[1, cols] = torch.arange(len(short))  # the short row's real tokens count from 0
    model.set_attn_implementation(name)
    got = gpt2.forward_logits(model, batch, attention_mask=mask, position_ids=positions)[1, cols]
    return got, gpt2.forward_logits(model, short[None])[0]


def registers_in_both_tables(register_attention) -> str:
    """``register_attention(name, fn)`` returns name and puts fn in AttentionInterface and sdpa_mask in
    AttentionMaskInterface under that name, and a second call (another name, another fn) keeps each name's own fn (no
    state); returns the (fresh) name it registered."""
    ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS, _, _, sdpa_mask = _hf()
    fn = hf_attention.attention_forward
    name = fresh_name("ex2_student")
    returned = register_attention(name, fn)
    grading.check_true(returned == name, name="register_attention 回傳 name", detail=f"應回傳 {name!r}，卻得到 {returned!r}。")
    grading.check_true(name in ALL_ATTENTION_FUNCTIONS and ALL_ATTENTION_FUNCTIONS[name] is fn,
                       name="fn 以 name 註冊進 AttentionInterface", detail="AttentionInterface 裡沒有這個名字，或存的不是傳進來的 fn。",
                       hint="用 AttentionInterface.register 以 name 註冊 fn。")
    grading.check_true(name in ALL_MASK_ATTENTION_FUNCTIONS, name="同一個名字註冊進 AttentionMaskInterface",
                       detail="名字不在 AttentionMaskInterface 裡：補齊遮罩會被無聲地丟掉。",
                       hint="再用 AttentionMaskInterface.register 以同一個 name 註冊 sdpa_mask。")
    grading.check_true(ALL_MASK_ATTENTION_FUNCTIONS[name] is sdpa_mask, name="遮罩函式是 transformers 的 sdpa_mask",
                       detail="AttentionMaskInterface 裡這個名字對應的不是 sdpa_mask。",
                       hint="遮罩表要的是產生遮罩的函式（sdpa_mask），不是注意力函式 fn。")
    other_fn, other = (lambda *args, **kwargs: fn(*args, **kwargs)), fresh_name("ex2_other")  # a second call, another fn
    register_attention(other, other_fn)
    grading.check_true(ALL_ATTENTION_FUNCTIONS[other] is other_fn and ALL_ATTENTION_FUNCTIONS[name] is fn,
                       name="register_attention：不留跨呼叫的狀態（第二次註冊另一個名字與 fn）",
                       detail="第二次呼叫後，兩個名字在 AttentionInterface 裡不是各自傳進來的 fn。",
                       hint="每次都註冊這次傳進來的 name 與 fn：不要把 fn 存在函式屬性、全域變數或快取裡沿用。")
    return name


def refuses_flash_names(register_attention) -> None:
    """ValueError for a name containing 'flash' anywhere, in any case; a refused name lands in neither table."""
    ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS, *_ = _hf()
    fn = hf_attention.attention_forward
    grading.check_raises(lambda: register_attention("my_flash_kernel", fn), ValueError, name="名字含 'flash' 時拋出 ValueError",
                         hint="名字裡任何位置出現 'flash' 都要拋出（'flash' in name），不只是開頭。")
    for shouted in ("MyFlashKernel", fresh_name("ex2_FLASH")):        # any case: 'Flash' and 'FLASH' are refused too
        grading.check_raises(lambda: register_attention(shouted, fn), ValueError,
                             name=f"名字 {shouted!r}（大寫的 Flash/FLASH）也拋出 ValueError",
                             hint="不分大小寫：檢查 'flash' in name.lower()，不是 'flash' in name。")
    refused = fresh_name("ex2_flash")                                    # a new name that contains 'flash'
    grading.check_raises(lambda: register_attention(refused, fn), ValueError, name=f"名字 {refused!r} 拋出 ValueError")
    grading.check_true(refused not in ALL_ATTENTION_FUNCTIONS and refused not in ALL_MASK_ATTENTION_FUNCTIONS,
                       name="拋出 ValueError 的名字沒有被註冊",
                       detail=f"{refused!r} 拋出了 ValueError，卻已經被註冊進 AttentionInterface 或 AttentionMaskInterface。",
                       hint="先檢查名字、再註冊：拒絕的名字不應留在兩張表裡（之後用它的模型會被當成 FlashAttention 套件）。")


def padding_mask_applied(name) -> None:
    """With the attention registered as `name`, 11 tokens after 9 left pads give their logits when run alone."""
    model = gpt2.build_model("tiny", attn_implementation="eager")
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(2))
    got, alone = padded_vs_alone(model, name, ids, ids[3:14], "left")
    grading.check_tensor(got, alone, name="遮罩函式有作用：左側補齊的序列和它單獨跑時的 logits 相同", atol=1e-4, rtol=1e-4,
                         hint="遮罩函式要是 transformers 的 sdpa_mask（有補齊時回傳布林遮罩 [B, 1, N, Nk]）；"
                              "沒有遮罩時，真正的 token 會看到左邊的補齊。")


def rel_l2(x, r) -> float:
    """||x - r|| / ||r|| in float64."""
    return float((x.double() - r.double()).norm() / r.double().norm())


def errors(model, ids, implementation, dtype):
    """(relative L2 error of eager, of `implementation`), both under autocast `dtype`, against fp32 eager."""
    model.eval()
    ref = gpt2.forward_logits(model, ids, "eager")
    base = gpt2.forward_logits(model, ids, "eager", autocast_dtype=dtype)
    model.set_attn_implementation(implementation)
    return rel_l2(base, ref), rel_l2(gpt2.forward_logits(model, ids, autocast_dtype=dtype), ref)


def no_scaling(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """A wrong implementation: scores not scaled (registered as "ex3_no_scaling" by :func:`agreement_tiny`)."""
    return hf_attention.attention_forward(module, query, key, value, attention_mask, scaling=1.0, **kwargs)


def agreement_tiny():
    """(tiny GPT-2, token ids [2, 32]) for ex3's checks; registers :func:`no_scaling` as "ex3_no_scaling"."""
    _, _, AttentionInterface, AttentionMaskInterface, sdpa_mask = _hf()
    AttentionInterface.register("ex3_no_scaling", no_scaling)
    AttentionMaskInterface.register("ex3_no_scaling", sdpa_mask)
    model = gpt2.build_model("tiny", attn_implementation="eager")
    return model, torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))


def agreement_returns_floats(agreement) -> None:
    """A dict with err_eager and err_impl Python floats and ok a bool (sdpa, bf16); no labkit in the answer."""
    grading.check_own_code(agreement, name="agreement 不呼叫 labkit")
    model, ids = agreement_tiny()
    res = agreement(model, ids, "sdpa", torch.bfloat16)
    grading.check_true(isinstance(res, dict) and {"err_eager", "err_impl", "ok"} <= set(res), name="agreement 回傳值",
                       detail=f"應回傳含 err_eager、err_impl、ok 的 dict，卻得到 {res!r}。")
    grading.check_true(all(type(res[key]) is float for key in ("err_eager", "err_impl")) and type(res["ok"]) is bool,
                       name="err_eager、err_impl 是 Python float，ok 是 bool",
                       detail=f"得到的型別：{ {key: type(value).__name__ for key, value in res.items()} }",
                       hint="用 float(...) 把 0 維張量轉成 Python 數字；兩個 float 比較的結果就是 bool。")


def agreement_errors_and_rule(agreement) -> None:
    """err_eager and err_impl as :func:`errors` gives them (rel 1e-3) and ok = err_impl <= factor * err_eager + 1e-6:
    sdpa passes, eager against itself with factor=1 passes, factor=0 fails sdpa, a missing scaling fails and its
    large error divides by ||ref||, and in fp32 (autocast off) only the 1e-6 floor lets sdpa pass."""
    model, ids = agreement_tiny()
    res = agreement(model, ids, "sdpa", torch.bfloat16)
    err_eager, err_sdpa = errors(model, ids, "sdpa", torch.bfloat16)
    grading.check_scalar(res["err_eager"], err_eager, name="err_eager：bf16 的 eager 對 fp32 eager 的相對 L2 誤差", rel=1e-3,
                         hint="相對 L2：||x - ref|| / ||ref||（不是 ||x - ref||）；ref 是 fp32、不用 autocast 的 eager，"
                              "x 是 autocast 下的 eager。")
    grading.check_scalar(res["err_impl"], err_sdpa, name="err_impl：autocast 下的 sdpa 對 fp32 eager 的相對 L2 誤差",
                         rel=1e-3, hint="受測的實作也要在 autocast 下跑，並和同一個 fp32 eager 參考比。")
    grading.check_true(res["ok"] is True, name="sdpa 應通過（err_impl <= factor * err_eager + 1e-6）", detail=f"得到 {res}。")
    same = agreement(model, ids, "eager", torch.bfloat16, factor=1.0)
    grading.check_true(same["ok"] is True and same["err_impl"] == same["err_eager"],
                       name="eager 和自己比（factor=1）：err_impl == err_eager，ok 為 True", detail=f"得到 {same}。",
                       hint="ok = err_impl <= factor * err_eager + 1e-6：用 <=（相等也通過）並加上 1e-6 的下限，不是 <。")
    zero = agreement(model, ids, "sdpa", torch.bfloat16, factor=0.0)
    grading.check_true(zero["ok"] is False, name="使用傳進來的 factor：factor=0 時 sdpa 不通過", detail=f"得到 {zero}。",
                       hint="ok = err_impl <= factor * err_eager + 1e-6，factor 是參數，不是固定的 2。")
    bad = agreement(model, ids, "ex3_no_scaling", torch.bfloat16)
    grading.check_true(bad["ok"] is False, name="忘了 scaling 的實作不通過", detail=f"得到 {bad}。",
                       hint="參考要用 fp32 的 eager（不是受測的實作本身）；比較的方向是 err_impl <= factor * err_eager + 1e-6。")
    # A large error tells the denominators apart: ||x - ref|| / ||ref||, not / ||x|| (for sdpa the two agree to ~1e-4).
    grading.check_scalar(bad["err_impl"], errors(model, ids, "ex3_no_scaling", torch.bfloat16)[1],
                         name="忘了 scaling 的實作：err_impl 除以參考的範數 ||ref||", rel=1e-3,
                         hint="相對 L2 = ||x - ref|| / ||ref||：分母是 fp32 eager 的 logits，不是受測的 x；誤差大時兩者差很多。")
    # The 1e-6 floor decides in fp32: autocast does not support fp32 (it warns and turns itself off), so eager's error
    # is exactly 0 and sdpa's is its summation order only (~4e-7): without the floor, 4e-7 <= 2 * 0 fails.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                                    # "target dtype is not supported. Disabling autocast."
        fp32 = agreement(model, ids, "sdpa", torch.float32)
    grading.check_true(fp32["err_eager"] == 0.0 and fp32["ok"] is True,
                       name="dtype=torch.float32：err_eager 為 0，sdpa 靠 1e-6 的下限通過", detail=f"得到 {fp32}。",
                       hint="ok = err_impl <= factor * err_eager + 1e-6：fp32 下 eager 的誤差恰好是 0，"
                            "少了 + 1e-6，只差在加總順序（約 1e-7）的實作也會不通過。")


def loud(scale, seed=0):
    """The tiny GPT-2 with its final LayerNorm scaled by `scale`: same relative errors, logits ~`scale`."""
    big = gpt2.build_model("tiny", attn_implementation="eager", seed=seed)
    with torch.no_grad():
        big.transformer.ln_f.weight.mul_(scale)
        big.transformer.ln_f.bias.mul_(scale)
    return big


def agreement_eval_and_float64(agreement) -> None:
    """model.eval() first (a model in training mode with dropout 0.3 gives eval's error), and the relative L2 in
    float64: on logits ~1e19 fp32's sum of squares passes 3.4e38 (inf / inf = NaN), float64 gives the usual error."""
    _, ids = agreement_tiny()
    noisy = gpt2.build_model("tiny", attn_implementation="eager", dropout=0.3).train()
    got = agreement(noisy, ids, "sdpa", torch.bfloat16)
    grading.check_scalar(got["err_eager"], errors(noisy, ids, "sdpa", torch.bfloat16)[0],
                         name="先 model.eval()：訓練模式的模型（dropout 0.3）也得到確定的誤差", rel=1e-3,
                         hint="訓練模式下 dropout 每次前向都抽新的遮罩，誤差就沒有意義：一開始先 model.eval()。")
    big = loud(1e19)
    got, want = agreement(big, ids, "sdpa", torch.bfloat16), errors(big, ids, "sdpa", torch.bfloat16)
    for key, expected in zip(("err_eager", "err_impl"), want):
        grading.check_scalar(got[key], expected, name=f"{key} 在 float64 計算（logits 約 1e19 的模型，相對誤差應為 {expected:.2%}）",
                             rel=1e-3, hint="相對 L2 在 float64 計算：logits 先 .double() 再相減、取範數。"
                                            "在 fp32 算，logits 約 1e19 時平方和超過 fp32 的最大值 3.4e38，變成 inf，誤差就成了 NaN。")


def as_long(rows):
    """Nested lists as a torch.long tensor."""
    return torch.tensor(rows, dtype=torch.long)


PAD_HINTS = {"input_ids": "補齊的位置填 pad_id；left 把序列放在右端、right 放在左端。",
             "attention_mask": "真正的 token 為 1、補齊為 0。",
             "position_ids": "真正的 token 從 0 起算（左側補齊時從第一個真正 token 起算）；"
                             "補齊的位置一律為 0，右側補齊也是，不能沿用最後一個 token 的位置。"}


def pads_both_sides(pad_batch) -> None:
    """[[5, 6, 7, 8], [1, 2]] padded with 9 on each side: three torch.long tensors [2, 4] as worked out by hand, and the
    caller's lists left unchanged."""
    for side, expected in (("right", ([[5, 6, 7, 8], [1, 2, 9, 9]], [[1, 1, 1, 1], [1, 1, 0, 0]], [[0, 1, 2, 3], [0, 1, 0, 0]])),
                           ("left", ([[5, 6, 7, 8], [9, 9, 1, 2]], [[1, 1, 1, 1], [0, 0, 1, 1]], [[0, 1, 2, 3], [0, 0, 0, 1]]))):
        seqs = [[5, 6, 7, 8], [1, 2]]
        got = pad_batch(seqs, 9, side=side)
        grading.check_true(seqs == [[5, 6, 7, 8], [1, 2]], name=f"pad_batch：不修改輸入（{side}）",
                           detail=f"呼叫之後，傳入的串列變成 {seqs}。", hint="補齊寫進新的張量；不要對呼叫端的串列 extend、insert 或 +=。")
        grading.check_true(isinstance(got, tuple) and len(got) == 3, name="pad_batch 回傳值",
                           detail="應回傳 (input_ids, attention_mask, position_ids)。")
        for what, actual, rows in zip(("input_ids", "attention_mask", "position_ids"), got, expected):
            grading.check_tensor(actual, as_long(rows), name=f"{side} 補齊（pad_id=9）的 {what}", atol=0, hint=PAD_HINTS[what])
            grading.check_true(actual.dtype == torch.long, name=f"{what} 是 torch.long", detail=f"卻是 {actual.dtype}。",
                               hint="用 dtype=torch.long 建立張量（布林或 int32 的遮罩都不行）。")


def width_default_and_side(pad_batch) -> None:
    """Width L is the longest sequence's (not the first's), side defaults to "left", another side is a ValueError."""
    got = pad_batch([[1, 2], [3, 4, 5], [6]], 9, side="right")                      # the longest sequence is not the first
    grading.check_tensor(got[0], as_long([[1, 2, 9], [3, 4, 5], [6, 9, 9]]), name="寬度 L 是最長序列的長度（最長的不在第一條）",
                         atol=0, hint="L = max(len(s) for s in seqs)，不是 len(seqs[0])。")
    default = pad_batch([[5, 6, 7, 8], [1, 2]], 9)
    grading.check_tensor(default[0], as_long([[5, 6, 7, 8], [9, 9, 1, 2]]), name="side 預設為 \"left\"", atol=0)
    grading.check_raises(lambda: pad_batch([[1, 2]], 9, side="middle"), ValueError,
                         name="side 不是 \"left\" 或 \"right\" 時拋出 ValueError",
                         hint="一開始就檢查 side，不要把其他值當成 left 或 right。")


def left_padded_logits_match_alone(pad_batch) -> None:
    """Two random sequences (7 and 3 tokens) left-padded with 0: each row's real-token logits equal the sequence's
    own (tiny GPT-2 with labkit's attention, atol and rtol 1e-4)."""
    model = gpt2.build_model("tiny", attn_implementation="labkit")
    gen = torch.Generator().manual_seed(24)
    seqs = [torch.randint(0, 255, (n,), generator=gen).tolist() for n in (7, 3)]
    ids_, mask_, pos_ = pad_batch(seqs, 0, side="left")
    batch = gpt2.forward_logits(model, ids_, attention_mask=mask_, position_ids=pos_)
    for row, seq in enumerate(seqs):
        alone = gpt2.forward_logits(model, torch.tensor([seq]))[0]
        grading.check_tensor(batch[row][mask_[row].bool()], alone, name=f"左側補齊的 batch 第 {row} 列 vs 單獨跑的 logits",
                             atol=1e-4, rtol=1e-4, hint="每個序列的 position_ids 從它第一個真正的 token 起算為 0：左側補齊的位置不佔號碼。")


def does_not_call_generate(greedy_decode) -> None:
    """The answer writes its own loop: model.generate is what the tests compare with."""
    grading.check_true("generate" not in greedy_decode.__code__.co_names and ".generate(" not in inspect.getsource(greedy_decode),
                       name="不呼叫 model.generate", detail="請自己寫解碼迴圈：model.generate 是測試用來對答案的。")


def without_cache(model, prompt, steps):
    """Greedy tokens [B, N + steps] recomputing the whole sequence every step: no KV cache involved."""
    seq = prompt
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    return seq


def decode_uses_kv_cache(greedy_decode, model, prompt, steps, label) -> None:
    """greedy_decode on `model` (labkit attention), prompt [B, N]: same tokens as without a cache, and a KV cache
    used (after the prefill one token a forward, the key length growing by 1)."""
    n = prompt.shape[1]
    gpt2.set_attention(model, "labkit")
    with hf_attention.record_calls() as calls:
        tokens = greedy_decode(model, prompt, steps)
    grading.check_tensor(tokens, without_cache(model, prompt, steps), name=f"{label}：有快取與沒有快取的 token 相同", atol=0,
                         hint="每步取最後一個位置的 logits（out.logits[:, -1]）的 argmax。")
    seen = [(call["query"][2], call["key"][2]) for call in calls if call["layer"] == 0]  # one per forward
    used_cache = (len(seen) in (steps, steps + 1) and seen[0] == (n, n)
                  and all(s == (1, n + i) for i, s in enumerate(seen[1:], start=1)))
    grading.check_true(used_cache, name=f"{label}：用 KV 快取（prefill 之後每步只送 1 個 token，key 長度每步加 1）",
                       detail=f"每次前向第 0 層的 (query 長度, key 長度)：{seen}；"
                              f"應為 {[(n, n)] + [(1, n + i) for i in range(1, steps)]}（最後一步可以多一次前向）。",
                       hint="prefill 之後只送新的那個 token（[B, 1]），並把上一步回傳的 KV 快取傳回去"
                            "（lk.hfcompat.cache_kwarg(model, lk.hfcompat.returned_cache(out))）；沒傳快取時 key 長度會是 1。")


def decodes_like_without_cache(greedy_decode) -> None:
    """Prompt [2, 10], 8 new tokens: the prompt left unchanged, shape [2, 18], the tokens of decoding without a cache (eager), and with labkit's
    attention the same tokens through the KV cache (:func:`decode_uses_kv_cache`)."""
    model = gpt2.build_model("tiny", attn_implementation="eager")
    prompt = torch.randint(0, 255, (2, 10), generator=torch.Generator().manual_seed(5))
    got = contract.check_inputs_unchanged(greedy_decode, model, prompt, 8, name="greedy_decode")
    grading.check_true(isinstance(got, torch.Tensor) and tuple(got.shape) == (2, 18),
                       name="形狀 [B, N + max_new_tokens]（提示接上新 token）",
                       detail=f"應為 (2, 18)，卻得到 {tuple(got.shape) if isinstance(got, torch.Tensor) else type(got)}。",
                       hint="回傳 torch.cat([input_ids, 新 token...], dim=1)，新 token 剛好 max_new_tokens 個。")
    grading.check_tensor(got, without_cache(model, prompt, 8), name="eager：有快取與沒有快取的 token 相同", atol=0,
                         hint="每步取最後一個位置的 logits（out.logits[:, -1]）的 argmax。")
    decode_uses_kv_cache(greedy_decode, model, prompt, 8, "labkit")
