"""OpenAI's routes (lesson 07).

    POST /v1/completions         completions (``stream`` too); the adapter goes in ``model``
    POST /v1/chat/completions    chat completions (``stream`` too), through the chat template
    GET  /v1/models              the base model and the adapters
    GET  /v1/models/{id}         one of them (404 for a name this server does not serve)

Unlike LoRAX's answers, the text leaves out a matched stop sequence (and its tokens) and the
special tokens; ``n`` and ``best_of`` return the best sequences as separate choices.
"""

from __future__ import annotations

import time
import uuid
from itertools import groupby

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from . import errors, guards
from .contract import PromptEvent
from .openai_bodies import adapter_of, parse_chat, parse_completion
from .serving import Call, Completion, Run, event_stream, pick, sse

router = APIRouter()


def finish_reason(sequence: Completion) -> str:
    return "length" if sequence.finish.reason == "length" else "stop"


def cut(sequence: Completion) -> tuple[str, list[tuple[int, dict]]]:
    """The text as OpenAI returns it (no special tokens, no matched stop sequence), built from
    the tokens' pieces so that a streamed answer agrees, and the ``(start, token)`` in it."""
    finish = sequence.finish
    stop_at = finish.stop_at if finish.reason == "stop_sequence" else None
    text, kept, engine_offset = "", [], 0    # engine_offset: where the engine's text is
    for token in sequence.tokens:
        piece, start = token["text"], engine_offset
        engine_offset += len(piece)
        if token["special"]:
            continue
        if stop_at is not None and engine_offset > stop_at:
            # The token the stop sequence starts in stays if any of its text comes before.
            if stop_at > start:
                kept.append((len(text), token))
            return text + piece[:max(0, stop_at - start)], kept
        kept.append((len(text), token))
        text += piece
    return text, kept


def usage(sequences: list[Completion]) -> dict:
    """Token counts: each prompt once, every generated sequence (chosen or not)."""
    prompt_tokens = sum({s.index: s.finish.prompt_tokens for s in sequences}.values())
    completion_tokens = sum(s.finish.generated_tokens for s in sequences)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def header(kind: str, call: Call) -> dict:
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": call.model}


def top_of(token: dict) -> dict:
    return {alt["text"]: alt["logprob"] for alt in token.get("alternative_tokens") or []}


async def answer(request: Request, parser, kind: str, stream, choice) -> JSONResponse:
    """A route's whole answer to the body read by ``parser``: ``stream(run, call, meta)``'s
    chunks, or ``choice(sequence, call, index)`` of the ``n`` best of each prompt's copies."""
    call = parser(await guards.read_json(request), request.app.state.engine.model_id)
    try:
        run = await Run.start(request.app.state, call)
    except errors.EngineError as err:      # the adapter came in `model`: say that field
        if err.message.startswith("adapter_id "):
            raise type(err)("`model`" + err.message[len("adapter_id"):]) from None
        raise
    if call.stream:
        # OpenAI names a chat stream's objects "chat.completion.chunk"
        meta = header(f"{kind}.chunk" if kind == "chat.completion" else kind, call)

        async def chunks():            # then the usage chunk if asked, and [DONE]
            async for chunk in stream(run, call, meta):
                yield chunk
            if call.include_usage:
                yield sse({**meta, "choices": [], "usage": usage(run.completions)})
            yield "data: [DONE]\n\n"

        return event_stream(request, run, chunks(), lambda message, error_type: {
            "error": {"message": message, "type": error_type}})
    sequences = await run.collect(request)
    returned = [s for _, copies in groupby(sequences, key=lambda s: s.index)
                for s in pick(list(copies), call.n)]
    return JSONResponse({**header(kind, call),
                         "choices": [choice(s, call, i) for i, s in enumerate(returned)],
                         "usage": usage(sequences)})


# --- completions ----------------------------------------------------------------------------

def completion_logprobs(tokens: list[tuple[int, dict]], offset: int = 0, prompt=()) -> dict:
    """OpenAI's completions ``logprobs``: the ``prompt_entries`` given, then ``tokens``
    (``(start, token)``, starts counted from ``offset``)."""
    entries = list(prompt) + [(offset + start, t["text"], t["logprob"], top_of(t))
                              for start, t in tokens]
    return {"tokens": [e[1] for e in entries], "token_logprobs": [e[2] for e in entries],
            "top_logprobs": [e[3] for e in entries], "text_offset": [e[0] for e in entries]}


def prompt_entries(sequence: Completion) -> list[tuple]:
    """The echoed prompt's tokens as ``(offset, text, logprob, top)``; the first has no
    alternatives (nothing comes before it)."""
    entries, offset = [], 0
    for i, token in enumerate(sequence.prompt_tokens or []):
        entries.append((offset, token["text"], token["logprob"], top_of(token) if i else None))
        offset += len(token["text"])
    return entries


def completion_choice(sequence: Completion, call: Call, index: int) -> dict:
    text, kept = cut(sequence)
    prefix = sequence.prompt if call.echo else ""
    logprobs = None if call.logprobs is None else completion_logprobs(
        kept, len(prefix), prompt_entries(sequence) if call.echo else ())
    return {"index": index, "text": prefix + text, "logprobs": logprobs,
            "finish_reason": finish_reason(sequence)}


@router.post("/v1/completions")
async def completions(request: Request):
    return await answer(request, parse_completion, "text_completion", completion_stream,
                        completion_choice)


class Held:
    """One streamed choice's text, held back while its end could still begin a stop sequence
    (which OpenAI leaves out, and a chunk sent cannot be taken back). Tokens go out whole."""

    def __init__(self, stop: list[str]):
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0
        self.pending: list[tuple[int, dict]] = []

    def add(self, token: dict | None) -> tuple[str, list[tuple[int, dict]]]:
        """Take a token that is not the last; ``(text, tokens)`` that can be sent now."""
        self.take(token)
        safe = len(self.text) - self.hold
        ready = []
        while self.pending and self.pending[0][0] + len(self.pending[0][1]["text"]) <= safe:
            ready.append(self.pending.pop(0))
        end = ready[-1][0] + len(ready[-1][1]["text"]) if ready else self.sent
        return self._release(end), ready

    def take(self, token: dict | None) -> None:
        if token is not None and not token["special"]:
            self.pending.append((len(self.text), token))
            self.text += token["text"]

    def finish(self, last: dict | None, final: str) -> tuple[str, list[tuple[int, dict]]]:
        """Take the last token; the rest, now that the final text is known (a token that begins
        at or after its end holds only the cut stop sequence, as in ``cut``)."""
        self.take(last)
        ready = [(start, t) for start, t in self.pending if start < len(final)]
        self.pending = []
        return self._release(len(final), final), ready

    def _release(self, end: int, text: str | None = None) -> str:
        piece = (self.text if text is None else text)[self.sent:end]
        self.sent = max(self.sent, end)
        return piece


async def released(run: Run, call: Call):
    """``(sequence, event, text, tokens)`` for each event of a streamed run: what ``Held``
    lets go now (nothing for a ``PromptEvent``)."""
    held = {s: Held(call.params.stop) for s in run.completions}
    async for s, event in run.events():
        if isinstance(event, PromptEvent):
            yield s, event, "", []
        elif event.finish is None:
            yield s, event, *held[s].add(event.token)
        else:
            yield s, event, *held[s].finish(event.token, cut(s)[0])


async def completion_stream(run: Run, call: Call, meta: dict):
    def chunk(index, text, tokens, offset=0, reason=None, prompt=()):
        logprobs = None if call.logprobs is None else completion_logprobs(tokens, offset, prompt)
        return sse({**meta, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                         "finish_reason": reason}]})

    for s in run.completions:
        if call.echo and not call.params.prompt_logprobs:
            yield chunk(s.index * call.n + s.copy, s.prompt, [])
    async for s, event, text, tokens in released(run, call):
        index, prefix = s.index * call.n + s.copy, s.prompt if call.echo else ""
        if isinstance(event, PromptEvent):         # the prompt's tokens (echo + logprobs)
            yield chunk(index, prefix, [], prompt=prompt_entries(s))
        elif event.finish is not None:
            yield chunk(index, text, tokens, len(prefix), finish_reason(s))
        elif text or tokens:
            yield chunk(index, text, tokens, len(prefix))


# --- chat completions -----------------------------------------------------------------------

def chat_logprobs(tokens: list[tuple[int, dict]]) -> dict:
    def entry(token: dict) -> dict:
        return {"token": token["text"], "logprob": token["logprob"],
                "bytes": list(token["text"].encode("utf-8"))}

    return {"content": [{**entry(t), "top_logprobs": [entry(a) for a in
                                                      t.get("alternative_tokens") or []]}
                        for _, t in tokens]}


def chat_choice(sequence: Completion, call: Call, index: int) -> dict:
    text, kept = cut(sequence)
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": chat_logprobs(kept) if call.logprobs is not None else None,
            "finish_reason": finish_reason(sequence)}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await answer(request, parse_chat, "chat.completion", chat_stream, chat_choice)


async def chat_stream(run: Run, call: Call, meta: dict):
    def chunk(index, delta, tokens=(), reason=None):
        logprobs = chat_logprobs(list(tokens)) if call.logprobs is not None and tokens else None
        return sse({**meta, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": reason}]})

    for s in run.completions:
        yield chunk(s.copy, {"role": "assistant", "content": ""})
    async for s, event, text, tokens in released(run, call):
        if text or tokens:
            yield chunk(s.copy, {"content": text}, tokens)
        if not isinstance(event, PromptEvent) and event.finish is not None:
            yield chunk(s.copy, {}, reason=finish_reason(s))


# --- models ---------------------------------------------------------------------------------
# Plain functions (run in a worker thread): the adapters may be asked of the engine's process.

def model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "course"}


@router.get("/v1/models")
def models(request: Request):
    engine = request.app.state.engine
    names = [engine.model_id] + engine.adapters_available()
    return {"object": "list", "data": [model_card(n) for n in names]}


@router.get("/v1/models/{name:path}")
def model(request: Request, name: str):
    engine = request.app.state.engine
    adapter = adapter_of(name, engine.model_id)
    if adapter is None:                # the base model, under any of its names
        return model_card(engine.model_id)
    available = engine.adapters_available()
    if adapter not in available and adapter not in engine.adapters_loaded():
        raise errors.NotFound(f"the model {name!r} does not exist on this server: it serves "
                              f"{engine.model_id!r} and the adapters {available}")
    return model_card(name)
