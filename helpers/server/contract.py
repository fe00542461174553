"""The contract between the HTTP side and the engine: what a route submits, what comes back, and
the interface both kinds of engine offer (``EngineClient``). (Lesson 07.) No torch here.

    routes ──▶ Submission ──▶ engine.submit(submission, sink) ──▶ Handle (or an EngineError)
    routes ◀── sink([(sequence, event), ...]) ◀── the engine, after every step
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Union

from .errors import InvalidRequest

log = logging.getLogger("helpers.server")

#: Stop sequences one request may give (LoRAX's default limit too).
MAX_STOP_SEQUENCES = 4
#: Longest stop sequence, in characters: each token is searched for each, and a stream holds
#: back as many characters as the longest one.
MAX_STOP_CHARS = 256
#: Alternatives per token (OpenAI's chat ``top_logprobs`` goes to 20).
MAX_ALTERNATIVES = 20
#: What ``torch.Generator.manual_seed`` takes: a 64-bit unsigned integer.
MAX_SEED = 2**64 - 1
#: Adapter sources this server loads from; LoRAX also knows "s3" and "pbase".
ADAPTER_SOURCES = ("local", "hub")
KNOWN_ADAPTER_SOURCES = ("local", "hub", "s3", "pbase")
#: Entries of logit_bias one request may give (OpenAI allows 300).
MAX_LOGIT_BIAS = 300

#: Why the ranges. temperature divides float32 logits (at most a few hundred): by 1e-3 they
#: stay far below 3.4e38, by 1e-38 they are inf (softmax: NaN); below 1e-3 sampling is greedy
#: anyway for any logit gap above 0.03. repetition_penalty divides or multiplies logits (1e-40
#: is 0 in float32); useful values are 1.0 to 1.5, and [0.01, 100] keeps penalty x
#: 1/temperature x logit below 1e10. The penalties and logit_bias: OpenAI's ranges.
MIN_TEMPERATURE = 1e-3
REPETITION_PENALTY_RANGE = (0.01, 100.0)
PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)


@dataclass
class GenerationParams:
    """One request's generation settings, in the engine's terms. (Lesson 07.)

    max_new_tokens None: the server's default; 0 generates nothing (with ``prompt_logprobs``,
    every prompt token's log probability: the loglikelihood request of evaluation harnesses).
    Any of temperature / top_k / top_p / typical_p / min_p turns sampling on, as in TGI.
    ``grammar``: ``("json", schema)``, ``("regex", pattern)`` or None. A matched stop sequence
    stays in the text (as in LoRAX; the OpenAI route cuts it). The penalties follow OpenAI:
    ``frequency_penalty`` once per time a token was generated, ``presence_penalty`` once if it
    was; ``min_p`` keeps the tokens at least ``min_p`` times as likely as the likeliest."""

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
    min_p: float | None = None

    @property
    def sampling(self) -> bool:
        return bool(self.do_sample) or any(getattr(self, name) is not None for name in
                                           ("temperature", "top_k", "top_p", "typical_p", "min_p"))

    def greedy_if_zero(self) -> "GenerationParams":
        """Temperature 0 is greedy decoding (as in OpenAI, vLLM, TGI's clients)."""
        if self.temperature == 0:
            self.temperature, self.do_sample = None, False
            self.top_k = self.top_p = self.typical_p = self.min_p = None
        return self

    def check(self, prefix: str = "") -> "GenerationParams":
        """Every range of every parameter, in one place: ``InvalidRequest`` naming the field
        (``prefix`` + its name, e.g. ``parameters.top_p``). What depends on the model (token
        ids in its vocabulary) is ``admission.py``'s to check."""
        def bad(name: str, rule: str, value) -> InvalidRequest:
            return InvalidRequest(f"`{prefix}{name}` {rule}, got {value!r}")

        for name in ("temperature", "top_p", "repetition_penalty", "typical_p", "min_p",
                     "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(
                    value, (int, float)) or not math.isfinite(value)):
                raise bad(name, "must be a finite number", value)
        t = self.temperature
        if t is not None and t < MIN_TEMPERATURE:
            raise bad("temperature", f"must be at least {MIN_TEMPERATURE:g} (below that "
                      f"sampling is greedy in all but name and float32 logits overflow: ask "
                      f"for greedy decoding, temperature 0, instead)", t)
        low, high = REPETITION_PENALTY_RANGE
        checks = [
            ("max_new_tokens", self.max_new_tokens, lambda v: v >= 0, "must not be negative"),
            ("top_k", self.top_k, lambda v: v >= 1, "must be strictly positive"),
            ("top_p", self.top_p, lambda v: 0 < v <= 1, "must be > 0 and <= 1"),
            ("typical_p", self.typical_p, lambda v: 0 < v <= 1, "must be > 0 and <= 1 (1 is none)"),
            ("min_p", self.min_p, lambda v: 0 <= v <= 1, "must be between 0 and 1 (0 is none)"),
            ("seed", self.seed, lambda v: 0 <= v <= MAX_SEED, "must be between 0 and 2**64 - 1"),
            ("truncate", self.truncate, lambda v: v >= 1, "must be strictly positive"),
            ("repetition_penalty", self.repetition_penalty, lambda v: low <= v <= high,
             f"must be between {low:g} and {high:g} (1 is none)"),
            ("alternatives", self.alternatives, lambda v: 0 <= v <= MAX_ALTERNATIVES,
             f"(alternatives per token) must be between 0 and {MAX_ALTERNATIVES}"),
        ] + [(name, getattr(self, name), lambda v: PENALTY_RANGE[0] <= v <= PENALTY_RANGE[1],
              f"must be between {PENALTY_RANGE[0]:g} and {PENALTY_RANGE[1]:g}")
             for name in ("frequency_penalty", "presence_penalty")]
        for name, value, ok, rule in checks:
            if value is not None and not ok(value):
                raise bad(name, rule, value)
        self._check_stop_and_source(prefix)
        self._check_logit_bias(prefix)
        return self

    def _check_stop_and_source(self, prefix: str) -> None:
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise InvalidRequest(f"`{prefix}stop` may hold at most {MAX_STOP_SEQUENCES} "
                                 f"sequences, got {len(self.stop)}")
        for stop in self.stop:
            if stop == "":
                raise InvalidRequest(f"`{prefix}stop` holds an empty string, which would stop "
                                     f"at once")
            if len(stop) > MAX_STOP_CHARS:
                raise InvalidRequest(f"`{prefix}stop`: a stop sequence may be at most "
                                     f"{MAX_STOP_CHARS} characters, got one of {len(stop)}")
        source = self.adapter_source
        if source is not None and source not in ADAPTER_SOURCES:
            if source in KNOWN_ADAPTER_SOURCES:
                raise InvalidRequest(f"`{prefix}adapter_source={source}` is not supported by "
                                     f"this server (it loads adapters from "
                                     f"{list(ADAPTER_SOURCES)} only); leave it unset")
            raise InvalidRequest(f"`{prefix}adapter_source` must be one of "
                                 f"{list(ADAPTER_SOURCES)}, got {source!r}")

    def _check_logit_bias(self, prefix: str) -> None:
        bias = self.logit_bias
        where = f"`{prefix}logit_bias`"
        if len(bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"{where} may hold at most {MAX_LOGIT_BIAS} tokens, got "
                                 f"{len(bias)}")
        low, high = LOGIT_BIAS_RANGE
        for token, value in bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidRequest(f"{where}: {token!r} is not a token id")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value) or not low <= value <= high:
                raise InvalidRequest(f"{where}: the bias of token {token} must be a number "
                                     f"between {low:g} and {high:g}, got {value!r}")


Prompt = Union[str, list[int]]


@dataclass
class Submission:
    """One HTTP request: ``prompts`` (texts, or token ids) or a chat's ``messages`` (for the
    model's chat template), each generated ``copies`` times (``best_of``; each its own seed)."""

    params: GenerationParams
    prompts: list[Prompt] = field(default_factory=list)
    messages: list[dict] | None = None
    copies: int = 1


@dataclass
class Finish:
    """How a sequence ended. reason: "length", "eos_token" or "stop_sequence"; stop_at: where
    the stop sequence starts in ``text``; seconds: since submission."""

    reason: str
    text: str
    generated_tokens: int
    prompt_tokens: int
    seed: int | None
    stop_at: int | None
    seconds: float


@dataclass
class PromptEvent:
    """The prompt's tokens with their log probabilities (the first: None), before any token."""

    tokens: list[dict]


@dataclass
class TokenEvent:
    """One generated token (id, text, logprob, special[, alternative_tokens]); ``finish`` on
    the last (with ``max_new_tokens`` 0, the one event, ``token`` None)."""

    token: dict | None
    finish: Finish | None = None


@dataclass
class ErrorEvent:
    """The sequence failed after it was accepted (the model raised, or the server stops)."""

    message: str
    error_type: str = "generation"
    status: int = 500


Event = Union[PromptEvent, TokenEvent, ErrorEvent]
#: Where a submission's events go: ``[(sequence, event), ...]``, ``sequence`` counting its
#: prompts x copies (None: an error that ends them all).
Sink = Callable[[list], None]


@dataclass(eq=False)
class Handle:
    """A submission the engine accepted: ``prompts`` as the engine read them (token ids
    decoded), ``sequences`` (prompts x copies) and their ``seeds`` (None: greedy)."""

    id: int
    prompts: list[str]
    sequences: int
    seeds: list[int | None]
    sink: Sink | None = None
    tag: object = None          # the submitter's own name for it (``engine_process.py``)
    cancelled: bool = False
    done: int = 0               # sequences finished (their last event sent)

    @property
    def finished(self) -> bool:
        return 0 < self.sequences <= self.done     # (0: not answered yet)

    def count(self, event: Event) -> bool:
        """Count ``event`` if it ends one of the sequences; True if it ended the last one."""
        if not (isinstance(event, ErrorEvent)
                or isinstance(event, TokenEvent) and event.finish is not None):
            return False
        self.done += 1
        return self.finished

    def deliver(self, events: list) -> None:
        """Events to the sink, unless cancelled. A sink that fails (its event loop closed)
        loses its own events, nobody else's."""
        if self.sink is None or self.cancelled:
            return
        try:
            self.sink(events)
        except Exception:
            log.exception("the sink of submission %s failed; its events are dropped", self.id)


def deliver(items: list, forget=lambda handle: None) -> None:
    """One step's ``[(handle, sequence, event), ...]``: one sink call per handle, its events in
    order; a handle whose last sequence finished is first ``forget``-ed."""
    by_handle: dict[Handle, list] = {}
    for handle, sequence, event in items:
        if handle.count(event):
            forget(handle)
        by_handle.setdefault(handle, []).append((sequence, event))
    for handle, events in by_handle.items():
        handle.deliver(events)


class EngineClient(Protocol):
    """What the HTTP side uses of an engine (``Engine`` and ``EngineProcess``). ``submit``
    blocks (call it from a worker thread) and raises ``errors.EngineError``."""

    model_id: str
    kv_cache: str
    max_batch_size: int
    max_input_tokens: int
    max_total_tokens: int
    max_prompt_chars: int
    vocab_size: int
    special_ids: set[int]
    restarts: int             # engine processes started again after a crash
    healthy: bool

    def start(self) -> "EngineClient": ...

    def stop(self, timeout: float = ...) -> None: ...

    def submit(self, submission: Submission, sink: Sink | None = None) -> Handle: ...

    def cancel(self, handle: Handle) -> None: ...

    def snapshot(self) -> dict: ...

    def info(self) -> dict: ...

    def adapters_available(self) -> list[str]: ...

    def adapters_loaded(self) -> list[str]: ...

    def tokenize(self, text: str) -> list[dict]: ...
