"""The server's door (lesson 07): each malformed request is refused with an ``ApiError`` that
says what is wrong; a client that hangs up, sends its headers slowly or stops reading is let go;
``AnswerGuard`` counts every answer by status."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import math
import re
import uuid
from collections import Counter
from itertools import accumulate
from typing import Any, Awaitable, Callable, TypeVar

from .errors import EngineError

log = logging.getLogger("helpers.server")

T = TypeVar("T")

#: Largest request body accepted, in bytes, and the seconds it may take to arrive.
MAX_BODY_BYTES = 1 << 20
BODY_TIMEOUT_SECONDS = 30.0
#: Deepest nesting of arrays and objects in a body (a schema three properties deep nests ~10).
MAX_JSON_DEPTH = 64
#: Seconds a connection has to send a request's headers (uvicorn has no such limit), and to
#: take the next piece of an answer.
HEADER_TIMEOUT_SECONDS = 10.0
SEND_TIMEOUT_SECONDS = 60.0


class ApiError(Exception):
    """Answered as ``{"error": message, "error_type": error_type}`` with ``status``; LoRAX's
    types: "validation", "not_found", "overloaded", "unavailable", "generation"."""

    def __init__(self, status: int, message: str, error_type: str = "validation"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type


def invalid(message: str, status: int = 422) -> ApiError:
    return ApiError(status, message, "validation")


class RefusedBody(ApiError):
    """A body refused before it was read to the end: the answer closes the connection, as
    HTTP/1.1 cannot skip the rest of a body otherwise."""

    headers = {"Connection": "close"}


class ClientGone(Exception):
    """The client hung up before its answer was ready."""


def internal_error(request, err: BaseException) -> str:
    """Log an unexpected exception under a fresh request id: the client's message names only
    that id."""
    request_id = uuid.uuid4().hex[:16]
    where = f"{request.method} {request.url.path}" if request is not None else "a request"
    log.error("internal error in %s (request id %s)", where, request_id,
              exc_info=(type(err), err, err.__traceback__))
    return f"internal error, see the server log (request id {request_id})"


def stream_failure(err: Exception, request=None) -> tuple[str, str]:
    """``(message, error_type)`` of the event that ends a stream already started: the server's
    own errors say their message, others are logged as in ``internal_error``."""
    if isinstance(err, ApiError):
        return err.message, err.error_type
    if isinstance(err, EngineError):
        return err.message, "generation"
    return internal_error(request, err), "generation"


def require_json(request) -> None:
    """415 unless the body is declared ``application/json`` (UTF-8 if a charset is named).
    Browsers post ``text/plain`` cross-site without a preflight: refusing it keeps web pages
    from posting here through a visitor's browser."""
    given = request.headers.get("content-type")
    media, _, rest = (given or "").partition(";")
    if media.strip().lower() != "application/json":
        shown = f"Content-Type {given!r}" if given else "no Content-Type"
        raise RefusedBody(415, f"the request body must be JSON sent with Content-Type: "
                          f"application/json (got {shown})")
    charset = re.search(r"charset\s*=\s*\"?([\w-]+)", rest, re.IGNORECASE)
    if charset and charset.group(1).lower() not in ("utf-8", "utf8"):
        raise RefusedBody(415, f"the request body must be UTF-8 JSON (Content-Type: "
                          f"application/json; charset=utf-8), got charset={charset.group(1)}")


async def read_body(request, limit: int = MAX_BODY_BYTES,
                    timeout: float = BODY_TIMEOUT_SECONDS) -> bytes:
    """The body, at most ``limit`` bytes, read within ``timeout`` seconds: a Content-Length over
    the limit is refused before reading, a chunked body one chunk past it (413)."""
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


async def read_json(request):
    require_json(request)
    return parse_json(await read_body(request))


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number (JSON has no NaN or Infinity)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):     # 1e999 parses as inf
        raise ValueError(f"the number {text[:30]} is too large for a 64-bit float")
    return value


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def json_depth(text: str) -> int:
    """How deeply arrays and objects nest in ``text`` (not counting brackets in strings),
    cheaply enough to run before parsing."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(_DEPTH_STEP[c] for c in brackets), default=0)


def parse_json(raw: bytes) -> Any:
    """The body as strict JSON: UTF-8, no NaN/Infinity or float overflow, no lone surrogate
    escape (UTF-8 cannot write it back), at most ``MAX_JSON_DEPTH`` levels. Python's ``json``
    takes all of these; here each is a 400 that says what is wrong."""
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
    except ValueError as err:      # the hooks above, or an integer of more than 4300 digits
        raise invalid(f"the request body is not valid JSON: {str(err).split(';')[0][:120]}",
                      400) from None
    if _SURROGATE_ESCAPE.search(text):        # only then can a string hold a lone surrogate
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise invalid("the request body's JSON holds a lone UTF-16 surrogate escape (such "
                          "as \\ud800) in a string or a key, which is not a character",
                          400) from None
    return data


async def cancel_on_disconnect(request, work: Awaitable[T],
                               on_gone: Callable[[], None] | None = None) -> T:
    """Await ``work`` unless the client hangs up first: then call ``on_gone()``, cancel ``work``
    (its ``finally`` blocks cancel its engine requests) and raise ``ClientGone``. Once the body
    is read, the only ASGI message left to come is ``http.disconnect``."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected())
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


def _refusal(message: str) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """``(body, headers)`` of an error answered below the application, in LoRAX's shape; the
    connection closes after it."""
    body = json.dumps({"error": message, "error_type": "validation"}).encode()
    return body, [(b"content-type", b"application/json"), (b"connection", b"close"),
                  (b"content-length", str(len(body)).encode())]


def http_protocol(header_timeout: float = HEADER_TIMEOUT_SECONDS):
    """uvicorn's h11 protocol (``uvicorn.Config(http=...)``) with two guards: a connection
    whose headers have not all come within ``header_timeout`` seconds is closed (a byte at a
    time would hold it forever); a request with both Transfer-Encoding and Content-Length gets
    400 and the connection closes (RFC 9112 section 6.1: h11 would frame it by the chunks, so a
    proxy going by Content-Length would pass on a request hidden after them)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadlineProtocol(H11Protocol):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            # uvicorn's loop (handle_events) takes every event from conn.next_event: each
            # request's headers pass through _next_event before uvicorn sees them.
            self._h11_next_event = self.conn.next_event
            self.conn.next_event = self._next_event
            self._header_timer = None

        def _next_event(self):
            event = self._h11_next_event()
            names = {n for n, _ in event.headers} if isinstance(event, h11.Request) else set()
            if not {b"transfer-encoding", b"content-length"} <= names:
                return event
            log.warning("refused a request framed twice (Transfer-Encoding and Content-Length)"
                        " from %s", self.client)
            body, headers = _refusal("a request may not carry both Transfer-Encoding and "
                                     "Content-Length (RFC 9112 section 6.1): send one")
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()
            return h11.NEED_DATA           # uvicorn reads no further; the connection closes

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._waiting_after = self.cycle            # a new cycle means: headers arrived
            self._header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
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


class AnswerGuard:
    """ASGI middleware: counts each answer by status into ``responses`` (for /metrics), and
    drops a client once one write has waited ``timeout`` seconds (uvicorn has no write timeout)."""

    def __init__(self, app, responses: Counter, timeout: float = SEND_TIMEOUT_SECONDS):
        self.app = app
        self.responses = responses
        self.timeout = timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        stalled = []

        async def guarded_send(message):
            if message["type"] == "http.response.start":
                self.responses[message["status"]] += 1
            try:
                await asyncio.wait_for(send(message), self.timeout)
            except asyncio.TimeoutError:
                stalled.append(message["type"])
                raise ClientGone() from None

        try:
            await self.app(scope, receive, guarded_send)
        except BaseException:
            if not stalled:
                raise
            # Returning without finishing the answer makes the server close the connection.
            log.warning("a client read nothing for %g s: dropped it (%s %s)", self.timeout,
                        scope.get("method"), scope.get("path"))


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (127.x.x.x, ::1, localhost)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The name in a Host header, without its port: "[::1]:8080" -> "::1"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class LoopbackHosts:
    """ASGI middleware for a server on this machine only: a Host that is not a loopback name
    is refused (403), as a page whose name is pointed at 127.0.0.1 (DNS rebinding) sends it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if not is_loopback(_host_name(host)):
                body, headers = _refusal(f"this server answers requests addressed to this "
                                         f"machine only (Host: {host[:100]!r})")
                await send({"type": "http.response.start", "status": 403, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)

