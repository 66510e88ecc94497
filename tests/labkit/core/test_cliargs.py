"""labkit.core.cliargs: the argparse types every ``python -m labkit`` command shares.

Each either returns the parsed value or raises ArgumentTypeError with one line that names the
rule, a valid value and what was given; argparse turns that into its error and exit status 2
(tests/course/test_cli.py runs each command with bad input).
"""
from __future__ import annotations

import argparse

import pytest

from labkit.core import cliargs as ca


def refusal(parse, text: str) -> str:
    with pytest.raises(argparse.ArgumentTypeError) as info:
        parse(text)
    message = str(info.value)
    assert "\n" not in message, "one line"
    return message


def test_integer():
    parse = ca.integer(2, 4096)
    assert parse("2") == 2 and parse(" 8 ") == 8
    assert refusal(parse, "1") == "must be an integer >= 2, e.g. 4096; got 1"
    assert refusal(parse, "-5") == "must be an integer >= 2, e.g. 4096; got -5"
    assert refusal(parse, "1.5") == "expected an integer >= 2, e.g. 4096; got '1.5'"
    assert ca.integer(0)("0") == 0, "a minimum of 0 takes 0"


@pytest.mark.parametrize("text", ["0", "-5", "", ",", "64,abc", "64,0", "1e3"])
def test_integers_refuse_a_list_with_any_bad_or_no_value(text):
    message = refusal(ca.integers(1, "512,1024"), text)
    assert message == f"expected comma-separated integers >= 1, e.g. 512,1024; got {text!r}"


def test_integers():
    assert ca.integers(2)("64, 128,") == [64, 128]


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "fast"])
def test_number_is_finite_and_above_the_minimum(text):
    assert refusal(ca.number(0, 100), text) == f"expected a number > 0, e.g. 100; got {text!r}"


def test_number():
    assert ca.number(0, 100)("0.5") == 0.5


def test_names_from_a_set():
    parse = ca.names(["fwd", "fwd_bwd"], "mode")
    assert parse("fwd_bwd,fwd") == ["fwd_bwd", "fwd"]
    assert refusal(parse, "fwd,bwd") == "unknown mode(s) ['bwd']; choose from fwd, fwd_bwd (comma-separated), e.g. fwd"
    assert refusal(parse, ",").startswith("no mode in ','; choose from fwd, fwd_bwd")


def test_words():
    assert ca.words("01,03")("01, 03") == ["01", "03"]
    assert refusal(ca.words("01,03"), " , ") == "expected a comma-separated list, e.g. 01,03; got ' , '"


def test_checked_passes_on_the_checks_own_message():
    def check(name: str) -> None:
        if name not in ("sdpa", "labkit"):
            raise ValueError(f"unknown implementation {name!r}; use 'sdpa' or 'labkit'.\nmore detail")

    assert ca.checked(check)("sdpa") == "sdpa"
    assert refusal(ca.checked(check), "foo") == "unknown implementation 'foo'; use 'sdpa' or 'labkit'."
    many = ca.checked(check, "implementation", many=True)
    assert many("sdpa,labkit") == ["sdpa", "labkit"]
    assert refusal(many, "sdpa,foo").startswith("unknown implementation 'foo'")
    assert refusal(many, "") == "expected a comma-separated list of implementations; got ''"


def test_folder(tmp_path):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "a file").write_text("x")
    parse = ca.folder("solutions", "the course folder", "'.'")
    assert parse(str(tmp_path)) == tmp_path
    missing = str(tmp_path / "nope")
    assert refusal(parse, missing) == f"no folder {missing!r}; give the course folder, e.g. '.'"
    assert refusal(parse, str(tmp_path / "solutions")).startswith(f"folder {str(tmp_path / 'solutions')!r} holds no "
                                                                  "solutions; give the course folder")
    assert refusal(parse, str(tmp_path / "a file")).startswith("no folder")


def test_out_folder(tmp_path):
    (tmp_path / "a file").write_text("x")
    parse = ca.out_folder("build/bench")
    assert parse(str(tmp_path / "new" / "deeper")) == tmp_path / "new" / "deeper", "created later, by the command"
    assert not (tmp_path / "new").exists(), "a check writes nothing"
    assert refusal(parse, str(tmp_path / "a file")).endswith("is a file, not a folder; give an output folder, "
                                                             "e.g. build/bench")
    assert "not a folder this user can write" in refusal(parse, str(tmp_path / "a file" / "below"))


def test_out_file(tmp_path):
    (tmp_path / "a file").write_text("x")
    parse = ca.out_file("build/out.json")
    assert parse(str(tmp_path / "new" / "r.json")) == tmp_path / "new" / "r.json"
    assert parse(str(tmp_path / "a file")) == tmp_path / "a file", "an existing file is overwritten"
    assert refusal(parse, str(tmp_path)) == f"{str(tmp_path)!r} is a folder; give a file name, e.g. build/out.json"
    assert "not a file this user can write" in refusal(parse, str(tmp_path / "a file" / "r.json"))


def test_out_zip(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # "build" below is a folder that does not exist (a checkout may have one)
    (tmp_path / "a file").write_text("x")
    parse = ca.out_zip("build/student-bundle.zip")
    assert parse(str(tmp_path)) == tmp_path / "student-bundle.zip", "an existing folder gets the default name inside"
    assert parse(str(tmp_path / "new" / "b.ZIP")) == tmp_path / "new" / "b.ZIP", "its folder is created later"
    assert not (tmp_path / "new").exists(), "a check writes nothing"
    for text in ("build", str(tmp_path / "missing"), str(tmp_path / "a file")):
        assert refusal(parse, text) == (f"{text!r} is neither a file name ending in .zip nor an existing folder; "
                                        "give e.g. build/student-bundle.zip or build (then student-bundle.zip inside it)")
    assert "not a file this user can write" in refusal(parse, str(tmp_path / "a file" / "b.zip"))


def test_argparse_answers_with_the_option_and_exit_status_2(capsys):
    parser = argparse.ArgumentParser(prog="tool")
    parser.add_argument("--seq-lens", type=ca.integers(1, "512,1024"))
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--seq-lens", "0"])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("tool: error: argument --seq-lens: expected comma-separated "
                                                        "integers >= 1, e.g. 512,1024; got '0'")
