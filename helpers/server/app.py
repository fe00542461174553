"""The HTTP side: LoRAX's routes and OpenAI's completions on top of the engine. (Lesson 07.)

Routes
    POST /                  LoRAX: a JSON array with one answer, or server-sent events when
                            the body says ``"stream": true`` (this is what lorax-client calls)
    POST /generate          LoRAX: one answer (a JSON object)
    POST /generate_stream   LoRAX: server-sent events, one per token, ``data:{json}``
    POST /v1/completions    OpenAI completions (``stream`` too); the adapter goes in ``model``
    GET  /v1/models         the base model and the adapters, OpenAI style
    GET  /health            200 while the scheduler runs
    GET  /info              the model and the server's limits
    GET  /metrics           counters in Prometheus' text format

Every error is ``{"error": ..., "error_type": ...}`` (under ``/v1/`` "error" is OpenAI's
``{"message", "type", "param", "code"}`` object, so that the openai client shows it): 400 for
a body that is not JSON, 422 for a request that is wrong or asks for something this server does
not do, 404 for an unknown adapter, 413 for a body that is too large, 429 when the queue is
full, 424 when a hub adapter cannot be fetched, 500 when generation fails.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import Engine, ErrorEvent, Handle, Prepared
from .protocol import (ApiError, describe_validation_errors, invalid, parse_completion,
                       parse_json_body, parse_lorax)

log = logging.getLogger("helpers.server")

#: Largest request body accepted, in bytes.
MAX_BODY_BYTES = 1 << 20
#: How often a non-streaming request checks that its client is still there, in seconds.
DISCONNECT_POLL_SECONDS = 0.5
SERVER_NAME = "helpers.server (Efficiently Serving LLMs, lesson 07)"


def _error(err: ApiError, request: Request | None = None) -> JSONResponse:
    return _error_response(err.message, err.error_type, err.status, request)


def _error_response(message: str, error_type: str, status: int, request: Request | None = None,
                    headers=None) -> JSONResponse:
    """LoRAX's error body. Under /v1/ (OpenAI's routes) "error" is OpenAI's object instead of
    a string, so that the openai client shows the message; "error_type" is there too."""
    if request is not None and request.url.path.startswith("/v1/"):
        body = {"error": {"message": message, "type": error_type, "param": None,
                          "code": status}, "error_type": error_type}
    else:
        body = {"error": message, "error_type": error_type}
    return JSONResponse(body, status_code=status, headers=headers)


def _sse(data) -> str:
    return "data:" + json.dumps(data, separators=(",", ":")) + "\n\n"


class _ClientGone(Exception):
    pass


def create_app(engine: Engine, *, manage_engine: bool = True) -> FastAPI:
    """The FastAPI application serving ``engine``. (Lesson 07.)

    With ``manage_engine`` the app starts the engine's scheduler when the server starts and
    stops it when the server stops.
    """

    @asynccontextmanager
    async def lifespan(app):
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            if manage_engine:
                await run_in_threadpool(engine.stop)

    app = FastAPI(title="LoRAX-compatible course server", lifespan=lifespan,
                  docs_url="/docs", redoc_url=None)
    app.state.engine = engine

    # --- errors in LoRAX's shape ---------------------------------------------------------

    @app.exception_handler(ApiError)
    async def api_error(request, err: ApiError):
        return _error(err, request)

    @app.exception_handler(_ClientGone)
    async def client_gone(request, err: _ClientGone):
        # Nobody reads this answer; 499 (nginx's "client closed request") marks it in logs.
        return JSONResponse({"error": "client disconnected", "error_type": "generation"},
                            status_code=499)

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(request, err: RequestValidationError):
        return _error(invalid(describe_validation_errors(err.errors())), request)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, err: StarletteHTTPException):
        message = err.detail if isinstance(err.detail, str) else json.dumps(err.detail)
        if err.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif err.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        return _error_response(message, "validation", err.status_code, request,
                               headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected_error(request, err: Exception):
        log.exception("unexpected error")
        return _error_response(f"internal error: {type(err).__name__}: {err}", "generation",
                               500, request)

    # --- shared steps ----------------------------------------------------------------------

    async def read_body(request: Request):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise invalid(f"the request body is {length} bytes; at most {MAX_BODY_BYTES}", 413)
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise invalid(f"the request body is {len(raw)} bytes; at most {MAX_BODY_BYTES}", 413)
        return parse_json_body(raw)

    async def submit(prompts, params, queue) -> list[Handle]:
        prepared = [await run_in_threadpool(engine.prepare, prompt, params) for prompt in prompts]
        loop = asyncio.get_running_loop()
        handles = []
        try:
            for tag, item in enumerate(prepared):
                handles.append(engine.submit(item, loop, queue, tag))
        except ApiError:
            for handle in handles:
                engine.cancel(handle)
            raise
        return handles

    async def next_event(queue: asyncio.Queue, request: Request, handles, state: dict):
        """The next (tag, event); checks every half second that the client is still there."""
        while True:
            task = state.get("task")
            if task is None:
                task = state["task"] = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                state["task"] = None
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                for handle in handles:
                    engine.cancel(handle)
                raise _ClientGone()

    def cancel_unfinished(handles):
        for handle in handles:
            if not handle.finished:
                engine.cancel(handle)

    # --- LoRAX --------------------------------------------------------------------------------

    async def lorax_answer(request: Request, prompt, params) -> dict:
        queue: asyncio.Queue = asyncio.Queue()
        (handle,) = await submit([prompt], params, queue)
        tokens, state = [], {}
        try:
            while True:
                _, event = await next_event(queue, request, [handle], state)
                if isinstance(event, ErrorEvent):
                    raise ApiError(event.status, event.message, event.error_type)
                tokens.append(event.token)
                if event.finish is not None:
                    return lorax_response(handle.prepared, tokens, event.finish)
        finally:
            cancel_unfinished([handle])

    def lorax_response(prepared: Prepared, tokens, finish) -> dict:
        params = prepared.params
        text = finish["generated_text"]
        if params.return_full_text:
            text = prepared.prompt + text
        answer = {"generated_text": text}
        if params.details:
            answer["details"] = {
                "finish_reason": finish["finish_reason"],
                "prompt_tokens": finish["prompt_tokens"],
                "generated_tokens": finish["generated_tokens"],
                "seed": finish["seed"], "prefill": [], "tokens": tokens,
                "best_of_sequences": None}
        return answer

    async def lorax_stream(prompt, params) -> StreamingResponse:
        queue: asyncio.Queue = asyncio.Queue()
        (handle,) = await submit([prompt], params, queue)

        async def events():
            try:
                while True:
                    _, event = await queue.get()
                    if isinstance(event, ErrorEvent):
                        yield _sse({"error": event.message, "error_type": event.error_type})
                        return
                    message = {"token": event.token, "generated_text": None, "details": None}
                    finish = event.finish
                    if finish is not None:
                        text = finish["generated_text"]
                        if params.return_full_text:
                            text = prompt + text
                        message["generated_text"] = text
                        message["details"] = {key: finish[key] for key in (
                            "finish_reason", "prompt_tokens", "generated_tokens", "seed")}
                    yield _sse(message)
                    if finish is not None:
                        return
            finally:          # the client went away (or we are done): free the slot
                cancel_unfinished([handle])

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/")
    async def compat(request: Request):
        prompt, params, stream = parse_lorax(await read_body(request))
        if stream:
            return await lorax_stream(prompt, params)
        return JSONResponse([await lorax_answer(request, prompt, params)])

    @app.post("/generate")
    async def generate(request: Request):
        prompt, params, _ = parse_lorax(await read_body(request))
        return JSONResponse(await lorax_answer(request, prompt, params))

    @app.post("/generate_stream")
    async def generate_stream(request: Request):
        prompt, params, _ = parse_lorax(await read_body(request))
        return await lorax_stream(prompt, params)

    # --- OpenAI completions -----------------------------------------------------------------

    def openai_finish(reason: str) -> str:
        return "length" if reason == "length" else "stop"

    def openai_text(finish) -> str:
        text = finish["generated_text"]
        if finish["finish_reason"] == "stop_sequence" and finish.get("stop_at") is not None:
            text = text[:finish["stop_at"]]
        return text

    def openai_logprobs(tokens, offset: int):
        tokens = [t for t in tokens if not t["special"]]
        texts, positions = [], []
        for token in tokens:
            positions.append(offset)
            texts.append(token["text"])
            offset += len(token["text"])
        return {"tokens": texts, "token_logprobs": [t["logprob"] for t in tokens],
                "top_logprobs": [{alt["text"]: alt["logprob"]
                                  for alt in t.get("alternative_tokens") or []} for t in tokens],
                "text_offset": positions}

    @app.post("/v1/completions")
    async def completions(request: Request):
        prompts, params, stream, extras = parse_completion(await read_body(request),
                                                           engine.model_id)
        queue: asyncio.Queue = asyncio.Queue()
        handles = await submit(prompts, params, queue)
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": extras["model"]}
        if stream:
            return StreamingResponse(openai_stream(handles, queue, params, extras, meta),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        results: dict[int, tuple] = {}
        tokens: dict[int, list] = {h.tag: [] for h in handles}
        state: dict = {}
        try:
            while len(results) < len(handles):
                tag, event = await next_event(queue, request, handles, state)
                if isinstance(event, ErrorEvent):
                    raise ApiError(event.status, event.message, event.error_type)
                tokens[tag].append(event.token)
                if event.finish is not None:
                    results[tag] = event.finish
        finally:
            cancel_unfinished(handles)
        choices = []
        for handle in handles:
            finish = results[handle.tag]
            prefix = handle.prepared.prompt if extras["echo"] else ""
            choices.append({
                "index": handle.tag, "text": prefix + openai_text(finish),
                "logprobs": (openai_logprobs(tokens[handle.tag], len(prefix))
                             if extras["logprobs"] is not None else None),
                "finish_reason": openai_finish(finish["finish_reason"])})
        prompt_tokens = sum(results[h.tag]["prompt_tokens"] for h in handles)
        completion_tokens = sum(results[h.tag]["generated_tokens"] for h in handles)
        return JSONResponse({**meta, "choices": choices, "usage": {
            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}})

    async def openai_stream(handles, queue, params, extras, meta):
        # With stop sequences the end of the text is held back until it cannot be the start of
        # a stop sequence, because OpenAI leaves the stop sequence out of the text.
        hold = max((len(s) for s in params.stop), default=1) - 1
        sent = {h.tag: 0 for h in handles}
        text = {h.tag: "" for h in handles}
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        remaining = len(handles)

        def chunk(tag, piece, finish_reason=None, logprobs=None):
            return _sse({**meta, "choices": [{"index": tag, "text": piece, "logprobs": logprobs,
                                              "finish_reason": finish_reason}]})

        try:
            if extras["echo"]:
                for handle in handles:
                    yield chunk(handle.tag, handle.prepared.prompt)
            while remaining:
                tag, event = await queue.get()
                if isinstance(event, ErrorEvent):
                    yield _sse({"error": {"message": event.message, "type": event.error_type}})
                    return
                token, finish = event.token, event.finish
                logprobs = None
                if extras["logprobs"] is not None and not token["special"]:
                    logprobs = openai_logprobs([token], len(text[tag]))
                if not token["special"]:
                    text[tag] += token["text"]
                if finish is None:
                    safe = len(text[tag]) - hold
                    if safe > sent[tag] or logprobs is not None:
                        piece = text[tag][sent[tag]:max(safe, sent[tag])]
                        sent[tag] += len(piece)
                        yield chunk(tag, piece, logprobs=logprobs)
                    continue
                final = openai_text(finish)
                yield chunk(tag, final[sent[tag]:], openai_finish(finish["finish_reason"]),
                            logprobs)
                usage["prompt_tokens"] += finish["prompt_tokens"]
                usage["completion_tokens"] += finish["generated_tokens"]
                remaining -= 1
            if extras["include_usage"]:
                yield _sse({**meta, "choices": [], "usage": {
                    **usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}})
            yield "data: [DONE]\n\n"
        finally:
            cancel_unfinished(handles)

    @app.get("/v1/models")
    async def models():
        names = [engine.model_id] + engine.adapters.available()
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                            "owned_by": "course"} for name in names]}

    # --- state ----------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return JSONResponse({"error": "the scheduler is not running",
                                 "error_type": "generation"}, status_code=503)
        return {"status": "ok"}

    @app.get("/info")
    async def info():
        from .. import server

        return {**engine.info(), "version": server.__version__, "server": SERVER_NAME}

    @app.get("/metrics")
    async def metrics():
        lines = []
        for key, value in sorted(engine.snapshot().items()):
            lines.append(f"helpers_server_{key} {value:g}")
        return PlainTextResponse("\n".join(lines) + "\n")

    return app
