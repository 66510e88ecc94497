"""Tests for labkit.course.bundle: the student zip holds what students need and no solution text.

Its README speaks to students (nothing of the instructor's tools) and every target of its Makefile works in
the unpacked bundle: each is dry-run with ``make -n``, and ``make check`` runs for real with this Python.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from labkit.course import bundle

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, bytes]:
    """The bundle, written by the command into an existing folder (``--out FOLDER``: the default name inside)."""
    folder = tmp_path_factory.mktemp("bundle")
    proc = subprocess.run([sys.executable, "-m", "labkit", "bundle", "--root", str(ROOT), "--out", str(folder)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in folder.iterdir()] == ["student-bundle.zip"]
    with zipfile.ZipFile(folder / "student-bundle.zip") as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def _strip_top(files: dict[str, bytes]) -> dict[str, bytes]:
    assert all(name.startswith(bundle.TOP_FOLDER + "/") for name in files)
    return {name[len(bundle.TOP_FOLDER) + 1:]: content for name, content in files.items()}


def test_bundle_holds_the_student_course(built):
    files = _strip_top(built)
    for name in ("README.md", "environment.yml", "pyproject.toml", "constraints.txt", "Makefile", "labkit/__init__.py"):
        assert name in files
    committed = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "notebooks").rglob("*.ipynb"))
    assert committed and sorted(n for n in files if n.endswith(".ipynb")) == committed
    for name in committed:
        assert files[name] == (ROOT / name).read_bytes()
    for name, source in bundle.STUDENT_FILES.items():
        assert files[name] == (ROOT / source).read_bytes() and source not in files, "the student's, at the top only"
    modules = [p for p in (ROOT / "labkit").rglob("*.py") if "__pycache__" not in p.parts]
    assert len(modules) >= 50, f"the walk should see every labkit module, in its subpackages too: {len(modules)}"
    for module in modules:
        name = module.relative_to(ROOT).as_posix()
        if name.startswith(bundle.INSTRUCTOR_ONLY):
            assert name not in files
        else:
            assert files[name] == module.read_bytes(), f"{name} is not in the bundle as it is in the repository"


def test_bundle_holds_no_solutions_hidden_tests_or_answers(built):
    files = _strip_top(built)
    assert not [n for n in files if n.split("/")[0] in ("solutions", "tests") or "__pycache__" in n]
    secrets = bundle.secret_lines(ROOT)
    assert all(secrets.values()), "solutions/ should have solution code, hidden tests and model answers"
    assert bundle.leaks(files, secrets) == []
    # Every notebook's source, decoded from JSON, is free of nbgrader markers too.
    for name in (n for n in files if n.endswith(".ipynb")):
        sources = "".join("".join(c["source"]) for c in json.loads(files[name])["cells"])
        assert "BEGIN SOLUTION" not in sources and "HIDDEN TESTS" not in sources


@pytest.fixture
def unpacked(built, tmp_path) -> Path:
    for name, content in built.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(content)
    return tmp_path / bundle.TOP_FOLDER


def test_bundle_installs_and_imports(unpacked):
    proc = subprocess.run([sys.executable, "-c", "import labkit, sys; print(labkit.__file__)"],
                          cwd=unpacked, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert str(unpacked) in proc.stdout


def test_the_readme_is_the_students(unpacked):
    text = (unpacked / "README.md").read_text(encoding="utf-8")
    instructor = [w for w in ("board", "nbgrader", "autograde", "solutions/", "hidden", "make test", "make release")
                  if w in text.lower()]
    assert not instructor, f"the student README speaks of the instructor's tools: {instructor}"
    for step in ("make setup", "make lab", "make check", ".ipynb", "安裝（install）", "繳交（submit）"):
        assert step in text, f"the student README should say {step!r}"
    assert len(text.encode()) < 10_000, "a page for students, not the instructor's README"


def _targets(makefile: Path) -> list[str]:
    import re

    return sorted(set(re.findall(r"^([a-z][\w-]*):", makefile.read_text(encoding="utf-8"), re.M)))


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_every_makefile_target_works_in_the_bundle(unpacked):
    # a student's shell, not the make that runs this test: its MAKEFLAGS would print "Entering directory" lines
    student = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    targets = _targets(unpacked / "Makefile")
    assert targets == ["bench", "check", "lab", "setup"]
    for target in targets:  # dry runs: every prerequisite exists in the bundle or has a rule
        proc = subprocess.run(["make", "-n", target], cwd=unpacked, capture_output=True, text=True, timeout=60,
                              env=student)
        assert proc.returncode == 0, f"make -n {target}: {proc.stderr}"
    dry = subprocess.run(["make", "-n", "check", f"PY={sys.executable}"], cwd=unpacked, capture_output=True,
                         text=True, timeout=60, env=student)
    assert dry.stdout.strip() == f"{sys.executable} -m labkit doctor", "with PY given, no .venv is set up"
    env = {**student, "PYTHONPATH": ""}  # the bundle's own labkit, not the repository's
    proc = subprocess.run(["make", "check", f"PY={sys.executable}"], cwd=unpacked, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "reference" in proc.stdout and "runs here" in proc.stdout, proc.stdout[-2000:]


def test_out_zip_gets_its_folder_created(tmp_path, capsys):
    from labkit.__main__ import main

    out = tmp_path / "new" / "deeper" / "lab.zip"
    assert main(["bundle", "--root", str(ROOT), "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    with zipfile.ZipFile(out) as archive:
        assert f"{bundle.TOP_FOLDER}/README.md" in archive.namelist()


def _fake_course(tmp_path: Path) -> Path:
    root = tmp_path / "course"
    root.mkdir()
    for name in bundle.BUNDLE_FILES:
        shutil.copy(ROOT / name, root / name)
    shutil.copytree(ROOT / "labkit", root / "labkit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "notebooks", root / "notebooks")
    shutil.copytree(ROOT / "solutions", root / "solutions")
    return root


@pytest.mark.parametrize("kind", ["solution", "hidden test", "model answer"])
def test_a_leaked_line_refuses_the_bundle(tmp_path, kind):
    root = _fake_course(tmp_path)
    secret = sorted(bundle.secret_lines(root)[kind])[0]
    (root / "notebooks" / "NOTES.md").write_text(f"cheat sheet\n    {secret}\n", encoding="utf-8")
    with pytest.raises(bundle.BundleLeakError, match=kind):
        bundle.build_bundle(root, tmp_path / "out.zip")
    assert not (tmp_path / "out.zip").exists()


def test_hidden_tests_may_not_hide_in_labkit(tmp_path):
    root = _fake_course(tmp_path)
    secret = sorted(bundle.secret_lines(root)["hidden test"])[0]
    with open(root / "labkit" / "core" / "grading.py", "a", encoding="utf-8") as f:
        f.write(f'\nHINT = """\n{secret}\n"""\n')
    with pytest.raises(bundle.BundleLeakError, match="labkit/core/grading.py: hidden test"):
        bundle.build_bundle(root, tmp_path / "out.zip")


def test_markers_in_a_notebook_refuse_the_bundle(tmp_path):
    root = _fake_course(tmp_path)
    shutil.copy(next((root / "solutions").rglob("*.ipynb")), root / "notebooks" / "copied_solution.ipynb")
    with pytest.raises(bundle.BundleLeakError, match="nbgrader marker"):
        bundle.build_bundle(root, tmp_path / "out.zip")


def test_missing_files_are_named(tmp_path):
    root = _fake_course(tmp_path)
    (root / "environment.yml").unlink()
    with pytest.raises(FileNotFoundError, match="environment.yml"):
        bundle.bundle_files(root)


def test_the_board_stays_out_of_the_bundle():
    files = list(bundle.bundle_files(ROOT))
    assert "labkit/core/grading.py" in files
    assert not [f for f in files if f.startswith("labkit/board")], "the board's check shapes would reach students"
