"""What the server accepts and answers: request bodies, their checks, the error shape. (Lesson 07.)

Two protocols come in:

* LoRAX's REST protocol (``POST /``, ``/generate``, ``/generate_stream``): a body
  ``{"inputs": "...", "parameters": {...}, "stream": false}`` as ``lorax-client`` sends it,
  with every parameter present and the unset ones ``null``.
* OpenAI's completions protocol (``POST /v1/completions``): ``{"model", "prompt",
  "max_tokens", ...}``; the adapter's name goes in ``model``.

Both are turned into one ``GenerationParams`` that the engine understands. A parameter that
this server does not implement is never silently ignored: if a request sets it to anything but
its "off" value (null, false, an empty list, 1 for ``best_of``), the answer is a 422 that names
it. Every error is ``{"error": "...", "error_type": "..."}`` with an HTTP status, as LoRAX does.
"""

from __future__ import annotations

import json
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


# --- request bodies ----------------------------------------------------------------------

class _Strict(BaseModel):
    # strict: "10" is not an integer and 1 is not a boolean; extra keys are looked at
    # afterwards (an unknown key set to a value is refused, one set to null is ignored).
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)


class ResponseFormat(_Strict):
    """``{"type": "json_object", "schema": {...}}`` (LoRAX), or OpenAI's
    ``{"type": "json_schema", "json_schema": {"schema": {...}}}``, or ``{"type": "text"}``."""

    type: Literal["json_object", "json_schema", "text"]
    schema_: Any = Field(default=None, alias="schema")
    json_schema: dict | None = None


class LoraxParameters(_Strict):
    """The ``parameters`` object of a LoRAX request (every field lorax-client 0.6.3 sends)."""

    adapter_id: str | None = None
    adapter_source: str | None = None
    merged_adapters: Any = None
    api_token: str | None = None
    do_sample: bool | None = None
    max_new_tokens: int | None = None
    ignore_eos_token: bool | None = None
    repetition_penalty: float | None = None
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
    response_format: ResponseFormat | None = None


class LoraxRequest(_Strict):
    """A LoRAX request body."""

    inputs: str
    parameters: LoraxParameters | None = None
    stream: bool | None = None


class CompletionRequest(_Strict):
    """An OpenAI ``/v1/completions`` body. ``model`` names the adapter (or the base model)."""

    model: str | None = None
    prompt: Union[str, list[str]]
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: dict | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    suffix: str | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # LoRAX's extensions of the OpenAI body
    adapter_source: str | None = None
    api_token: str | None = None
    repetition_penalty: float | None = None
    top_k: int | None = None
    ignore_eos_token: bool | None = None


def parse_json_body(raw: bytes) -> Any:
    """The request body as JSON, or a 400 that says what is wrong with it."""
    if not raw.strip():
        raise invalid("the request body is empty: send a JSON object", 400)
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise invalid("the request body is not UTF-8 text", 400) from None
    except json.JSONDecodeError as err:
        raise invalid(f"the request body is not valid JSON: {err.msg} (line {err.lineno}, "
                      f"column {err.colno})", 400) from None


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
        schema = fmt.schema_
        if schema is None:
            schema = {"type": "object"}   # JSON mode without a schema: any JSON object
    if not isinstance(schema, dict):
        raise invalid(f"`{where}schema` must be a JSON schema (an object), got "
                      f"{type(schema).__name__}")
    return schema


def _grammar_of(fmt: ResponseFormat | None, where: str) -> tuple[str, dict] | None:
    schema = _schema_of(fmt, where)
    return None if schema is None else ("json", schema)


def _check_common(p: GenerationParams, prefix: str = "") -> None:
    """Range checks shared by both protocols (types were checked by pydantic)."""
    if p.max_new_tokens is not None and p.max_new_tokens < 1:
        raise invalid(f"`{prefix}max_new_tokens` must be at least 1, got {p.max_new_tokens}")
    if p.temperature is not None and not p.temperature > 0:
        raise invalid(f"`{prefix}temperature` must be strictly positive, got {p.temperature}")
    if p.top_k is not None and p.top_k < 1:
        raise invalid(f"`{prefix}top_k` must be strictly positive, got {p.top_k}")
    if p.top_p is not None and not 0 < p.top_p <= 1:
        raise invalid(f"`{prefix}top_p` must be > 0 and <= 1, got {p.top_p}")
    if p.repetition_penalty is not None and not p.repetition_penalty > 0:
        raise invalid(f"`{prefix}repetition_penalty` must be strictly positive, got "
                      f"{p.repetition_penalty}")
    if p.seed is not None and not 0 <= p.seed <= MAX_SEED:
        raise invalid(f"`{prefix}seed` must be between 0 and 2**64 - 1, got {p.seed}")
    if p.truncate is not None and p.truncate < 1:
        raise invalid(f"`{prefix}truncate` must be strictly positive, got {p.truncate}")
    if p.alternatives is not None and not 0 <= p.alternatives <= MAX_ALTERNATIVES:
        raise invalid(f"alternatives per token must be between 0 and {MAX_ALTERNATIVES}, got "
                      f"{p.alternatives}")
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


def parse_lorax(data: Any) -> tuple[str, GenerationParams, bool]:
    """``(inputs, params, stream)`` of a LoRAX request body, or an ``ApiError``."""
    request = _validate(LoraxRequest, data)
    _reject_extras(request, "")
    p = request.parameters or LoraxParameters()
    _reject_extras(p, "parameters.")
    if p.best_of is not None and p.best_of != 1:
        raise _unsupported("parameters.best_of", "one sequence is generated per request")
    if p.watermark:
        raise _unsupported("parameters.watermark", "no watermarking")
    if p.merged_adapters is not None:
        raise _unsupported("parameters.merged_adapters", "adapters are applied one per request, "
                           "never merged; use adapter_id")
    if p.typical_p is not None:
        raise _unsupported("parameters.typical_p", "no typical sampling; use top_p or top_k")
    if p.decoder_input_details:
        raise _unsupported("parameters.decoder_input_details", "the prompt's token log "
                           "probabilities are not computed")
    params = GenerationParams(
        max_new_tokens=p.max_new_tokens, stop=list(p.stop or []), do_sample=bool(p.do_sample),
        temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed,
        repetition_penalty=p.repetition_penalty, ignore_eos_token=bool(p.ignore_eos_token),
        truncate=p.truncate, details=bool(p.details), return_full_text=bool(p.return_full_text),
        alternatives=p.return_k_alternatives, adapter_id=p.adapter_id,
        adapter_source=p.adapter_source, api_token=p.api_token,
        grammar=_grammar_of(p.response_format, "parameters.response_format."))
    if p.return_k_alternatives is not None and p.return_k_alternatives < 1:
        raise invalid("`parameters.return_k_alternatives` must be strictly positive")
    _check_common(params, "parameters.")
    return request.inputs, params, bool(request.stream)


#: Names in an OpenAI ``model`` field that mean "the base model, no adapter".
BASE_MODEL_NAMES = ("", "base", "__base__")


def parse_completion(data: Any, model_id: str) -> tuple[list[str], GenerationParams, bool, dict]:
    """``(prompts, params, stream, extras)`` of an OpenAI completions body.

    extras: ``echo`` (prompt before the answer), ``logprobs`` (int or None), ``include_usage``
    (a last streamed chunk with the token counts), ``model`` (the name to answer with).
    The adapter is the ``model`` field unless it names the base model (its id, "", "base").
    """
    request = _validate(CompletionRequest, data)
    _reject_extras(request, "")
    if request.n not in (None, 1):
        raise _unsupported("n", "one completion is generated per prompt")
    if request.best_of not in (None, 1):
        raise _unsupported("best_of", "one sequence is generated per prompt")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name) not in (None, 0, 0.0):
            raise _unsupported(name, "use repetition_penalty instead")
    if request.logit_bias:
        raise _unsupported("logit_bias", "no per-token biases")
    if request.suffix is not None:
        raise _unsupported("suffix", "no insertion mode")
    if request.stream_options is not None:
        unknown = set(request.stream_options) - {"include_usage"}
        if unknown:
            raise _unsupported(f"stream_options.{sorted(unknown)[0]}", "only include_usage is")
    prompts = [request.prompt] if isinstance(request.prompt, str) else list(request.prompt)
    if not prompts:
        raise invalid("`prompt` is an empty list: give at least one prompt")
    if len(prompts) > 16:
        raise invalid(f"`prompt` holds {len(prompts)} prompts; at most 16 per request")
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    model = request.model or ""
    adapter = None if model in BASE_MODEL_NAMES or model == model_id else model
    temperature = request.temperature
    # OpenAI's temperature 0 means "always the most likely token": greedy decoding here.
    greedy = temperature is not None and temperature == 0
    if temperature is not None and temperature < 0:
        raise invalid(f"`temperature` must be >= 0, got {temperature}")
    if request.logprobs is not None and not 0 <= request.logprobs <= 5:
        raise invalid(f"`logprobs` must be between 0 and 5, got {request.logprobs}")
    params = GenerationParams(
        max_new_tokens=request.max_tokens, stop=stop,
        temperature=None if greedy else temperature,
        top_p=None if greedy or request.top_p in (None, 1, 1.0) else request.top_p,
        top_k=None if greedy else request.top_k,
        seed=request.seed, repetition_penalty=request.repetition_penalty,
        ignore_eos_token=bool(request.ignore_eos_token),
        details=True, alternatives=request.logprobs or None,
        adapter_id=adapter, adapter_source=request.adapter_source, api_token=request.api_token,
        grammar=_grammar_of(request.response_format, "response_format."))
    if params.max_new_tokens is not None and params.max_new_tokens < 1:
        raise invalid(f"`max_tokens` must be at least 1, got {params.max_new_tokens}")
    _check_common(params)
    extras = {"echo": bool(request.echo), "logprobs": request.logprobs,
              "include_usage": bool((request.stream_options or {}).get("include_usage")),
              "model": request.model or model_id}
    return prompts, params, bool(request.stream), extras
