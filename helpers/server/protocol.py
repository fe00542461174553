"""What the server accepts and answers: request bodies, their checks, the error shape. (Lesson 07.)

Two families of protocols come in:

* LoRAX's REST protocol (``POST /``, ``/generate``, ``/generate_stream``): a body
  ``{"inputs": "...", "parameters": {...}, "stream": false}`` as ``lorax-client`` sends it,
  with every parameter present and the unset ones ``null``. TGI's protocol is the same with a
  few more parameters (``grammar``, ``top_n_tokens``, ``frequency_penalty``), which
  huggingface_hub's ``InferenceClient`` sends.
* OpenAI's completions and chat completions (``POST /v1/completions``,
  ``/v1/chat/completions``): ``{"model", "prompt" or "messages", "max_tokens", ...}``; the
  adapter's name goes in ``model``.

Each body becomes a ``Call``: the prompts, one ``GenerationParams`` that the engine
understands, and how the answer is shaped (how many sequences, echo, log probabilities). A
parameter that this server does not implement is never silently ignored: if a request sets it
to anything but its "off" value (null, false, an empty list), the answer is a 422 that names
it. Every error is ``{"error": "...", "error_type": "..."}`` with an HTTP status, as LoRAX does.
"""

from __future__ import annotations

import re

from dataclasses import dataclass, field
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field
from pydantic import ValidationError as PydanticValidationError

#: Stop sequences one request may give (LoRAX's default limit too).
MAX_STOP_SEQUENCES = 4
#: Alternatives per token that ``return_k_alternatives`` (or OpenAI ``logprobs``) may ask for.
MAX_ALTERNATIVES = 10
#: Seeds are 64-bit unsigned integers (what ``torch.Generator.manual_seed`` takes).
MAX_SEED = 2**64 - 1
#: Adapter sources this server can load from; LoRAX also knows "s3" and "pbase".
ADAPTER_SOURCES = ("local", "hub")
KNOWN_ADAPTER_SOURCES = ("local", "hub", "s3", "pbase")


class ApiError(Exception):
    """An error answered as ``{"error": message, "error_type": error_type}`` with ``status``.

    error_type is one of LoRAX's: "validation" (the request is wrong: 400, 404, 413, 422),
    "overloaded" (429: the queue is full), "generation" (424/500: the server could not do it).
    """

    def __init__(self, status: int, message: str, error_type: str = "validation"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type


def invalid(message: str, status: int = 422) -> ApiError:
    """A validation error (422 unless told otherwise)."""
    return ApiError(status, message, "validation")


# --- what the engine gets ----------------------------------------------------------------

@dataclass
class GenerationParams:
    """One request's generation settings, checked, in the engine's terms. (Lesson 07.)

    max_new_tokens None means "the server's default" (see ``Engine.prepare``). Sampling is on
    when ``do_sample`` is set or when any of temperature / top_k / top_p is given (as in TGI and
    LoRAX); otherwise decoding is greedy. ``grammar`` constrains the output: ``("json",
    schema)`` (JSON mode) or ``("regex", pattern)``; None is free text. A matched stop sequence
    stays in the text (as in LoRAX); the OpenAI route cuts the text before it.

    max_new_tokens 0 generates nothing (with ``prompt_logprobs``: score the prompt only, the
    loglikelihood request of evaluation harnesses). ``prompt_logprobs`` asks for every prompt
    token's log probability (LoRAX/TGI ``decoder_input_details``, OpenAI ``echo`` with
    ``logprobs``). The penalties follow OpenAI: ``frequency_penalty`` is subtracted from a
    token's logit once per time it was generated so far, ``presence_penalty`` once if it was;
    ``logit_bias`` adds a fixed amount to listed token ids.
    """

    max_new_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    ignore_eos_token: bool = False
    truncate: int | None = None
    details: bool = False
    return_full_text: bool = False
    alternatives: int | None = None
    adapter_id: str | None = None
    adapter_source: str | None = None
    api_token: str | None = None
    grammar: tuple[str, Any] | None = None
    typical_p: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    prompt_logprobs: bool = False

    @property
    def sampling(self) -> bool:
        """True when the next token is drawn at random (else: the most likely one)."""
        return bool(self.do_sample or self.temperature is not None or self.top_k is not None
                    or self.top_p is not None or self.typical_p is not None)


# --- what one HTTP request asks for --------------------------------------------------------

@dataclass
class Call:
    """One HTTP request in the routes' terms: what to generate and how to answer.

    prompts:   each a string, or a list of token ids (OpenAI's pre-tokenized prompts)
    best_of:   sequences generated per prompt (each a copy of the request with its own seed)
    n:         sequences returned per prompt: the ``n`` best of the ``best_of`` by mean log
               probability per token (OpenAI's rule); LoRAX returns one and lists the others
               in ``details.best_of_sequences``
    echo:      the prompt comes back before the answer (OpenAI completions)
    logprobs:  OpenAI: alternatives per token (0: only the chosen token's log probability);
               None: no log probabilities in the answer
    messages:  the chat's messages (``/v1/chat/completions``), already checked
    """

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


# --- request bodies ----------------------------------------------------------------------

class _Strict(BaseModel):
    # strict: "10" is not an integer and 1 is not a boolean; NaN and Infinity are not numbers
    # (Python's json module reads them, JSON does not have them); extra keys are looked at
    # afterwards (an unknown key set to a value is refused, one set to null is ignored).
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True,
                              allow_inf_nan=False)


class ResponseFormat(_Strict):
    """``{"type": "json_object", "schema": {...}}`` (LoRAX; TGI and huggingface_hub write
    ``"value"`` for ``"schema"``), OpenAI's ``{"type": "json_schema", "json_schema":
    {"schema": {...}}}``, or ``{"type": "text"}``."""

    type: Literal["json_object", "json_schema", "text"]
    schema_: Any = Field(default=None, alias="schema")
    value: Any = None
    json_schema: dict | None = None


class Grammar(_Strict):
    """TGI's ``grammar``: ``{"type": "json", "value": schema}`` or ``{"type": "regex",
    "value": pattern}`` (huggingface_hub's ``InferenceClient.text_generation(grammar=...)``)."""

    type: Literal["json", "json_object", "regex"]
    value: Any


class LoraxParameters(_Strict):
    """The ``parameters`` object of a LoRAX request: every field lorax-client 0.6.3 sends, and
    the TGI ones huggingface_hub's ``InferenceClient.text_generation`` adds."""

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


class LoraxRequest(_Strict):
    """A LoRAX (or TGI) request body."""

    inputs: str
    parameters: LoraxParameters | None = None
    stream: bool | None = None


class _OpenAISampling(_Strict):
    """The fields OpenAI's completions and chat completions share."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: dict | None = None
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
    ignore_eos_token: bool | None = None


class CompletionRequest(_OpenAISampling):
    """An OpenAI ``/v1/completions`` body. ``model`` names the adapter (or the base model);
    ``prompt`` is a text, a list of texts, a list of token ids or a list of such lists."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(_Strict):
    """One chat message. ``content`` is a text, or a list of parts of which only
    ``{"type": "text", "text": ...}`` is understood (this model reads no images)."""

    role: Literal["system", "user", "assistant", "developer"]
    content: Union[str, list[dict], None] = None
    name: str | None = None


class ChatRequest(_OpenAISampling):
    """An OpenAI ``/v1/chat/completions`` body."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


def _validate(model: type[BaseModel], data: Any) -> BaseModel:
    if not isinstance(data, dict):
        raise invalid(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except PydanticValidationError as err:
        raise invalid(describe_validation_errors(err.errors())) from None


def describe_validation_errors(errors: list[dict]) -> str:
    """One line per problem, each naming the field: ``parameters.max_new_tokens: ...``."""
    lines = []
    for error in errors[:5]:
        loc = ".".join(str(part) for part in error.get("loc", ()) if part not in ("body",))
        # Unions repeat the location once per member: keep the first, readable part.
        loc = loc.split(".str")[0].split(".list[")[0].split(".function-")[0]
        message = error.get("msg", "invalid value")
        got = error.get("input")
        shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
        lines.append(f"`{loc or 'body'}`: {message}{shown}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(lines) + more


def _reject_extras(model: BaseModel, where: str) -> None:
    """An unknown field with a value is refused; one that is null (or false) is ignored."""
    for key, value in (model.model_extra or {}).items():
        if value not in (None, False, [], {}):
            raise invalid(f"`{where}{key}` is not a parameter this server knows; it implements "
                          f"no such option, so it refuses the request rather than ignore it")


def _unsupported(name: str, why: str) -> ApiError:
    return invalid(f"`{name}` is not supported by this server ({why}); leave it unset")


def _schema_of(fmt: ResponseFormat | None, where: str) -> dict | None:
    if fmt is None or fmt.type == "text":
        return None
    _reject_extras(fmt, where)
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


def _grammar_of(fmt: ResponseFormat | None, grammar: Grammar | None,
                where: str) -> tuple[str, Any] | None:
    """The engine's grammar from a ``response_format`` or a TGI ``grammar`` (not both)."""
    schema = _schema_of(fmt, where + "response_format.")
    if grammar is None:
        return None if schema is None else ("json", schema)
    if schema is not None:
        raise invalid(f"`{where}grammar` and `{where}response_format` both constrain the "
                      f"answer: give one of them")
    _reject_extras(grammar, where + "grammar.")
    if grammar.type == "regex":
        if not isinstance(grammar.value, str) or not grammar.value:
            raise invalid(f"`{where}grammar.value` must be a regular expression (a string)")
        return ("regex", grammar.value)
    if not isinstance(grammar.value, dict):
        raise invalid(f"`{where}grammar.value` must be a JSON schema (an object), got "
                      f"{type(grammar.value).__name__}")
    return ("json", grammar.value)


def _greedy_if_zero(p: GenerationParams) -> None:
    """Temperature 0 means "always the most likely token" (OpenAI, vLLM, TGI's clients): the
    same as greedy decoding, on every route."""
    if p.temperature is not None and p.temperature == 0:
        p.temperature, p.do_sample = None, False
        p.top_k = p.top_p = p.typical_p = None


def _check_common(p: GenerationParams, prefix: str = "") -> None:
    """Range checks shared by all protocols (pydantic checked the types). The bounds that keep
    the sampler's arithmetic finite (NaN and Infinity, temperature, penalties, stop lengths,
    logit_bias) are ``guards.check_ranges``. Call after ``_greedy_if_zero``."""
    checks = [
        (p.max_new_tokens is None or p.max_new_tokens >= 0, "max_new_tokens",
         "must not be negative", p.max_new_tokens),
        (p.temperature is None or p.temperature > 0, "temperature", "must be >= 0",
         p.temperature),
        (p.top_k is None or p.top_k >= 1, "top_k", "must be strictly positive", p.top_k),
        (p.top_p is None or 0 < p.top_p <= 1, "top_p", "must be > 0 and <= 1", p.top_p),
        (p.seed is None or 0 <= p.seed <= MAX_SEED, "seed", "must be between 0 and 2**64 - 1",
         p.seed),
        (p.truncate is None or p.truncate >= 1, "truncate", "must be strictly positive",
         p.truncate),
    ]
    for ok, name, rule, value in checks:
        if not ok:
            raise invalid(f"`{prefix}{name}` {rule}, got {value}")
    if p.alternatives is not None and not 0 <= p.alternatives <= MAX_ALTERNATIVES:
        raise invalid(f"alternatives per token must be between 0 and {MAX_ALTERNATIVES}, got "
                      f"{p.alternatives}")
    _check_stop_and_source(p, prefix)
    from .guards import check_ranges   # finite numbers in ranges the sampler survives

    check_ranges(p, prefix)


def _check_stop_and_source(p: GenerationParams, prefix: str) -> None:
    if len(p.stop) > MAX_STOP_SEQUENCES:
        raise invalid(f"`{prefix}stop` may hold at most {MAX_STOP_SEQUENCES} sequences, got "
                      f"{len(p.stop)}")
    if any(s == "" for s in p.stop):
        raise invalid(f"`{prefix}stop` holds an empty string, which would stop at once")
    if p.adapter_source is not None and p.adapter_source not in ADAPTER_SOURCES:
        if p.adapter_source in KNOWN_ADAPTER_SOURCES:
            raise _unsupported(f"{prefix}adapter_source={p.adapter_source}",
                               f"this server loads adapters from {list(ADAPTER_SOURCES)} only")
        raise invalid(f"`{prefix}adapter_source` must be one of {list(ADAPTER_SOURCES)}, got "
                      f"{p.adapter_source!r}")


def _check_best_of(best_of: int | None, n: int, sampling: bool, name: str) -> int:
    """How many sequences to generate per prompt."""
    if best_of is None:
        return n
    if best_of < 1:
        raise invalid(f"`{name}` must be strictly positive, got {best_of}")
    if best_of < n:
        raise invalid(f"`{name}` ({best_of}) must be at least `n` ({n})")
    if best_of > MAX_BEST_OF:
        raise invalid(f"`{name}` may be at most {MAX_BEST_OF}, got {best_of}")
    if best_of > 1 and not sampling:
        raise invalid(f"`{name}` > 1 needs sampling (do_sample, or a temperature, top_k or "
                      f"top_p): greedy decoding would give {best_of} identical sequences")
    return best_of


#: Sequences one request may ask to generate per prompt (``best_of``, ``n``).
MAX_BEST_OF = 4


# --- LoRAX / TGI ---------------------------------------------------------------------------

def parse_lorax(data: Any) -> Call:
    """A LoRAX (or TGI) request body as a ``Call`` (one prompt), or an ``ApiError``."""
    request = _validate(LoraxRequest, data)
    _reject_extras(request, "")
    p = request.parameters or LoraxParameters()
    _reject_extras(p, "parameters.")
    if p.watermark:
        raise _unsupported("parameters.watermark", "it does not watermark its answers, and "
                           "an answer without the watermark asked for would mislead")
    if p.merged_adapters is not None:
        raise _unsupported("parameters.merged_adapters", "adapters are applied one per request, "
                           "never merged; use adapter_id")
    if p.return_k_alternatives is not None and p.top_n_tokens is not None:
        raise invalid("`parameters.return_k_alternatives` (LoRAX) and `parameters.top_n_tokens` "
                      "(TGI) ask for the same thing: give one of them")
    alternatives = p.return_k_alternatives if p.return_k_alternatives is not None \
        else p.top_n_tokens
    if alternatives is not None and alternatives < 1:
        raise invalid("`parameters.return_k_alternatives` (or `top_n_tokens`) must be "
                      "strictly positive")
    params = GenerationParams(
        max_new_tokens=p.max_new_tokens, stop=list(p.stop or []), do_sample=bool(p.do_sample),
        temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed,
        repetition_penalty=p.repetition_penalty, ignore_eos_token=bool(p.ignore_eos_token),
        truncate=p.truncate, details=bool(p.details), return_full_text=bool(p.return_full_text),
        alternatives=alternatives, adapter_id=p.adapter_id, adapter_source=p.adapter_source,
        api_token=p.api_token, typical_p=p.typical_p,
        frequency_penalty=p.frequency_penalty or 0.0,
        prompt_logprobs=bool(p.decoder_input_details),
        grammar=_grammar_of(p.response_format, p.grammar, "parameters."))
    if params.max_new_tokens is not None and params.max_new_tokens < 1:
        raise invalid(f"`parameters.max_new_tokens` must be at least 1, got "
                      f"{params.max_new_tokens}")
    _greedy_if_zero(params)
    _check_common(params, "parameters.")
    best_of = _check_best_of(p.best_of, 1, params.sampling, "parameters.best_of")
    if best_of > 1 and request.stream:
        raise invalid("`parameters.best_of` > 1 cannot be streamed (as in LoRAX): set "
                      "stream to false")
    if best_of > 1 and params.seed is not None:
        raise invalid("`parameters.seed` cannot be set with `best_of` > 1: each sequence "
                      "draws its own seed")
    return Call([request.inputs], params, stream=bool(request.stream), best_of=best_of)


# --- OpenAI -------------------------------------------------------------------------------

#: Names in an OpenAI ``model`` field that mean "the base model, no adapter": "" and "base",
#: "dummy" (what huggingface_hub's InferenceClient sends when it was given a URL) and "tgi"
#: (what TGI's examples send).
BASE_MODEL_NAMES = ("", "base", "__base__", "dummy", "tgi")
#: Prompts one OpenAI completions request may hold.
MAX_PROMPTS = 16
#: Messages in one chat request.
MAX_MESSAGES = 256


def adapter_of(model: str | None, model_id: str) -> str | None:
    """The adapter an OpenAI ``model`` field names (None: the base model). An unknown name
    goes to the adapter store, which answers 404 naming it."""
    model = model or ""
    return None if model in BASE_MODEL_NAMES or model == model_id else model


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        if not re.fullmatch(r"[0-9]{1,9}", key):
            raise invalid(f"`logit_bias` keys are token ids (strings of at most 9 digits 0-9), "
                          f"got {key[:20]!r}")
        if not -100 <= value <= 100:
            raise invalid(f"`logit_bias` values must be between -100 and 100, got {value} "
                          f"for token {key}")
        out[int(key)] = float(value)
    return out


def _openai_params(request: _OpenAISampling, model_id: str, max_tokens: int | None,
                   alternatives: int | None) -> GenerationParams:
    """GenerationParams from the fields completions and chat completions share."""
    if request.stream_options is not None:
        unknown = set(request.stream_options) - {"include_usage"}
        if unknown:
            raise _unsupported(f"stream_options.{sorted(unknown)[0]}", "only include_usage is")
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    params = GenerationParams(
        max_new_tokens=max_tokens, stop=stop, temperature=request.temperature,
        top_p=None if request.top_p in (None, 1, 1.0) else request.top_p,
        top_k=request.top_k, seed=request.seed, repetition_penalty=request.repetition_penalty,
        ignore_eos_token=bool(request.ignore_eos_token), details=True,
        alternatives=alternatives, adapter_id=adapter_of(request.model, model_id),
        adapter_source=request.adapter_source, api_token=request.api_token,
        frequency_penalty=request.frequency_penalty or 0.0,
        presence_penalty=request.presence_penalty or 0.0,
        logit_bias=_logit_bias(request.logit_bias),
        grammar=_grammar_of(request.response_format, None, ""))
    if params.temperature is not None and params.temperature < 0:
        raise invalid(f"`temperature` must be >= 0, got {params.temperature}")
    _greedy_if_zero(params)
    _check_common(params)
    return params


def _prompts_of(prompt) -> list:
    """OpenAI's four prompt shapes as a list of prompts (each a string or a list of ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(x, int) for x in prompt):
        return [list(prompt)]                  # one prompt given as token ids
    prompts = list(prompt)
    if not prompts:
        raise invalid("`prompt` is an empty list: give at least one prompt")
    if len(prompts) > MAX_PROMPTS:
        raise invalid(f"`prompt` holds {len(prompts)} prompts; at most {MAX_PROMPTS} per "
                      f"request")
    for ids in prompts:
        if isinstance(ids, list) and (not ids or min(ids) < 0):
            raise invalid("`prompt`: a prompt given as token ids must be a non-empty list of "
                          "non-negative integers")
    return prompts


def _n_of(n: int | None) -> int:
    n = 1 if n is None else n
    if not 1 <= n <= MAX_BEST_OF:
        raise invalid(f"`n` must be between 1 and {MAX_BEST_OF}, got {n}")
    return n


def _sample_if_several(params: GenerationParams, request: _OpenAISampling, copies: int) -> None:
    """Without a temperature this server decodes greedily (OpenAI's default is 1). Several
    sequences of one prompt would then all be the same, so they sample at OpenAI's default
    temperature 1 instead; an explicit ``temperature=0`` still gives identical copies."""
    if copies > 1 and request.temperature is None and not params.sampling:
        params.temperature = 1.0


def parse_completion(data: Any, model_id: str) -> Call:
    """An OpenAI completions body as a ``Call``, or an ``ApiError``.

    The adapter is the ``model`` field unless it names the base model (its id, "", "base").
    ``max_tokens`` 0 with ``echo`` and ``logprobs`` scores the prompt and generates nothing
    (the loglikelihood request of evaluation harnesses).
    """
    _check_count(data, "prompt", MAX_PROMPTS)
    request = _validate(CompletionRequest, data)
    _reject_extras(request, "")
    if request.suffix is not None:
        raise _unsupported("suffix", "no insertion mode")
    if request.logprobs is not None and not 0 <= request.logprobs <= 5:
        raise invalid(f"`logprobs` must be between 0 and 5, got {request.logprobs}")
    if request.max_tokens is not None and request.max_tokens < 0:
        raise invalid(f"`max_tokens` must not be negative, got {request.max_tokens}")
    params = _openai_params(request, model_id, request.max_tokens, request.logprobs or None)
    params.prompt_logprobs = bool(request.echo) and request.logprobs is not None
    stream = bool(request.stream)
    n = _n_of(request.n)
    best_of = _check_best_of(request.best_of, n, True, "best_of")
    _sample_if_several(params, request, best_of)
    if best_of > n and stream:
        raise invalid("`best_of` cannot be streamed: the best sequence is known only at the end")
    return Call(_prompts_of(request.prompt), params, stream=stream, best_of=best_of, n=n,
                echo=bool(request.echo), logprobs=request.logprobs,
                include_usage=bool((request.stream_options or {}).get("include_usage")),
                model=request.model if params.adapter_id else model_id)


def _message_text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise invalid(f"`messages[{index}].content` holds a {part.get('type')!r} part; "
                          f"this model reads text parts only")
        parts.append(part["text"])
    return "".join(parts)


def _check_count(data: Any, key: str, most: int) -> None:
    """A list in the body longer than the server takes is refused before validating it item
    by item (a cheap body of 200,000 tiny prompts would otherwise keep the event loop busy)."""
    value = data.get(key) if isinstance(data, dict) else None
    if isinstance(value, list) and len(value) > most:
        raise invalid(f"`{key}` holds {len(value)} items; at most {most} per request")


def parse_chat(data: Any, model_id: str) -> Call:
    """An OpenAI chat completions body as a ``Call`` whose ``messages`` are
    ``[{"role", "content"}]`` with text content; the route turns them into the prompt with
    the model's chat template (``chat.py``)."""
    _check_count(data, "messages", MAX_MESSAGES)
    request = _validate(ChatRequest, data)
    _reject_extras(request, "")
    if not request.messages:
        raise invalid("`messages` is empty: give at least one message")
    if request.max_tokens is not None and request.max_completion_tokens is not None:
        raise invalid("give `max_completion_tokens` or `max_tokens`, not both")
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None \
        else request.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise invalid(f"`max_completion_tokens` must be at least 1, got {max_tokens}")
    top = request.top_logprobs
    if top is not None and not 0 <= top <= 5:
        raise invalid(f"`top_logprobs` must be between 0 and 5, got {top}")
    if top is not None and not request.logprobs:
        raise invalid("`top_logprobs` needs `logprobs` set to true")
    params = _openai_params(request, model_id, max_tokens, top or None)
    messages = [{"role": m.role, "content": _message_text(m, i)}
                for i, m in enumerate(request.messages)]
    n = _n_of(request.n)
    _sample_if_several(params, request, n)
    return Call([], params, stream=bool(request.stream), best_of=n, n=n,
                logprobs=(top or 0) if request.logprobs else None,
                include_usage=bool((request.stream_options or {}).get("include_usage")),
                model=request.model if params.adapter_id else model_id, messages=messages)
