"""Every notebook carries the kernel metadata JupyterLab writes, so opening one changes nothing.

When the ``python3`` kernel starts, JupyterLab stores in the notebook's top-level metadata the
kernelspec it opened (name, display name, language) and the kernel's ``language_info`` (from
ipykernel's ``kernel_info`` reply). Where the file holds less, opening the notebook marks it
modified and autosave rewrites it. ``tests/course/test_browser.py`` checks the same in a real JupyterLab.

The one field no file can match for every reader is ``language_info.version``: the kernel reports
its own Python's (3.11.7 here, something else on another machine), and a reader whose Python
differs sees the notebook marked modified (that one line) whatever the file holds. The notebooks
carry one version, the same in all of them, from the Python series environment.yml installs.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = [p for tree in ("solutions", "notebooks") for p in sorted(ROOT.glob(f"{tree}/[0-9]*/[0-9]*.ipynb"))]


def kernel_metadata() -> dict:
    """The top-level metadata JupyterLab writes for this environment's ``python3`` kernel."""
    from ipykernel.ipkernel import IPythonKernel
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("python3")
    return {"kernelspec": {"display_name": spec.display_name, "language": spec.language, "name": "python3"},
            "language_info": dict(IPythonKernel.language_info)}


def metadata(path: Path) -> dict:
    nb = json.loads(path.read_text(encoding="utf-8"))
    return {"format": (nb["nbformat"], nb["nbformat_minor"]), **nb["metadata"]}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.relative_to(ROOT).parts[0] + "/" + p.stem for p in NOTEBOOKS])
def test_notebook_has_the_kernel_metadata_jupyterlab_writes(path):
    meta, expected = metadata(path), kernel_metadata()
    assert meta["format"] == (4, 5), "nbformat 4.5, what JupyterLab 4 writes"
    assert meta.get("kernelspec") == expected["kernelspec"]
    language_info = dict(meta.get("language_info", {}))
    assert "version" in language_info, "language_info needs the kernel's Python version"
    language_info["version"] = expected["language_info"]["version"]  # may differ: see the module docstring
    assert language_info == expected["language_info"], \
        "incomplete language_info: JupyterLab would rewrite it on opening (give the full kernel_info values)"


def test_notebooks_share_one_python_version_from_environment_yml():
    series = re.search(r"^\s*-\s*python\s*=\s*([\d.]+)\s*$", (ROOT / "environment.yml").read_text(), re.M).group(1)
    versions = {metadata(p).get("language_info", {}).get("version") for p in NOTEBOOKS}
    assert len(versions) == 1, f"one language_info.version for every notebook, not {versions}"
    version = versions.pop()
    assert re.fullmatch(re.escape(series) + r"\.\d+", version or ""), \
        f"language_info.version {version!r} is not a Python {series}.x release (environment.yml)"
