"""The server's door: what a request must look like before any real work is spent on it.
(Lesson 07.)

Everything here is cheap and runs before the engine sees a request:

* ``read_body``: the body, with its size limit enforced WHILE it arrives. A chunked body has
  no Content-Length, so a server that reads it whole and then measures it has already paid for
  it (a 1 GB body would take more than 1 GB of memory). Here reading stops one chunk past the
  limit, and the answer (413) closes the connection so the rest is never read.
* ``require_json``: POST bodies must say ``Content-Type: application/json``. A web page can
  make a browser POST ``text/plain`` to any address without asking first (no CORS preflight);
  refusing every other type means such a page cannot drive a server on the visitor's machine.
* ``parse_json``: strict JSON. Python's ``json`` module accepts NaN and Infinity, lone UTF-16
  surrogates ("\\ud800", which no UTF-8 encoder can write back), and nests as deep as its C
  stack allows; each of those used to turn into a 500 further in. Here they are a 400 that
  says what is wrong.
* ``cancel_on_disconnect``: a request whose client hangs up stops generating at once.
* ``internal_error``: a 500 tells the client a request id, never the exception.
* ``http_protocol``: uvicorn's HTTP protocol with a deadline for a request's headers, so that
  a client sending them a byte at a time (slowloris) cannot hold a connection for ever;
  ``SendDeadline`` does the same for a client that stops reading its answer. The same
  protocol refuses (400, connection closed) a request that carries both Content-Length and
  Transfer-Encoding (RFC 9112 section 6.1): a proxy in front that goes by the other header
  would take a second request hidden in the body for part of the first (request smuggling).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import uuid
from itertools import accumulate
from typing import Any, Awaitable, Callable, TypeVar

from .protocol import ApiError, invalid

log = logging.getLogger("helpers.server")

T = TypeVar("T")

#: Largest request body accepted, in bytes.
MAX_BODY_BYTES = 1 << 20
#: A body must arrive within this many seconds once its headers have (a slow sender holds a
#: connection and a task for as long as it likes otherwise).
BODY_TIMEOUT_SECONDS = 30.0
#: Deepest nesting of arrays and objects accepted in a body. A JSON schema three levels of
#: properties deep nests about ten levels; nothing this server reads needs more than a few.
MAX_JSON_DEPTH = 64

# --- errors of the door -------------------------------------------------------------------

class RefusedBody(ApiError):
    """A body refused before it was read to the end: the answer closes the connection so that
    the rest of the body is never read (HTTP/1.1 cannot skip it otherwise)."""

    headers = {"Connection": "close"}


class ClientGone(Exception):
    """The client hung up before its answer was ready (see ``cancel_on_disconnect``)."""


def internal_error(request, err: BaseException) -> tuple[str, str]:
    """Log an unexpected exception with a fresh request id; ``(message, request_id)`` for the
    client. The message names no exception, path or line: those are for the server's log."""
    request_id = uuid.uuid4().hex[:16]
    where = f"{request.method} {request.url.path}" if request is not None else "a request"
    log.error("internal error in %s (request id %s)", where, request_id,
              exc_info=(type(err), err, err.__traceback__))
    return f"internal error, see the server log (request id {request_id})", request_id


def stream_failure(err: Exception, request=None) -> tuple[str, str]:
    """``(message, error_type)`` for the error event that ends a stream already started (its
    status line was sent, so no error handler can answer any more): the error's own message
    when it is one of the server's (``ApiError``, ``errors.EngineError``), else a request id,
    the exception going to the server's log as ``internal_error`` does."""
    from .errors import EngineError

    if isinstance(err, ApiError):
        return err.message, err.error_type
    if isinstance(err, EngineError):
        return err.message, "generation"
    return internal_error(request, err)[0], "generation"


# --- reading the body ---------------------------------------------------------------------

def require_json(request) -> None:
    """415 unless the request says its body is JSON (``application/json``, any charset that
    is UTF-8). Browsers send ``text/plain`` cross-site without a preflight: refusing it keeps
    web pages from posting to this server through a visitor's browser. The body is not read
    (the answer closes the connection)."""
    given = request.headers.get("content-type")
    media, _, rest = (given or "").partition(";")
    media = media.strip().lower()
    if media != "application/json":
        shown = f"Content-Type {given!r}" if given else "no Content-Type"
        raise RefusedBody(415, f"the request body must be JSON sent with Content-Type: "
                          f"application/json (got {shown})")
    charset = re.search(r"charset\s*=\s*\"?([\w-]+)", rest, re.IGNORECASE)
    if charset and charset.group(1).lower() not in ("utf-8", "utf8"):
        raise RefusedBody(415, f"the request body must be UTF-8 JSON (Content-Type: "
                          f"application/json; charset=utf-8), got charset={charset.group(1)}")


async def read_body(request, limit: int = MAX_BODY_BYTES,
                    timeout: float = BODY_TIMEOUT_SECONDS) -> bytes:
    """The request's body, at most ``limit`` bytes, read within ``timeout`` seconds.

    A Content-Length above the limit is refused before anything is read. A chunked body (no
    Content-Length) is counted as it arrives and refused as soon as it passes the limit:
    at most one chunk beyond the limit is ever held in memory (the server reads the socket in
    chunks of at most 64 KiB). Both answer 413 and close the connection.
    """
    length = request.headers.get("content-length")
    if length is not None:
        if not re.fullmatch(r"[0-9]{1,18}", length.strip()):
            raise RefusedBody(400, f"Content-Length {length[:40]!r} is not a number")
        if int(length) > limit:
            raise RefusedBody(413, f"the request body is {int(length)} bytes; this server "
                              f"accepts at most {limit} bytes")

    async def collect() -> bytes:
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RefusedBody(413, f"the request body is more than {limit} bytes; this "
                                  f"server accepts at most {limit} bytes (it stopped reading)")
            parts.append(chunk)
        return b"".join(parts)

    try:
        return await asyncio.wait_for(collect(), timeout)
    except asyncio.TimeoutError:
        raise RefusedBody(408, f"the request body did not arrive within {timeout:g} s") from None


# --- parsing JSON -------------------------------------------------------------------------

class _NotJson(ValueError):
    pass


def _refuse_constant(name: str):
    raise _NotJson(f"{name} is not a JSON number (JSON has no NaN or Infinity)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):     # 1e999 parses as inf
        raise _NotJson(f"the number {text[:30]} is too large for a 64-bit float")
    return value


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def json_depth(text: str) -> int:
    """How deeply arrays and objects nest in ``text`` (brackets inside strings don't count).
    Cheap enough to run before parsing: two regular-expression passes and one running sum
    (about 0.1 s for a megabyte of brackets, the worst case the body limit allows)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(_DEPTH_STEP[c] for c in brackets), default=0)


def _lone_surrogate(value: Any, path: str = "") -> str | None:
    """Where the first string (or key) holding a lone UTF-16 surrogate is, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "(the body)"
        return None
    items = enumerate(value) if isinstance(value, list) else (
        value.items() if isinstance(value, dict) else ())
    for key, item in items:
        if isinstance(key, str) and _lone_surrogate(key):
            return f"a key of {path or 'the body'}"      # (the key itself cannot be shown)
        found = _lone_surrogate(item, f"{path}[{key}]" if isinstance(key, int)
                                else (f"{path}.{key}" if path else key))
        if found:
            return found
    return None


def parse_json(raw: bytes) -> Any:
    """The body as JSON, strictly: UTF-8, no NaN/Infinity, no number too large for a float,
    no lone surrogate escape, at most ``MAX_JSON_DEPTH`` levels. Anything else is a 400 that
    says what is wrong."""
    if not raw.strip():
        raise invalid("the request body is empty: send a JSON object", 400)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise invalid(f"the request body is not UTF-8 text (byte {err.start})", 400) from None
    # Opening brackets bound the depth from above: most bodies skip the scan.
    depth = (json_depth(text) if text.count("[") + text.count("{") > MAX_JSON_DEPTH else 0)
    if depth > MAX_JSON_DEPTH:
        raise invalid(f"the request body nests arrays/objects {depth} levels deep; at most "
                      f"{MAX_JSON_DEPTH}", 400)
    try:
        data = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except json.JSONDecodeError as err:
        raise invalid(f"the request body is not valid JSON: {err.msg} (line {err.lineno}, "
                      f"column {err.colno})", 400) from None
    except _NotJson as err:
        raise invalid(f"the request body is not valid JSON: {err}", 400) from None
    except (ValueError, RecursionError) as err:   # e.g. an integer of more than 4300 digits
        reason = ("it nests too deeply" if isinstance(err, RecursionError)
                  else str(err).split(";")[0][:120])
        raise invalid(f"the request body cannot be read as JSON: {reason}", 400) from None
    if _SURROGATE_ESCAPE.search(text):        # only then can a string hold a lone surrogate
        where = _lone_surrogate(data)
        if where:
            where = where if where.startswith("a key") else f"`{where[:200]}`"
            raise invalid(f"the request body's JSON string at {where} holds a lone UTF-16 "
                          f"surrogate escape (such as \\ud800), which is not a character", 400)
    return data


# --- clients that hang up -----------------------------------------------------------------

async def wait_for_disconnect(request) -> None:
    """Returns when the client of ``request`` has hung up. Call it only once the body has been
    read: it consumes the request's ASGI messages (after the body, the only one left to come
    is ``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request, work: Awaitable[T],
                               on_gone: Callable[[], None] | None = None) -> T:
    """Run ``work`` (a coroutine) until it finishes or the client hangs up, whichever is first.

    If the client goes, ``on_gone()`` is called, ``work`` is cancelled (so its ``finally``
    blocks run: that is where a route cancels its engine requests) and ``ClientGone`` is
    raised. A non-streaming request is watched all the time, not only between two tokens:
    a row that is producing tokens leaves the batch at the next step after the hang-up.
    """
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        if on_gone is not None:
            on_gone()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)   # let its cleanup run
        raise ClientGone()
    finally:
        gone.cancel()
        if not task.done():        # we were cancelled ourselves: take the work with us
            task.cancel()


# --- clients that send their headers slowly (slowloris) ----------------------------------

#: A connection must finish a request's headers within this many seconds of opening (or of
#: its previous answer); uvicorn itself has no such limit.
HEADER_TIMEOUT_SECONDS = 10.0


def http_protocol(header_timeout: float = HEADER_TIMEOUT_SECONDS):
    """uvicorn's h11 HTTP protocol with a deadline for the request's headers, for
    ``uvicorn.Config(http=...)``.

    uvicorn closes a kept-alive connection that stays idle, but a client that opens a
    connection and sends its headers a byte at a time (slowloris) holds that connection, a
    file descriptor and a slot of ``limit_concurrency`` for as long as it likes. Enough of
    them and nobody else can connect. Here a connection whose request has not started within
    ``header_timeout`` seconds is closed.

    It also refuses a request that says how long its body is twice, with both Content-Length
    and Transfer-Encoding (see ``_refuse_two_framings``)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadlineProtocol(H11Protocol):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            # uvicorn's loop (handle_events) takes every event from conn.next_event: each
            # request's headers pass through _next_event before uvicorn sees them.
            self._h11_next_event = self.conn.next_event
            self.conn.next_event = self._next_event

        def _next_event(self):
            event = self._h11_next_event()
            if isinstance(event, h11.Request) and _two_framings(event.headers):
                self._refuse_two_framings()
                return h11.NEED_DATA       # uvicorn reads no further; the connection closes
            return event

        def _refuse_two_framings(self) -> None:
            """400 and close the connection, without reading the body or anything after it.

            RFC 9112 section 6.1: a request with both Transfer-Encoding and Content-Length
            "ought to be handled as an error", and a server that processes it anyway must
            close the connection afterwards. h11 frames it by the chunked encoding and keeps
            the connection open, so a proxy in front that goes by Content-Length would pass a
            second request hidden after the last chunk, and it would be answered.
            (h11 itself refuses any Transfer-Encoding but a single ``chunked``.)"""
            log.warning("refused a request with both Transfer-Encoding and Content-Length "
                        "from %s", self.client)
            body = json.dumps({"error": "a request may not carry both Transfer-Encoding and "
                                        "Content-Length (RFC 9112 section 6.1): send one",
                               "error_type": "validation"}).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                       (b"content-length", str(len(body)).encode())]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer = None
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._waiting_after = self.cycle            # a new cycle means: headers arrived
            self._header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _disarm(self) -> None:
            if getattr(self, "_header_timer", None) is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.cycle is self._waiting_after and not self.transport.is_closing():
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not self._waiting_after:
                self._disarm()

        def on_response_complete(self) -> None:
            if not self.transport.is_closing():
                self._arm()             # the next request's headers (before a pipelined
            super().on_response_complete()          # request is read, which disarms it)

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderDeadlineProtocol


def _two_framings(headers) -> bool:
    """True when h11's request headers (names in lower case) hold both Transfer-Encoding
    and Content-Length."""
    names = {name for name, _ in headers}
    return b"transfer-encoding" in names and b"content-length" in names


# --- clients that stop reading -------------------------------------------------------------

#: Longest wait for a client to take the next piece of an answer, in seconds.
SEND_TIMEOUT_SECONDS = 60.0


class SendDeadline:
    """ASGI middleware: a client that stops reading its answer (a stream it neither reads nor
    closes) is dropped once one write has waited ``timeout`` seconds. Without it the request's
    task and connection stay open for as long as the client likes: uvicorn has no write
    timeout, and the socket's buffers stay full."""

    def __init__(self, app, timeout: float = SEND_TIMEOUT_SECONDS):
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        stalled = []

        async def send_with_deadline(message):
            try:
                await asyncio.wait_for(send(message), self.timeout)
            except asyncio.TimeoutError:
                stalled.append(message["type"])
                raise ClientGone() from None

        try:
            await self.app(scope, receive, send_with_deadline)
        except BaseException:
            if not stalled:
                raise
            # Returning without finishing the answer makes the server close the connection.
            log.warning("a client read nothing for %g s: dropped it (%s %s)", self.timeout,
                        scope.get("method"), scope.get("path"))


# --- web pages that rebind their name to this machine ------------------------------------

#: The names a browser uses for this machine (any port).
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    """True for an address that only this machine can reach (127.x.x.x, ::1, localhost)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The name in a Host header, without its port: "[::1]:8080" -> "::1"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class LoopbackHosts:
    """ASGI middleware for a server that listens on this machine only: a request whose Host
    header is not a loopback name is refused (403).

    Requiring JSON keeps other web sites' pages from posting to the server through a visitor's
    browser, but not a page whose own name the attacker points at 127.0.0.1 after it loaded
    (DNS rebinding): to the browser that page and the server are then one site. Its requests
    still carry the attacker's name in Host, which is how they are told apart."""

    def __init__(self, app, names=LOOPBACK_NAMES):
        self.app = app
        self.names = set(names)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            name = _host_name(host)
            if name not in self.names and not is_loopback(name):
                body = json.dumps({"error": f"this server answers requests addressed to this "
                                            f"machine only (Host: {host[:100]!r})",
                                   "error_type": "validation"}).encode()
                await send({"type": "http.response.start", "status": 403, "headers": [
                    (b"content-type", b"application/json"), (b"connection", b"close"),
                    (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
