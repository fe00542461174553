"""OpenAI's request bodies as a ``Call`` for ``routes_openai.py`` (lesson 07); the adapter's
name goes in ``model``."""

from __future__ import annotations

import re
from typing import Any, Literal, Union

from .contract import MAX_ALTERNATIVES, GenerationParams
from .guards import invalid
from .serving import (MAX_BEST_OF, Call, ResponseFormat, Strict, check_best_of, check_range,
                      check_rows, checked, grammar_of, reject_extras, unsupported, validate)

#: The largest ``top_logprobs`` (chat) and ``logprobs`` (completions) OpenAI allows.
MAX_TOP_LOGPROBS = MAX_ALTERNATIVES
MAX_COMPLETION_LOGPROBS = 5
#: ``model`` names meaning "the base model": "dummy" is what InferenceClient sends when given
#: a URL, "tgi" what TGI's examples send.
BASE_MODEL_NAMES = ("", "base", "__base__", "dummy", "tgi")
#: Prompts in one completions request, messages in one chat request.
MAX_PROMPTS = 16
MAX_MESSAGES = 256
#: New tokens of a completions request without ``max_tokens``: OpenAI's default.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class StreamOptions(Strict):
    include_usage: bool | None = None


class _OpenAISampling(Strict):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # LoRAX's (and vLLM's) extensions of the OpenAI body
    adapter_source: str | None = None
    api_token: str | None = None
    repetition_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos_token: bool | None = None


class CompletionRequest(_OpenAISampling):
    # list[int] first: a long list of token ids then validates in one pass (smart unions try
    # the members in order, and a failing list[str] would list an error per item).
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(Strict):
    """``content`` is a text or ``{"type": "text", "text": ...}`` parts; the tool-calling roles
    and fields are here only so that ``parse_chat`` can refuse them by name."""

    role: Literal["system", "user", "assistant", "developer", "tool", "function"]
    content: Union[str, list[dict], None] = None
    name: str | None = None
    tool_calls: Any = None
    function_call: Any = None
    tool_call_id: Any = None


class ChatRequest(_OpenAISampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Any, so that every value reaches ``_refuse_tools`` and its message.
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None


def adapter_of(model: str | None, model_id: str) -> str | None:
    """The adapter ``model`` names (None: the base model; an unknown name is the store's 404)."""
    return None if (model or "") in BASE_MODEL_NAMES or model == model_id else model


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        if not re.fullmatch(r"[0-9]{1,9}", key):
            raise invalid(f"`logit_bias` keys are token ids (strings of at most 9 digits 0-9), "
                          f"got {key[:20]!r}")
        out[int(key)] = float(value)          # its range: GenerationParams.check
    return out


def _openai_params(request: _OpenAISampling, model_id: str, max_tokens: int | None,
                   alternatives: int | None) -> GenerationParams:
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    params = GenerationParams(
        max_new_tokens=max_tokens, stop=stop, temperature=request.temperature,
        top_p=None if request.top_p in (None, 1, 1.0) else request.top_p,
        top_k=request.top_k, min_p=request.min_p, seed=request.seed,
        repetition_penalty=request.repetition_penalty,
        ignore_eos_token=bool(request.ignore_eos_token), details=True,
        alternatives=alternatives, adapter_id=adapter_of(request.model, model_id),
        adapter_source=request.adapter_source, api_token=request.api_token,
        frequency_penalty=request.frequency_penalty or 0.0,
        presence_penalty=request.presence_penalty or 0.0,
        logit_bias=_logit_bias(request.logit_bias),
        grammar=grammar_of(request.response_format, None, ""))
    if params.temperature is not None and params.temperature < 0:
        raise invalid(f"`temperature` must be >= 0, got {params.temperature}")
    return checked(params)


def _include_usage(request: _OpenAISampling) -> bool:
    """Whether a stream ends with the usage chunk; ``stream_options`` (not null) needs a stream."""
    if request.stream_options is None:
        return False
    if request.stream is not True:
        raise invalid("`stream_options` is only allowed when `stream` is true: leave it unset "
                      "(or null) for an answer that is not streamed")
    reject_extras(request.stream_options, "stream_options.")
    return bool(request.stream_options.include_usage)


def _is_token_ids(value) -> bool:
    """One prompt as token ids: a non-empty list of integers (not booleans)."""
    return isinstance(value, list) and bool(value) and all(type(x) is int for x in value)


def _check_prompt_count(data: Any) -> None:
    """At most ``MAX_PROMPTS`` prompts, and a shape that is one of the four, checked before
    validating item by item (as ``parse_chat`` does for ``messages``). One list of token ids is
    one prompt, however long (the engine bounds it)."""
    value = data.get("prompt") if isinstance(data, dict) else None
    if isinstance(value, list) and len(value) > MAX_PROMPTS and not _is_token_ids(value):
        raise invalid(f"`prompt` holds {len(value)} items; at most {MAX_PROMPTS} per request "
                      f"(a list of texts or of token-id lists is that many prompts; one prompt "
                      f"given as token ids is a flat list of integers)")
    # A shape that is none of them: one message, not one per member of the union.
    items = value if isinstance(value, list) else [value]
    leaves = [x for item in items for x in (item if isinstance(item, list) else [item])]
    wrong = [x for x in leaves if not isinstance(x, (str, int)) or isinstance(x, bool)]
    if value is not None and wrong:
        raise invalid(f"`prompt` must be a text, a list of texts, a list of token ids "
                      f"(integers) or a list of such lists; it holds {wrong[0]!r} "
                      f"({type(wrong[0]).__name__})")


def _prompts_of(prompt) -> list:
    """OpenAI's four prompt shapes as a list of prompts (strings or lists of ids)."""
    if isinstance(prompt, str):
        return [prompt]
    prompts = [list(prompt)] if _is_token_ids(prompt) else list(prompt)
    if not prompts:
        raise invalid("`prompt` is an empty list: give at least one prompt")
    for ids in prompts:
        if isinstance(ids, list) and (not ids or min(ids) < 0):
            raise invalid("`prompt`: a prompt given as token ids must be a non-empty list of "
                          "non-negative integers")
    return prompts


def _n_of(n: int | None) -> int:
    check_range("n", n, 1, MAX_BEST_OF)
    return 1 if n is None else n


def _call(request: _OpenAISampling, params: GenerationParams, model_id: str, copies: int,
          **fields) -> Call:
    """The body's ``Call``. Several copies of a prompt without a temperature sample at OpenAI's
    default 1 (this server's default is greedy: they would all be the same); 0 stays 0."""
    if copies > 1 and request.temperature is None and not params.sampling:
        params.temperature = 1.0
    return Call(params=params, stream=bool(request.stream), include_usage=_include_usage(request),
                model=request.model if params.adapter_id else model_id, **fields)


def parse_completion(data: Any, model_id: str) -> Call:
    """A completions body as a ``Call``. ``max_tokens`` 0 with ``echo`` and ``logprobs`` scores
    the prompt only (evaluation harnesses' loglikelihood request)."""
    _check_prompt_count(data)
    request = validate(CompletionRequest, data)
    reject_extras(request, "")
    if request.suffix is not None:
        raise unsupported("suffix", "no insertion mode")
    check_range("logprobs", request.logprobs, 0, MAX_COMPLETION_LOGPROBS)
    # Missing or null: OpenAI's default for completions (not the server's, as chat gets).
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if request.max_tokens is None \
        else request.max_tokens
    if max_tokens < 0:
        raise invalid(f"`max_tokens` must not be negative, got {max_tokens}")
    params = _openai_params(request, model_id, max_tokens, request.logprobs or None)
    params.prompt_logprobs = bool(request.echo) and request.logprobs is not None
    n = _n_of(request.n)
    best_of = check_best_of(request.best_of, n, True, "best_of")
    if best_of > n and request.stream:
        raise invalid("`best_of` cannot be streamed: the best sequence is known only at the end")
    prompts = _prompts_of(request.prompt)
    check_rows(len(prompts), n, best_of)
    return _call(request, params, model_id, best_of, prompts=prompts, best_of=best_of, n=n,
                 echo=bool(request.echo), logprobs=request.logprobs)


def _message_text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise invalid(f"`messages[{index}].content` holds a {part.get('type')!r} part; "
                          f"this model reads text parts only")
    return "".join(part["text"] for part in content)


_NO_TOOLS = "the model cannot call tools"


def _refuse_tools(request: ChatRequest) -> None:
    """Tool (and function) calling is refused by field: an answer that ignored the tools would
    look like a model that chose not to call one. Each field's "off" value is accepted."""
    off = {"tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
           "function_call": (None, "none"), "parallel_tool_calls": (None, False)}
    for name, values in off.items():
        value = getattr(request, name)
        if not any(value is v or (type(value) is type(v) and value == v) for v in values):
            raise unsupported(name, _NO_TOOLS)
    for i, message in enumerate(request.messages):
        if message.role in ("tool", "function"):
            raise invalid(f"`messages[{i}].role` is {message.role!r}: this server has no tool "
                          f"calling ({_NO_TOOLS}), so there is no tool call for a {message.role} "
                          f"result to answer; leave such messages out")
        for name in ("tool_calls", "function_call", "tool_call_id"):
            if getattr(message, name) not in (None, []):
                raise invalid(f"`messages[{i}].{name}` is not supported by this server "
                              f"({_NO_TOOLS}, so no tool call can be in the conversation); "
                              f"leave it unset")


def parse_chat(data: Any, model_id: str) -> Call:
    """A chat body as a ``Call`` whose ``messages`` are ``[{"role", "content"}]``, texts that
    the engine puts through the chat template."""
    # Counted before validating item by item: 200,000 tiny messages would keep the loop busy.
    messages = data.get("messages") if isinstance(data, dict) else None
    if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
        raise invalid(f"`messages` holds {len(messages)} items; at most {MAX_MESSAGES} per request")
    request = validate(ChatRequest, data)
    reject_extras(request, "")
    if not request.messages:
        raise invalid("`messages` is empty: give at least one message")
    _refuse_tools(request)
    if request.max_tokens is not None and request.max_completion_tokens is not None:
        raise invalid("give `max_completion_tokens` or `max_tokens`, not both")
    # Neither given (or null): the server's default, capped by the room left (OpenAI has none).
    given = "max_completion_tokens" if request.max_completion_tokens is not None \
        else "max_tokens"
    max_tokens = getattr(request, given)
    if max_tokens is not None and max_tokens < 1:
        raise invalid(f"`{given}` must be at least 1, got {max_tokens}")
    top = request.top_logprobs
    check_range("top_logprobs", top, 0, MAX_TOP_LOGPROBS)
    if top is not None and not request.logprobs:
        raise invalid("`top_logprobs` needs `logprobs` set to true")
    params = _openai_params(request, model_id, max_tokens, top or None)
    messages = [{"role": m.role, "content": _message_text(m, i)}
                for i, m in enumerate(request.messages)]
    if not any(m["content"] for m in messages):
        where = "`messages[0].content`" if len(messages) == 1 else \
            f"every `content` of the {len(messages)} messages"
        raise invalid(f"{where} is missing or empty: give the model some text")
    n = _n_of(request.n)
    check_rows(1, n, n)
    return _call(request, params, model_id, n, prompts=[], best_of=n, n=n, messages=messages,
                 logprobs=(top or 0) if request.logprobs else None)
