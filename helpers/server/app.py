"""The application that puts the routes (``routes_lorax.py``, ``routes_openai.py``) in front of
the engine, with ``GET /health``, ``/info``, ``/metrics`` and the error handlers. (Lesson 07.)
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import errors, guards, metrics, routes_lorax, routes_openai, serving
from .contract import MAX_STOP_SEQUENCES, EngineClient
from .guards import ApiError
from .serving import MAX_BEST_OF

SERVER_NAME = "helpers.server (Efficiently Serving LLMs, lesson 07)"

#: How each engine error is answered: the first class that matches (a subclass before its
#: parent). lorax-client raises NotFoundError for "not_found", ValidationError for "validation".
ENGINE_ERRORS = [
    (errors.TooLarge, 413, "validation"),
    (errors.InvalidRequest, 422, "validation"),
    (errors.NotFound, 404, "not_found"),
    (errors.Overloaded, 429, "overloaded"),
    (errors.Unavailable, 503, "unavailable"),
    (errors.EngineError, 500, "generation"),        # GenerationFailed, and any other
]


def status_of(err: errors.EngineError) -> tuple[int, str]:
    """The HTTP status and LoRAX error_type that answer an engine error."""
    return next((status, error_type) for kind, status, error_type in ENGINE_ERRORS
                if isinstance(err, kind))


def error_response(message: str, error_type: str, status: int, request: Request | None = None,
                   headers=None) -> JSONResponse:
    """LoRAX's error body; under /v1/ "error" is OpenAI's object ("error_type" is there too)."""
    if request is not None and request.url.path.startswith("/v1/"):
        body = {"error": {"message": message, "type": error_type, "param": None,
                          "code": status}, "error_type": error_type}
    else:
        body = {"error": message, "error_type": error_type}
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(engine: EngineClient, *, manage_engine: bool = True) -> FastAPI:
    """The FastAPI application serving ``engine``, which it starts and stops if
    ``manage_engine``. (Lesson 07.)"""

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
    app.state.metrics = metrics.Metrics()       # what the clients saw: latencies, statuses
    app.state.runs = serving.Runs()             # the requests in flight
    add_error_handlers(app)
    app.include_router(routes_lorax.router)
    app.include_router(routes_openai.router)
    add_state_routes(app, engine)
    app.add_middleware(guards.AnswerGuard, responses=app.state.metrics.responses)
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error in the body of the protocol the client spoke."""

    @app.exception_handler(ApiError)
    async def api_error(request, err: ApiError):
        return error_response(err.message, err.error_type, err.status, request,
                              headers=getattr(err, "headers", None))

    @app.exception_handler(errors.EngineError)
    async def engine_error(request, err: errors.EngineError):
        status, error_type = status_of(err)
        return error_response(err.message, error_type, status, request)

    @app.exception_handler(guards.ClientGone)
    async def client_gone(request, err: guards.ClientGone):
        # Nobody reads this answer; 499 (nginx's "client closed request") marks it in logs.
        return error_response("client disconnected", "generation", 499)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, err: StarletteHTTPException):
        message = err.detail if isinstance(err.detail, str) else json.dumps(err.detail)
        error_type = "validation"
        if err.status_code == 404:
            message, error_type = f"no route {request.method} {request.url.path}", "not_found"
        elif err.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        return error_response(message, error_type, err.status_code, request,
                              headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected_error(request, err: Exception):
        message = guards.internal_error(request, err)     # logged; no internals sent
        return error_response(message, "generation", 500, request)


def add_state_routes(app: FastAPI, engine: EngineClient) -> None:
    # Plain functions: FastAPI runs them in a worker thread, so that asking an engine in
    # another process never holds up the event loop.
    @app.get("/health")
    def health():
        """200 only if the engine answers now (a process killed a moment ago looks alive)."""
        if app.state.runs.stopping:
            return error_response("the server is shutting down", "unavailable", 503)
        try:
            if engine.healthy:
                engine.snapshot()
                return {"status": "ok", "engine_restarts": engine.restarts}
        except errors.Unavailable:
            pass
        return JSONResponse({"error": "the scheduler is not running",
                             "error_type": "unavailable",
                             "engine_restarts": engine.restarts}, status_code=503)

    @app.get("/info")
    def info():
        from .. import server

        return {**engine.info(), "max_best_of": MAX_BEST_OF,
                "max_stop_sequences": MAX_STOP_SEQUENCES, "version": server.__version__,
                "server": SERVER_NAME}

    @app.get("/metrics")
    def prometheus():
        try:
            snapshot = engine.snapshot()
        except errors.Unavailable:        # the engine's process is gone: the rest still counts
            snapshot = None
        page = app.state.metrics.render(snapshot, engine.restarts)
        return PlainTextResponse(page, media_type=metrics.CONTENT_TYPE)
