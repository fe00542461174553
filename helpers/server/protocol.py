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
understands, and how the answer is shaped (how many sequences, echo, log probabilities). The
parsers check shapes and what each protocol allows; the ranges of the engine's parameters are
checked once, by ``GenerationParams.check`` (``contract.py``). A parameter that this server
does not implement is never silently ignored: if a request sets it
to anything but its "off" value (null, false, an empty list), the answer is a 422 that names
it. Every error is ``{"error": "...", "error_type": "..."}`` with an HTTP status, as LoRAX does.
"""

from __future__ import annotations

import re

from dataclasses import dataclass
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field
from pydantic import ValidationError as PydanticValidationError

from .contract import MAX_ALTERNATIVES, GenerationParams
from .errors import InvalidRequest

#: Alternatives per token each protocol lets a request ask for (the engine's bound,
#: ``contract.MAX_ALTERNATIVES``, is OpenAI chat's 20):
#: LoRAX's ``return_k_alternatives`` (TGI's ``top_n_tokens``)
MAX_LORAX_ALTERNATIVES = 10
#: OpenAI chat's ``top_logprobs`` (0 to 20, as OpenAI allows)
MAX_TOP_LOGPROBS = MAX_ALTERNATIVES
#: OpenAI completions' ``logprobs`` (0 to 5, as OpenAI's legacy completions allow)
MAX_COMPLETION_LOGPROBS = 5
#: Rows one request may start (prompts x n x best_of): each row takes a batch slot.
MAX_ROWS_PER_REQUEST = 16


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
    min_p: float | None = None
    ignore_eos_token: bool | None = None


class CompletionRequest(_OpenAISampling):
    """An OpenAI ``/v1/completions`` body. ``model`` names the adapter (or the base model);
    ``prompt`` is a text, a list of texts, a list of token ids or a list of such lists."""

    # list[int] before list[str]: a long list of token ids then validates in one pass (smart
    # unions try the members in order, and a failing list[str] would list an error per item).
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = None         # None (missing or null): OpenAI's default, 16
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(_Strict):
    """One chat message. ``content`` is a text, or a list of parts of which only
    ``{"type": "text", "text": ...}`` is understood (this model reads no images).

    The tool-calling roles ("tool", "function") and fields (``tool_calls``, ``function_call``,
    ``tool_call_id``) are known here only so that ``parse_chat`` can refuse them by name."""

    role: Literal["system", "user", "assistant", "developer", "tool", "function"]
    content: Union[str, list[dict], None] = None
    name: str | None = None
    tool_calls: Any = None
    function_call: Any = None
    tool_call_id: Any = None


class ChatRequest(_OpenAISampling):
    """An OpenAI ``/v1/chat/completions`` body."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Tool calling, which this server refuses by name (``_refuse_tools``); Any, so that every
    # value reaches that check and its message.
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None


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


def _checked(params: GenerationParams, prefix: str = "") -> GenerationParams:
    """``params`` with temperature 0 read as greedy, checked by ``GenerationParams.check`` (the
    one check of every parameter's range; pydantic checked their types), as an ApiError."""
    try:
        return params.greedy_if_zero().check(prefix)
    except InvalidRequest as err:
        raise invalid(err.message) from None


def check_rows(prompts: int, n: int | None = 1, best_of: int | None = 1) -> None:
    """One request may start at most ``MAX_ROWS_PER_REQUEST`` rows: prompts x max(n,
    best_of) (each row is generated in full, whatever is returned)."""
    copies = max(n or 1, best_of or 1)
    if prompts * copies > MAX_ROWS_PER_REQUEST:
        raise invalid(f"this request would generate {prompts * copies} sequences ({prompts} "
                      f"prompts x {copies}); at most {MAX_ROWS_PER_REQUEST} per request")


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
    if alternatives is not None and not 1 <= alternatives <= MAX_LORAX_ALTERNATIVES:
        raise invalid(f"`parameters.return_k_alternatives` (or `top_n_tokens`): alternatives "
                      f"per token must be between 1 and {MAX_LORAX_ALTERNATIVES}, got "
                      f"{alternatives}")
    params = GenerationParams(
        max_new_tokens=p.max_new_tokens, stop=list(p.stop or []), do_sample=bool(p.do_sample),
        temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed,
        repetition_penalty=p.repetition_penalty, ignore_eos_token=bool(p.ignore_eos_token),
        truncate=p.truncate, details=bool(p.details), return_full_text=bool(p.return_full_text),
        alternatives=alternatives, adapter_id=p.adapter_id, adapter_source=p.adapter_source,
        api_token=p.api_token, typical_p=p.typical_p, min_p=p.min_p,
        frequency_penalty=p.frequency_penalty or 0.0,
        prompt_logprobs=bool(p.decoder_input_details),
        grammar=_grammar_of(p.response_format, p.grammar, "parameters."))
    if params.max_new_tokens is not None and params.max_new_tokens < 1:
        raise invalid(f"`parameters.max_new_tokens` must be at least 1, got "
                      f"{params.max_new_tokens}")
    _checked(params, "parameters.")
    best_of = _check_best_of(p.best_of, 1, params.sampling, "parameters.best_of")
    if best_of > 1 and request.stream:
        raise invalid("`parameters.best_of` > 1 cannot be streamed (as in LoRAX): set "
                      "stream to false")
    if best_of > 1 and params.seed is not None:
        raise invalid("`parameters.seed` cannot be set with `best_of` > 1: each sequence "
                      "draws its own seed")
    check_rows(1, 1, best_of)
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
#: New tokens of a completions request without ``max_tokens`` (or with ``max_tokens: null``):
#: OpenAI's default for its (legacy) completions.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


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
        out[int(key)] = float(value)          # its range: GenerationParams.check
    return out


def _openai_params(request: _OpenAISampling, model_id: str, max_tokens: int | None,
                   alternatives: int | None) -> GenerationParams:
    """GenerationParams from the fields completions and chat completions share."""
    _check_stream_options(request)
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
        grammar=_grammar_of(request.response_format, None, ""))
    if params.temperature is not None and params.temperature < 0:
        raise invalid(f"`temperature` must be >= 0, got {params.temperature}")
    return _checked(params)


def _check_stream_options(request: _OpenAISampling) -> None:
    """``stream_options`` only with ``stream: true`` (as OpenAI: it says how to stream);
    ``null`` is accepted either way. Of its options only ``include_usage`` exists here."""
    options = request.stream_options
    if options is None:
        return
    if request.stream is not True:
        raise invalid("`stream_options` is only allowed when `stream` is true: leave it unset "
                      "(or null) for an answer that is not streamed")
    unknown = set(options) - {"include_usage"}
    if unknown:
        raise _unsupported(f"stream_options.{sorted(unknown)[0]}", "only include_usage is")
    if options.get("include_usage") is not None and \
            not isinstance(options["include_usage"], bool):
        raise invalid(f"`stream_options.include_usage` must be true or false, got "
                      f"{options['include_usage']!r}")


def _is_token_ids(value) -> bool:
    """A non-empty list of integers (JSON's true and false are not): one prompt as token ids."""
    return isinstance(value, list) and bool(value) and all(type(x) is int for x in value)


def _check_prompt_count(data: Any) -> None:
    """OpenAI's ``prompt`` is one text, one list of token ids (one prompt, however long: the
    engine bounds its length by its longest input), or a list of texts or of token-id lists
    (several prompts, at most ``MAX_PROMPTS``). Like ``_check_count``, this runs before
    validating the list item by item; a long list that is not all integers counts as prompts."""
    value = data.get("prompt") if isinstance(data, dict) else None
    if isinstance(value, list) and len(value) > MAX_PROMPTS and not _is_token_ids(value):
        raise invalid(f"`prompt` holds {len(value)} items; at most {MAX_PROMPTS} per request "
                      f"(a list of texts or of token-id lists is that many prompts; one prompt "
                      f"given as token ids is a flat list of integers)")
    # A shape that is none of the four: one message, not one per member of the union.
    items = value if isinstance(value, list) else [value]
    leaves = [x for item in items for x in (item if isinstance(item, list) else [item])]
    wrong = [x for x in leaves if not isinstance(x, (str, int)) or isinstance(x, bool)]
    if value is not None and wrong:
        raise invalid(f"`prompt` must be a text, a list of texts, a list of token ids "
                      f"(integers) or a list of such lists; it holds {wrong[0]!r} "
                      f"({type(wrong[0]).__name__})")


def _prompts_of(prompt) -> list:
    """OpenAI's four prompt shapes as a list of prompts (each a string or a list of ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if _is_token_ids(prompt):
        prompts = [list(prompt)]               # one prompt given as token ids
    else:
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
    _check_prompt_count(data)
    request = _validate(CompletionRequest, data)
    _reject_extras(request, "")
    if request.suffix is not None:
        raise _unsupported("suffix", "no insertion mode")
    if request.logprobs is not None and not 0 <= request.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise invalid(f"`logprobs` must be between 0 and {MAX_COMPLETION_LOGPROBS}, got "
                      f"{request.logprobs}")
    # Missing and null mean the same: OpenAI's default for completions (not the server's
    # default, which LoRAX requests and chat get).
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if request.max_tokens is None \
        else request.max_tokens
    if max_tokens < 0:
        raise invalid(f"`max_tokens` must not be negative, got {max_tokens}")
    params = _openai_params(request, model_id, max_tokens, request.logprobs or None)
    params.prompt_logprobs = bool(request.echo) and request.logprobs is not None
    stream = bool(request.stream)
    n = _n_of(request.n)
    best_of = _check_best_of(request.best_of, n, True, "best_of")
    _sample_if_several(params, request, best_of)
    if best_of > n and stream:
        raise invalid("`best_of` cannot be streamed: the best sequence is known only at the end")
    prompts = _prompts_of(request.prompt)
    check_rows(len(prompts), n, best_of)
    return Call(prompts, params, stream=stream, best_of=best_of, n=n,
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


#: Why tool calling is refused, in every message about it.
_NO_TOOLS = "the model cannot call tools"


def _refuse_tools(request: ChatRequest) -> None:
    """Tool (and legacy function) calling is refused, naming the field: this model cannot call
    tools, and an answer that ignored them would look like a model that chose not to.

    Each field's "off" value is accepted, since it asks for what this server does anyway (as
    ``_reject_extras`` ignores unknown keys set to null, false or an empty list): ``tools``
    and ``functions`` null or ``[]``, ``tool_choice`` and ``function_call`` null or
    ``"none"`` (OpenAI's "call no tool"), ``parallel_tool_calls`` null or false. Anything else
    (``"auto"``, ``"required"``, a named function, ``parallel_tool_calls: true``) is a 422."""
    off = {"tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
           "function_call": (None, "none"), "parallel_tool_calls": (None, False)}
    for name, values in off.items():
        value = getattr(request, name)
        if not any(value is v or (type(value) is type(v) and value == v) for v in values):
            raise _unsupported(name, _NO_TOOLS)
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


def _check_count(data: Any, key: str, most: int) -> None:
    """A list in the body longer than the server takes is refused before validating it item
    by item (a cheap body of 200,000 tiny prompts would otherwise keep the event loop busy)."""
    value = data.get(key) if isinstance(data, dict) else None
    if isinstance(value, list) and len(value) > most:
        raise invalid(f"`{key}` holds {len(value)} items; at most {most} per request")


def parse_chat(data: Any, model_id: str) -> Call:
    """An OpenAI chat completions body as a ``Call`` whose ``messages`` are
    ``[{"role", "content"}]`` with text content; the engine turns them into the prompt with
    the model's chat template (``admission.py``, ``tokens.py``)."""
    _check_count(data, "messages", MAX_MESSAGES)
    request = _validate(ChatRequest, data)
    _reject_extras(request, "")
    if not request.messages:
        raise invalid("`messages` is empty: give at least one message")
    _refuse_tools(request)
    if request.max_tokens is not None and request.max_completion_tokens is not None:
        raise invalid("give `max_completion_tokens` or `max_tokens`, not both")
    # Missing and null mean the same (neither field given: the server's default, capped by
    # the room the model has left); OpenAI's chat has no fixed default either.
    given = "max_completion_tokens" if request.max_completion_tokens is not None \
        else "max_tokens"
    max_tokens = getattr(request, given)
    if max_tokens is not None and max_tokens < 1:
        raise invalid(f"`{given}` must be at least 1, got {max_tokens}")
    top = request.top_logprobs
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid(f"`top_logprobs` must be between 0 and {MAX_TOP_LOGPROBS}, got {top}")
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
    _sample_if_several(params, request, n)
    check_rows(1, n, n)
    return Call([], params, stream=bool(request.stream), best_of=n, n=n,
                logprobs=(top or 0) if request.logprobs else None,
                include_usage=bool((request.stream_options or {}).get("include_usage")),
                model=request.model if params.adapter_id else model_id, messages=messages)
