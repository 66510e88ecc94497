"""Tests for labkit.runguard: no network, no deprecation warnings from the code the course controls.

The guard patches process-wide state (socket, warnings), so each check runs in a fresh interpreter.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from labkit.runguard import is_local


def _guarded(code: str, mode: str = "raise") -> subprocess.CompletedProcess:
    program = f"import labkit.runguard as g\ng.install({mode!r})\ng.install({mode!r})  # idempotent\n"
    program += textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "/tmp/kernel.sock", b"127.0.0.2"])
def test_local_hosts(host):
    assert is_local(host)


@pytest.mark.parametrize("host", ["huggingface.co", "8.8.8.8", "2001:4860:4860::8888", None, ("h", 1)])
def test_remote_hosts(host):
    assert not is_local(host)


@pytest.mark.parametrize("call", [
    "socket.create_connection(('huggingface.co', 443), timeout=1)",
    "socket.getaddrinfo('pypi.org', 443)",
    "socket.socket().connect(('10.1.2.3', 80))",
    "socket.socket().connect_ex(('10.1.2.3', 80))",
])
def test_network_access_raises_even_through_except_exception(call):
    proc = _guarded(f"""
        import socket
        try:
            {call}
        except Exception as err:  # library code that swallows errors must not hide the attempt
            print("swallowed", type(err).__name__)
    """)
    assert proc.returncode != 0 and "swallowed" not in proc.stdout
    assert "RunGuardViolation: network access attempted" in proc.stderr


def test_loopback_still_works():
    proc = _guarded("""
        import socket
        server = socket.socket(); server.bind(("127.0.0.1", 0)); server.listen()
        client = socket.create_connection(server.getsockname(), timeout=5)
        print("connected", socket.getaddrinfo("localhost", 80)[0][4][0])
    """)
    assert proc.returncode == 0, proc.stderr
    assert "connected" in proc.stdout


@pytest.mark.parametrize("category", ["DeprecationWarning", "FutureWarning"])
@pytest.mark.parametrize("module, filename", [
    ("labkit.fake", "/site-packages/labkit/fake.py"), ("torch.fake", "/site-packages/torch/fake.py"),
    ("transformers.fake", "/site-packages/transformers/fake.py"),
    ("__main__", "/tmp/ipykernel_4242/1234.py"),  # a notebook cell, as ipykernel names it
])
def test_guarded_warnings_raise(category, module, filename):
    proc = _guarded(f"""
        import warnings
        warnings.warn_explicit("old API", {category}, "{filename}", 3, module="{module}")
    """)
    assert proc.returncode != 0 and f"RunGuardViolation: {category}" in proc.stderr and "old API" in proc.stderr


def test_other_warnings_pass_through():
    proc = _guarded("""
        import warnings
        warnings.warn_explicit("theirs", DeprecationWarning, "/site-packages/jupyter_client/x.py", 1,
                               module="jupyter_client.x")
        warnings.warn_explicit("a user warning", UserWarning, "/site-packages/labkit/x.py", 1, module="labkit.x")
        with warnings.catch_warnings(record=True) as caught:  # a notebook may still study a warning on purpose
            warnings.simplefilter("always")
            warnings.warn("studied", FutureWarning)
        print("recorded", len(caught))
    """)
    assert proc.returncode == 0, proc.stderr
    assert "recorded 1" in proc.stdout and "a user warning" in proc.stderr


def test_report_mode_prints_and_goes_on():
    proc = _guarded("""
        import socket, warnings
        warnings.warn_explicit("old API", FutureWarning, "/site-packages/torch/x.py", 1, module="torch.x")
        try:
            socket.create_connection(("huggingface.co", 443), timeout=1)
        except ConnectionRefusedError as err:
            print("offline-like", err)
    """, mode="report")
    assert proc.returncode == 0, proc.stderr
    assert "offline-like network access attempted to 'huggingface.co'" in proc.stdout
    reports = [line for line in proc.stderr.splitlines() if line.startswith("[run guard]")]
    assert len(reports) == 2 and "FutureWarning" in reports[0] and "huggingface.co" in reports[1]


def test_unknown_mode_is_named():
    from labkit import runguard

    with pytest.raises(ValueError, match="'loud' is not one of"):
        runguard.install("loud")
