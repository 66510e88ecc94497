"""labkit.models.hf_attention: the registered name, the routes of the attention function, call recording.

Tolerances as in tests/labkit/models/test_gpt2.py: fp32 paths differ only in summation order (~1e-6 relative);
1e-5 relative L2 leaves margin without hiding a wrong mask or scale (errors of order 1e-1).
"""
from __future__ import annotations

import pytest
import torch

import labkit as lk
from labkit.models import gpt2, hf_attention, hfcompat

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model():
    return gpt2.build_model("tiny", attn_implementation="eager", seed=0)


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm())


def test_the_name_is_in_both_interfaces_once_a_model_uses_it(model):
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    gpt2.set_attention(model, "labkit")
    gpt2.set_attention(model, "eager")
    assert ALL_ATTENTION_FUNCTIONS[hf_attention.ATTN_NAME] is hf_attention.attention_forward
    assert hf_attention.ATTN_NAME in ALL_MASK_ATTENTION_FUNCTIONS
    assert "flash" not in hf_attention.ATTN_NAME


def test_without_mask_function_padding_is_dropped(model):
    """The gotcha ensure_registered avoids: a name only in AttentionInterface gets no padding mask."""
    from transformers import AttentionInterface

    ids = torch.randint(0, 255, (3, 48), generator=torch.Generator().manual_seed(0))
    AttentionInterface.register("labkit_nomask", hf_attention.attention_forward)
    mask = torch.ones_like(ids)
    mask[0, :10] = 0
    try:
        ref = gpt2.forward_logits(model, ids, "eager", attention_mask=mask)
        model.set_attn_implementation("labkit_nomask")
        dropped = gpt2.forward_logits(model, ids, attention_mask=mask)
        kept = gpt2.forward_logits(model, ids, "labkit", attention_mask=mask)
    finally:
        AttentionInterface._global_mapping.pop("labkit_nomask", None)
        gpt2.set_attention(model, "eager")
    real = mask.bool()
    assert rel_l2(kept[real], ref[real]) < 1e-5
    assert rel_l2(dropped[0, 10:], ref[0, 10:]) > 1e-3


def test_decode_and_padding_routes():
    """N=1 runs non-causal (sees every cached key); a mask goes to SDPA with that mask."""
    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = (torch.randn(2, 3, n, 8, generator=torch.Generator().manual_seed(n)) for n in (1, 9, 9))
    out, weights = hf_attention.attention_forward(module, q, k, v, None, scaling=0.3)
    ref = lk.attention.reference_attention(q, k, v, scale=0.3)[0].transpose(1, 2)
    assert weights is None and out.shape == (2, 1, 3, 8)
    torch.testing.assert_close(out, ref)
    keep = torch.rand(2, 1, 1, 9, generator=torch.Generator().manual_seed(3)) > 0.3
    keep[..., 0] = True
    out, _ = hf_attention.attention_forward(module, q, k, v, keep, scaling=0.3)
    ref = lk.attention.reference_attention(q, k, v, scale=0.3, mask=keep)[0].transpose(1, 2)
    torch.testing.assert_close(out, ref)


def test_record_calls_sees_what_gpt2_passes(model):
    ids = torch.randint(0, 255, (2, 6), generator=torch.Generator().manual_seed(1))
    pad = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    gpt2.set_attention(model, "labkit")
    try:
        with hf_attention.record_calls() as plain, torch.no_grad():
            model(input_ids=ids, use_cache=False)
        with hf_attention.record_calls() as padded, torch.no_grad():
            out = model(input_ids=ids, attention_mask=pad, use_cache=True)
            with hf_attention.record_calls() as decode:  # the innermost recorder gets the calls
                model(input_ids=ids[:, :1], **hfcompat.cache_kwarg(model, hfcompat.returned_cache(out)),
                      attention_mask=torch.cat([pad, torch.ones(2, 1, dtype=torch.long)], dim=1))
    finally:
        gpt2.set_attention(model, "eager")
    layers, heads = model.config.n_layer, model.config.n_head
    assert [c["layer"] for c in plain] == list(range(layers))
    assert plain[0]["query"] == (2, heads, 6, 64 // heads) and plain[0]["mask"] is None
    assert plain[0]["scaling"] == pytest.approx((64 // heads) ** -0.5) and plain[0]["dropout"] == 0.0
    mask = padded[0]["mask"]
    assert mask.dtype == torch.bool and mask.shape == (2, 1, 6, 6) and not mask[1, 0, :, :2].any()
    assert len(padded) == layers and decode[0]["query"][2] == 1 and decode[0]["key"][2] == 7
    assert not hf_attention._RECORDERS


def test_rope_model_refuses_a_padding_mask():
    m = gpt2.build_model("tiny", attn_implementation="labkit")
    lk.rope.use_rope(m)
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[0, :2] = 0
    with pytest.raises(ValueError, match="padding"):
        gpt2.forward_logits(m, torch.zeros(1, 8, dtype=torch.long), attention_mask=mask)
