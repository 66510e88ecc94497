"""A Jupyter server on a throw-away course copy and a headless Chromium driven over the DevTools protocol.

Used by tests/course/test_browser.py (JupyterLab opens every student notebook) and
tests/course/test_formgrader.py (nbgrader's formgrader). The server gets fresh HOME / config / data /
runtime / IPython dirs, 127.0.0.1, a free port and a random token; Chromium a fresh profile. The
:func:`chromium` fixture skips where no Chromium is installed (``.ci/run`` installs Debian's ``chromium``);
import it into the test module that uses it.
"""
from __future__ import annotations

import base64
import contextlib
import io
import itertools
import json
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

CHROMIUM = next((p for p in ["/usr/bin/chromium", *map(shutil.which, ("chromium", "chromium-browser",
                                                                       "google-chrome"))]
                 if p and os.access(p, os.X_OK)), None)
WIDTH, HEIGHT = 1400, 1000
READY_TIMEOUT = 90  # seconds for the server to answer, and for a page to render (2 busy CPU cores)


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


def throwaway_jupyter_dirs(tmp: Path, settings: dict[str, dict] | None = None) -> dict[str, Path]:
    """Fresh HOME / config / data / runtime / IPython / checkpoint dirs under ``tmp``.

    ``settings`` maps a JupyterLab user-settings file name to its content (written under config/lab/user-settings).
    """
    dirs = {name: tmp / name for name in ("home", "config", "data", "runtime", "ipython", "checkpoints")}
    for d in dirs.values():
        d.mkdir()
    for name, value in (settings or {}).items():
        path = dirs["config"] / "lab" / "user-settings" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    return dirs


@contextlib.contextmanager
def jupyter_server(cmd: list[str], cwd: Path, dirs: dict[str, Path], log: Path) -> Iterator[tuple[str, str]]:
    """Run ``cmd`` (a Jupyter server command) in ``cwd`` with :func:`throwaway_jupyter_dirs`' ``dirs``.

    Adds 127.0.0.1, a free port and a random token; yields (base URL, token) once ``/api/status`` answers.
    The server's own assets, kernelspecs and sys-prefix server extensions are found under sys.prefix as usual.
    """
    env = dict(os.environ, HOME=str(dirs["home"]), JUPYTER_CONFIG_DIR=str(dirs["config"]),
               JUPYTER_DATA_DIR=str(dirs["data"]), JUPYTER_RUNTIME_DIR=str(dirs["runtime"]),
               IPYTHONDIR=str(dirs["ipython"]), JUPYTER_PLATFORM_DIRS="0")
    port, token = free_port(), secrets.token_hex(16)
    cmd = [*cmd, "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--ServerApp.port_retries=0",
           f"--ServerApp.token={token}"]
    base = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + READY_TIMEOUT
            while True:
                try:
                    get_json(f"{base}/api/status?token={token}")
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        pytest.fail(f"`{shlex.join(cmd)}` did not start a server; log:\n{log.read_text()[-3000:]}")
                    time.sleep(0.5)
            yield base, token
        finally:
            stop(proc)


class DevTools:
    """The few Chrome DevTools protocol calls the tests need, over one page's websocket."""

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

    def screenshot(self) -> bytes:
        """The viewport as PNG bytes."""
        return base64.b64decode(self("Page.captureScreenshot", format="png")["data"])

    def wait_for(self, probe: str, done: Callable[[dict], bool]) -> dict:
        """Evaluate ``probe`` (a JS expression giving an object) until ``done`` accepts it or
        :data:`READY_TIMEOUT` passes; the last value."""
        deadline, state = time.monotonic() + READY_TIMEOUT, {}
        while time.monotonic() < deadline:
            state = self.evaluate(probe) or {}
            if done(state):
                break
            time.sleep(0.5)
        return state

    def close(self):
        self.ws.close()


@pytest.fixture(scope="module")
def chromium(tmp_path_factory):
    """A headless Chromium with a fresh profile: yields its DevTools HTTP endpoint."""
    if CHROMIUM is None:
        pytest.skip("no Chromium found (Debian: apt install chromium; .ci/run does it)")
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


@contextlib.contextmanager
def open_page(chromium: str, url: str) -> Iterator[DevTools]:
    """A new Chromium tab (WIDTH x HEIGHT) navigated to ``url``; closed afterwards."""
    target = get_json(f"{chromium}/json/new?about:blank", method="PUT")
    page = DevTools(target["webSocketDebuggerUrl"])
    try:
        page("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT, deviceScaleFactor=1, mobile=False)
        page("Page.enable")
        page("Page.navigate", url=url)
        yield page
    finally:
        page.close()
        get_json(f"{chromium}/json/close/{target['id']}")


def blank_check(png: bytes) -> dict:
    """Numbers that tell a drawn page from a blank one."""
    from PIL import Image, ImageStat

    img = Image.open(io.BytesIO(png)).convert("RGB")
    colours = img.getcolors(maxcolors=img.width * img.height)
    background = max(colours)[0]
    return dict(size=img.size, colours=len(colours), non_background=1 - background / (img.width * img.height),
                std=sum(ImageStat.Stat(img.convert("L")).stddev))


def assert_drawn(png: bytes, shot: Path) -> None:
    """The screenshot (saved at ``shot``) is a drawn page of WIDTH x HEIGHT, not a blank one."""
    stats = blank_check(png)
    assert stats["size"] == (WIDTH, HEIGHT), stats
    assert stats["colours"] > 100 and stats["non_background"] > 0.05 and stats["std"] > 20, \
        f"the screenshot looks blank: {stats} ({shot})"
