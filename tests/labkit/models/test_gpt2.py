"""labkit.models.gpt2: every attention implementation against eager GPT-2, padding, KV-cache decoding,
checkpointing, model building, measurements and errors.

Tolerances: in fp32 the paths differ only in summation order (softmax in fp32 everywhere), so
logits agree to ~1e-6 relative; 1e-5 (relative L2) leaves margin without hiding a wrong mask
or scale (those give errors of order 1e-1). In bf16 the rule is FlashAttention's: the error
against fp32 may be at most twice eager's error at the same dtype.
"""
from __future__ import annotations

import pytest
import torch

import labkit as lk
from labkit.models import gpt2

transformers = pytest.importorskip("transformers")
CPU_IMPLS = ["labkit", "labkit:reference", "labkit:sdpa_math", "labkit:sdpa_flash", "labkit:auto"]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


@pytest.fixture(scope="module")
def model():
    return gpt2.build_model("tiny", attn_implementation="eager", seed=0)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 255, (3, 48), generator=torch.Generator().manual_seed(0))


def padded(seqs: list[list[int]], side: str, pad_id: int = 0):
    """input_ids, attention_mask, position_ids for a batch padded on ``side``."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, s in enumerate(seqs):
        cols = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids[row, cols], mask[row, cols] = torch.tensor(s), 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


# ----------------------------------------------------------------------------- switching implementations

def test_set_attention_keeps_the_same_weights(model):
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    for impl in ["labkit:reference", "sdpa", "eager"]:
        gpt2.set_attention(model, impl)
        assert model.config._attn_implementation == impl.split(":")[0]
    assert before == {n: p.data_ptr() for n, p in model.named_parameters()}


@pytest.mark.parametrize("bad", ["flash_attention_2", "labkit:nope", "sdpa:fa4", "Labkit"])
def test_set_attention_rejects_unknown_names(model, bad):
    with pytest.raises(ValueError):
        gpt2.set_attention(model, bad)


def test_set_attention_keeps_a_rope_model_on_labkit():
    m = gpt2.build_model("tiny", attn_implementation="labkit")
    lk.rope.use_rope(m)
    for impl in ["sdpa", "eager"]:
        with pytest.raises(ValueError, match="RoPE"):
            gpt2.set_attention(m, impl)
    gpt2.set_attention(m, "labkit:sdpa_math")  # any labkit backend applies it


# ----------------------------------------------------------------------------- numerics (fp32, CPU)

@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_logits_match_eager(model, ids, impl):
    ref = gpt2.forward_logits(model, ids, "eager")
    assert rel_l2(gpt2.forward_logits(model, ids, impl), ref) < 1e-5


def test_scaling_by_inverse_layer_idx_is_honoured(ids):
    m = gpt2.build_model("tiny", attn_implementation="eager", scale_attn_by_inverse_layer_idx=True)
    ref = gpt2.forward_logits(m, ids, "eager")
    assert rel_l2(gpt2.forward_logits(m, ids, "labkit:reference"), ref) < 1e-5


def _grads(model, ids, impl):
    gpt2.set_attention(model, impl)
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("impl", ["labkit:sdpa_math", "labkit:sdpa_flash"])
def test_gradients_match_eager(model, ids, impl):
    ref, got = _grads(model, ids, "eager"), _grads(model, ids, impl)
    worst = max(rel_l2(got[n], ref[n]) for n in ref)
    assert worst < 1e-4, worst  # fp32; grads of small tensors (biases) sum fewer terms, so looser


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_matches_unpadded_sequences(model, side):
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 255, (n,), generator=gen).tolist() for n in (20, 13, 7)]
    ids, mask, pos = padded(seqs, side)
    for impl in ["eager", "labkit"]:
        batch = gpt2.forward_logits(model, ids, impl, attention_mask=mask, position_ids=pos)
        assert torch.isfinite(batch).all()
        for row, s in enumerate(seqs):
            alone = gpt2.forward_logits(model, torch.tensor([s]), impl)[0]
            got = batch[row][mask[row].bool()]
            assert rel_l2(got, alone) < 1e-5, (impl, side, row)


def test_greedy_generation_with_cache_gives_the_same_tokens(model):
    prompt = torch.randint(0, 255, (2, 12), generator=torch.Generator().manual_seed(2))
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=10, min_new_tokens=10,
                  do_sample=False, pad_token_id=0)
    gpt2.set_attention(model, "eager")
    with torch.no_grad():
        ref = model.generate(prompt, **kwargs)
        no_cache = prompt
        for _ in range(10):  # recompute the whole sequence each step: no KV cache involved
            nxt = model(input_ids=no_cache, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            no_cache = torch.cat([no_cache, nxt], dim=1)
        for impl in ["labkit", "labkit:reference", "labkit:sdpa_math"]:
            gpt2.set_attention(model, impl)
            assert torch.equal(model.generate(prompt, **kwargs), ref), impl
    assert torch.equal(ref, no_cache)
    assert len(set(ref[:, 12:].flatten().tolist())) > 2  # the tiny model does not just repeat one token
    gpt2.set_attention(model, "eager")


def test_left_padded_generation_matches_eager(model):
    ids, mask, _ = padded([[5, 6, 7, 8, 9, 10], [11, 12, 13]], "left")
    outs = []
    for impl in ["eager", "labkit"]:
        gpt2.set_attention(model, impl)
        outs.append(model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
                                   do_sample=False, pad_token_id=0))
    assert torch.equal(*outs)


def test_dropout_in_training_runs():
    m = gpt2.build_model("tiny", attn_implementation="labkit", dropout=0.1).train()
    ids = torch.randint(0, 255, (2, 16))
    a, b = (m(input_ids=ids, use_cache=False).logits for _ in range(2))
    assert not torch.equal(a, b)  # dropout active in train mode


# ----------------------------------------------------------------------------- training features

def test_activation_checkpointing_gives_the_same_gradients(ids):
    m = gpt2.build_model("tiny", attn_implementation="labkit:sdpa_math").train()
    ref = _grads(m, ids, "labkit:sdpa_math")
    gpt2.enable_checkpointing(m)
    assert getattr(m, "is_activation_checkpointing", None) or m.is_gradient_checkpointing
    got = _grads(m, ids, "labkit:sdpa_math")
    assert max(rel_l2(got[n], ref[n]) for n in ref) < 1e-6


# ----------------------------------------------------------------------------- models and measurements

def test_sizes_and_bad_size():
    cfg = gpt2.gpt2_config("small")
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size) == (12, 768, 12, 50257)
    assert cfg.attn_pdrop == 0.0 and gpt2.gpt2_config("tiny", n_positions=64).n_positions == 64
    with pytest.raises(ValueError, match="size"):
        gpt2.gpt2_config("huge")


def test_random_init_takes_any_number_of_positions_pretrained_none():
    m = gpt2.build_model("tiny", n_positions=1500)
    assert m.transformer.wpe.weight.shape == (1500, 64)
    assert torch.isfinite(gpt2.forward_logits(m, torch.randint(0, 255, (1, 1400)))).all()
    with pytest.raises(ValueError, match="random init"):
        gpt2.build_model("small", pretrained=True, n_positions=4096)


def test_pretrained_missing_gives_notice_and_random_init(monkeypatch, capsys):
    monkeypatch.setitem(gpt2.HUB_IDS, "small", "labkit-test/not-a-cached-gpt2")
    monkeypatch.setitem(gpt2.SIZES, "small", dict(gpt2.SIZES["tiny"]))  # keep the fallback model tiny
    m = gpt2.build_model("small", pretrained=True)
    assert "not in the local Hugging Face cache" in capsys.readouterr().out
    assert m.config.n_embd == 64


def test_training_throughput_rows():
    df = gpt2.training_throughput_table(["eager", "labkit", "labkit:fa4"], seq_lens=[32], tokens_per_step=128,
                                        size="tiny", target_ms=20)
    ok = df[df.status == "ok"]
    assert list(ok.implementation) == ["eager", "labkit"]
    assert (ok.tokens_per_s > 0).all() and (ok.tokens == 128).all()
    assert df.set_index("implementation").loc["eager", "vs_eager"] == pytest.approx(1.0)
    assert df.set_index("implementation").loc["labkit:fa4", "status"].startswith("unsupported")


def test_inference_latency_row(model):
    row = gpt2.inference_latency(model, "labkit", 32, 2, target_ms=20)
    assert row["status"] == "ok" and row["ms"] > 0 and row["tokens_per_s"] > 0


# ----------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("impl", ["labkit:sdpa_cudnn", "labkit:sdpa_flash", "labkit:fa4", "labkit"])
def test_bf16_error_within_twice_eager(impl):
    if impl == "labkit:fa4" and lk.attention.why_not("fa4", device="cuda", dtype=torch.bfloat16):
        pytest.skip("FlashAttention-4 does not run here")
    m = gpt2.build_model("small", device="cuda", n_layer=4)
    ids = torch.randint(0, 50257, (2, 1024), device="cuda")
    ref = gpt2.forward_logits(m, ids, "eager")
    base = rel_l2(gpt2.forward_logits(m, ids, "eager", autocast_dtype=torch.bfloat16), ref)
    got = rel_l2(gpt2.forward_logits(m, ids, impl, autocast_dtype=torch.bfloat16), ref)
    assert got <= 2 * base + 1e-6, (got, base)


@pytest.mark.gpu
@gpu
def test_gpu_training_throughput_small():
    df = gpt2.training_throughput_table(["eager", "sdpa", "labkit:sdpa_cudnn"], seq_lens=[1024],
                                        tokens_per_step=4096, target_ms=200)
    assert (df.status == "ok").all(), df
    assert (df.peak_gib > 0).all()
