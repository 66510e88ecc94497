"""labkit's structure: layers without import cycles, and no exercise answer a student could copy.

Imports are read from the source of every module, in every subpackage (module level and inside functions
alike: a lazy import is still a dependency), keyed by dotted name (``labkit.core.measure``). labkit ships in
the student bundle, so no line of a solution block of solutions/ may stand verbatim in it.

The layer rules between subpackages (``ALLOWED``): the floor (core) imports no other part; the engine only the floor;
the topics build on the engine and on each other downward only (cp -> long -> models/perf; flex -> models;
tritonlab -> perf); no topic imports the course pipeline, the board or the command line; only the command line
(``labkit/__main__.py``) imports the board, and only the board's worker imports the face (it runs notebooks).
No module reads another labkit module's private (``_name``) helper: what two modules share is public where it lives.
"""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "labkit"


def module_name(path: Path, package: Path = PACKAGE) -> str:
    """``labkit/core/measure.py`` -> ``labkit.core.measure``; a subpackage's ``__init__.py`` -> its own name."""
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def labkit_imports(path: Path, known: set[str], package: Path = PACKAGE) -> set[str]:
    """The labkit modules (dotted names in ``known``) that ``path`` imports.

    ``from labkit.core import measure`` names ``labkit.core.measure`` when that is a module, else the package;
    ``from labkit.core.measure import x`` and ``import labkit.core.measure`` name ``labkit.core.measure``.
    """
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "labkit" and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "labkit"}
    return found - {module_name(path, package)}


def relative_imports(path: Path) -> list[int]:
    """Line numbers of relative imports (``from . import x``) in ``path``."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.level > 0]


FILES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)
KNOWN = {module_name(p) for p in FILES}
# the package's face (labkit/__init__.py) and the command line (labkit/__main__.py) sit above every layer
GRAPH = {module_name(p): labkit_imports(p, KNOWN) for p in FILES if module_name(p) not in ("labkit", "labkit.__main__")}


LESSONS = {"models", "perf", "numerics", "decoding", "tritonlab", "long", "flex", "cp", "fp8", "determinism"}
ALLOWED = {  # subpackage -> the other subpackages it may import
    "core": set(),
    "engine": {"core"},
    "models": {"core", "engine"},
    "perf": {"core", "engine"},
    "numerics": {"core", "engine"},
    "decoding": {"core", "engine"},
    "tritonlab": {"core", "engine", "perf"},
    "long": {"core", "engine", "models", "perf"},
    "flex": {"core", "engine", "models", "perf"},
    "cp": {"core", "engine", "models", "perf", "long"},
    "fp8": {"core", "engine", "numerics", "perf", "tritonlab"},
    "determinism": {"core", "engine", "tritonlab"},
    "checks": {"core", "engine"} | LESSONS,
    "course": {"core"},
    "board": {"core", "engine", "course", "checks", "labkit"} | LESSONS,  # "labkit": the face, to run notebook cells
}


def wing(module: str) -> str:
    """``labkit.core.measure`` -> ``core``; the face ``labkit`` -> ``labkit``."""
    return module.split(".")[1] if "." in module else module


def test_the_walk_sees_every_module():
    assert len(GRAPH) >= 50, f"the walk should reach every labkit module, in subpackages too: {len(GRAPH)}"


def test_labkit_imports_have_no_cycles():
    order, state = [], {}  # depth-first search; state: 1 = on the current path, 2 = done

    def visit(module: str, path: list[str]) -> None:
        if state.get(module) == 1:
            pytest.fail(f"import cycle: {' -> '.join(path[path.index(module):] + [module])}")
        if state.get(module) == 2:
            return
        state[module] = 1
        for dep in sorted(GRAPH.get(module, ())):
            visit(dep, path + [module])
        state[module] = 2
        order.append(module)

    for module in sorted(GRAPH):
        visit(module, [])


@pytest.mark.parametrize("path", FILES, ids=[module_name(p) or "labkit" for p in FILES])
def test_every_module_reads_in_one_sitting(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= 320, f"{path.relative_to(ROOT)} has {lines} lines: split it along a concept a reader looks for (<= 320)"


def test_labkit_holds_only_the_face_the_command_line_and_subpackages():
    top = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    loose = [n for n in top if n not in ("__init__.py", "__main__.py") and not (PACKAGE / n / "__init__.py").exists()]
    assert not loose, f"labkit/ should hold __init__.py, __main__.py and subpackages only: {loose}"
    assert {n for n in top if (PACKAGE / n).is_dir()} == set(ALLOWED), "every subpackage states its layer rule in ALLOWED"


def upward(module: str, imports: set[str]) -> list[str]:
    """The subpackages ``module`` imports that its own may not (``ALLOWED``)."""
    return sorted({wing(dep) for dep in imports} - {wing(module)} - ALLOWED[wing(module)])


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_each_subpackage_imports_only_the_layers_below_it(module):
    assert not upward(module, GRAPH[module]), (
        f"{module} imports {upward(module, GRAPH[module])}: {wing(module)}/ may import only {sorted(ALLOWED[wing(module)])}")


def test_only_the_command_line_imports_the_board():
    main = labkit_imports(PACKAGE / "__main__.py", KNOWN)
    assert any(wing(m) == "board" for m in main)
    face = labkit_imports(PACKAGE / "__init__.py", KNOWN)
    assert not [m for m in face if wing(m) == "board"], "the face must not import the board (the bundle leaves it out)"


def test_the_layer_rule_catches_an_upward_import():
    assert upward("labkit.flex.bench", {"labkit.course.reference", "labkit.core.measure"}) == ["course"]
    assert upward("labkit.core.env", {"labkit.engine.kernels"}) == ["engine"]
    assert upward("labkit.checks.nb06", {"labkit.board.nb06", "labkit.tritonlab.mode"}) == ["board"]


@pytest.mark.parametrize("path", FILES, ids=[module_name(p) or "labkit" for p in FILES])
def test_labkit_imports_are_absolute(path):
    """An import line names where its target lives, so it changes only when the target moves."""
    assert not relative_imports(path), f"{path.relative_to(ROOT)}: relative import at lines {relative_imports(path)}"


def test_the_import_reader_reads_every_form(tmp_path):
    (tmp_path / "labkit" / "core").mkdir(parents=True)
    known = {"labkit.core", "labkit.core.measure", "labkit.core.env", "labkit.engine.kernels"}
    a = tmp_path / "labkit" / "core" / "a.py"
    a.write_text("from labkit.core import measure, env\nimport labkit.engine.kernels\n"
                 "def f():\n    from labkit.core.measure import time_fn\n    from . import b\n")
    assert labkit_imports(a, known, tmp_path / "labkit") == {"labkit.core.measure", "labkit.core.env", "labkit.engine.kernels"}
    assert relative_imports(a) == [5]
    assert module_name(a, tmp_path / "labkit") == "labkit.core.a"


def solution_lines(notebook: Path, min_chars: int = 30) -> set[str]:
    """Code lines of ``min_chars`` or more inside ``### BEGIN SOLUTION`` blocks (comments excluded)."""
    lines = set()
    for cell in json.loads(notebook.read_text())["cells"]:
        for block in re.findall(r"### BEGIN SOLUTION(.*?)### END SOLUTION", "".join(cell["source"]), re.S):
            lines |= {s for s in map(str.strip, block.splitlines()) if len(s) >= min_chars and not s.startswith("#")}
    return lines


def test_no_solution_line_stands_in_labkit():
    labkit_text = "\n".join(p.read_text() for p in FILES)
    shared = sorted((nb.parent.name, line) for nb in (ROOT / "solutions").glob("*/*.ipynb")
                    for line in solution_lines(nb) if line in labkit_text)
    assert not shared, f"{len(shared)} solution line(s) a student can copy from labkit: {shared}"


def test_solution_lines_are_read_from_the_solution_blocks_only(tmp_path):
    cell = {"cell_type": "code", "source": ["x = 1\n", "### BEGIN SOLUTION\n", "    total = sum(values) / len(values) + offset\n",
                                            "    # a comment that is long enough to count if it were code\n",
                                            "### END SOLUTION\n", "outside = 'a line that is long enough to count'\n"]}
    (tmp_path / "nb.ipynb").write_text(json.dumps({"cells": [cell]}))
    assert solution_lines(tmp_path / "nb.ipynb") == {"total = sum(values) / len(values) + offset"}


def private_reaches(path: Path) -> list[str]:
    """``alias._name`` read in ``path`` where ``alias`` is a labkit module it imports (``from labkit.core import
    grading`` then ``grading._first_reached``): another module's private helper, which may move or vanish."""
    tree = ast.parse(path.read_text())
    aliases = {alias.asname or alias.name for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "labkit" and node.level == 0
               for alias in node.names}
    return [f"line {node.lineno}: {node.value.id}.{node.attr}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
            and node.attr.startswith("_") and not node.attr.startswith("__")]


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_reads_another_modules_private_helper(path):
    assert not private_reaches(path), (f"{path.relative_to(ROOT)} reads private helpers of other labkit modules "
                                       f"{private_reaches(path)}: make them public where they live (e.g. "
                                       f"labkit/core/codereach.py for the code-reading helpers)")


def test_no_two_test_files_share_a_name():
    """tests/ has no __init__.py files: pytest imports each test file by its base name, so two of one name in two
    folders stop the run of the second ("import file mismatch")."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test files of one name in several folders: {clashes}; name them after their module's face name"
