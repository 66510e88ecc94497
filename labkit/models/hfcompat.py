"""The one transformers API the course spans two spellings of: the KV cache's keyword.

transformers 5.24 renamed a model's KV-cache argument and output field from ``past_key_values``
to ``cache`` (the old name still works there, with a FutureWarning, until 5.40). The course's lock
(``constraints.txt``) installs the new spelling; the GPU machine the course is measured on may
have an older transformers. These two helpers pick the spelling the installed transformers
expects, by looking at the model's own signature and output fields, so no cell warns under either.

- :func:`cache_kwarg`: ``{"cache": cache}`` or ``{"past_key_values": cache}`` for ``model(...)``.
- :func:`returned_cache`: the KV cache a forward returned (``out.cache`` or ``out.past_key_values``).

Used in: 02_gpt2_integration, tests.
"""
from __future__ import annotations

import dataclasses
import inspect

NEW_NAME, OLD_NAME = "cache", "past_key_values"


def cache_keyword(model) -> str:
    """The name under which ``model.forward`` takes the KV cache: "cache" (transformers >= 5.24) or
    "past_key_values" (older)."""
    params = inspect.signature(model.forward).parameters
    if NEW_NAME in params:
        return NEW_NAME
    if OLD_NAME in params:
        return OLD_NAME
    raise TypeError(f"{type(model).__name__}.forward takes neither {NEW_NAME!r} nor {OLD_NAME!r}: "
                    "it has no KV cache argument.")


def cache_kwarg(model, cache) -> dict:
    """Keyword arguments that pass ``cache`` (a transformers ``Cache``, or None) to ``model(...)``."""
    return {cache_keyword(model): cache}


def returned_cache(output):
    """The KV cache in a model output (``use_cache=True``), read without a deprecation warning."""
    fields = {f.name for f in dataclasses.fields(output)}
    for name in (NEW_NAME, OLD_NAME):
        if name in fields:
            return getattr(output, name)
    raise TypeError(f"{type(output).__name__} has no KV cache field ({NEW_NAME!r} or {OLD_NAME!r}); "
                    "was the forward called with use_cache=True on a decoder model?")
