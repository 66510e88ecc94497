"""The lock (constraints.txt): it covers every dependency, and a locked run uses exactly its versions.

``make test`` sets ``LABKIT_LOCK`` to the lock it installed from; ``make test-latest`` sets it empty
(the newest versions pyproject allows, on purpose unlocked), and these checks of the installed
versions skip there. Deprecated APIs under the locked versions are the run guard's job
(tests/labkit/course/test_runguard.py and every solution notebook, executed by the autograde round trip).
"""
from __future__ import annotations

import os
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "constraints.txt"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked() -> dict[str, str]:
    """package name -> exact version, from the lock."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            pins[canonical(name)] = version
    return pins


def requirement_names(extras=("lab", "dev")) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]
    return {canonical(re.match(r"[A-Za-z0-9_.\-]+", r).group()) for r in reqs}


def test_the_lock_pins_every_direct_dependency_but_torch():
    missing = requirement_names() - {"torch"} - set(locked())
    assert not missing, f"constraints.txt has no pin for {sorted(missing)}: run `make lock`"
    assert "torch" not in locked(), "torch is pinned by TORCH in the Makefile (CPU and CUDA builds differ)"


def test_the_lock_is_used_by_setup_and_the_conda_environment():
    assert "-c $(LOCK)" in (ROOT / "Makefile").read_text()
    assert "-c constraints.txt" in (ROOT / "environment.yml").read_text()


@pytest.mark.skipif(not os.environ.get("LABKIT_LOCK"), reason="not a locked run (make test-latest, or pytest by hand)")
def test_a_locked_run_has_exactly_the_locked_versions():
    wrong = {}
    for name, version in locked().items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            if sys.platform == "linux":  # the lock is written on Linux: elsewhere some pins do not apply
                wrong[name] = f"not installed, {version} locked"
            continue
        if have != version:
            wrong[name] = f"{have} installed, {version} locked"
    assert not wrong, f"the environment is not the lock's: {wrong}; rerun `make setup` (delete .venv first)"
