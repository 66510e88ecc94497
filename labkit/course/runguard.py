"""A guard for executing the course notebooks: no network, no deprecation warnings.

Installed in a notebook's kernel before its first cell (``labkit.course`` does it through an
IPython startup file), it turns two silent problems into errors that name the culprit:

- a connection or DNS lookup to any host that is not this machine (the course must run offline:
  models are random-init, data ships with Python, Hugging Face runs with ``HF_HUB_OFFLINE=1``);
- a ``DeprecationWarning`` or ``FutureWarning`` attributed to torch, transformers, labkit or the
  notebook's own code (a deprecated call that works today breaks a later class). A warning raised
  while torch imports one of its own modules is torch calling its own deprecated API, which no reader
  can change (torch 2.11 on a GPU: ``torch.utils.mkldnn``, imported by inductor, decorates 14 methods
  with the deprecated ``torch.jit.script_method``): it passes.

In ``mode="raise"`` (tests) both raise :class:`RunGuardViolation`, a ``BaseException``: library
code that swallows ``Exception`` (for example a download retried "offline") cannot hide it. In
``mode="report"`` (long GPU runs, where one warning should not cost the rest of the notebook) each
violation prints a line starting with :data:`REPORT_PREFIX` to stderr; the warned call goes on and
a network call fails with ``ConnectionRefusedError``, as it would offline. Warnings raised inside
other packages (Jupyter's own machinery, say) pass through untouched.

Used in: ``labkit.course`` (``make test`` through nbgrader's autograde, ``make execute``).
"""
from __future__ import annotations

import ipaddress
import re
import socket
import sys
import warnings

# Whose warnings count: the file a warning is attributed to (after its stacklevel).
GUARDED_SOURCES = re.compile(r"[\\/](torch|transformers|labkit)[\\/]|[\\/]ipykernel_\d+[\\/]|<ipython-input|^<cell")
GUARDED_MODULES = r"(torch|transformers|labkit)(\.|$)|__main__$"  # warnings filter: by module name
TORCH_FILE = re.compile(r"[\\/]torch[\\/]")
PLUMBING_FILE = re.compile(r"^<frozen importlib|[\\/](_py_)?warnings\.py$|[\\/]importlib[\\/]")  # 3.14: _py_warnings
GUARDED_CATEGORIES = (DeprecationWarning, FutureWarning)
LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", ""}
MODES = ("raise", "report")
REPORT_PREFIX = "[run guard]"


class RunGuardViolation(BaseException):
    """A notebook reached the network or hit a deprecation warning from code the course controls."""


def is_local(host) -> bool:
    """True for loopback addresses, local host names and Unix-socket paths."""
    if not isinstance(host, (str, bytes)):
        return False
    name = host.decode() if isinstance(host, bytes) else host
    if name.startswith("/") or name.lower() in LOCAL_NAMES:
        return True
    try:
        return ipaddress.ip_address(name.split("%")[0]).is_loopback
    except ValueError:
        return False


def _host_of(address) -> object:
    return address[0] if isinstance(address, tuple) else address


def _violation(message: str, mode: str, fallback: type[Exception] | None) -> None:
    if mode == "raise":
        raise RunGuardViolation(message)
    import sys

    print(f"{REPORT_PREFIX} {message}", file=sys.stderr, flush=True)
    if fallback is not None:
        raise fallback(message)


def _guard_network(mode: str) -> None:
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    real_getaddrinfo = socket.getaddrinfo

    def check(host) -> None:
        if not is_local(host):
            _violation(f"network access attempted to {host!r}: the course must run offline "
                       "(set HF_HUB_OFFLINE=1; use random-init models and local data)", mode, ConnectionRefusedError)

    def checked(real_method):
        def method(sock, address):
            if sock.family != getattr(socket, "AF_UNIX", None):
                check(_host_of(address))
            return real_method(sock, address)
        return method

    def getaddrinfo(host, *args, **kwargs):
        check(host if host is not None else "localhost")
        return real_getaddrinfo(host, *args, **kwargs)

    socket.socket.connect, socket.socket.connect_ex = checked(real_connect), checked(real_connect_ex)
    socket.getaddrinfo = getaddrinfo


def raised_by_torch_importing_itself(frame) -> bool:
    """True when the warning whose stack starts at ``frame`` comes from the top-level code of a torch module
    that torch itself imports, with only torch, import and warnings frames in between: no reader's or
    labkit's call, and no import of a deprecated torch module by them."""
    while frame is not None:
        name = frame.f_code.co_filename
        if frame.f_code.co_name == "<module>" and TORCH_FILE.search(name):
            importer = frame.f_back
            while importer is not None and PLUMBING_FILE.search(importer.f_code.co_filename):
                importer = importer.f_back
            return importer is not None and bool(TORCH_FILE.search(importer.f_code.co_filename))
        if not (TORCH_FILE.search(name) or PLUMBING_FILE.search(name)):
            return False
        frame = frame.f_back
    return False


def _guard_warnings(mode: str) -> None:
    real_showwarning = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if (issubclass(category, GUARDED_CATEGORIES) and GUARDED_SOURCES.search(str(filename))
                and not raised_by_torch_importing_itself(sys._getframe(1))):
            _violation(f"{category.__name__} at {filename}:{lineno}: {message}", mode, None)
        return real_showwarning(message, category, filename, lineno, file, line)

    for category in GUARDED_CATEGORIES:
        warnings.filterwarnings("always", category=category, module=GUARDED_MODULES)
    warnings.showwarning = showwarning


def install(mode: str = "raise") -> None:
    """Guard this process in ``mode`` ("raise" or "report"): see the module docstring. Idempotent."""
    if mode not in MODES:
        raise ValueError(f"run guard mode {mode!r} is not one of {MODES}")
    if getattr(socket, "_labkit_guarded", False):
        return
    _guard_network(mode)
    _guard_warnings(mode)
    socket._labkit_guarded = True
