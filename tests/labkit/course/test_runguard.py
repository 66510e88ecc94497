"""Tests for labkit.course.runguard: no network, no deprecation warnings from the code the course controls.

The guard patches process-wide state (socket, warnings), so each check runs in a fresh interpreter. There the module
is loaded from its file, without labkit's package init, which imports torch and the rest of labkit (about 4 s a
process on CI's machine, most of what these tests took): runguard imports nothing from labkit.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from labkit.course import runguard
from labkit.course.runguard import is_local


def _guarded(code: str, mode: str = "raise") -> subprocess.CompletedProcess:
    program = ("import importlib.util\n"
               f"spec = importlib.util.spec_from_file_location('runguard', {runguard.__file__!r})\n"
               "g = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(g)\n"
               f"g.install({mode!r})\ng.install({mode!r})  # idempotent\n")
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


def _fake_torch(tmp_path):
    """tmp_path/torch/{deprecated_api, internal_user, deprecated_module}.py: a package whose files sit in a
    ``torch`` folder, as torch's do, importable as ``faketorch``."""
    pkg = tmp_path / "faketorch"
    (pkg / "torch").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "torch" / "__init__.py").write_text("")
    (pkg / "torch" / "deprecated_api.py").write_text(
        "import warnings\n\ndef old(fn):\n    warnings.warn('old is deprecated', DeprecationWarning)\n    return fn\n")
    (pkg / "torch" / "internal_user.py").write_text(
        "from faketorch.torch.deprecated_api import old\n\nclass Module:\n    @old\n    def forward(self):\n        pass\n")
    (pkg / "torch" / "importer.py").write_text("import faketorch.torch.internal_user\n")
    (pkg / "torch" / "deprecated_module.py").write_text(
        "import warnings\nwarnings.warn('this module is deprecated', DeprecationWarning)\n")
    return tmp_path


@pytest.mark.parametrize("code, reported", [
    ("import faketorch.torch.importer", False),            # torch importing its own module that uses its own old API
    ("import faketorch.torch.internal_user", True),        # the reader imports it: the warning is theirs to see
    ("import faketorch.torch.deprecated_module", True),    # the reader imports a deprecated module
    ("from faketorch.torch.deprecated_api import old\nold(print)", True),   # the reader calls the old API
])
def test_torch_calling_its_own_deprecated_api_at_import_passes(tmp_path, code, reported):
    root = _fake_torch(tmp_path)
    shown = "import warnings\nwarnings.filterwarnings('always', category=DeprecationWarning)\n"  # faketorch is no
    proc = _guarded(f"import sys\nsys.path.insert(0, {str(root)!r})\n{shown}{code}\nprint('went on')",  # guarded module
                    mode="report")
    assert proc.returncode == 0 and "went on" in proc.stdout, proc.stderr
    assert ("[run guard] DeprecationWarning" in proc.stderr) == reported, proc.stderr


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
    with pytest.raises(ValueError, match="'loud' is not one of"):
        runguard.install("loud")
