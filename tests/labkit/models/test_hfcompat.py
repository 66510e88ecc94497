"""labkit.models.hfcompat: the KV cache passed and read under the spelling the installed transformers expects."""
from __future__ import annotations

import warnings

import pytest
import torch

from labkit.models import gpt2, hfcompat


@pytest.fixture(scope="module")
def model():
    return gpt2.build_model("tiny", attn_implementation="eager").eval()


def test_cache_round_trip_decodes_one_token_without_a_warning(model):
    ids = torch.randint(0, 255, (2, 5), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")  # a deprecated spelling would raise here
        out = model(input_ids=ids, use_cache=True)
        cache = hfcompat.returned_cache(out)
        step = model(input_ids=ids[:, -1:], use_cache=True, **hfcompat.cache_kwarg(model, cache))
        full = model(input_ids=torch.cat([ids, ids[:, -1:]], dim=1), use_cache=False)
    assert hfcompat.returned_cache(step).get_seq_length() == 6
    torch.testing.assert_close(step.logits[:, -1], full.logits[:, -1])


def test_the_keyword_is_the_one_forward_takes(model):
    import inspect

    name = hfcompat.cache_keyword(model)
    assert name in (hfcompat.NEW_NAME, hfcompat.OLD_NAME)
    assert name in inspect.signature(model.forward).parameters


def test_a_model_without_a_cache_argument_is_refused():
    with pytest.raises(TypeError, match="no KV cache argument"):
        hfcompat.cache_keyword(torch.nn.Linear(2, 2))


def test_an_output_without_a_cache_field_is_refused(model):
    from transformers.modeling_outputs import BaseModelOutput

    with pytest.raises(TypeError, match="no KV cache field"):
        hfcompat.returned_cache(BaseModelOutput(last_hidden_state=torch.zeros(1)))
