"""labkit's face: ``import labkit as lk`` binds every ``lk.<name>`` the notebooks use, to the module itself.

- every ``lk.X...`` / ``labkit.X...`` chain in the code cells of solutions/ and in tests/mutants/ resolves after
  ``import labkit`` (no notebook needs an ``import labkit.X`` line of its own);
- ``lk.X`` is the module object registered in ``sys.modules`` (a monkeypatch of ``lk.X.f`` reaches the code);
- the face binds no name that neither a notebook nor the mutants use, except the ones named in ``FOR_TESTS``;
- ``import labkit`` works without the board (the student bundle's view);
- a wheel built from the repository holds every subpackage and the stored reference run.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import labkit
import pytest
from labkit.course import bundle

ROOT = Path(__file__).resolve().parents[2]
CHAIN = re.compile(r"(?<![\w.])(?:lk|labkit)((?:\.[A-Za-z_]\w*)+)")
# bound by the face for the unit tests (lk.kernels, lk.cpcpu, lk.cptrain), named by no notebook cell
FOR_TESTS = {"cpcpu", "cptrain", "kernels"}


def code_sources() -> dict[str, str]:
    """Where -> source: each code cell of solutions/ and each file of tests/mutants/."""
    sources = {}
    for nb in sorted(ROOT.glob("solutions/*/*.ipynb")):
        for i, cell in enumerate(json.loads(nb.read_text(encoding="utf-8"))["cells"]):
            if cell["cell_type"] == "code":
                sources[f"{nb.parent.name} cell {i}"] = "".join(cell["source"])
    for path in sorted((ROOT / "tests" / "mutants").glob("*.py")):
        sources[f"tests/mutants/{path.name}"] = path.read_text(encoding="utf-8")
    return sources


def chains(source: str) -> set[tuple[str, ...]]:
    """The attribute chains after ``lk`` / ``labkit``: ``lk.decode.read_once(x)`` -> ("decode", "read_once")."""
    return {tuple(m.group(1).split(".")[1:]) for m in CHAIN.finditer(source)}


SOURCES = code_sources()
USED = sorted({c for source in SOURCES.values() for c in chains(source)})


def test_the_chain_reader_reads_what_notebooks_write():
    assert chains("o = lk.decode.read_once(x)  # labkit.checks.nb06.forward\nblk.x; lk.env") == {
        ("decode", "read_once"), ("checks", "nb06", "forward"), ("env",)}


@pytest.mark.parametrize("chain", USED, ids=[".".join(c) for c in USED])
def test_every_name_the_notebooks_use_resolves(chain):
    where = sorted(k for k, s in SOURCES.items() if chain in chains(s))
    obj = labkit
    for depth, name in enumerate(chain):
        if not isinstance(obj, types.ModuleType):
            return  # past the module: an attribute of an object (its class decides)
        assert hasattr(obj, name), f"lk.{'.'.join(chain[:depth + 1])} does not resolve after `import labkit` ({where[:3]})"
        obj = getattr(obj, name)


def test_no_notebook_imports_a_labkit_module_itself():
    lines = sorted((k, line.strip()) for k, s in SOURCES.items() for line in s.splitlines()
                   if re.match(r"\s*(import labkit\.|from labkit(\.\w+)* import )", line))
    assert not lines, f"reach modules through the face (lk.<name>), not their own import: {lines}"


@pytest.mark.parametrize("name", labkit.__all__)
def test_the_face_binds_the_module_itself(name):
    module = getattr(labkit, name)
    assert isinstance(module, types.ModuleType), f"lk.{name} is {type(module).__name__}, not a module"
    assert sys.modules[module.__name__] is module, f"lk.{name} is a copy of {module.__name__}: patches would miss the code"


def test_the_face_lists_what_the_notebooks_use():
    used = {c[0] for c in USED}
    bound = {n for n in vars(labkit) if isinstance(getattr(labkit, n), types.ModuleType)}
    assert used <= set(labkit.__all__), f"used but not in labkit.__all__: {sorted(used - set(labkit.__all__))}"
    assert set(labkit.__all__) <= bound
    unused = set(labkit.__all__) - used - FOR_TESTS - {"tritonmode"}
    assert not unused, f"the face binds names no notebook uses: {sorted(unused)} (name them in FOR_TESTS if a test needs them)"


def test_the_checks_load_on_first_use():
    """``import labkit`` leaves the nine notebooks' checks unloaded (every kernel and board worker imports the face);
    ``lk.checks.nbNN`` loads its module, and a name that is no module is an AttributeError that says so."""
    proc = subprocess.run([sys.executable, "-c", "import sys, labkit\n"
                           "print(sorted(m for m in sys.modules if m.startswith('labkit.checks.')))\n"
                           "print(labkit.checks.nb07.__name__)"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:2] == ["[]", "labkit.checks.nb07"]
    with pytest.raises(AttributeError, match="no module 'nb99'"):
        labkit.checks.nb99


def test_labkit_imports_without_the_board(tmp_path):
    """The student bundle leaves the board out; the face must not need it."""
    for name, path in bundle.bundle_files(ROOT).items():
        if name.startswith("labkit/"):
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / path, tmp_path / path)
    assert not list((tmp_path / "labkit").rglob("board*")) or not any(
        p.name.startswith("board") or p.parent.name == "board" for p in (tmp_path / "labkit").rglob("*.py"))
    proc = subprocess.run([sys.executable, "-c", "import labkit; print(labkit.__file__, len(labkit.__all__))"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert str(tmp_path) in proc.stdout


@pytest.mark.slow
def test_a_built_wheel_holds_every_subpackage(tmp_path):
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "__pycache__", "*.egg-info"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = set(zipfile.ZipFile(next((tmp_path / "dist").glob("labkit-*.whl"))).namelist())
    packages = sorted(p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "labkit").rglob("__init__.py"))
    missing = [p for p in packages if f"{p}/__init__.py" not in names]
    assert not missing, f"the wheel leaves out {missing}"
    runs = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "labkit").rglob("reference_runs/*.json"))
    assert runs and set(runs) <= names, "the wheel leaves out the stored reference run"
