"""The server as an operator runs it (``python -m helpers.server`` under systemd, in
``docker stop``, at a terminal): a signal stops it cleanly, and a flag it cannot serve is
refused before anything loads. Each test runs real server processes and sends real signals."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.skipif(os.name != "posix", reason="sends POSIX signals")

ROOT = Path(__file__).resolve().parents[1]
#: A server that starts fast: the contiguous cache, nothing compiled.
FAST = ["--threads", "1", "--kv-cache", "contiguous", "--compile", "off", "--max-batch-size", "8"]


def start(tmp_path, *flags) -> tuple[subprocess.Popen, str]:
    """``python -m helpers.server`` in a process group of its own, once it answers /health."""
    port_file = tmp_path / "port"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    process = subprocess.Popen([sys.executable, "-m", "helpers.server", "--port", "0",
                                "--port-file", str(port_file), *FAST, *flags],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=env, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and process.poll() is None:
        if port_file.exists():
            url = f"http://127.0.0.1:{port_file.read_text()}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return process, url
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    process.kill()
    raise AssertionError(f"the server did not start:\n{process.communicate()[0]}")


def group_is_empty(group: int, timeout: float = 15.0) -> bool:
    """True once no process of the group is left (the server's engine process included)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def stream(url: str, out: list, first: threading.Event, tokens: int = 250) -> None:
    """One /generate_stream request; every event it got goes to ``out`` (the last one tells
    how the stream ended)."""
    body = {"inputs": "Jack and Jill", "parameters": {"max_new_tokens": tokens,
                                                      "ignore_eos_token": True}}
    try:
        with httpx.stream("POST", url + "/generate_stream", json=body, timeout=60) as reply:
            for line in reply.iter_lines():
                if line.startswith("data:"):
                    out.append(json.loads(line[5:]))
                    first.set()
    except httpx.HTTPError as err:
        out.append({"cut": repr(err)})
    first.set()


def last_event(events: list) -> str:
    """How a stream ended: "finished", "error: ..." or "cut" (no last event at all)."""
    last = events[-1] if events else {}
    if last.get("details") is not None:
        return "finished"
    if "error" in last:
        return f"error: {last['error']}"
    return "cut"


def streams(url: str, count: int, tokens: int = 250):
    """``count`` streams running (each has its first token), and their events."""
    outs, threads = [[] for _ in range(count)], []
    for out in outs:
        first = threading.Event()
        thread = threading.Thread(target=stream, args=(url, out, first, tokens), daemon=True)
        thread.start()
        threads.append((thread, first))
    for _, first in threads:
        assert first.wait(120)
    return outs, [thread for thread, _ in threads]


@pytest.mark.parametrize("how", ["SIGTERM to the server", "SIGTERM to the group",
                                 "Ctrl-C (SIGINT to the group)"])
def test_a_signal_ends_every_stream_with_a_last_event_and_exits_0(tmp_path, how):
    """No drain time: every stream running gets an error event that says the server is
    stopping, a request waiting for its whole answer gets a 503, the server exits with status
    0, no traceback, no restart of the engine, and no process of its group is left."""
    process, url = start(tmp_path, "--drain-seconds", "0")
    outs, threads = streams(url, 4)
    whole = []
    body = {"inputs": "Jack", "parameters": {"max_new_tokens": 250, "ignore_eos_token": True}}
    threads.append(threading.Thread(target=lambda: whole.append(
        httpx.post(url + "/generate", json=body, timeout=60)), daemon=True))
    threads[-1].start()
    while "helpers_server_running 5\n" not in httpx.get(url + "/metrics", timeout=10).text:
        time.sleep(0.05)
    sig = signal.SIGINT if "SIGINT" in how else signal.SIGTERM
    if "group" in how:
        os.killpg(process.pid, sig)
    else:
        process.send_signal(sig)
    output, _ = process.communicate(timeout=60)
    for thread in threads:
        thread.join(30)
    assert process.returncode == 0, output
    assert [last_event(out) for out in outs] == ["error: the server is shutting down"] * 4
    assert whole[0].status_code == 503 and "shutting down" in whole[0].json()["error"]
    assert "Traceback" not in output and "restart" not in output, output
    assert group_is_empty(process.pid)


def test_while_draining_new_requests_get_503_and_running_ones_finish(tmp_path):
    """With a drain time, the streams that finish within it finish; a request that comes
    meanwhile is refused with a 503 in JSON, and so is /health. (With the engine in a thread
    of the server, which says when it is ready as the engine process does.)"""
    process, url = start(tmp_path, "--drain-seconds", "60", "--engine", "thread")
    outs, threads = streams(url, 2, tokens=40)
    process.send_signal(signal.SIGTERM)
    refused = httpx.post(url + "/generate", json={"inputs": "Jack", "parameters": {}},
                         timeout=30)
    health = httpx.get(url + "/health", timeout=30)
    output, _ = process.communicate(timeout=90)
    for thread in threads:
        thread.join(30)
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]
    assert health.status_code == 503
    assert [last_event(out) for out in outs] == ["finished"] * 2
    assert process.returncode == 0 and "Traceback" not in output, output
    assert "start-up: the engine is ready" in output
    assert group_is_empty(process.pid)


# --- flags refused before anything loads ------------------------------------------------------

def refusal(*flags) -> str:
    """Run the server with ``flags``: it must exit with status 2, saying one ``error:`` line,
    before the model loads, and leave no process behind; that line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if "--port" not in flags:            # not the default 8080, which anything may hold
        flags = (*flags, "--port", "0")
    process = subprocess.Popen([sys.executable, "-m", "helpers.server", *flags], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=120)
    finally:                             # a server that did not refuse: nothing left behind
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 2, stderr
    assert "loading the model" not in stderr and "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, stderr
    assert group_is_empty(process.pid)
    return errors[0]


@pytest.mark.parametrize("flags, words", [
    (["--device", "meta"], "--device meta"),
    (["--device", "mps"], "--device mps"),
    (["--threads", "100000"], "--threads 100000"),
    (["--port", "70000"], "--port 70000"),
    (["--host", "999.1.1.1"], "--host 999.1.1.1"),
])
def test_a_flag_the_server_cannot_serve_is_refused_by_name(flags, words):
    if flags == ["--device", "mps"]:
        import torch

        if torch.backends.mps.is_available():
            pytest.skip("this machine has MPS")
    assert words in refusal(*flags)


def test_a_port_in_use_is_refused_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refusal("--port", str(port))
    assert f"--port {port}" in line and "in use" in line


def test_ctrl_c_while_the_model_loads_stops_quietly(tmp_path):
    """Ctrl-C during the start-up: no traceback, status 0, nothing of the group left."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-m", "helpers.server", "--port", "0", *FAST],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=env, start_new_session=True)
    seen = []
    for line in process.stdout:
        seen.append(line)
        if "loading the model" in line:
            break
    os.killpg(process.pid, signal.SIGINT)
    output = "".join(seen) + process.communicate(timeout=60)[0]
    assert process.returncode == 0 and "Traceback" not in output, output
    assert group_is_empty(process.pid)
