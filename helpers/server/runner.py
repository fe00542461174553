"""The one request path every route shares: read the body, prepare, submit, collect or stream
the engine's events, cancel what nobody waits for any more. (Lesson 07.)

A route (``routes_lorax.py``, ``routes_openai.py``) only translates: its protocol's body into a
``protocol.Call``, and the finished ``Sequence`` objects (or the events of a stream) into its
protocol's answer. Everything between is here, once:

    call = parse(await read_json(request))       # the route's parser; ApiError if wrong
    run = await Run.start(engine, call)          # engine.prepare + submit (worker thread)
    sequences = await run.collect(request)       # non-streaming: every sequence, finished
    async for sequence, event in run.events():   # streaming: events as they come
    run.close()                                  # cancels what is unfinished (always called)

``best_of`` and ``n`` are copies: one prepared request is submitted several times, each copy
with its own seed, and the engine sees separate requests. ``pick`` chooses the best ones.
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool

from . import guards
from .engine import ErrorEvent
from .protocol import ApiError, Call


async def read_json(request) -> Any:
    """The request's JSON body: ``Content-Type: application/json``, the size limit enforced
    while reading, strict JSON (``guards.py``). ApiError (4xx) otherwise."""
    guards.require_json(request)
    return guards.parse_json(await guards.read_body(request))


def check_call(call: Call, engine, prefix: str = "") -> Call:
    """The check every protocol shares once its body is parsed and its ranges checked
    (``guards.check_ranges``, from the protocol's parser; the engine checks what depends on
    the model, such as ``logit_bias``'s token ids): rows per request."""
    guards.check_rows(max(1, len(call.prompts)), call.n, call.best_of)
    return call


@dataclass(eq=False)
class Sequence:
    """One generated sequence: the engine's events for one submitted copy, gathered.

    index:   which prompt of the request (OpenAI's list of prompts; 0 for LoRAX)
    copy:    which copy of that prompt (best_of / n)
    prompt_tokens: the prompt's tokens with their log probabilities, when they were asked for
    tokens:  the generated tokens (dicts: id, text, logprob, special[, alternative_tokens])
    finish:  the finish dict of the last event (finish_reason, generated_text, ...), or None
    """

    index: int
    copy: int
    handle: Any
    prompt_tokens: list[dict] | None = None
    tokens: list[dict] = field(default_factory=list)
    finish: dict | None = None

    @property
    def prepared(self):
        return self.handle.prepared

    def mean_logprob(self) -> float:
        """Mean log probability per generated token: how ``best_of`` ranks sequences
        (OpenAI's rule; a sum would favour short answers)."""
        values = [t["logprob"] for t in self.tokens if t.get("logprob") is not None]
        return sum(values) / len(values) if values else 0.0

    def add(self, event) -> None:
        """Take one engine event (a PromptEvent or a TokenEvent)."""
        if not hasattr(event, "finish"):           # PromptEvent: the prompt's tokens
            self.prompt_tokens = list(event.tokens)
            return
        if event.token is not None:                # None: max_new_tokens 0, nothing generated
            self.tokens.append(event.token)
        if event.finish is not None:
            self.finish = event.finish


def prompt_text(engine, prepared) -> str:
    """The prompt as text (a prompt given as token ids is decoded)."""
    prompt = prepared.prompt
    if isinstance(prompt, str):
        return prompt
    return engine.tokenizer.decode(prepared.input_ids if hasattr(prepared, "input_ids")
                                   else prompt)


def pick(sequences: list[Sequence], n: int) -> list[Sequence]:
    """The ``n`` best of one prompt's copies, best first (highest mean log probability)."""
    return sorted(sequences, key=lambda s: -s.mean_logprob())[:n]


def _copy_with_seed(prepared, seed: int | None):
    """Another copy of a prepared request, sampling with ``seed``."""
    other = copy.copy(prepared)
    other.seed = seed
    return other


class Run:
    """The engine requests of one HTTP request, and the queue their events come on."""

    def __init__(self, engine, call: Call):
        self.engine = engine
        self.call = call
        self.queue: asyncio.Queue = asyncio.Queue()
        self.sequences: list[Sequence] = []
        self.handles: list = []

    @classmethod
    async def start(cls, engine, call: Call, prompts: list | None = None) -> "Run":
        """Prepare each prompt and submit ``call.best_of`` copies of each, in a worker thread:
        preparing may take a while (tokenizing, loading an adapter, compiling a grammar), and
        an engine in another process (``engine_process.py``) answers each call over a pipe.
        If the client goes away meanwhile, what was submitted is cancelled once the thread is
        done."""
        run = cls(engine, call)
        prompts = call.prompts if prompts is None else prompts
        loop = asyncio.get_running_loop()
        work = asyncio.ensure_future(run_in_threadpool(run._prepare_and_submit, prompts, loop))
        try:
            await asyncio.shield(work)
        except BaseException:
            work.add_done_callback(run._close_after)
            raise
        return run

    def _prepare_and_submit(self, prompts: list, loop) -> None:
        """In a worker thread: every prompt prepared first (a bad one refuses the request
        before anything runs), then the copies submitted, each copy with its own seed."""
        prepared = []
        try:
            for prompt in prompts:
                prepared.append(self.engine.prepare(prompt, self.call.params))
            for index, first in enumerate(prepared):
                for number in range(self.call.best_of):
                    item = first
                    if number and first.seed is not None:          # each copy its own draw
                        item = _copy_with_seed(first, (first.seed + number) % 2**64)
                    handle = self.engine.submit(item, loop, self.queue, len(self.sequences))
                    self.handles.append(handle)
                    self.sequences.append(Sequence(index, number, handle))
        finally:       # submitted or not, no more copies will be made of them
            for item in prepared:
                self.engine.release(item)

    def _close_after(self, work) -> None:
        """``work`` (the submitting thread's future) is done, and nobody waits for its
        requests: cancel them (and read its error, so that asyncio does not report it)."""
        if not work.cancelled():
            work.exception()
        self.close()

    def close(self) -> None:
        """Cancel every request of this run that has not finished (the client went away, or
        an error ended the run). Safe to call twice."""
        for handle in self.handles:
            if not handle.finished:
                self.engine.cancel(handle)

    async def next(self) -> tuple[Sequence, Any]:
        """The next ``(sequence, event)``; the event is already added to its sequence. An
        ErrorEvent raises ApiError (with the engine's status and error type)."""
        tag, event = await self.queue.get()
        if isinstance(event, ErrorEvent):
            raise ApiError(event.status, event.message, event.error_type)
        sequence = self.sequences[tag]
        sequence.add(event)
        return sequence, event

    @property
    def finished(self) -> bool:
        return all(s.finish is not None for s in self.sequences)

    async def events(self):
        """Every event of the run, as ``(sequence, event)``, until all sequences finished.
        Closes the run at the end, and also when the consumer stops early (a streaming
        response whose client hung up is cancelled by Starlette)."""
        try:
            while not self.finished:
                yield await self.next()
        finally:
            self.close()

    async def _collect(self) -> list[Sequence]:
        try:
            while not self.finished:
                await self.next()
        finally:
            self.close()
        return self.sequences

    async def collect(self, request) -> list[Sequence]:
        """Wait until every sequence finished. If the client hangs up first, its requests
        are cancelled at once (``guards.cancel_on_disconnect``) and ``guards.ClientGone`` is
        raised."""
        return await guards.cancel_on_disconnect(request, self._collect(), self.close)

    def by_prompt(self) -> list[list[Sequence]]:
        """The sequences grouped by prompt, in the prompts' order."""
        groups: list[list[Sequence]] = [[] for _ in range(1 + max(
            (s.index for s in self.sequences), default=-1))]
        for sequence in self.sequences:
            groups[sequence.index].append(sequence)
        return groups
