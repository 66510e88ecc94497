"""The course's own GPU run, shown where the reader's machine cannot measure: labelled, never passed off.

A cell that measures something only a GPU can (it calls :func:`lk.env.gpu_only <labkit.core.env.gpu_only>`
on other machines) ends its CPU branch with ``lk.reference.show("NN_slug", "cell-id")``: that shows
the outputs the same cell produced in the course's reference run (tables, printed numbers,
figures), under a heading that names the device, the date and the versions. A reader without a GPU
then sees the numbers the written questions ask about, and knows whose they are.

The reference run is made by one command on a GPU machine (``make reference``: ``make execute``,
then :func:`build` from the executed copies); it writes ``labkit/course/reference_runs/NN_slug.json``
(one per notebook): the run's facts and, for every code cell whose source calls ``gpu_only``, its
outputs (text, HTML tables, PNG figures).

Used in: notebooks 01-07 (GPU-only cells), the Makefile (``reference``), ``tests/labkit/course/test_reference.py``.
"""
from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

STORE = Path(__file__).with_name("reference_runs")
KEPT_MIME = ("text/html", "image/png", "text/plain")  # what a cell output keeps, richest first
GPU_ONLY_CALL = "gpu_only("
PROGRESS_LINE = re.compile(r"\[\d+:\d+(:\d+)?[<,]")   # a progress bar's "[00:12<00:30, ..." or "[00:00, ?it/s]"


def _run_facts() -> dict:
    """Device, date and versions of the machine that runs this (the reference GPU machine)."""
    from importlib import metadata

    import torch

    from labkit.core import env

    info = env.device_info()
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda or "-"}
    for package in ("transformers", "triton", "flash-attn-4"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    device = f"{info.name} (sm{info.sm}, {info.memory_gib:.0f} GiB)" if info.device == "cuda" else f"CPU ({info.name})"
    if info.device == "cuda" and torch.cuda.device_count() > 1:   # what a multi-GPU notebook (07) ran on
        device = f"{torch.cuda.device_count()}x {device}"
    return {"device": device, "date": datetime.date.today().isoformat(), "versions": versions}


def _kept_output(output: dict) -> dict | None:
    """A cell output reduced to what :func:`show` displays: stdout text, or one rich representation."""
    if output["output_type"] == "stream":
        if output["name"] != "stdout":
            return None
        text = "".join(line for line in "".join(output["text"]).splitlines(keepends=True)
                       if not PROGRESS_LINE.search(line))
        return {"text": text} if text.strip() else None
    data = output.get("data", {})
    for mime in KEPT_MIME:
        if mime in data:
            value = data[mime]
            return {mime: "".join(value) if isinstance(value, list) else value}
    return None


def build(executed: Path, out: Path = STORE) -> list[Path]:
    """Store the GPU-only cells' outputs of every executed notebook in ``executed`` (``make execute``'s folder).

    Run on the reference GPU machine right after the execution (the facts are read off this machine).
    Returns the files written, one per notebook.
    """
    import nbformat

    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("a reference run is a GPU run: run `make reference` on a machine with a CUDA GPU")
    facts = _run_facts()
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(Path(executed).glob("[0-9][0-9]_*.ipynb")):
        target = out / f"{path.stem}.json"
        cells = gpu_only_outputs(nbformat.read(path, as_version=4))
        target.write_text(json.dumps({"notebook": path.stem, **facts, "cells": cells}, ensure_ascii=False, indent=1),
                          encoding="utf-8")
        written.append(target)
    return written


def gpu_only_outputs(nb) -> dict[str, list[dict]]:
    """cell id -> kept outputs, for the executed code cells whose source calls ``gpu_only``."""
    cells = {}
    for cell in nb.cells:
        if cell.cell_type == "code" and GPU_ONLY_CALL in cell.source:
            kept = [k for k in (_kept_output(o) for o in cell.get("outputs", [])) if k]
            if kept:
                cells[cell.id] = kept
    return cells


def load(notebook: str) -> dict | None:
    """The stored reference run of ``notebook`` (its slug, e.g. "02_gpt2_integration"), or None."""
    path = STORE / f"{notebook}.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def heading(run: dict) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in run["versions"].items())
    return (f"📎 課程參考執行（course reference run），不是你的機器量到的：{run['device']}，{run['date']}；{versions}。"
            "這些數字來自課程作者在該 GPU 上執行同一個儲存格的結果。")


def show(notebook: str, cell_id: str) -> None:
    """Display what cell ``cell_id`` of ``notebook`` printed and drew in the course's reference GPU run."""
    run = load(notebook)
    outputs = None if run is None else run["cells"].get(cell_id)
    if not outputs:
        print(f"（這個儲存格還沒有收錄課程參考執行的結果（{notebook} / {cell_id}）：這一格的數字要在 CUDA GPU 上執行才看得到。）")
        return
    print(heading(run))
    if cell_id in run.get("notes", {}):   # what this run does not show, or how it ran
        print(f"⚠️ {run['notes'][cell_id]}")
    display_outputs(outputs)


def display_outputs(outputs: list[dict]) -> None:
    """Display outputs in the stored form (``{"text": ...}``, ``{"text/html": ...}``, ``{"image/png": base64}``,
    ``{"text/plain": ...}``): a stored cell's, or a report built in that form (notebook 10's sweep report), so
    that a GPU reader and the reference run show the same thing."""
    from IPython.display import HTML, Image, display

    for output in outputs:
        if "text" in output:
            print(output["text"], end="" if output["text"].endswith("\n") else "\n")
        elif "text/html" in output:
            display(HTML(output["text/html"]))
        elif "image/png" in output:
            import base64

            display(Image(data=base64.b64decode(output["image/png"])))
        else:
            print(output["text/plain"])
