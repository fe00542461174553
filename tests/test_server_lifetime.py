"""Lesson 07's server never outlives the notebook that started it, and a port already taken is
no dead end. Each test runs a real Jupyter kernel, as a notebook does."""

import os
import signal
import socket
import time

import pytest
from jupyter_client.manager import start_new_kernel

from helpers.server.background import port_is_free

from .conftest import process_gone

START = ("from helpers import serve_in_background\n"
         "server = serve_in_background(threads=1, max_batch_size=2{port})\n"
         "print(server.pid, server.url.rsplit(':', 1)[1])")


def run(client, code: str) -> str:
    """Execute ``code`` in the kernel; what it printed (AssertionError if it failed)."""
    out = []

    def hook(message):
        if message["msg_type"] == "stream":
            out.append(message["content"]["text"])
        elif message["msg_type"] == "error":
            out.append("\n".join(message["content"]["traceback"]))

    reply = client.execute_interactive(code, timeout=180, output_hook=hook)
    assert reply["content"]["status"] == "ok", "".join(out)
    return "".join(out)


@pytest.fixture
def kernel():
    manager, client = start_new_kernel(kernel_name="python3", startup_timeout=90)
    yield manager, client
    client.stop_channels()
    if manager.is_alive():
        manager.shutdown_kernel(now=True)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc to see the server exit")
def test_killing_the_kernel_stops_its_server_and_frees_the_port(kernel):
    manager, client = kernel
    pid, port = map(int, run(client, START.format(port="")).split()[-2:])
    assert not port_is_free("127.0.0.1", port)
    os.kill(manager.provisioner.process.pid, signal.SIGKILL)     # the kernel dies at once
    assert process_gone(pid), "the server outlived its kernel"
    deadline = time.monotonic() + 10
    while not port_is_free("127.0.0.1", port) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert port_is_free("127.0.0.1", port)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc to see the server exit")
def test_restarting_the_kernel_stops_its_server(kernel):
    manager, client = kernel
    pid, _ = map(int, run(client, START.format(port="")).split()[-2:])
    manager.restart_kernel(now=True)
    assert process_gone(pid), "the server outlived the kernel's restart"


def test_a_port_in_use_gets_a_message_and_another_port(kernel):
    _, client = kernel
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        printed = run(client, START.format(port=f", port={port}"))
        served = int(printed.split()[-1])
        assert f"Port {port} is in use" in printed and "serving on a free port" in printed
        assert served != port
        run(client, "server.stop()")
