"""The HTTP request path every route shares: read the body, submit, collect or stream the
engine's events, cancel what nobody waits for any more. (Lesson 07.)

A route (``routes_lorax.py``, ``routes_openai.py``) only translates: its protocol's body into a
``protocol.Call``, and the finished ``Completion`` objects (or the events of a stream) into its
protocol's answer. Everything between is here, once:

    call = parse(await read_json(request))       # the route's parser; ApiError if wrong
    run = await Run.start(request.app.state, call)   # engine.submit, in a worker thread
    completions = await run.collect(request)     # non-streaming: every completion, finished
    async for completion, event in run.events(): # streaming: events as they come
    run.close()                                  # cancels what is unfinished (always called)

The engine answers one submission per HTTP request: its prompts, each generated
``call.best_of`` times (``n`` and ``best_of`` are copies, each sampling with a seed of its
own);
``pick`` chooses the best ones. Events reach the run through its sink, from the engine's
thread (or the thread reading the engine's process), and are handed to the event loop once per
step.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from . import errors, guards
from .contract import ErrorEvent, Handle, PromptEvent, Submission, TokenEvent
from .protocol import ApiError, Call


async def read_json(request):
    """The request's JSON body: ``Content-Type: application/json``, the size limit enforced
    while reading, strict JSON (``guards.py``). ApiError (4xx) otherwise."""
    guards.require_json(request)
    return guards.parse_json(await guards.read_body(request))


def sse(data) -> str:
    """One server-sent event, as LoRAX writes it (``data:`` then compact JSON)."""
    return "data:" + json.dumps(data, separators=(",", ":")) + "\n\n"


def event_stream(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


@dataclass(eq=False)
class Completion:
    """One generated completion: the engine's events for one sequence of the submission.

    index:   which prompt of the request (OpenAI's list of prompts; 0 for LoRAX)
    copy:    which copy of that prompt (best_of / n)
    prompt:  the prompt as the engine read it (a text; token ids decoded)
    prompt_tokens: the prompt's tokens with their log probabilities, when they were asked for
    tokens:  the generated tokens (dicts: id, text, logprob, special[, alternative_tokens])
    finish:  the ``contract.Finish`` of the last event, or None
    """

    index: int
    copy: int
    prompt: str
    prompt_tokens: list[dict] | None = None
    tokens: list[dict] = field(default_factory=list)
    finish: object = None

    def mean_logprob(self) -> float:
        """Mean log probability per generated token: how ``best_of`` ranks completions
        (OpenAI's rule; a sum would favour short answers)."""
        values = [t["logprob"] for t in self.tokens if t.get("logprob") is not None]
        return sum(values) / len(values) if values else 0.0

    def add(self, event) -> None:
        """Take one engine event (a PromptEvent or a TokenEvent)."""
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
        """End every run in flight with a 503 error event: a stream's last event, or the
        answer of a request that waits for its whole completion."""
        for run in list(self.active):
            run._take([(None, ErrorEvent(message, status=503, error_type="unavailable"))])


class Run:
    """The engine submission of one HTTP request, and the queue its events come on."""

    def __init__(self, state, call: Call):
        self.engine, self.metrics, self.runs = state.engine, state.metrics, state.runs
        self.call = call
        self.queue: asyncio.Queue = asyncio.Queue()
        self.completions: list[Completion] = []
        self.handle: Handle | None = None
        self.loop = asyncio.get_running_loop()
        self.started: float = self.loop.time()
        self._last_token: dict[int, float] = {}

    @classmethod
    async def start(cls, state, call: Call) -> "Run":
        """Submit the call to ``state.engine`` (the app's state: engine, metrics, runs) in a
        worker thread: admitting it may take a while (tokenizing, loading an adapter, compiling
        a grammar), and an engine in another process (``engine_process.py``) answers over a
        pipe. If the client goes away meanwhile, the submission is cancelled once it is
        accepted. ``errors.Unavailable`` (503) once the server is stopping."""
        if state.runs.stopping:
            raise errors.Unavailable("the server is shutting down")
        run = cls(state, call)
        submission = Submission(call.params, call.prompts, call.messages, call.best_of)
        work = asyncio.ensure_future(run_in_threadpool(run.engine.submit, submission, run.sink))
        run.runs.active.add(run)
        try:
            handle = await asyncio.shield(work)
        except BaseException:
            run.runs.active.discard(run)
            work.add_done_callback(run._cancel_after)
            raise
        run._started(handle)
        return run

    def _started(self, handle: Handle) -> None:
        self.handle = handle
        copies = self.call.best_of
        self.completions = [Completion(i // copies, i % copies, handle.prompts[i // copies])
                            for i in range(handle.sequences)]

    def sink(self, events: list) -> None:
        """Called from the engine's thread (or the thread reading the engine's process) with
        one step's events of this run."""
        try:
            self.loop.call_soon_threadsafe(self._take, events)
        except RuntimeError:          # the event loop is closed: nobody is listening
            pass

    def _take(self, events: list) -> None:
        """In the event loop: count each token for /metrics (what the client saw), and queue
        the events."""
        now = self.loop.time()
        for sequence, event in events:
            if isinstance(event, TokenEvent) and event.token is not None:
                self.metrics.observe_token(self.started, self._last_token.get(sequence), now)
                self._last_token[sequence] = now
            self.queue.put_nowait((sequence, event))

    def _cancel_after(self, work) -> None:
        """``work`` (the submitting thread's future) is done, and nobody waits for it:
        cancel what it submitted (and read its error, so that asyncio does not report it)."""
        if work.cancelled() or work.exception() is not None:
            return
        self.engine.cancel(work.result())

    def close(self) -> None:
        """Cancel the submission if it has not finished (the client went away, or an error
        ended the run). Safe to call twice."""
        self.runs.active.discard(self)
        if self.handle is not None and not self.handle.finished:
            self.engine.cancel(self.handle)

    async def next(self) -> tuple[Completion, object]:
        """The next ``(completion, event)``; the event is already added to its completion. An
        ErrorEvent raises ApiError (with the engine's status and error type)."""
        sequence, event = await self.queue.get()
        if isinstance(event, ErrorEvent):
            raise ApiError(event.status, event.message, event.error_type)
        completion = self.completions[sequence]
        completion.add(event)
        return completion, event

    @property
    def finished(self) -> bool:
        return all(c.finish is not None for c in self.completions)

    async def events(self):
        """Every event of the run, as ``(completion, event)``, until all completions finished.
        Closes the run at the end, and also when the consumer stops early (a streaming
        response whose client hung up is cancelled by Starlette)."""
        try:
            while not self.finished:
                yield await self.next()
        finally:
            self.close()

    async def _collect(self) -> list[Completion]:
        try:
            while not self.finished:
                await self.next()
        finally:
            self.close()
        return self.completions

    async def collect(self, request) -> list[Completion]:
        """Wait until every completion finished. If the client hangs up first, its requests
        are cancelled at once (``guards.cancel_on_disconnect``) and ``guards.ClientGone`` is
        raised."""
        return await guards.cancel_on_disconnect(request, self._collect(), self.close)

    def by_prompt(self) -> list[list[Completion]]:
        """The completions grouped by prompt, in the prompts' order."""
        groups: list[list[Completion]] = [[] for _ in range(1 + max(
            (c.index for c in self.completions), default=-1))]
        for completion in self.completions:
            groups[completion.index].append(completion)
        return groups
