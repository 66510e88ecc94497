"""labkit.flex.packtrain: packed GPT-2 training equals the documents run one by one, and no document reaches another.

A tiny GPT-2 (2 layers, width 64) in fp32 on a CPU. The packed attention here is SDPA with the dense
document-causal mask (the notebook's kernels are exercise answers, so the tests bring their own attention).
Tolerance 1e-5 (relative) where packed and unpacked runs are compared: in fp32 they compute the same sums,
only in a different order (matmuls of other shapes), which moves a loss of about 6 by ~1e-7.
"""
from __future__ import annotations

import time

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from labkit.flex import packtrain

DOCS = [torch.tensor(d) for d in ([5, 6, 7, 8, 9], [40, 41, 42], [100, 17, 3, 9, 60, 61, 62, 1], [7], [33, 34])]


def pack(docs):
    """The packing of the notebook's exercise 8, written here for the tests."""
    lengths = torch.tensor([len(d) for d in docs])
    cu = torch.zeros(len(docs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    ids = torch.repeat_interleave(torch.arange(len(docs)), lengths)
    return {"tokens": torch.cat(docs), "cu_seqlens": cu, "position_ids": torch.arange(len(ids)) - cu[:-1].long()[ids],
            "document_ids": ids}


def dense_packed(packed):
    """A prepare: SDPA with the [T, T] document-causal mask of this batch."""
    ids = packed["document_ids"]
    T = len(ids)
    allowed = (ids.view(T, 1) == ids.view(1, T)) & torch.ones(T, T, dtype=torch.bool).tril()
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def per_doc_varlen(q, k, v, cu, max_len):
    """A varlen call on [T, H, D]: causal attention inside each document, one by one."""
    out = torch.empty_like(q)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qd, kd, vd = (t[a:b].transpose(0, 1) for t in (q, k, v))                # [H, n, D]
        out[a:b] = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).transpose(0, 1)
    return out


@pytest.fixture(scope="module")
def model():
    m = packtrain._model("tiny", 64, torch.device("cpu"), 0, packed=True, overrides={})
    return m.eval()


def doc_losses_packed(model, docs, prepare=dense_packed):
    batch = packtrain.packed_batch(docs, pack, "cpu")
    with packtrain.attending(prepare(batch)):
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"].view(1, -1)).logits[0]
    per_token = F.cross_entropy(logits, batch["targets"][0], ignore_index=packtrain.IGNORE, reduction="none")
    return [per_token[a:b].sum() for a, b in zip(batch["cu_seqlens"][:-1].tolist(), batch["cu_seqlens"][1:].tolist())]


def doc_loss_alone(model, doc):
    batch = packtrain.packed_batch([doc], pack, "cpu")
    with packtrain.attending(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)):
        return packtrain.summed_loss(model, batch)[0]


@pytest.mark.parametrize("prepare", [dense_packed, packtrain.varlen_packed(per_doc_varlen)], ids=["mask", "varlen"])
def test_packed_loss_equals_each_document_run_alone(model, prepare):
    with torch.no_grad():
        packed = doc_losses_packed(model, DOCS, prepare)
        alone = [doc_loss_alone(model, d) for d in DOCS]
    torch.testing.assert_close(torch.stack(packed), torch.stack(alone), rtol=1e-5, atol=1e-6)


def test_a_documents_gradient_does_not_depend_on_another_document(model):
    def grads(docs):
        model.zero_grad(set_to_none=True)
        doc_losses_packed(model, docs)[0].backward()           # the loss of document 0 only
        return [p.grad.clone() for p in model.parameters()]

    other = [DOCS[0], torch.tensor([1, 2, 3]), *DOCS[2:]]      # document 1 rewritten (shorter, other tokens)
    for a, b in zip(grads(DOCS), grads(other)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_causal_mask_without_documents_leaks_and_the_loss_shows_it(model):
    leaky = lambda packed: (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))   # noqa: E731
    with torch.no_grad():
        gap = (doc_losses_packed(model, DOCS, leaky)[1] - doc_loss_alone(model, DOCS[1])).abs()
    assert gap > 1e-3


def test_targets_stay_inside_each_document_and_padding_has_none():
    assert packtrain.next_token_targets([torch.tensor([1, 2, 3]), torch.tensor([4])]).tolist() == [2, 3, -100, -100]
    batch = packtrain.padded_batch([torch.tensor([1, 2, 3]), torch.tensor([4])], "cpu")
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["targets"].tolist() == [[2, 3, -100], [-100, -100, -100]]


def test_stdlib_batches_hold_exactly_the_tokens_asked_for():
    batches = packtrain.stdlib_batches(3, 200, max_len=50, scale=16, seed=1)
    assert [sum(len(d) for d in docs) for docs in batches] == [200] * 3
    assert all(1 <= len(d) <= 50 and d.dtype == torch.int64 and int(d.max()) < 256 for docs in batches for d in docs)


def test_train_gives_the_padded_losses_and_a_status_for_a_failing_variant():
    batches = packtrain.stdlib_batches(2, 96, max_len=40, scale=64)
    broken = packtrain.varlen_packed(lambda q, k, v, cu, m: 1 / 0)
    table = packtrain.train({packtrain.PADDED: None, "dense": dense_packed, "broken": broken}, batches, pack=pack,
                            size="tiny", max_len=64, steps=3, warmup=1, device="cpu", dtype=torch.float32)
    assert list(table.index) == [packtrain.PADDED, "dense", "broken"]
    assert table.loc["broken", "status"].startswith("ZeroDivisionError") and table.loc["dense", "status"] == "ok"
    assert table.loc["dense", "tokens_per_s"] > 0
    assert table.loc["dense", "warmup_ms"] > 0 and table.loc["dense", "step_ms"] > 0
    assert table.loc[["broken"], ["warmup_ms", "step_ms"]].isna().all(axis=None)
    gap = packtrain.loss_gap(table)
    assert gap["dense"] < 1e-5 and gap.isna()["broken"]


def test_a_cost_paid_on_each_new_batch_lands_in_the_warm_up_pass_not_in_the_timed_one():
    batches = packtrain.stdlib_batches(3, 64, max_len=32, scale=64, seed=2)
    seen = set()

    def slow_first_time(packed):   # as a backend that prepares something for every batch it has not seen
        key = tuple(packed["tokens"].tolist())
        if key not in seen:
            seen.add(key)
            time.sleep(0.2)
        return dense_packed(packed)

    table = packtrain.train({"slow_first_time": slow_first_time}, batches, pack=pack, size="tiny", max_len=64,
                            steps=2 * len(batches), warmup=len(batches), device="cpu", dtype=torch.float32)
    row = table.loc["slow_first_time"]
    assert row["warmup_ms"] >= 200 and row["step_ms"] < row["warmup_ms"] - 150, row
    seen.clear()
    untimed = packtrain.train({"slow_first_time": slow_first_time}, batches, pack=pack, size="tiny", max_len=64,
                              steps=len(batches), warmup=2 * len(batches), device="cpu", dtype=torch.float32)
    assert untimed.loc["slow_first_time", "warmup_ms"] >= 200   # the mean over the steps that ran, not over warmup
    assert untimed.loc[["slow_first_time"], ["step_ms", "tokens_per_s"]].isna().all(axis=None)


def _table(padded_status: str = "ok") -> pd.DataFrame:
    rows = [dict(variant=packtrain.PADDED, status=padded_status, tokens_per_s=100.0 if padded_status == "ok" else
                 float("nan"), loss_0=2.0 if padded_status == "ok" else float("nan")),
            dict(variant="fast", status="ok", tokens_per_s=250.0, loss_0=2.001),
            dict(variant="slow", status="ok", tokens_per_s=120.0, loss_0=2.1),
            dict(variant="broken", status="ZeroDivisionError: division by zero", tokens_per_s=float("nan"),
                 loss_0=float("nan"))]
    return pd.DataFrame(rows).set_index("variant")


def test_verdicts_name_the_speed_up_goal_and_the_loss_tolerance_per_variant():
    lines = packtrain.verdicts(_table(), goal=1.5, tolerance=2 ** -7)
    assert lines[0] == ("fast: 250 tokens/s = 2.50x padded (goal >= 1.5x: ok); largest loss difference 5.0e-04 "
                        "(within 2^-7)")
    assert "1.20x padded (goal >= 1.5x: below goal)" in lines[1] and "(NOT within 2^-7)" in lines[1]
    assert lines[2] == "broken: ZeroDivisionError: division by zero"


def test_verdicts_say_the_padded_baseline_did_not_run_instead_of_a_nan_ratio():
    lines = packtrain.verdicts(_table("oom"))
    assert lines[0].startswith("padded_sdpa: oom: the padded baseline did not run")
    assert lines[1:] == ["fast: 250 tokens/s", "slow: 120 tokens/s", "broken: ZeroDivisionError: division by zero"]
    assert not any("nan" in line or "below goal" in line for line in lines)
