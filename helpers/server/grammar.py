"""Constrained decoding: a JSON schema or a regular expression becomes a mask on the logits.
(Lesson 07.)

``Grammars(tokenizer).compile(kind, value)`` returns a ``Compiled`` grammar, shared by the
requests that ask for it; ``Compiled.matcher()`` follows one request. The engine is llguidance
(vLLM's and SGLang's): it parses as the text is written, so compiling costs about as much as
reading the schema. Grammars, compiles and the cache stay within the server's limits.

The budget: a matcher's *closer* finds a short completion from where the text is. Within
``MARGIN`` tokens of the budget, only tokens from which the closer still finishes in time are
allowed, so JSON mode closes within ``max_new_tokens``.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from .errors import EngineError, InvalidRequest, Overloaded, TooLarge

KINDS = ("json", "regex")
#: json.dumps's layout, and nothing else: a small model must not fill its budget with spaces.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: The budget rule starts this many tokens before the closer's ending would no longer fit.
MARGIN = 4
#: The most likely tokens checked one by one near the end of the budget.
CANDIDATES = 3
#: The closer gives up after this many tokens (each costs a mask computation), or after this
#: much CPU time per step and at compile time.
CLOSER_STEPS = 256
CLOSER_SECONDS = 0.01
CLOSER_COMPILE_SECONDS = 0.25
#: The closer's first choices (what ends a string, an array, an object), then the shortest
#: ways to continue JSON.
_CLOSING = b'"]}'
_OTHERS = b',: 0123456789' + bytes(b for b in range(33, 127) if b not in b'"]},:0123456789')
_WHAT = {"json": "JSON schema", "regex": "regular expression"}
# Words in llguidance's messages that say a limit was hit (not that the grammar is wrong).
_LIMIT_WORDS = ("limit", "fuel", "too large", "too many", "too complex", "too big")


def parser_limits():
    """llguidance's defaults, tightened where a request could take memory (a lexer state takes
    1-2 kB)."""
    from llguidance import LLParserLimits

    return LLParserLimits(
        max_grammar_size=100_000,         # symbols in the grammar (default 500 000)
        initial_lexer_fuel=1_000_000,     # building the lexer: ~20 ms of work (default)
        step_lexer_fuel=200_000,          # one token's mask: ~15 ms of lexer work (default)
        step_max_items=50_000,            # one token's mask: parser items (default)
        max_lexer_states=20_000,          # at most ~40 MB of lexer per grammar (default 250 000)
        verbose_errors=False,             # messages go to clients: no grammar internals
    )


def _mask(bias) -> torch.Tensor:
    """llguidance's logit bias (a byte a token, 0 = forbidden) as a bool tensor."""
    return torch.frombuffer(bytearray(bias), dtype=torch.uint8) != 0


def _depth(value) -> int:
    """How deeply lists and dicts nest in ``value`` (a loop: no recursion limit)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, level)
            todo.extend((child, level + 1) for child in item)
    return deepest


# The keys under which a JSON schema holds one schema, a list of them ("items" also in its old
# tuple form), or a map of name -> schema.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_LIST = ("items", "prefixItems", "anyOf", "oneOf", "allOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


def closed_objects(schema):
    """A copy of ``schema`` where objects that list ``properties`` and say nothing of others
    get ``additionalProperties: false`` (or a small model writes extra keys until its budget
    ends); ``{"type": "object"}`` stays open."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, item in schema.items():
        if key in _MAP and isinstance(item, dict):
            out[key] = {name: closed_objects(one) for name, one in item.items()}
        elif key in _LIST and isinstance(item, list):
            out[key] = [closed_objects(one) for one in item]
        elif key in _ONE:
            out[key] = closed_objects(item)
    if "properties" in out and not {"additionalProperties", "patternProperties"} & out.keys():
        out["additionalProperties"] = False
    return out


class Matcher:
    """One request's place in a grammar (``Compiled.matcher()``; one thread at a time)."""

    def __init__(self, compiled: "Compiled", state):
        self.compiled = compiled
        self._state = state                 # an llguidance LLMatcher
        self._closing = compiled.min_tokens is not None   # False: budget-free
        self._look_at = float("inf")        # the budget at which the closer looks again

    def apply(self, logits_row: torch.Tensor, budget: int | None = None) -> None:
        """Set the forbidden tokens' logits to -inf, in place. ``budget``: the tokens left after
        this one (None: no limit)."""
        allowed = _mask(self._state.compute_logit_bias())
        if budget is not None and self._closing and budget <= self._look_at:
            allowed = self._in_time(allowed, logits_row, budget)
        keep = torch.zeros(logits_row.shape[-1], dtype=torch.bool)
        n = min(keep.numel(), allowed.numel())
        keep[:n] = allowed[:n]
        logits_row.masked_fill_(~keep.to(logits_row.device), float("-inf"))

    def _in_time(self, allowed: torch.Tensor, logits_row: torch.Tensor,
                 budget: int) -> torch.Tensor:
        deadline = time.thread_time() + CLOSER_SECONDS
        ending = self.compiled.closer(self._state, deadline)
        if ending is None:
            self._closing = False           # no ending found from here: budget-free from now
            return allowed
        slack = budget - len(ending) - MARGIN
        if slack >= 0:      # no restriction; a token lengthens the ending by MARGIN + 1 at most
            # (the rule's assumption): look again before it could catch up with the budget
            self._look_at = budget - max(1, slack // (MARGIN + 2))
            return allowed
        self._look_at = budget - 1          # from here on, at every token
        eos = self.compiled.eos_id
        keep = torch.zeros_like(allowed)
        keep[ending[0] if ending else eos] = True           # complete now: end it here
        if not ending:
            return keep
        scores = logits_row.detach().float().cpu()[: allowed.numel()]
        scores = scores.masked_fill(~allowed, float("-inf"))
        scores[eos] = float("-inf")
        for token in scores.topk(min(CANDIDATES, scores.numel())).indices.tolist():
            if not torch.isfinite(scores[token]) or keep[token]:
                continue
            after = self._state.deep_copy()
            if after.consume_token(token):
                rest = self.compiled.closer(after, deadline)
                keep[token] = rest is not None and len(rest) <= budget
        return keep

    def advance(self, token_id: int) -> None:
        """Follow the token the engine chose."""
        self._state.consume_token(int(token_id))

    @property
    def accepting(self) -> bool:
        """Whether the text so far is complete (EOS allowed now)."""
        return self._state.is_accepting()


class Compiled:
    """A compiled grammar. ``min_tokens``: the closer's length from the start (a smaller
    ``max_new_tokens`` is refused; None: budget-free). ``nbytes``: the cache's estimate of its
    memory (llguidance took 6-470 kB for schemas of 0.1-9 kB on the bundled tokenizer)."""

    def __init__(self, grammars: "Grammars", kind: str, key: str, state):
        self.kind = kind
        self.key = key
        self.eos_id = grammars.eos_id
        self._grammars = grammars
        self._start = state                 # never advanced: each matcher is a copy
        self._lock = threading.Lock()
        self.nbytes = (64 << 10) + 40 * len(key)
        ending = self.closer(state, time.thread_time() + CLOSER_COMPILE_SECONDS)
        self.min_tokens = None if ending is None else len(ending)

    def matcher(self) -> Matcher:
        with self._lock:
            return Matcher(self, self._start.deep_copy())

    def closer(self, state, deadline: float) -> list[int] | None:
        """Tokens that complete the text from ``state`` (left as it is): [] if it is complete,
        None if none within CLOSER_STEPS tokens or before ``deadline`` (a ``thread_time()``,
        which a busy machine does not stretch)."""
        state = state.deep_copy()
        closing, others = self._grammars.closer_tokens
        used: dict[int, int] = {}
        taken: list[int] = []
        for _ in range(CLOSER_STEPS):
            if state.is_accepting() or state.is_error() or time.thread_time() > deadline:
                break
            allowed = state.compute_logit_bias()
            token = next((t for t in closing if allowed[t]), None)
            if token is None:
                # a single character, least used first; else (where the grammar forces its
                # own tokens, e.g. inside a key) any allowed token, least used first
                options = [t for t in others if allowed[t]] or [
                    t for t in _mask(allowed).nonzero().flatten().tolist() if t != self.eos_id]
                token = min(options, key=lambda t: used.get(t, 0), default=None)
            if token is None:
                return None
            used[token] = used.get(token, 0) + 1
            taken.append(token)
            state.consume_token(token)
        return taken if state.is_accepting() and not state.is_error() else None


class Grammars:
    """Compiles grammars for one tokenizer within the server's limits, and keeps them."""

    def __init__(self, tokenizer, *, max_grammar_bytes: int = 32 << 10, max_depth: int = 64,
                 compile_timeout: float = 5.0, cache_bytes: int = 64 << 20,
                 max_compiling: int = 4):
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.max_grammar_bytes = max_grammar_bytes
        self.max_depth = max_depth
        self.compile_timeout = compile_timeout
        self.cache_bytes = cache_bytes
        self.max_compiling = max_compiling
        self.compilations = 0
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Compiled] = OrderedDict()
        self._compiling: dict[str, Future] = {}
        self._llg_tokenizer = None
        # the closer's single-character tokens, in its order: (closing ones, others)
        self.closer_tokens: tuple[list[int], list[int]] = ([], [])

    @staticmethod
    def available() -> bool:
        """Whether the grammar engine (llguidance) is installed."""
        try:
            import llguidance  # noqa: F401
        except ImportError:
            return False
        return True

    @property
    def cached_bytes(self) -> int:
        """The estimated memory of the grammars kept."""
        with self._lock:
            return sum(c.nbytes for c in self._cache.values())

    def __len__(self) -> int:
        return len(self._cache)

    def key(self, kind: str, value) -> str:
        """The canonical text of a grammar (the cache's key), after the size checks."""
        if kind not in KINDS:
            raise InvalidRequest(f"grammar type {kind!r} is not supported: use one of {KINDS}")
        if kind == "json":
            if not isinstance(value, dict):
                raise InvalidRequest("a JSON schema must be a JSON object")
            if _depth(value) > self.max_depth:
                raise TooLarge(f"the JSON schema is nested more than {self.max_depth} levels "
                               f"deep (the server's max_depth for grammars)")
            try:
                text = json.dumps(value, sort_keys=True, separators=(",", ":"),
                                  ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError) as err:
                raise InvalidRequest(f"the JSON schema is not plain JSON: {err}") from None
        else:
            if not isinstance(value, str):
                raise InvalidRequest("a regex grammar must be a string")
            text = value
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_grammar_bytes:
            raise TooLarge(f"the {_WHAT[kind]} takes {size} bytes; the server accepts at most "
                           f"{self.max_grammar_bytes} (max_grammar_bytes)")
        return f"{kind}:{text}"

    def compile(self, kind: str, value) -> Compiled:
        """The compiled grammar, from the cache or compiled now (waiting ``compile_timeout`` at
        most; a late one is cached when done). Blocks: call it from a worker thread."""
        if not self.available():
            raise InvalidRequest("constrained decoding needs the llguidance package, which is "
                                 "not installed on this server")
        key = self.key(kind, value)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            future = self._compiling.get(key)
            if future is None:
                if len(self._compiling) >= self.max_compiling:
                    raise Overloaded(f"{self.max_compiling} grammars are being compiled already "
                                     f"(the server's max_compiling); retry shortly")
                future = self._compiling[key] = Future()
                self.compilations += 1
                threading.Thread(target=self._build, args=(key, kind, value, future),
                                 daemon=True, name="grammar-compile").start()
        try:
            return future.result(timeout=self.compile_timeout)
        except FutureTimeout:
            raise TooLarge(f"the grammar took longer than {self.compile_timeout:g} s to compile "
                           f"(the server's compile_timeout)") from None

    def _build(self, key: str, kind: str, value, future: Future) -> None:
        try:
            outcome = self._compile_now(kind, value, key)
        except EngineError as err:
            outcome = err
        except Exception as err:       # anything else llguidance raises: the grammar's fault
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            outcome = InvalidRequest(f"this grammar cannot be used: {first[:200]}")
        with self._lock:
            self._compiling.pop(key, None)
            if isinstance(outcome, Compiled) and outcome.nbytes <= self.cache_bytes:
                self._cache[key] = outcome
                total = sum(c.nbytes for c in self._cache.values())
                while total > self.cache_bytes:             # least recently used out first
                    total -= self._cache.popitem(last=False)[1].nbytes
        if isinstance(outcome, Compiled):
            future.set_result(outcome)
        else:
            future.set_exception(outcome)

    def _engine_tokenizer(self):
        """llguidance's view of the tokenizer, built once, and the closer's tokens."""
        with self._lock:
            if self._llg_tokenizer is None:
                import llguidance.hf

                try:
                    llg = llguidance.hf.from_tokenizer(self.tokenizer)
                except ValueError as err:         # a slow (Python) tokenizer
                    raise InvalidRequest(f"constrained decoding is not available with this "
                                         f"tokenizer: {err}") from None
                tokens = {byte: llg.tokenize_bytes(bytes([byte])) for byte in _CLOSING + _OTHERS}
                self.closer_tokens = tuple([tokens[b][0] for b in group if len(tokens[b]) == 1]
                                           for group in (_CLOSING, _OTHERS))
                self._llg_tokenizer = llg
            return self._llg_tokenizer

    def _compile_now(self, kind: str, value, key: str) -> Compiled:
        from llguidance import LLMatcher

        tokenizer = self._engine_tokenizer()
        if kind == "json":
            try:
                grammar = LLMatcher.grammar_from_json_schema(closed_objects(value),
                                                             defaults=JSON_OPTIONS)
            except ValueError as err:
                raise InvalidRequest(f"invalid JSON schema: {err}") from None
        else:
            grammar = LLMatcher.grammar_from_regex(value)
        state = LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
        what = _WHAT[kind]
        if state.is_error():
            message = state.get_error().strip().splitlines()[0][:200]
            if any(word in message.lower() for word in _LIMIT_WORDS):
                raise TooLarge(f"the {what} is more complex than the server's limits allow: "
                               f"{message}")
            if message.startswith("Unsatisfiable"):
                raise InvalidRequest(f"no text satisfies this {what}: {message}")
            raise InvalidRequest(f"this {what} cannot be used: {message}")
        allowed = _mask(state.compute_logit_bias())
        allowed[self.eos_id] = False
        if state.is_error() or (not allowed.any() and not state.is_accepting()):
            raise InvalidRequest(f"no text satisfies this {what}")
        return Compiled(self, kind, key, state)
