"""A request says how long its body is once: with Content-Length or with Transfer-Encoding:
chunked, never both (RFC 9112 section 6.1).

With both, h11 used to go by the chunked encoding and keep the connection open, so a second
request hidden after the last chunk was answered too. Behind a proxy that goes by
Content-Length, that second request is one the proxy never saw (request smuggling). The server
(``guards.http_protocol``) now answers 400 and closes the connection. The tests talk to the
real server (``python -m helpers.server``) through raw sockets, since HTTP clients refuse to
send such requests.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from helpers.server import serve_in_background  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")    # see tests/conftest.py

BODY = json.dumps({"inputs": "Jack", "parameters": {"max_new_tokens": 1}}).encode()
CHUNKED_BODY = f"{len(BODY):x}\r\n".encode() + BODY + b"\r\n0\r\n\r\n"
SMUGGLED = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@pytest.fixture(scope="module")
def address():
    """(host, port) of the bundled model's server on the CPU."""
    server = serve_in_background(name="test-http-framing", threads=1, device="cpu",
                                 max_batch_size=2, env={"HF_HUB_OFFLINE": "1"})
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    yield host, int(port)
    server.stop()


def post_generate(*, content_length: int | None = None,
                  transfer_encoding: str | None = None) -> bytes:
    """The head of ``POST /generate`` with the framing headers asked for."""
    lines = ["POST /generate HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    if content_length is not None:
        lines.append(f"Content-Length: {content_length}")
    if transfer_encoding is not None:
        lines.append(f"Transfer-Encoding: {transfer_encoding}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def parse(data: bytes) -> list[tuple[int, dict, bytes]]:
    """The complete responses in ``data``, as (status, headers, body). Every answer of this
    server to these requests has a Content-Length."""
    responses = []
    while True:
        head, found, rest = data.partition(b"\r\n\r\n")
        if not found:
            return responses
        lines = head.decode("latin-1").split("\r\n")
        headers = dict((name.strip().lower(), value.strip())
                       for name, value in (line.split(":", 1) for line in lines[1:]))
        length = int(headers.get("content-length", 0))
        if len(rest) < length:
            return responses
        responses.append((int(lines[0].split()[1]), headers, rest[:length]))
        data = rest[length:]


def exchange(address, data: bytes, answers: int | None = None, timeout: float = 60.0):
    """Send ``data`` on a fresh connection; read until ``answers`` complete responses have
    arrived (None: until the server closes the connection). Returns (responses, closed)."""
    sock = socket.create_connection(address, timeout=timeout)
    received, closed = b"", False
    deadline = time.monotonic() + timeout
    try:
        sock.sendall(data)
        while answers is None or len(parse(received)) < answers:
            assert time.monotonic() < deadline, f"no end of the answer: {received[:300]!r}"
            try:
                part = sock.recv(65536)
            except ConnectionResetError:
                part = b""
            if not part:
                closed = True
                break
            received += part
    finally:
        sock.close()
    return parse(received), closed


def test_both_headers_are_refused_and_the_hidden_request_is_never_answered(address):
    """The smuggling shape: Content-Length and chunked, and after the last chunk a second
    request. One answer, 400, naming both headers; then the connection is closed."""
    head = post_generate(content_length=len(CHUNKED_BODY), transfer_encoding="chunked")
    responses, closed = exchange(address, head + CHUNKED_BODY + SMUGGLED)
    assert closed
    assert len(responses) == 1, f"the hidden request was answered: {responses}"
    status, headers, body = responses[0]
    assert status == 400
    assert headers["connection"].lower() == "close"
    assert headers["content-type"] == "application/json"
    error = json.loads(body)
    assert error["error_type"] == "validation"
    assert "Transfer-Encoding" in error["error"] and "Content-Length" in error["error"]


@pytest.mark.parametrize("transfer_encoding", [
    "Chunked", "CHUNKED", " chunked ",                           # h11 reads these as chunked
    "chunked, identity", "gzip", "gzip, chunked", "identity",    # h11 refuses these itself
])
def test_every_transfer_encoding_with_content_length_is_refused(address, transfer_encoding):
    """Whatever the Transfer-Encoding, with a Content-Length beside it: a 400, the connection
    closed, the request after it never answered."""
    head = post_generate(content_length=len(CHUNKED_BODY), transfer_encoding=transfer_encoding)
    responses, closed = exchange(address, head + CHUNKED_BODY + SMUGGLED)
    assert closed
    assert [status for status, _, _ in responses] == [400]


def test_the_headers_in_the_other_order_are_refused_too(address):
    head = (b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Type: application/json\r\nContent-Length: 4\r\n\r\n")
    responses, closed = exchange(address, head + CHUNKED_BODY + SMUGGLED)
    assert closed
    assert [status for status, _, _ in responses] == [400]


def test_a_kept_alive_connection_is_closed_at_the_refused_request(address):
    """A normal request first, answered; then the one with both headers on the same
    connection: refused and closed, and the request hidden behind it not answered."""
    first = post_generate(content_length=len(BODY)) + BODY
    second = post_generate(content_length=len(CHUNKED_BODY), transfer_encoding="chunked")
    responses, closed = exchange(address, first + second + CHUNKED_BODY + SMUGGLED)
    assert closed
    assert [status for status, _, _ in responses] == [200, 400]
    assert "generated_text" in json.loads(responses[0][2])


def test_a_chunked_request_is_served(address):
    """Transfer-Encoding: chunked alone is fine, and so is a request pipelined after it
    (the check is about the two headers together, not about chunked bodies or pipelining)."""
    head = post_generate(transfer_encoding="chunked")
    responses, closed = exchange(address, head + CHUNKED_BODY + SMUGGLED, answers=2)
    assert not closed
    assert [status for status, _, _ in responses] == [200, 200]
    assert "generated_text" in json.loads(responses[0][2])
    assert json.loads(responses[1][2])["status"] == "ok"


def test_a_content_length_request_is_served(address):
    head = post_generate(content_length=len(BODY))
    responses, closed = exchange(address, head + BODY, answers=1)
    assert not closed
    assert [status for status, _, _ in responses] == [200]
    assert "generated_text" in json.loads(responses[0][2])
