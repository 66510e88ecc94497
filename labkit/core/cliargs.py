"""Argument checks shared by every ``python -m labkit`` command: argparse ``type=`` functions.

Each returns the parsed value or raises ``argparse.ArgumentTypeError`` with one line that names
the rule and a valid value; argparse prints it as ``<prog>: error: argument --x: <rule>`` under the
usage and exits with status 2, before the command does any work. Checks that need two options
(``--seq-len`` and ``--nproc``) are made after parsing with ``parser.error``, which answers the same way.

- :func:`integer`, :func:`integers`: an int (or a comma-separated list of ints) at least ``minimum``;
  :func:`number`: a finite float above ``minimum``;
- :func:`shard`: ``K/N``, one machine's share of N (0 <= K < N);
- :func:`names`: a comma-separated list of names from a fixed set (:func:`words`: of any names);
  :func:`checked`: a name that a module's own function accepts (its ValueError's message becomes the answer);
- :func:`folder`: an existing folder (holding a given file); :func:`out_folder`, :func:`out_file`:
  where output may be written (not a file where a folder is meant, nor the reverse); :func:`out_zip`: a
  ``.zip`` file name, or an existing folder to write the default-named zip into.

Used by: ``labkit.__main__``, :mod:`labkit.cp.run`, :mod:`labkit.long.ctx`.
"""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Callable, Iterable

Error = argparse.ArgumentTypeError


def _named(parse: Callable, name: str) -> Callable:
    parse.__name__ = name  # argparse names the type by it in its own messages
    return parse


def _parts(text: str) -> list[str]:
    """The non-empty, stripped items of a comma-separated option value."""
    return [x.strip() for x in text.split(",") if x.strip()]


def integer(minimum: int = 1, example: int | None = None) -> Callable[[str], int]:
    """An int >= ``minimum``, e.g. ``example``."""
    example = minimum if example is None else example

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise Error(f"expected an integer >= {minimum}, e.g. {example}; got {text!r}") from None
        if value < minimum:
            raise Error(f"must be an integer >= {minimum}, e.g. {example}; got {value}")
        return value

    return _named(parse, "integer")


def shard() -> Callable[[str], tuple[int, int]]:
    """``K/N`` -> (K, N) with 0 <= K < N: the K-th of N machines (Slurm: ``$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT``
    with task ids from 0)."""

    def parse(text: str) -> tuple[int, int]:
        try:
            k, n = (int(part) for part in text.split("/"))
        except ValueError:
            raise Error(f"expected K/N, e.g. 0/4 (the first of four machines); got {text!r}") from None
        if not 0 <= k < n:
            raise Error(f"K/N needs 0 <= K < N, e.g. 3/4 (the last of four); got {text!r}")
        return k, n

    return _named(parse, "shard")


def integers(minimum: int = 1, example: str = "1024,2048") -> Callable[[str], list[int]]:
    """A comma-separated list of at least one int, each >= ``minimum``, e.g. ``example``."""
    one = integer(minimum)

    def parse(text: str) -> list[int]:
        parts = _parts(text)
        if not parts:
            raise Error(f"expected comma-separated integers >= {minimum}, e.g. {example}; got {text!r}")
        try:
            return [one(x) for x in parts]
        except Error:
            raise Error(f"expected comma-separated integers >= {minimum}, e.g. {example}; got {text!r}") from None

    return _named(parse, "integers")


def number(minimum: float = 0.0, example: float = 1.0) -> Callable[[str], float]:
    """A finite float > ``minimum``, e.g. ``example``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > minimum):
            raise Error(f"expected a number > {minimum:g}, e.g. {example:g}; got {text!r}")
        return value

    return _named(parse, "number")


def names(choices: Iterable[str], what: str = "name") -> Callable[[str], list[str]]:
    """A comma-separated list of at least one of ``choices`` (in their order of the command line)."""
    choices = list(choices)
    valid = ", ".join(choices)

    def parse(text: str) -> list[str]:
        parts = _parts(text)
        unknown = [x for x in parts if x not in choices]
        if unknown or not parts:
            got = f"unknown {what}(s) {unknown}" if unknown else f"no {what} in {text!r}"
            raise Error(f"{got}; choose from {valid} (comma-separated), e.g. {choices[0]}")
        return parts

    return _named(parse, f"{what} list")


def words(example: str = "a,b") -> Callable[[str], list[str]]:
    """A comma-separated list of at least one word (checked against what exists after parsing)."""

    def parse(text: str) -> list[str]:
        parts = _parts(text)
        if not parts:
            raise Error(f"expected a comma-separated list, e.g. {example}; got {text!r}")
        return parts

    return _named(parse, "list")


def checked(check: Callable[[str], object], what: str = "name", many: bool = False) -> Callable:
    """``text`` if ``check(text)`` raises no ValueError, else that error's message (its first line);
    with ``many``, a comma-separated list of at least one such name."""

    def one(text: str) -> str:
        try:
            check(text)
        except ValueError as err:
            raise Error(str(err).splitlines()[0]) from None
        return text

    def parse(text: str) -> str | list[str]:
        if not many:
            return one(text)
        parts = _parts(text)
        if not parts:
            raise Error(f"expected a comma-separated list of {what}s; got {text!r}")
        return [one(x) for x in parts]

    return _named(parse, what)


def folder(holding: str | None = None, what: str = "a folder", example: str = "'.'") -> Callable[[str], Path]:
    """An existing folder (``what``, e.g. ``example``); with ``holding``, one that has a path matching that glob."""

    def parse(text: str) -> Path:
        path = Path(text)
        if not path.is_dir() or (holding and not any(path.glob(holding))):
            found = f"folder {text!r} holds no {holding}" if path.is_dir() else f"no folder {text!r}"
            raise Error(f"{found}; give {what}, e.g. {example}")
        return path

    return _named(parse, "folder")


def _writable_from(path: Path) -> bool:
    """Whether ``path`` can be created (or written): its nearest existing ancestor is a writable folder."""
    for parent in path.absolute().parents:
        if parent.exists():
            return parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)
    return False


def out_folder(example: str = "build/out") -> Callable[[str], Path]:
    """A folder to write into: an existing folder, or a path that can be created as one."""

    def parse(text: str) -> Path:
        path = Path(text)
        ok = (path.is_dir() and os.access(path, os.W_OK)) if path.exists() else _writable_from(path)
        if not ok:
            kind = "a file, not a folder" if path.is_file() else "not a folder this user can write"
            raise Error(f"{text!r} is {kind}; give an output folder, e.g. {example}")
        return path

    return _named(parse, "output folder")


def out_file(example: str = "build/out.json") -> Callable[[str], Path]:
    """A file to write: not an existing folder, in a folder that exists or can be created."""

    def parse(text: str) -> Path:
        path = Path(text)
        if path.is_dir() or not (os.access(path, os.W_OK) if path.exists() else _writable_from(path)):
            kind = "a folder" if path.is_dir() else "not a file this user can write"
            raise Error(f"{text!r} is {kind}; give a file name, e.g. {example}")
        return path

    return _named(parse, "output file")


def out_zip(default: str = "build/student-bundle.zip") -> Callable[[str], Path]:
    """A zip to write: a path ending in ``.zip`` (its folder created if needed), or an existing folder, which gets
    ``default``'s file name inside it. Anything else (``build`` where no such folder exists) is refused."""
    name = Path(default).name
    as_file = out_file(default)

    def parse(text: str) -> Path:
        path = Path(text)
        if path.is_dir():
            if not os.access(path, os.W_OK | os.X_OK):
                raise Error(f"folder {text!r} is not writable by this user; give a .zip file name, e.g. {default}")
            return path / name
        if path.suffix.lower() != ".zip":
            raise Error(f"{text!r} is neither a file name ending in .zip nor an existing folder; give e.g. {default}"
                        f" or {Path(default).parent} (then {name} inside it)")
        return as_file(text)

    return _named(parse, "zip file")


__all__ = ["Error", "checked", "folder", "integer", "integers", "names", "number", "out_file", "out_folder", "out_zip",
           "words"]
