"""What every route shares (lesson 07): the request as a ``Call``, the checks both dialects
make, and ``Run``: submit to the engine, collect or stream its events, cancel what nobody waits
for. A route only translates its protocol's body into a ``Call`` and the ``Completion`` objects
(or a stream's events) into its answer. A parameter this server does not implement, set to
anything but its "off" value (null, false, an empty list), is a 422 naming it.

    run = await Run.start(request.app.state, call)   # engine.submit, in a worker thread
    completions = await run.collect(request)     # non-streaming: every completion, finished
    async for completion, event in run.events(): # streaming: events as they come
    run.close()                                  # cancels what is unfinished (always called)
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from pydantic import ValidationError as PydanticValidationError
from starlette.concurrency import run_in_threadpool

from . import errors, guards
from .contract import ErrorEvent, GenerationParams, Handle, PromptEvent, Submission, TokenEvent
from .guards import ApiError, invalid

#: Sequences one request may ask to generate per prompt (``best_of``, ``n``).
MAX_BEST_OF = 4
#: Rows one request may start (prompts x n x best_of): each row takes a batch slot.
MAX_ROWS_PER_REQUEST = 16


@dataclass
class Call:
    """One HTTP request in the routes' terms. ``prompts``: strings or lists of token ids;
    ``best_of`` sequences are generated per prompt, the ``n`` best returned; ``logprobs``
    (OpenAI): alternatives per token, 0 only the chosen token's, None none."""

    prompts: list
    params: GenerationParams
    stream: bool = False
    best_of: int = 1
    n: int = 1
    echo: bool = False
    logprobs: int | None = None
    include_usage: bool = False
    model: str = ""
    messages: list[dict] | None = None


class Strict(BaseModel):
    # strict: "10" is not an integer, 1 not a boolean, NaN not a number; extras: reject_extras
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True,
                              allow_inf_nan=False)


class ResponseFormat(Strict):
    """LoRAX's ``{"type": "json_object", "schema": {...}}`` (TGI writes ``"value"``), OpenAI's
    ``{"type": "json_schema", "json_schema": {"schema": {...}}}``, or ``{"type": "text"}``."""

    type: Literal["json_object", "json_schema", "text"]
    schema_: Any = Field(default=None, alias="schema")
    value: Any = None
    json_schema: dict | None = None


class Grammar(Strict):
    """TGI's ``grammar``: ``{"type": "json", "value": schema}`` or ``{"type": "regex",
    "value": pattern}``."""

    type: Literal["json", "json_object", "regex"]
    value: Any


def validate(model: type[BaseModel], data: Any) -> BaseModel:
    """``data`` as a ``model``, or a 422 naming each wrong field (``parameters.top_k: ...``)."""
    if not isinstance(data, dict):
        raise invalid(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except PydanticValidationError as err:
        problems = err.errors()
    lines = []
    for error in problems[:5]:
        loc = ".".join(str(part) for part in error.get("loc", ()) if part != "body")
        # Unions repeat the location once per member: keep the first, readable part.
        loc = loc.split(".str")[0].split(".list[")[0].split(".function-")[0]
        message = error.get("msg", "invalid value")
        got = error.get("input")
        shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
        lines.append(f"`{loc or 'body'}`: {message}{shown}")
    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    raise invalid("; ".join(lines) + more)


def reject_extras(model: BaseModel, where: str) -> None:
    """An unknown field with a value is refused; one that is null (or false) is ignored."""
    for key, value in (model.model_extra or {}).items():
        if value not in (None, False, [], {}):
            raise invalid(f"`{where}{key}` is not a parameter this server knows; it implements "
                          f"no such option, so it refuses the request rather than ignore it")


def unsupported(name: str, why: str) -> ApiError:
    return invalid(f"`{name}` is not supported by this server ({why}); leave it unset")


def _schema_of(fmt: ResponseFormat | None, where: str) -> dict | None:
    if fmt is None or fmt.type == "text":
        return None
    reject_extras(fmt, where)
    if fmt.type == "json_schema":
        inner = fmt.json_schema or {}
        schema = inner.get("schema")
        if schema is None:
            raise invalid(f"`{where}json_schema.schema` is missing: give the JSON schema")
    else:
        schema = fmt.schema_ if fmt.schema_ is not None else fmt.value
        if schema is None:
            schema = {"type": "object"}   # JSON mode without a schema: any JSON object
    if not isinstance(schema, dict):
        raise invalid(f"`{where}schema` must be a JSON schema (an object), got "
                      f"{type(schema).__name__}")
    return schema


def grammar_of(fmt: ResponseFormat | None, grammar: Grammar | None,
               where: str) -> tuple[str, Any] | None:
    """The engine's grammar from a ``response_format`` or a TGI ``grammar`` (not both)."""
    schema = _schema_of(fmt, where + "response_format.")
    if grammar is None:
        return None if schema is None else ("json", schema)
    if schema is not None:
        raise invalid(f"`{where}grammar` and `{where}response_format` both constrain the "
                      f"answer: give one of them")
    reject_extras(grammar, where + "grammar.")
    if grammar.type == "regex":
        if not isinstance(grammar.value, str) or not grammar.value:
            raise invalid(f"`{where}grammar.value` must be a regular expression (a string)")
        return ("regex", grammar.value)
    if not isinstance(grammar.value, dict):
        raise invalid(f"`{where}grammar.value` must be a JSON schema (an object), got "
                      f"{type(grammar.value).__name__}")
    return ("json", grammar.value)


def checked(params: GenerationParams, prefix: str = "") -> GenerationParams:
    """``params`` (temperature 0 read as greedy) after ``GenerationParams.check``, the one
    check of every parameter's range."""
    try:
        return params.greedy_if_zero().check(prefix)
    except errors.InvalidRequest as err:
        raise invalid(err.message) from None


def check_rows(prompts: int, n: int | None = 1, best_of: int | None = 1) -> None:
    """At most ``MAX_ROWS_PER_REQUEST`` rows: prompts x max(n, best_of), each generated in full."""
    copies = max(n or 1, best_of or 1)
    if prompts * copies > MAX_ROWS_PER_REQUEST:
        raise invalid(f"this request would generate {prompts * copies} sequences ({prompts} "
                      f"prompts x {copies}); at most {MAX_ROWS_PER_REQUEST} per request")


def check_range(name: str, value: int | None, low: int, high: int) -> None:
    if value is not None and not low <= value <= high:
        raise invalid(f"`{name}` must be between {low} and {high}, got {value}")


def check_best_of(best_of: int | None, n: int, sampling: bool, name: str) -> int:
    if best_of is None:
        return n
    check_range(name, best_of, 1, MAX_BEST_OF)
    if best_of < n:
        raise invalid(f"`{name}` ({best_of}) must be at least `n` ({n})")
    if best_of > 1 and not sampling:
        raise invalid(f"`{name}` > 1 needs sampling (do_sample, or a temperature, top_k or "
                      f"top_p): greedy decoding would give {best_of} identical sequences")
    return best_of


def sse(data) -> str:
    return "data:" + json.dumps(data, separators=(",", ":")) + "\n\n"


def event_stream(request, run: "Run", events, error) -> StreamingResponse:
    """Server-sent ``events`` (strings) of ``run``; a failure once started ends them with
    ``error(message, error_type)``. The run is closed in every case."""
    async def guarded():
        try:
            async for event in events:
                yield event
        except Exception as err:
            yield sse(error(*guards.stream_failure(err, request)))
        finally:
            run.close()

    return StreamingResponse(guarded(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


@dataclass(eq=False)
class Completion:
    """One sequence of the submission: ``copy`` (of best_of) of prompt ``index``, the prompt's
    tokens when asked for, the generated tokens (dicts: id, text, logprob, special[,
    alternative_tokens]) and the last event's ``contract.Finish`` (None until then)."""

    index: int
    copy: int
    prompt: str
    prompt_tokens: list[dict] | None = None
    tokens: list[dict] = field(default_factory=list)
    finish: object = None

    def mean_logprob(self) -> float:
        """How ``best_of`` ranks completions (OpenAI's rule; a sum would favour short ones)."""
        values = [t["logprob"] for t in self.tokens if t.get("logprob") is not None]
        return sum(values) / len(values) if values else 0.0

    def add(self, event) -> None:
        if isinstance(event, PromptEvent):
            self.prompt_tokens = list(event.tokens)
            return
        if event.token is not None:                # None: max_new_tokens 0, nothing generated
            self.tokens.append(event.token)
        if event.finish is not None:
            self.finish = event.finish


def pick(completions: list[Completion], n: int) -> list[Completion]:
    """The ``n`` best of one prompt's copies, best first (highest mean log probability)."""
    return sorted(completions, key=lambda c: -c.mean_logprob())[:n]


class Runs:
    """The runs in flight (``app.state.runs``). A server that is stopping (``__main__.py``)
    admits no new one, lets these finish for a while, then ``end``s the rest."""

    def __init__(self):
        self.active: set[Run] = set()
        self.stopping = False

    def end(self, message: str) -> None:
        for run in list(self.active):
            run._take([(None, ErrorEvent(message, status=503, error_type="unavailable"))])


class Run:
    """The engine submission of one HTTP request, and the queue its events come on."""

    def __init__(self, state):
        self.engine, self.metrics, self.runs = state.engine, state.metrics, state.runs
        self.queue: asyncio.Queue = asyncio.Queue()
        self.completions: list[Completion] = []
        self.handle: Handle | None = None
        self.loop = asyncio.get_running_loop()
        self.started: float = self.loop.time()
        self._last_token: dict[int, float] = {}

    @classmethod
    async def start(cls, state, call: Call) -> "Run":
        """Submit the call in a worker thread (admission may tokenize, load an adapter, compile
        a grammar, or ask another process); if the client goes meanwhile, the submission is
        cancelled once accepted. ``errors.Unavailable`` (503) once the server stops."""
        if state.runs.stopping:
            raise errors.Unavailable("the server is shutting down")
        run = cls(state)
        submission = Submission(call.params, call.prompts, call.messages, call.best_of)
        work = asyncio.ensure_future(run_in_threadpool(run.engine.submit, submission, run.sink))
        run.runs.active.add(run)
        try:
            handle = await asyncio.shield(work)
        except BaseException:
            run.runs.active.discard(run)
            work.add_done_callback(run._cancel_after)
            raise
        run.handle, copies = handle, call.best_of
        run.completions = [Completion(i // copies, i % copies, handle.prompts[i // copies])
                           for i in range(handle.sequences)]
        return run

    def sink(self, events: list) -> None:
        """Called from the engine's (or its pipe reader's) thread with one step's events."""
        try:
            self.loop.call_soon_threadsafe(self._take, events)
        except RuntimeError:          # the event loop is closed: nobody is listening
            pass

    def _take(self, events: list) -> None:
        """In the event loop: time each token for /metrics, and queue the events."""
        now = self.loop.time()
        for sequence, event in events:
            if isinstance(event, TokenEvent) and event.token is not None:
                last = self._last_token.get(sequence)      # None: the first, timed from start
                if last is None:
                    self.metrics.ttft.observe(now - self.started)
                else:
                    self.metrics.per_token.observe(now - last)
                self._last_token[sequence] = now
            self.queue.put_nowait((sequence, event))

    def _cancel_after(self, work) -> None:
        """Cancel what ``work`` submitted, nobody waiting for it (reading its error keeps
        asyncio from reporting it)."""
        if not work.cancelled() and work.exception() is None:
            self.engine.cancel(work.result())

    def close(self) -> None:
        """Cancel the submission if it has not finished. Safe to call twice."""
        self.runs.active.discard(self)
        if self.handle is not None and not self.handle.finished:
            self.engine.cancel(self.handle)

    async def next(self) -> tuple[Completion, object]:
        """The next ``(completion, event)``, the event added to it; an ErrorEvent raises."""
        sequence, event = await self.queue.get()
        if isinstance(event, ErrorEvent):
            raise ApiError(event.status, event.message, event.error_type)
        self.completions[sequence].add(event)
        return self.completions[sequence], event

    async def events(self):
        """Every ``(completion, event)`` until all finished; closes the run at the end, also
        when the consumer stops early."""
        try:
            while any(c.finish is None for c in self.completions):
                yield await self.next()
        finally:
            self.close()

    async def collect(self, request) -> list[Completion]:
        """Every completion, finished; ``guards.ClientGone`` if the client hangs up first."""
        async def every_event():
            async for _ in self.events():
                pass
            return self.completions

        return await guards.cancel_on_disconnect(request, every_event(), self.close)
