"""LoRAX's routes, which are TGI's too (lesson 07).

    POST /                  what lorax-client and InferenceClient call: a JSON array with one
                            answer, or server-sent events if the body says ``"stream": true``
    POST /generate          one answer: ``{"generated_text", "details"}``
    POST /generate_stream   server-sent events, one per token, ``data:{json}``
    POST /tokenize          TGI's: the prompt's tokens (id, text, start, stop)
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from . import guards
from .contract import GenerationParams, TokenEvent
from .guards import invalid
from .serving import (Call, Completion, Grammar, ResponseFormat, Run, Strict, check_best_of,
                      check_rows, checked, event_stream, grammar_of, pick, reject_extras, sse,
                      unsupported, validate)

#: Alternatives per token (``return_k_alternatives``, ``top_n_tokens``); the engine allows 20.
MAX_LORAX_ALTERNATIVES = 10

router = APIRouter()


class LoraxParameters(Strict):
    """A LoRAX request's ``parameters``: every field lorax-client 0.6.3 sends, and the TGI ones
    of huggingface_hub's ``InferenceClient.text_generation``."""

    adapter_id: str | None = None
    adapter_source: str | None = None
    merged_adapters: Any = None
    api_token: str | None = None
    do_sample: bool | None = None
    max_new_tokens: int | None = None
    ignore_eos_token: bool | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    return_full_text: bool | None = None
    stop: list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    truncate: int | None = None
    typical_p: float | None = None
    best_of: int | None = None
    watermark: bool | None = None
    details: bool | None = None
    decoder_input_details: bool | None = None
    return_k_alternatives: int | None = None
    top_n_tokens: int | None = None
    response_format: ResponseFormat | None = None
    grammar: Grammar | None = None


class LoraxRequest(Strict):
    inputs: str
    parameters: LoraxParameters | None = None
    stream: bool | None = None


def parse_lorax(data: Any) -> Call:
    request = validate(LoraxRequest, data)
    reject_extras(request, "")
    p = request.parameters or LoraxParameters()
    reject_extras(p, "parameters.")
    if p.watermark:
        raise unsupported("parameters.watermark", "it does not watermark its answers, and "
                          "an answer without the watermark asked for would mislead")
    if p.merged_adapters is not None:
        raise unsupported("parameters.merged_adapters", "adapters are applied one per request, "
                          "never merged; use adapter_id")
    if p.return_k_alternatives is not None and p.top_n_tokens is not None:
        raise invalid("`parameters.return_k_alternatives` (LoRAX) and `parameters.top_n_tokens` "
                      "(TGI) ask for the same thing: give one of them")
    alternatives = p.top_n_tokens if p.return_k_alternatives is None else p.return_k_alternatives
    if alternatives is not None and not 1 <= alternatives <= MAX_LORAX_ALTERNATIVES:
        raise invalid(f"`parameters.return_k_alternatives` (or `top_n_tokens`): alternatives "
                      f"must be between 1 and {MAX_LORAX_ALTERNATIVES}, got {alternatives}")
    params = GenerationParams(
        max_new_tokens=p.max_new_tokens, stop=list(p.stop or []), do_sample=bool(p.do_sample),
        temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed,
        repetition_penalty=p.repetition_penalty, ignore_eos_token=bool(p.ignore_eos_token),
        truncate=p.truncate, details=bool(p.details), return_full_text=bool(p.return_full_text),
        alternatives=alternatives, adapter_id=p.adapter_id, adapter_source=p.adapter_source,
        api_token=p.api_token, typical_p=p.typical_p, min_p=p.min_p,
        frequency_penalty=p.frequency_penalty or 0.0,
        prompt_logprobs=bool(p.decoder_input_details),
        grammar=grammar_of(p.response_format, p.grammar, "parameters."))
    if params.max_new_tokens is not None and params.max_new_tokens < 1:
        raise invalid(f"`parameters.max_new_tokens` must be at least 1, got "
                      f"{params.max_new_tokens}")
    checked(params, "parameters.")
    best_of = check_best_of(p.best_of, 1, params.sampling, "parameters.best_of")
    if best_of > 1 and request.stream:
        raise invalid("`parameters.best_of` > 1 cannot be streamed (as in LoRAX): set "
                      "stream to false")
    if best_of > 1 and params.seed is not None:
        raise invalid("`parameters.seed` cannot be set with `best_of` > 1: each sequence "
                      "draws its own seed")
    check_rows(1, 1, best_of)
    return Call([request.inputs], params, stream=bool(request.stream), best_of=best_of)


async def parse(request: Request) -> Call:
    return parse_lorax(await guards.read_json(request))


def top_tokens(engine, token: dict) -> list[dict]:
    """TGI's ``top_tokens`` of one token: its alternatives, each with ``special``."""
    return [{**alt, "special": alt["id"] in engine.special_ids}
            for alt in token.get("alternative_tokens") or []]


def finish_details(finish) -> dict:
    return {"finish_reason": finish.reason, "prompt_tokens": finish.prompt_tokens,
            "generated_tokens": finish.generated_tokens, "seed": finish.seed}


def details(engine, sequence: Completion, call: Call) -> dict:
    out = {**finish_details(sequence.finish),
           "prefill": [{k: t[k] for k in ("id", "text", "logprob")}
                       for t in sequence.prompt_tokens or []],
           "tokens": sequence.tokens}
    if call.params.alternatives:
        out["top_tokens"] = [top_tokens(engine, t) for t in sequence.tokens]
    return out


def generated_text(sequence: Completion, call: Call) -> str:
    return (sequence.prompt if call.params.return_full_text else "") + sequence.finish.text


async def generate_answer(request: Request, call: Call) -> dict:
    """The answer to a non-streaming request: the best of its sequences (one unless
    ``best_of``), the others in ``details.best_of_sequences``."""
    engine = request.app.state.engine
    run = await Run.start(request.app.state, call)
    best, *others = pick(await run.collect(request), call.best_of)
    out = {"generated_text": generated_text(best, call)}
    if call.params.details:
        out["details"] = {**details(engine, best, call), "best_of_sequences": None}
        if call.best_of > 1:
            out["details"]["best_of_sequences"] = [
                {"generated_text": generated_text(s, call),
                 **{k: v for k, v in details(engine, s, call).items() if k != "prompt_tokens"}}
                for s in others]
    return out


async def stream(request: Request, call: Call) -> StreamingResponse:
    """Server-sent events, one per token, the last with the text and the details. The request
    is admitted before the response starts, so a refusal is an HTTP error, not an event."""
    engine = request.app.state.engine
    run = await Run.start(request.app.state, call)

    async def messages():
        async for sequence, event in run.events():
            if not isinstance(event, TokenEvent) or event.token is None:     # the prompt
                continue
            message = {"index": 0, "token": event.token, "generated_text": None, "details": None}
            if call.params.alternatives:
                message["top_tokens"] = top_tokens(engine, event.token)
            if event.finish is not None:
                message["generated_text"] = generated_text(sequence, call)
                message["details"] = {**finish_details(event.finish),      # and TGI's name:
                                      "input_length": event.finish.prompt_tokens}
            yield sse(message)

    return event_stream(request, run, messages(),
                        lambda message, error_type: {"error": message, "error_type": error_type})


@router.post("/")
async def compat(request: Request):
    call = await parse(request)
    if call.stream:
        return await stream(request, call)
    return JSONResponse([await generate_answer(request, call)])


@router.post("/generate")
async def generate(request: Request):
    return JSONResponse(await generate_answer(request, await parse(request)))


@router.post("/generate_stream")
async def generate_stream(request: Request):
    call = await parse(request)
    if call.best_of > 1:        # the route streams whatever the body's `stream` says
        raise invalid("`parameters.best_of` > 1 cannot be streamed (as in LoRAX): use "
                      "/generate, or best_of 1")
    return await stream(request, call)


@router.post("/tokenize")
async def tokenize(request: Request):
    call = await parse(request)                     # the body /generate takes
    return JSONResponse(await run_in_threadpool(request.app.state.engine.tokenize,
                                                call.prompts[0]))
