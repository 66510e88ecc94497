"""Tests for labkit.core.codereach: what a function's code reaches (check_own_code's cases: test_grading.py)."""
from __future__ import annotations

import inspect

import torch

import labkit as lk
from labkit.core import codereach

kept_softmax = torch.softmax   # bound in another cell


def chains(x):
    return lk.fp8cast.exact() and lk.attention.flops(1, 1, x, 8) and getattr(lk, "plots")


def helper_softmax(x):
    return kept_softmax(x, -1)


def calls_a_helper(x):
    return [helper_softmax(x) for _ in range(1)]


def labkit_module(obj) -> bool:
    return inspect.ismodule(obj) and codereach.is_labkit(obj)


def test_unfolded_reads_a_module_through_the_chains_the_code_takes():
    found = codereach.unfolded(chains, codereach.loaded_globals(chains), labkit_module)
    assert found["lk.fp8cast.exact"] is lk.fp8cast.exact and found["lk.attention.flops"] is lk.attention.flops
    assert found["lk"] is lk, "a bare use (getattr(lk, ...)) is the module itself"
    assert set(found) == {"lk.fp8cast.exact", "lk.attention.flops", "lk"}, "each chain followed to its end"


def test_first_reached_follows_helpers_and_unfolds_only_what_it_is_told():
    assert codereach.first_reached(calls_a_helper, lambda o: o is torch.softmax) == "helper_softmax -> kept_softmax"
    assert codereach.first_reached(chains, lambda o: o is lk.attention.flops) is None, "lk itself is not flops"
    assert codereach.first_reached(chains, lambda o: o is lk.attention.flops, unfold=labkit_module) \
        == "lk.attention.flops"
    assert codereach.first_reached(helper_softmax, lambda o: False, attributes={"softmax"}) is None
    assert codereach.first_reached(lambda x: x.softmax(-1), lambda o: False, attributes={"softmax"}) == ".softmax"


def test_is_labkit_and_names():
    assert codereach.is_labkit(lk.fp8cast) and codereach.is_labkit(lk.attention.flops)
    assert not codereach.is_labkit(torch.softmax) and not codereach.is_labkit(lk.perfmodel.ModelShape.gpt2("small"))
    assert codereach.names("q_blk = lk.x  # labkit\ns = 'labkit.engine'\n") >= {"q_blk", "lk", "x", "labkit"}
    assert "labkit" not in codereach.names("s = 'not labkit here'\n")
