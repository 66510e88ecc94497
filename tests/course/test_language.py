"""Student-facing text stands alone and speaks Taiwan's Traditional Chinese, one term per concept.

Checked: the student notebooks (every cell), the solution notebooks (model answers and printed
strings are student-facing too: the instructor returns them as feedback), labkit's source (its
printed notices and test-cell messages), the stored reference run's outputs and the student bundle's README.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Words that refer to documents the student never had, or speak in the instructor's voice.
HISTORY = re.compile(r"原始講義|種子|舊教材|舊版的示範|Lab-1\.4|seed-style|the seed's|seed's reading|\bseed 0\d\d\b|超越同儕|本課程對解答核心設下的目標")
# Mainland terms -> the Taiwan term the course uses for the concept.
TERMS = {
    "啟用值": "活化值", "激活": "活化（activation）", "優化器": "最佳化器", "設置": "設定", "報錯": "拋出錯誤", "丟出": "拋出", "線程": "執行緒", "默認": "預設",
    "軟件": "軟體", "硬件": "硬體", "網絡": "網路", "調用": "呼叫", "變量": "變數", "內存": "記憶體", "緩存": "快取",
    "接口": "介面", "代碼": "程式碼", "數據": "資料", "(?<!演)算法": "演算法", "位移": "偏移量", "程序": "行程（process）或程式",
    "重量": "權重", "信息": "資訊", "打印": "印出", "模塊": "模組", "進程": "行程", "字節": "位元組", "帶寬": "頻寬",
    "顯存": "GPU 記憶體", "程式碼儲存格": "程式儲存格",
}
MAINLAND = re.compile("|".join(TERMS))


def student_facing_files():
    yield from sorted(ROOT.glob("notebooks/*/*.ipynb"))
    yield from sorted(ROOT.glob("solutions/*/*.ipynb"))
    yield from sorted(p for p in ROOT.glob("labkit/**/*.py") if "__pycache__" not in p.parts)
    yield from sorted(ROOT.glob("labkit/**/reference_runs/*.json"))
    yield ROOT / "labkit" / "course" / "student" / "README.md"   # the student bundle's README


FILES = list(student_facing_files())


def hits(pattern: re.Pattern, text: str) -> list[str]:
    return sorted({text[max(0, m.start() - 12):m.end() + 12].replace("\n", " ") for m in pattern.finditer(text)})


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_no_reference_to_documents_the_student_never_saw(path):
    found = hits(HISTORY, path.read_text(encoding="utf-8"))
    assert not found, f"{path.relative_to(ROOT)}: {found}"


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_taiwan_terms(path):
    found = hits(MAINLAND, path.read_text(encoding="utf-8"))
    assert not found, f"{path.relative_to(ROOT)}: {found}; Taiwan usage: " + ", ".join(f"{k}→{v}" for k, v in TERMS.items())


def test_the_checks_catch_what_they_are_for():
    assert hits(HISTORY, "如原始講義所說") and hits(MAINLAND, "優化器狀態") and hits(MAINLAND, "一個程序")
    assert not hits(MAINLAND, "演算法與最佳化器的狀態") and not hits(HISTORY, "torch.manual_seed(0)")


def _estimate(text: str) -> tuple[float, float, str] | None:
    m = re.search(r"([\d.]+)\s*[–-]\s*([\d.]+)\s*(分鐘|小時|min|h)\b", text)
    return None if m is None else (float(m[1]), float(m[2]), {"分鐘": "min", "小時": "h"}.get(m[3], m[3]))


def test_time_estimates_agree_between_readme_and_each_notebook():
    import json

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for path in sorted(ROOT.glob("solutions/*/*.ipynb")):
        row = re.search(rf"^\| `{path.stem}` \| ([^|]+) \|", readme, re.M)
        assert row, f"README's notebook table has no row for {path.stem}"
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        stated = next(("".join(c["source"]) for c in cells[:3] if "預估時間" in "".join(c["source"])), "")
        line = next(ln for ln in stated.splitlines() if "預估時間" in ln) if stated else ""
        assert line, f"{path.stem}: no 預估時間 line in its first cells"
        assert _estimate(line) == _estimate(row[1]), f"{path.stem}: notebook says {line!r}, README {row[1].strip()!r}"


# English terms a reader meets in the prose: at the first use in each notebook, a Chinese gloss stands
# beside it, either "中文（term）" (the term, maybe after other words, inside parentheses after Chinese)
# or "term（中文）". Inline code (`...`) is not prose and is skipped.
GLOSSED = ("wheel", "JIT", "CuTe DSL", "TMA", "warp", "SM", "CUTLASS", "local memory", "CUDA events", "rank",
           "NCCL", "FSDP", "all-reduce", "CUDA graph", "eager", "token", "head", "logit", "constexpr", "profile", "LSE",
           "rescale", "forward hook", "tokenizer")
_CJK = "\u4e00-\u9fff"
_BEFORE = re.compile(rf"[{_CJK}]\s*[（(][^（()）\n]{{0,60}}$")
_AFTER = re.compile(rf"^s?\s*[（(]\s*[{_CJK}]")


def prose(path: Path) -> str:
    """The markdown cells of a notebook."""
    import json

    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def unglossed(text: str) -> list[str]:
    """Terms of GLOSSED whose first use in ``text`` (inline code blanked out) has no Chinese gloss beside it."""
    text = re.sub(r"`[^`\n]*`", lambda m: " " * len(m[0]), text)
    missing = []
    for term in GLOSSED:
        m = re.search(rf"(?<![A-Za-z_-]){re.escape(term)}(?=s?(?![A-Za-z_-]))", text)
        if m and not (_BEFORE.search(text[max(0, m.start() - 80):m.start()]) or _AFTER.match(text[m.end():])):
            missing.append(f"{term}: …{text[max(0, m.start() - 20):m.end() + 20]}…".replace("\n", " "))
    return missing


SOLUTIONS = sorted(ROOT.glob("solutions/*/*.ipynb"))


@pytest.mark.parametrize("path", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_english_terms_are_glossed_at_first_use(path):
    found = unglossed(prose(path))
    assert not found, f"{path.stem}: gloss these at their first use in the notebook: {found}"


def test_the_gloss_check_catches_what_it_is_for():
    assert unglossed("用 CUDA graph 重播") and unglossed("每個 warp 有 32 條執行緒")
    assert not unglossed("CUDA 圖（CUDA graph）重播；之後的 CUDA graph 不必再註解")
    assert not unglossed("token（詞元）") and not unglossed("集合通訊（NCCL、all-reduce）")
    assert not unglossed("`warp` 只是程式碼")
    assert unglossed("每個 head 一個匯點") and not unglossed("每個 head（注意力頭）一個匯點")
    assert not unglossed("之字形的 head-tail 切分")   # a compound is another word, not the glossed term
