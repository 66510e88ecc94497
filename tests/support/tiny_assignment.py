"""A tiny nbgrader assignment for the tests of nbgrader's machinery: a kernel runs it in about a second.

test_grading_robustness.py and test_nbgrader_term.py test what nbgrader and nbgrader_config.py do with
submissions (hidden tests restored and kept out of feedback, checksum warnings, timeouts, deleted, renamed,
late and tampered submissions, the exchange). They need the structure of a course notebook, not its content:
:func:`source_notebook` is an nbgrader source notebook (``solutions/<id>/<id>.ipynb``) with the course's
metadata (kernelspec, nbgrader schema 3), four autograded exercises in the standard library only (no torch,
no labkit import) and one manually graded written answer. Each test cell runs visible checks, then a
``### BEGIN HIDDEN TESTS`` block of distinctive lines, then prints the course's success line; a failed check
raises the course's ``AssertionError`` (``[check name] detail`` and a hint line): the setup cell defines
``_fail``, ``check_true`` and ``passed`` with their source read from labkit/core/grading.py.

The round trip of the real notebooks stays in test_notebooks.py.
"""
from __future__ import annotations

import ast

from nbgrader_course import ASSIGNMENTS, ROOT, load

ASSIGNMENT = "00_tiny_assignment"
EX1, EX2, EX3, EX4 = "ex1_attention", "ex2_score_matrix_bytes", "ex3_online_softmax", "ex4_logsumexp"
EXERCISES = (EX1, EX2, EX3, EX4)
WRITTEN = "q1_written_recompute"
# Exercise 1's default scale, and the classic bug that treats scale=0.0 as not given.
SCALE_RIGHT = "scale = len(q) ** -0.5 if scale is None else scale"
SCALE_BUG = "scale = scale or len(q) ** -0.5"
SCALE_CHECK = "attention: scale=0.0 is used (o = mean of v)"
SCALE_HINT = "只有 scale is None 時才用預設的 1/sqrt(d)：`scale = scale or ...` 會把 0.0 當成沒給。"
# An exercise 2 answer right for every struct format the visible checks try, wrong for the hidden ones.
BYTES_VISIBLE_ONLY = """def score_matrix_bytes(batch, heads, seq_len, fmt):
    sizes = {"f": 4, "d": 8, "e": 2, "b": 1}
    return batch * heads * seq_len ** 2 * sizes.get(fmt, 4)"""
BYTES_HIDDEN_CHECK = "score_matrix_bytes(2, 3, 100, 'h')"      # the first hidden case that answer fails

SETUP = '''import math
import struct


def check_list(actual, expected, *, name, hint=""):
    """actual equals the list of floats expected, to 1e-9 relative."""
    ok = len(actual) == len(expected) and all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
                                              for a, b in zip(actual, expected))
    check_true(ok, name=name, detail=f"應為 {expected}，卻得到 {actual}。", hint=hint)


def softmax(x):
    """Reference softmax of a short list of moderate floats."""
    e = [math.exp(v) for v in x]
    return [v / sum(e) for v in e]
'''

ANSWERS = {
    EX1: f'''def attention(q, keys, values, scale=None):
    """One query's attention: q [d], keys [Nk][d], values [Nk][dv] (lists of floats) -> o [dv]."""
    ### BEGIN SOLUTION
    {SCALE_RIGHT}
    scores = [scale * sum(a * b for a, b in zip(q, k)) for k in keys]      # [Nk]
    m = max(scores)
    weights = [math.exp(s - m) for s in scores]                             # every weight <= 1
    return [sum(w * v[j] for w, v in zip(weights, values)) / sum(weights) for j in range(len(values[0]))]
    ### END SOLUTION''',
    EX2: '''def score_matrix_bytes(batch, heads, seq_len, fmt):
    """Bytes of a [batch, heads, seq_len, seq_len] matrix of struct format ``fmt`` (e.g. "f": 4 bytes), an int."""
    ### BEGIN SOLUTION
    return batch * heads * seq_len ** 2 * struct.calcsize(fmt)
    ### END SOLUTION''',
    EX3: '''def online_softmax(x, block_size):
    """Softmax of x [N] (a list of floats), reading one block of <= block_size values at a time."""
    ### BEGIN SOLUTION
    m, total = float("-inf"), 0.0
    for start in range(0, len(x), block_size):
        block = x[start:start + block_size]
        m_new = max(m, *block)
        total = total * math.exp(m - m_new) + sum(math.exp(v - m_new) for v in block)
        m = m_new
    return [math.exp(v - m) / total for v in x]
    ### END SOLUTION''',
    EX4: '''def logsumexp(x):
    """log(sum(exp(x))) of x [N] (a list of floats), without overflow."""
    ### BEGIN SOLUTION
    m = max(x)
    return m + math.log(sum(math.exp(v - m) for v in x))
    ### END SOLUTION''',
}

TESTS = {
    EX1: f'''keys, values = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], [[1.0, 0.0], [3.0, 2.0], [5.0, 4.0]]
check_list(attention([1.0, 0.0], keys, values, scale=1.0),
           [sum(w * v[j] for w, v in zip(softmax([1.0, 0.0, 1.0]), values)) for j in range(2)],
           name="attention: three keys, scale=1")
check_list(attention([2.0, 2.0], keys, values, scale=0.0), [3.0, 2.0], name="{SCALE_CHECK}",
           hint="{SCALE_HINT}")
### BEGIN HIDDEN TESTS
check_list(attention([1000.0], [[1.0], [1.0]], [[2.0], [4.0]]), [3.0],
           name="attention: scores near 1e3", hint="先減去最大的分數再取 exp。")
d_half = [sum(w * v[0] for w, v in zip(softmax([0.0, 0.5 ** 0.5]), [[1.0], [0.0]]))]
check_list(attention([1.0, 0.0], [[0.0, 1.0], [1.0, 0.0]], [[1.0], [0.0]]), d_half,
           name="attention: default scale 1/sqrt(d)")
### END HIDDEN TESTS
passed("練習 1 attention")''',
    EX2: '''for fmt, size in (("f", 4), ("d", 8), ("e", 2), ("b", 1)):
    check_true(score_matrix_bytes(1, 1, 1024, fmt) == 1024 ** 2 * size,
               name=f"score_matrix_bytes(1, 1, 1024, {fmt!r})", detail=f"應為 {1024 ** 2 * size} bytes。",
               hint="用 struct.calcsize(fmt)。")
### BEGIN HIDDEN TESTS
for fmt, size in (("h", 2), ("q", 8), ("?", 1), ("B", 1)):
    check_true(score_matrix_bytes(2, 3, 100, fmt) == 2 * 3 * 100 * 100 * size,
               name=f"score_matrix_bytes(2, 3, 100, {fmt!r})", detail=f"應為 {2 * 3 * 100 * 100 * size} bytes。")
big_matrix = score_matrix_bytes(4, 32, 131072, "f")
check_true(type(big_matrix) is int and big_matrix == 4 * 32 * 131072 ** 2 * 4, name="score_matrix_bytes: 128K tokens",
           detail=f"應為 {4 * 32 * 131072 ** 2 * 4}（int），卻得到 {big_matrix!r}。")
### END HIDDEN TESTS
passed("練習 2 score_matrix_bytes")''',
    EX3: '''x = [0.5, -1.0, 2.0, 0.0, 1.5, -0.5, 3.0]
for block_size in (1, 3, 7, 10):
    check_list(online_softmax(x, block_size), softmax(x), name=f"online_softmax: block_size={block_size}")
### BEGIN HIDDEN TESTS
huge_values = [1e4, 1e4 - 1.0, 1e4 - 2.0, 1e4 - 3.0]
check_list(online_softmax(huge_values, 3), softmax([3.0, 2.0, 1.0, 0.0]), name="online_softmax: values ~1e4",
           hint="永遠減去目前的最大值再取 exp。")
### END HIDDEN TESTS
passed("練習 3 online_softmax")''',
    EX4: '''check_list([logsumexp([0.0, 1.0, 2.0])], [math.log(1.0 + math.e + math.e ** 2)],
           name="logsumexp: [0, 1, 2]")
### BEGIN HIDDEN TESTS
check_list([logsumexp([-1e4, -1e4])], [-1e4 + math.log(2.0)], name="logsumexp: values ~-1e4",
           hint="減去最大值：exp(-1e4) 在 float 中是 0。")
### END HIDDEN TESTS
passed("練習 4 logsumexp")''',
}

POINTS = {EX1: 2, EX2: 1, EX3: 2, EX4: 3}
WRITTEN_POINTS = 3


def _grading_source(*names: str) -> str:
    """The source of ``names`` (functions of labkit/core/grading.py), read without importing labkit (torch)."""
    path = ROOT / "labkit" / "core" / "grading.py"
    text = path.read_text(encoding="utf-8")
    found = {n.name: ast.get_source_segment(text, n) for n in ast.parse(text).body if isinstance(n, ast.FunctionDef)}
    missing = [n for n in names if n not in found]
    assert not missing, f"{path} no longer defines {missing}, which the tiny assignment's test cells call"
    return "\n\n\n".join(found[n] for n in names)


def _cell(cell_type: str, index: int, source: str, nbgrader: dict | None = None) -> dict:
    cell = {"cell_type": cell_type, "id": f"cell-{index:03d}", "metadata": {}, "source": source}
    if nbgrader is not None:
        cell["metadata"]["nbgrader"] = dict(nbgrader, schema_version=3, task=False)
    if cell_type == "code":
        cell.update(execution_count=None, outputs=[])
    return cell


def source_notebook() -> dict:
    """The tiny assignment's nbgrader source notebook (nbformat 4.5), with the course notebooks' metadata."""
    course = load(ROOT / "solutions" / ASSIGNMENTS[0] / f"{ASSIGNMENTS[0]}.ipynb")
    parts = [("markdown", "# 迷你作業（tiny assignment）\n\n四個練習與一題問答，只用 Python 標準函式庫。", None),
             ("code", f"{SETUP}\n\n{_grading_source('_fail', 'check_true', 'passed')}\n", None)]
    for number, grade_id in enumerate(EXERCISES, start=1):
        parts += [("markdown", f"## 練習 {number}", None),
                  ("code", ANSWERS[grade_id], dict(grade=False, grade_id=grade_id, locked=False, solution=True)),
                  ("code", TESTS[grade_id], dict(grade=True, grade_id=f"{grade_id}_tests", locked=True,
                                                 points=POINTS[grade_id], solution=False))]
    written = "### BEGIN SOLUTION\n重算只多花矩陣乘法的算力，省下讀寫 $O(N^2)$ 矩陣的記憶體頻寬。\n### END SOLUTION"
    parts += [("markdown", "## 問答\n\n為什麼 FlashAttention 在反向傳播時重算注意力矩陣，而不是存下來？", None),
              ("markdown", written, dict(grade=True, grade_id=WRITTEN, locked=False, points=WRITTEN_POINTS,
                                         solution=True))]
    cells = [_cell(kind, i, source, meta) for i, (kind, source, meta) in enumerate(parts)]
    return {"cells": cells, "metadata": course["metadata"], "nbformat": 4, "nbformat_minor": 5}
