"""The student bundle: everything a student needs, nothing an instructor keeps.

``python -m labkit bundle`` (``make bundle``) zips the student notebooks, the labkit package and
the files that install them (environment.yml, pyproject.toml, the lock) into
``build/student-bundle.zip``, under one top folder, with a README and a Makefile written for students
(:data:`STUDENT_FILES`, kept in ``labkit/course/student/``: how to install, open the notebooks, check the
install and hand in; targets setup, lab, check and bench, each of which works in the unpacked bundle), not
the instructor's README and Makefile, whose tools (tests, release, board) need files the bundle lacks. Before writing, it scans every file for
leaks and refuses to write a bundle that has any:

- a path from ``solutions/`` or ``tests/`` (hidden tests live in both);
- an nbgrader marker (``BEGIN SOLUTION``, ``END HIDDEN TESTS``, ...) in a notebook;
- a line of a solution block, a hidden-test block or a written model answer from ``solutions/``
  that the solution notebooks do not also show outside those blocks. Lines shorter than
  ``MIN_LINE_CHARS`` are too generic to count (``return out``). One exception, by design:
  ``labkit/`` holds the reference implementations that answers are checked against, so a line of
  solution *code* may coincide with a reference there; hidden tests and model answers may not.

The board (``labkit/board/``, ``python -m labkit board``) stays out of the bundle: an instructor's tool,
with the check shapes and mask rules it judges submissions by.

Used in: the Makefile (``bundle``), ``tests/labkit/course/test_bundle.py``.
"""
from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

TOP_FOLDER = "lab-1.5-flashattention"
BUNDLE_FILES = ("environment.yml", "pyproject.toml", "constraints.txt")
STUDENT_FOLDER = "labkit/course/student"
STUDENT_FILES = {"README.md": f"{STUDENT_FOLDER}/README.md", "Makefile": f"{STUDENT_FOLDER}/Makefile"}  # bundle <- repo
BUNDLE_DIRS = ("notebooks", "labkit")
EXCLUDED_PARTS = {"__pycache__", ".ipynb_checkpoints"}
# instructors' tools that students must not see: the board's check shapes, its index rules and its seed handling;
# and the student README and Makefile's sources, which the bundle holds at its top instead
INSTRUCTOR_ONLY = ("labkit/board/", f"{STUDENT_FOLDER}/")
FORBIDDEN_DIRS = ("solutions", "tests")
MARKERS = ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS")
MIN_LINE_CHARS = 24
_BLOCK = re.compile(r"### BEGIN (SOLUTION|HIDDEN TESTS)\n(.*?)### END \1", re.S)


class BundleLeakError(RuntimeError):
    """The bundle would hand students solution text or hidden tests."""


def bundle_files(root: Path) -> dict[str, Path]:
    """Bundle path -> the file of ``root`` it is copied from (relative), sorted by bundle path."""
    files = {name: Path(name) for name in BUNDLE_FILES} | {name: Path(src) for name, src in STUDENT_FILES.items()}
    for folder in BUNDLE_DIRS:
        files.update({p.relative_to(root).as_posix(): p.relative_to(root) for p in (root / folder).rglob("*")
                      if p.is_file() and not EXCLUDED_PARTS & set(p.parts) and p.suffix != ".pyc"
                      and not p.relative_to(root).as_posix().startswith(INSTRUCTOR_ONLY)})
    missing = [str(f) for f in files.values() if not (root / f).is_file()]
    if missing:
        raise FileNotFoundError(f"bundle files missing under {root}: {missing}")
    return dict(sorted(files.items()))


def secret_lines(root: Path) -> dict[str, set[str]]:
    """Stripped lines of solutions/' hidden content by kind: "solution", "hidden test", "model answer"."""
    secrets: dict[str, set[str]] = {"solution": set(), "hidden test": set(), "model answer": set()}
    public: set[str] = set()
    for path in sorted((root / "solutions").rglob("*.ipynb")):
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            source = "".join(cell["source"]) + "\n"
            if cell["cell_type"] == "markdown" and cell.get("metadata", {}).get("nbgrader", {}).get("solution"):
                secrets["model answer"] |= _stripped(source)
                continue
            for match in _BLOCK.finditer(source):
                secrets["solution" if match.group(1) == "SOLUTION" else "hidden test"] |= _stripped(match.group(2))
            public |= _stripped(_BLOCK.sub("", source))
    return {kind: {line for line in lines - public if len(line) >= MIN_LINE_CHARS} for kind, lines in secrets.items()}


def _stripped(text: str) -> set[str]:
    return {line.strip() for line in text.splitlines()}


def leaks(files: dict[str, bytes], secrets: dict[str, set[str]]) -> list[str]:
    """Why ``files`` (bundle path -> content) must not reach students; empty when clean."""
    problems = [f"{name}: from {name.split('/')[0]}/" for name in files if name.split("/")[0] in FORBIDDEN_DIRS]
    for name, content in files.items():
        text = content.decode("utf-8", errors="replace")
        lines = _stripped(text)
        if name.endswith(".ipynb"):
            problems += [f"{name}: nbgrader marker {m!r}" for m in MARKERS if m in text]
            lines |= _stripped("\n".join(_json_lines(text)))
        for kind, secret in secrets.items():
            if kind == "solution" and name.startswith("labkit/"):
                continue  # labkit's reference implementations may share a line with an answer
            problems += [f"{name}: {kind} line {line!r}" for line in sorted(lines & secret)]
    return problems


def _json_lines(text: str) -> list[str]:
    """A notebook's cell source lines (JSON escapes resolved), so secrets cannot hide in quoting."""
    cells = json.loads(text).get("cells", [])
    return [line for cell in cells for line in "".join(cell.get("source", "")).splitlines()]


def build_bundle(root: Path, out: Path) -> Path:
    """Zip the student bundle of the course at ``root`` to ``out``; raise BundleLeakError on a leak."""
    root = Path(root).resolve()
    files = {name: (root / source).read_bytes() for name, source in bundle_files(root).items()}
    problems = leaks(files, secret_lines(root))
    if problems:
        raise BundleLeakError("refusing to write the student bundle:\n  " + "\n  ".join(problems[:20]))
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, content in files.items():
            archive.writestr(f"{TOP_FOLDER}/{name}", content)
    return out
