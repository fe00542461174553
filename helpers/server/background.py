"""Start the server in the background from a notebook or a test, and stop it. (Lesson 07.)

    server = serve_in_background(max_batch_size=16)    # waits until /health answers
    lorax.Client(server.url).generate("Jack and Jill")
    server.stop()                                      # or: with serve_in_background() as url:

The server is a process of its own (no interpreter lock shared with the notebook, which times
what a real client would). Its stdin is a pipe from the notebook's kernel, so it ends with the
kernel; running the cell again replaces the server it started before under the same name.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from .options import DEFAULTS, command_line, describe
from .startup import STAGE

_RUNNING: dict[str, "BackgroundServer"] = {}
_LOCK = threading.Lock()
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]   # the folder that holds helpers/
# Our server is on this machine: never ask a proxy from the environment for it.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class BackgroundServer:
    """A server process started by ``serve_in_background``: ``url`` (``http://host:port``),
    ``wait()`` until it answers, ``stop()`` (safe twice), ``with server as url:``."""

    def __init__(self, name: str, process: subprocess.Popen, host: str, workdir: Path):
        self.name = name
        self.process = process
        self.host = host
        self.workdir = workdir
        self.log_path = workdir / "server.log"
        self.port: int | None = None
        self.url: str | None = None

    def _read_port(self) -> bool:
        port_file = self.workdir / "port"
        if self.port is None and port_file.exists():
            self.port = int(port_file.read_text())
            url_host = f"[{self.host}]" if ":" in self.host else self.host
            self.url = f"http://{url_host}:{self.port}"
        return self.port is not None

    def wait(self, timeout: float = 120.0) -> "BackgroundServer":
        """Wait until the server answers ``GET /health``; ``RuntimeError`` (with its last lines)
        if it exits or stays longer than ``timeout`` seconds at one stage of its start-up."""
        stage, since = self.stage(), time.monotonic()
        try:
            while self.process.poll() is None:
                if self._read_port() and self.healthy(timeout=1.0):
                    return self
                now, latest = time.monotonic(), self.stage()
                if latest != stage:
                    stage, since = latest, now
                elif now - since > timeout:
                    break
                time.sleep(0.1)
            reason = (f"it exited with code {self.process.returncode}"
                      if self.process.poll() is not None
                      else f"it stayed at '{stage}' for {timeout:g} s")
            raise RuntimeError(f"the server did not start: {reason}. Its last lines:\n"
                               f"{self.logs()}")
        except BaseException:
            self.stop(timeout=5)
            raise

    def stage(self) -> str:
        """What the server's start-up is doing now: its last "start-up:" line."""
        lines = [line.split(STAGE, 1)[1] for line in self._log_lines() if STAGE in line]
        return lines[-1].strip() if lines else "starting the process"

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def healthy(self, timeout: float = 2.0) -> bool:
        if self.url is None and not self._read_port():
            return False
        try:
            with _NO_PROXY.open(self.url + "/health", timeout=timeout) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def logs(self, lines: int = 40) -> str:
        """The last lines the server printed (until it is stopped)."""
        return "\n".join(self._log_lines()[-lines:])

    def _log_lines(self) -> list[str]:
        try:
            return self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []

    def stop(self, timeout: float = 10.0) -> None:
        """Close its stdin and ask it to end, then kill it if it lingers."""
        with _LOCK:
            if _RUNNING.get(self.name) is self:
                del _RUNNING[self.name]
        process = self.process
        running = process.poll() is None
        if process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()
        if running:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        shutil.rmtree(self.workdir, ignore_errors=True)     # its port file and log

    def __enter__(self) -> str:
        if self.url is None or not self.healthy():
            self.wait()
        return self.url

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        if self.process.poll() is not None:
            state = f"stopped (exit code {self.process.returncode})"
        else:
            state = "running" if self.url is not None else "starting"
        return f"BackgroundServer(name={self.name!r}, url={self.url!r}, pid={self.pid}, {state})"


def serve_in_background(model: str | None = None, adapters: str | os.PathLike | None = None, *,
                        env: dict | None = None, timeout: float = 120.0, name: str = "default",
                        wait: bool = True, **options) -> BackgroundServer:
    """Start ``python -m helpers.server`` in the background, wait for ``/health``, return it.
    (Lesson 07.)

    ``port`` None (the default here) picks a free port. env: extra environment variables.
    name: replaces the server started before under it. wait: False returns at once (call
    ``.wait()`` before ``.url``). ``ValueError`` for a wrong option, before starting anything;
    ``RuntimeError`` if the server does not come up (and it is stopped). The options:"""
    options = {"model": model, "adapters": adapters, **options}
    options["port"] = options.get("port") or 0
    host = options.get("host") or DEFAULTS["host"]
    if options["port"] and not port_is_free(host, options["port"]):
        print(f"Port {options['port']} is in use (another program, or a server started "
              f"earlier and still running): serving on a free port instead, see .url.")
        options["port"] = 0
    flags = command_line(options)           # checks every name and value first
    with _LOCK:
        previous = _RUNNING.pop(name, None)
    if previous is not None:
        previous.stop()

    workdir = Path(tempfile.mkdtemp(prefix="helpers-server-"))
    command = [sys.executable, "-m", "helpers.server", *flags,
               "--port-file", str(workdir / "port"), "--watch-stdin"]
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(
        [str(_PACKAGE_ROOT)] + ([child_env["PYTHONPATH"]] if child_env.get("PYTHONPATH") else []))
    child_env.setdefault("TOKENIZERS_PARALLELISM", "false")
    child_env.update({k: str(v) for k, v in (env or {}).items()})

    with open(workdir / "server.log", "wb") as log:
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=log,
                                   stderr=subprocess.STDOUT, env=child_env, cwd=str(workdir))
    server = BackgroundServer(name, process, host, workdir)
    with _LOCK:
        _RUNNING[name] = server
    if wait:
        server.wait(timeout)
    return server


# The options, from options.py's table (help() shows them all).
serve_in_background.__doc__ = serve_in_background.__doc__.rstrip() + "\n" + describe() + "\n"


def port_is_free(host: str, port: int) -> bool:
    """True when nothing listens on (host, port). (Lesson 07.)"""
    try:
        bind(host, port).close()
    except ValueError:
        return False
    return True


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``(host, port)`` before anything loads (a port in use costs no model
    load to find); ``ValueError`` naming the flag. Clients wait until ``listen``."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: a port is a number from 0 to 65535 (0: any free one)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    if os.name != "nt":     # a closed connection's TIME_WAIT must not hold the port
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # No Nagle delay: small replies (headers, then the body) must not wait for an ACK.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise ValueError(f"--port {port}: in use on {host} (by another program, or a server "
                             f"started earlier and still running); choose another port, or 0 "
                             f"for any free one") from None
        raise ValueError(f"--host {host}: cannot listen there "
                         f"({err.strerror or err}); 127.0.0.1 is this machine only") from None
    return sock


def stop_all() -> None:
    """Stop every server this process started (also run when the process exits)."""
    with _LOCK:
        servers = list(_RUNNING.values())
    for server in servers:
        server.stop()


atexit.register(stop_all)
