"""labkit's structure: layers without import cycles, and no exercise answer a student could copy.

Imports are read from the source (module level and inside functions alike: a lazy import is
still a dependency). labkit ships in the student bundle, so no line of a solution block of
solutions/ may stand verbatim in it.
"""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "labkit"
FLOOR = ("measure", "env", "kernels")  # import no other labkit module


def labkit_imports(path: Path) -> set[str]:
    """The labkit modules ``path`` imports (``from . import x``, ``from .x import y``, ``import labkit.x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("labkit."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("labkit.")}
    return found - {path.stem}


GRAPH = {p.stem: labkit_imports(p) for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__")}


def test_labkit_imports_have_no_cycles():
    order, state = [], {}  # depth-first search; state: 1 = on the current path, 2 = done

    def visit(module: str, path: list[str]) -> None:
        if state.get(module) == 1:
            pytest.fail(f"import cycle: {' -> '.join(path[path.index(module):] + [module])}")
        if state.get(module) == 2:
            return
        state[module] = 1
        for dep in sorted(GRAPH[module]):
            visit(dep, path + [module])
        state[module] = 2
        order.append(module)

    for module in sorted(GRAPH):
        visit(module, [])
    assert order.index("measure") < order.index("attention") < order.index("bench")


@pytest.mark.parametrize("module", FLOOR)
def test_the_bottom_floor_imports_no_other_labkit_module(module):
    assert GRAPH[module] == set(), f"labkit.{module} imports {sorted(GRAPH[module])}"


def test_the_cycle_finder_finds_a_cycle(tmp_path):
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from .a import g\n")
    assert labkit_imports(tmp_path / "a.py") == {"b"} and labkit_imports(tmp_path / "b.py") == {"a"}


def solution_lines(notebook: Path, min_chars: int = 30) -> set[str]:
    """Code lines of ``min_chars`` or more inside ``### BEGIN SOLUTION`` blocks (comments excluded)."""
    lines = set()
    for cell in json.loads(notebook.read_text())["cells"]:
        for block in re.findall(r"### BEGIN SOLUTION(.*?)### END SOLUTION", "".join(cell["source"]), re.S):
            lines |= {s for s in map(str.strip, block.splitlines()) if len(s) >= min_chars and not s.startswith("#")}
    return lines


def test_no_solution_line_stands_in_labkit():
    labkit_text = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    shared = sorted((nb.parent.name, line) for nb in (ROOT / "solutions").glob("*/*.ipynb")
                    for line in solution_lines(nb) if line in labkit_text)
    assert not shared, f"{len(shared)} solution line(s) a student can copy from labkit: {shared}"


def test_solution_lines_are_read_from_the_solution_blocks_only(tmp_path):
    cell = {"cell_type": "code", "source": ["x = 1\n", "### BEGIN SOLUTION\n", "    total = sum(values) / len(values) + offset\n",
                                            "    # a comment that is long enough to count if it were code\n",
                                            "### END SOLUTION\n", "outside = 'a line that is long enough to count'\n"]}
    (tmp_path / "nb.ipynb").write_text(json.dumps({"cells": [cell]}))
    assert solution_lines(tmp_path / "nb.ipynb") == {"total = sum(values) / len(values) + offset"}
