"""Visible tests of 05_precision_analysis's exercise 4: ``precision_policy(op, amp_dtype, training)``, the dtype each
op of a training or inference step computes in (or is stored in) under an AMP setting.

The expected dtypes are the rules the notebook's sections state (softmax, normalisation statistics and the loss in
fp32; tensor-core ops in amp_dtype; master weights, optimizer state and residual stream in fp32 while training).

Used in: 05_precision_analysis (test cells of ex4)
"""
from __future__ import annotations

from typing import Callable

import torch

from labkit.core import grading

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
WHY = {"linear": "矩陣乘法在 amp_dtype 上走張量核心（核心內部以 FP32 累加；不用 AMP 時就是 FP32）。",
       "flash_attention": "FlashAttention 只接受 fp16/bf16：用 amp_dtype。",
       "softmax": "softmax 在 FP32 計算（7.3）。", "layernorm_stats": "正規化統計量在 FP32 計算（7.4）。",
       "loss": "loss 在 FP32 計算（7.5）。", "residual_stream": "訓練時殘差流留在 FP32，小更新才不會被捨入掉（7.6）。",
       "weights": "訓練時主權重留在 FP32：半精度權重會把小更新捨入掉（第 2 節）。",
       "optimizer_state": "AdamW 的動量與二階動量留在 FP32（第 2 節）。"}
EITHER_AT_INFERENCE = ("weights", "residual_stream")  # fp32 or amp_dtype both right at inference


def _answers(policy: Callable, op: str, amp: torch.dtype, training: bool, allowed: tuple, *, name: str, hint: str,
             either: str = "") -> None:
    """``policy(op, amp, training=training)`` is one of ``allowed``; ``either`` follows the list in the message."""
    got = policy(op, amp, training=training)
    grading.check_true(got in allowed, name=name, detail=f"應為 {' 或 '.join(map(str, allowed))}{either}，卻得到 {got}。",
                       hint=hint)


def training_dtypes(policy: Callable) -> None:
    """While training, under bf16 and fp16 AMP: linear and flash_attention in amp_dtype, every other op in fp32;
    without AMP (amp_dtype fp32): every op but flash_attention in fp32."""
    for op in WHY:
        expected = BF16 if op in ("linear", "flash_attention") else FP32
        _answers(policy, op, BF16, True, (expected,), name=f"訓練時 precision_policy({op!r}, bf16)", hint=WHY[op])
    for amp in (FP16, FP32):
        for op in WHY:
            if amp == FP32 and op == "flash_attention":
                continue
            expected = amp if op in ("linear", "flash_attention") else FP32
            _answers(policy, op, amp, True, (expected,), name=f"訓練時 precision_policy({op!r}, {str(amp)[6:]})",
                     hint=WHY[op] + "規則跟著 amp_dtype 走，不要寫死 bf16；fp16 與 bf16 的差別只在範圍（GradScaler），"
                                    "不在哪些運算留在 FP32。")


def inference_dtypes(policy: Callable) -> None:
    """At inference under bf16 AMP: softmax, layernorm_stats, loss and optimizer_state in fp32, linear and
    flash_attention in bf16; weights and residual_stream in fp32 or amp_dtype (bf16, fp16; fp32 only without AMP)."""
    for op in ("softmax", "layernorm_stats", "loss"):
        _answers(policy, op, BF16, False, (FP32,), name=f"推論時 precision_policy({op!r}, bf16) 仍是 FP32",
                 hint=WHY[op] + "推論也一樣。")
    for op in ("linear", "flash_attention"):
        _answers(policy, op, BF16, False, (BF16,), name=f"推論時 precision_policy({op!r}, bf16) 仍是 amp_dtype",
                 hint=WHY[op] + "推論與訓練一樣：矩陣乘法與 attention 在半精度跑張量核心；只有 weights 與 residual_stream "
                                "在推論時可以不同（第 8 節）。")
    for op in EITHER_AT_INFERENCE:
        _answers(policy, op, BF16, False, (FP32, BF16), name=f"推論時 precision_policy({op!r}, bf16) 是 FP32 或 amp_dtype",
                 hint="推論時可以保留 FP32 權重（autocast），或把權重轉成半精度（第 8 節）。", either="（兩種都接受）")
    _answers(policy, "optimizer_state", BF16, False, (FP32,), name="推論時 precision_policy('optimizer_state', bf16) 仍是 FP32",
             hint=WHY["optimizer_state"] + "只有 weights 與 residual_stream 在推論時可以不同。")
    for amp, allowed in ((FP32, (FP32,)), (FP16, (FP32, FP16))):
        for op in EITHER_AT_INFERENCE:
            _answers(policy, op, amp, False, allowed, name=f"推論時 precision_policy({op!r}, {str(amp)[6:]}) 是 FP32 或 amp_dtype",
                     hint="推論時的選擇是 FP32 或 amp_dtype：跟著 amp_dtype 走，不要寫死 bf16（不用 AMP 時 amp_dtype 就是 FP32）。")


def refuses_fp32_flash_and_unknown_ops(policy: Callable) -> None:
    """ValueError, with a message, for flash_attention with amp_dtype fp32 (training and inference), and ValueError
    for an op not in the table ("attention")."""
    grading.check_raises(lambda: policy("flash_attention", FP32, training=False), ValueError,
                         name="推論時 flash_attention 遇到 amp_dtype=float32 也拋出 ValueError",
                         hint="FlashAttention 沒有 FP32 路徑，訓練與推論都一樣（第 9 節）：檢查 amp_dtype 時不要看 training。")
    grading.check_raises(lambda: policy("flash_attention", FP32), ValueError,
                         name="flash_attention 遇到 amp_dtype=float32 時拋出 ValueError",
                         hint="FlashAttention 沒有 FP32 路徑（第 9 節）：不要悄悄改成別的 dtype，要拋出錯誤。")
    try:
        policy("flash_attention", FP32)
    except ValueError as err:
        grading.check_true(str(err).strip() != "", name="ValueError 的訊息說明原因",
                           detail="ValueError 沒有訊息。", hint='例如 raise ValueError("FlashAttention has no fp32 path ...")')
    grading.check_raises(lambda: policy("attention", BF16), ValueError, name="op 不在表中時拋出 ValueError",
                         hint="先檢查 op 是否在 POLICY_OPS 中；不要對未知的 op 回傳預設的 dtype。")
