"""JupyterLab opens every student notebook in a real (headless) browser.

One ``jupyter lab`` server (127.0.0.1, random token, throw-away HOME / config / runtime dirs,
checkpoints outside the repo) and one headless Chromium, driven over the DevTools protocol, serve
all five notebooks. For each notebook the test waits until JupyterLab has drawn its cells, then
checks the DOM (cell count, the Chinese title) and a screenshot (not a blank page), and that the
notebook file and its folder are left as they were.

Skipped where no Chromium is installed (``.ci/run`` installs Debian's ``chromium``).
Chinese text needs a CJK font on the machine (Debian ``fonts-noto-cjk``) to show as characters
rather than boxes; look at the saved screenshots (paths are printed, ``pytest -s``) to check.
"""
from __future__ import annotations

import base64
import io
import itertools
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(ROOT.glob("notebooks/[0-9]*/[0-9]*.ipynb"))
CHROMIUM = next((p for p in ["/usr/bin/chromium", *map(shutil.which, ("chromium", "chromium-browser",
                                                                       "google-chrome"))]
                 if p and os.access(p, os.X_OK)), None)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium found (Debian: apt install chromium; .ci/run does it)"),
]
WIDTH, HEIGHT = 1400, 1000
READY_TIMEOUT = 90  # seconds for the server to answer, and for a notebook to render (2 busy CPU cores)

# JupyterLab user settings for the test server: no news pop-up over the notebook, every cell in the DOM,
# no autosave (the kernel's language_info marks an opened notebook dirty; saving would rewrite the file).
SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false"},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, method: str = "GET", timeout: float = 5):
    """The JSON an HTTP endpoint answers (None for an empty answer, text for a non-JSON one)."""
    with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=timeout) as r:
        body = r.read()
    try:
        return json.loads(body) if body else None
    except ValueError:  # e.g. DevTools' /json/close answers "Target is closing"
        return body.decode(errors="replace")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A running ``jupyter lab`` serving the repo root: yields (base URL, token, checkpoint dir)."""
    tmp = tmp_path_factory.mktemp("jupyterlab")
    dirs = {name: tmp / name for name in ("home", "config", "data", "runtime", "ipython", "checkpoints")}
    for d in dirs.values():
        d.mkdir()
    for name, value in SETTINGS.items():
        path = dirs["config"] / "lab" / "user-settings" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    # JupyterLab's own assets and kernelspecs are found under sys.prefix/share/jupyter as usual.
    env = dict(os.environ, HOME=str(dirs["home"]), JUPYTER_CONFIG_DIR=str(dirs["config"]),
               JUPYTER_DATA_DIR=str(dirs["data"]), JUPYTER_RUNTIME_DIR=str(dirs["runtime"]),
               IPYTHONDIR=str(dirs["ipython"]), JUPYTER_PLATFORM_DIRS="0")
    port, token = free_port(), secrets.token_hex(16)
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
           "--ip=127.0.0.1", f"--port={port}", "--ServerApp.port_retries=0",
           f"--ServerApp.token={token}", f"--ServerApp.root_dir={ROOT}",
           f"--FileCheckpoints.checkpoint_dir={dirs['checkpoints']}",  # absolute: no .ipynb_checkpoints in the repo
           "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           "--LabApp.extension_manager=readonly"]
    log = (tmp / "server.log").open("wb")
    proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            try:
                get_json(f"{base}/api/status?token={token}")
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"jupyter lab did not start; log:\n{(tmp / 'server.log').read_text()[-3000:]}")
                time.sleep(0.5)
        yield base, token, dirs["checkpoints"]
    finally:
        stop(proc)
        log.close()


class DevTools:
    """The few Chrome DevTools protocol calls the test needs, over one page's websocket."""

    def __init__(self, ws_url: str):
        import websocket  # websocket-client, a dependency of jupyter_server

        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self.ids = itertools.count(1)

    def __call__(self, method: str, **params):
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:  # skip events until our answer arrives
            msg = json.loads(self.ws.recv())
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def evaluate(self, expression: str):
        result = self("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    def close(self):
        self.ws.close()


@pytest.fixture(scope="module")
def chromium(tmp_path_factory):
    """A headless Chromium with a fresh profile: yields its DevTools HTTP endpoint."""
    profile = tmp_path_factory.mktemp("chromium-profile")
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", f"--user-data-dir={profile}", f"--window-size={WIDTH},{HEIGHT}",
           "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", "about:blank"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        port_file, deadline = profile / "DevToolsActivePort", time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{CHROMIUM} did not open its DevTools port (exit code {proc.poll()})")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port_file.read_text().split()[0]}"
    finally:
        stop(proc)


def notebook_title(nb: dict) -> str:
    """Text of the first markdown heading, e.g. 'Lab-1.5 · 01：環境設置與注意力機制對比（Setup and Comparison）'."""
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    raise AssertionError("the notebook has no markdown heading")


def blank_check(png: bytes) -> dict:
    """Numbers that tell a drawn page from a blank one."""
    from PIL import Image, ImageStat

    img = Image.open(io.BytesIO(png)).convert("RGB")
    colours = img.getcolors(maxcolors=img.width * img.height)
    background = max(colours)[0]
    return dict(size=img.size, colours=len(colours), non_background=1 - background / (img.width * img.height),
                std=sum(ImageStat.Stat(img.convert("L")).stddev))


# Count the open notebook's cells and read its text once JupyterLab has drawn it.
PROBE = """(() => {
  const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
  return {cells: nb ? nb.querySelectorAll('.jp-Cell').length : 0, text: nb ? nb.innerText : '',
          fonts: document.fonts.status, spinner: !!document.querySelector('#jupyterlab-splash')};
})()"""


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_renders_in_jupyterlab(path, lab, chromium, tmp_path):
    base, token, checkpoints = lab
    nb_bytes = path.read_bytes()
    nb = json.loads(nb_bytes)
    title, n_cells = notebook_title(nb), len(nb["cells"])
    folder_before = sorted(p.name for p in path.parent.iterdir())
    rel = path.relative_to(ROOT).as_posix()
    # A workspace per notebook, so tabs restored from an earlier notebook do not open too.
    url = f"{base}/lab/workspaces/test-{path.stem}/tree/{rel}?token={token}"

    target = get_json(f"{chromium}/json/new?about:blank", method="PUT")
    page = DevTools(target["webSocketDebuggerUrl"])
    try:
        page("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT, deviceScaleFactor=1, mobile=False)
        page("Page.enable")
        page("Page.navigate", url=url)
        deadline, state = time.monotonic() + READY_TIMEOUT, {}
        while time.monotonic() < deadline:
            state = page.evaluate(PROBE) or {}
            if state.get("cells", 0) >= n_cells and title in state.get("text", "") and state.get("fonts") == "loaded" \
                    and not state.get("spinner"):
                break
            time.sleep(0.5)
        time.sleep(1.0)  # let MathJax and the layout settle before the picture
        png = base64.b64decode(page("Page.captureScreenshot", format="png")["data"])
    finally:
        page.close()
        get_json(f"{chromium}/json/close/{target['id']}")

    shot = tmp_path / f"{path.stem}.png"
    shot.write_bytes(png)
    print(f"screenshot: {shot}")
    # Opening the notebook started a kernel: shut it down before the next notebook.
    for session in get_json(f"{base}/api/sessions?token={token}"):
        get_json(f"{base}/api/sessions/{session['id']}?token={token}", method="DELETE")

    assert state.get("cells") == n_cells, f"JupyterLab drew {state.get('cells')} of {n_cells} cells ({shot})"
    assert title in state["text"], f"title {title!r} not on the page ({shot})"
    stats = blank_check(png)
    assert stats["size"] == (WIDTH, HEIGHT), stats
    assert stats["colours"] > 100 and stats["non_background"] > 0.05 and stats["std"] > 20, \
        f"the screenshot looks blank: {stats} ({shot})"
    # Opening changed nothing in the repo: same notebook bytes, no checkpoint or other new file beside it.
    assert path.read_bytes() == nb_bytes, "opening the notebook modified it"
    assert sorted(p.name for p in path.parent.iterdir()) == folder_before
    assert any(checkpoints.rglob(f"{path.stem}-checkpoint.ipynb")), "checkpoint was not redirected out of the repo"
