"""Constrained decoding (helpers/server/grammar.py): bounded in size, time and memory, one
compilation per distinct grammar, unsatisfiable grammars refused, and answers that follow
the grammar token by token on the bundled model."""

import json
import random
import re
import threading
from typing import Annotated

import pytest
import torch
from pydantic import BaseModel, Field

from helpers.corpus import task_prompt
from helpers.server.errors import InvalidRequest, Overloaded, TooLarge
from helpers.server.grammar import Grammars, closed_objects

pytestmark = pytest.mark.usefixtures("one_thread")   # see tests/conftest.py

SENTENCE = "Tom the fox met Lily the owl at the river and found a red ball."


def nested_schema(depth: int) -> dict:
    """Objects nested ``depth`` deep around an integer."""
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


class Score(BaseModel):                     # an integer with no bound
    points: int
    rank: int = Field(ge=1, le=10)


class Shopping(BaseModel):                  # arrays, and an integer with no bound
    items: list[str] = Field(max_length=3)
    count: int


class Facts(BaseModel):                     # lesson 07's StoryFacts
    characters: list[Annotated[str, Field(max_length=24)]] = Field(max_length=3)
    place: str = Field(max_length=20)
    object: str = Field(max_length=24)


class Note(BaseModel):                      # a string with no bound
    note: str


@pytest.fixture(scope="module")
def tokenizer(bundled):
    return bundled[1]


@pytest.fixture
def grammars(tokenizer):
    return Grammars(tokenizer)


def _peak_kb() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/self/status")


def _rss_kb() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def allowed_tokens(matcher, size: int) -> list[int]:
    logits = torch.zeros(size)
    matcher.apply(logits, None)
    return torch.isfinite(logits).nonzero().flatten().tolist()


# --- the hostile cases of the issue: bounded --------------------------------------------------

@pytest.mark.parametrize("max_length", [20, 2000, 10**6])
def test_a_long_string_compiles_small(grammars, tokenizer, max_length):
    """outlines-core needed ~90 s and ~4 GB for maxLength 20, doubling per character. Here the
    compilation finishes within the enforced 5 s and the process's peak memory hardly moves."""
    before = _rss_kb()
    _reset_peak()
    compiled = grammars.compile("json", {"type": "string", "maxLength": max_length})
    assert (_peak_kb() - before) < 64 * 1024          # KB: well under 64 MB
    assert grammars.compilations == 1 and grammars.cached_bytes < 1 << 20
    assert compiled.min_tokens is not None and compiled.min_tokens <= 2      # ""
    # and the string really stops at its maximum length
    if max_length == 20:
        matcher = compiled.matcher()
        a = tokenizer.convert_tokens_to_ids("a")
        matcher.advance(tokenizer.convert_tokens_to_ids('"'))
        for _ in range(20):
            assert a in allowed_tokens(matcher, len(tokenizer))
            matcher.advance(a)
        assert a not in allowed_tokens(matcher, len(tokenizer))


def test_a_big_enum_compiles_and_a_bigger_one_is_too_large(grammars):
    words = [f"value-{i:05d}" for i in range(1000)]
    compiled = grammars.compile("json", {"enum": words})
    assert compiled.nbytes < 2 << 20
    with pytest.raises(TooLarge, match="max_grammar_bytes"):
        grammars.compile("json", {"enum": words * 3})
    with pytest.raises(TooLarge, match="max_grammar_bytes"):
        grammars.compile("regex", "a" * (grammars.max_grammar_bytes + 1))


def test_deep_nesting_is_refused_by_its_limit(grammars):
    grammars.compile("json", nested_schema(10))
    with pytest.raises(TooLarge, match="max_depth"):
        grammars.compile("json", nested_schema(40))
    deep = {}
    for _ in range(10_000):                  # deeper than Python's recursion limit
        deep = {"anyOf": [deep]}
    with pytest.raises(TooLarge, match="max_depth"):
        grammars.compile("json", deep)


@pytest.mark.parametrize("schema", [
    {"enum": []},
    {"not": {}},
    {"type": "string", "minLength": 5, "maxLength": 2},
    {"type": "integer", "minimum": 5, "maximum": 2},
    {"allOf": [{"type": "string"}, {"type": "integer"}]},
], ids=["empty-enum", "not-anything", "min-over-max-length", "min-over-max", "string-and-int"])
def test_unsatisfiable_schemas_are_refused(grammars, schema):
    with pytest.raises(InvalidRequest):
        grammars.compile("json", schema)
    assert len(grammars) == 0                # nothing cached for them


@pytest.mark.parametrize("kind, value, words", [
    ("json", {"type": "nonsense"}, "nonsense"),
    ("json", [1], "object"),
    ("json", {"type": "number", "maximum": float("nan")}, "plain JSON"),
    ("regex", "(a", "regex"),
    ("regex", 3, "string"),
    ("regex", "[^\\x00-\\U0010FFFF]", "regular expression"),
    ("lark", "start: 'a'", "not supported"),
])
def test_bad_grammars_are_invalid_requests(grammars, kind, value, words):
    with pytest.raises(InvalidRequest, match=re.escape(words)):
        grammars.compile(kind, value)


def test_a_lone_surrogate_is_refused_not_crashed(grammars):
    with pytest.raises(InvalidRequest):
        grammars.compile("regex", "a\ud800")


def test_the_regex_of_the_issue_compiles_and_is_followed(grammars, tokenizer):
    compiled = grammars.compile("regex", "(a|b)*c{1000}")
    assert compiled.min_tokens is None               # too long for the closer: budget-free
    matcher = compiled.matcher()
    for token in allowed_tokens(matcher, len(tokenizer)):
        assert set(tokenizer.decode([token])) <= set("abc"), token


# --- one compilation per distinct grammar, a cache bounded in bytes ------------------------------

def _slow(grammars, monkeypatch):
    """Make every compilation wait for ``release`` (so that requests overlap for sure)."""
    release, started = threading.Event(), threading.Event()
    real = grammars._compile_now

    def compile_now(*args):
        started.set()
        release.wait(30)
        return real(*args)

    monkeypatch.setattr(grammars, "_compile_now", compile_now)
    return release, started


def test_identical_concurrent_requests_share_one_compilation(grammars, monkeypatch):
    release, started = _slow(grammars, monkeypatch)
    schema = Score.model_json_schema()
    results, errors = [], []

    def ask():
        try:
            results.append(grammars.compile("json", json.loads(json.dumps(schema))))
        except Exception as err:
            errors.append(err)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    assert started.wait(10)
    release.set()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert grammars.compilations == 1
    assert len(results) == 4 and all(r is results[0] for r in results)
    # the key is the schema's canonical JSON: another key order is the same grammar
    reordered = dict(reversed(list(schema.items())))
    assert grammars.compile("json", reordered) is results[0] and grammars.compilations == 1


def test_a_slow_compilation_times_out_and_its_result_is_kept(tokenizer, monkeypatch):
    grammars = Grammars(tokenizer, compile_timeout=0.2)
    release, _ = _slow(grammars, monkeypatch)
    with pytest.raises(TooLarge, match="compile_timeout"):
        grammars.compile("json", Note.model_json_schema())
    release.set()
    for _ in range(100):                    # the compilation finishes in the background ...
        if len(grammars):
            break
        threading.Event().wait(0.05)
    compiled = grammars.compile("json", Note.model_json_schema())   # ... and is reused
    assert compiled is not None and grammars.compilations == 1


def test_too_many_distinct_compilations_at_once_are_refused(tokenizer, monkeypatch):
    grammars = Grammars(tokenizer, compile_timeout=0.1, max_compiling=2)
    release, _ = _slow(grammars, monkeypatch)
    for n in range(2):
        with pytest.raises(TooLarge):
            grammars.compile("json", {"type": "string", "maxLength": n + 1})
    with pytest.raises(Overloaded, match="max_compiling"):
        grammars.compile("json", {"type": "string", "maxLength": 3})
    release.set()


def test_the_cache_is_bounded_in_bytes_least_recently_used_out(tokenizer):
    one = Grammars(tokenizer).compile("json", {"type": "string", "maxLength": 1}).nbytes
    grammars = Grammars(tokenizer, cache_bytes=3 * one + one // 2)
    schemas = [{"type": "string", "maxLength": n} for n in range(1, 6)]
    for schema in schemas[:3]:
        grammars.compile("json", schema)
    grammars.compile("json", schemas[0])             # used again: now the most recent
    for schema in schemas[3:]:
        grammars.compile("json", schema)
    assert grammars.cached_bytes <= grammars.cache_bytes and len(grammars) == 3
    assert grammars.compilations == 5
    grammars.compile("json", schemas[0])             # kept
    assert grammars.compilations == 5
    grammars.compile("json", schemas[1])             # evicted: compiled again
    assert grammars.compilations == 6


def test_objects_are_closed_unless_the_schema_says_otherwise():
    schema = Shopping.model_json_schema()
    schema["$defs"] = {"Open": {"properties": {"x": {}}, "additionalProperties": True},
                       "Inner": {"properties": {"x": {"type": "integer"}}},
                       "Any": {"type": "object"}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["Open"]["additionalProperties"] is True
    assert closed["$defs"]["Inner"]["additionalProperties"] is False
    assert closed["$defs"]["Any"] == {"type": "object"}          # any object: left open
    assert "additionalProperties" not in schema                    # the original is untouched


# --- token by token on the bundled model -------------------------------------------------------

def generate(bundled, matcher, max_new: int, choose=None) -> tuple[str, str]:
    """Decode with the matcher's mask: greedy, or ``choose(logits)`` (logits already masked).
    Returns (text, finish reason)."""
    model, tokenizer = bundled
    x = tokenizer(task_prompt(SENTENCE), return_tensors="pt").input_ids.to(model.device)
    past, out = None, []
    for used in range(max_new):
        with torch.no_grad():
            step = model(input_ids=x, past_key_values=past, use_cache=True)
        past = step.past_key_values
        logits = step.logits[0, -1].float().cpu()
        matcher.apply(logits, max_new - used - 1)
        token = choose(logits) if choose else int(logits.argmax())
        if token == tokenizer.eos_token_id:
            assert matcher.accepting
            return tokenizer.decode(out), "eos_token"
        matcher.advance(token)
        out.append(token)
        x = torch.tensor([[token]], device=model.device)
    return tokenizer.decode(out), "length"


@pytest.mark.parametrize("model", [Score, Shopping, Facts])
def test_greedy_answers_follow_the_schema(bundled, grammars, model):
    compiled = grammars.compile("json", model.model_json_schema())
    text, _ = generate(bundled, compiled.matcher(), 100)
    model.model_validate_json(text)
    assert json.loads(text).keys() == model.model_fields.keys()     # closed objects


@pytest.mark.parametrize("model", [Score, Shopping, Note, Facts])
@pytest.mark.parametrize("extra", [0, 3, 12, 40])
def test_answers_close_within_the_budget(bundled, grammars, model, extra):
    """Even a chooser that picks a random allowed token, never EOS while it has another
    choice, gets a complete answer within its token budget (from the shortest the grammar
    knows, ``min_tokens``, to 40 tokens more)."""
    compiled = grammars.compile("json", model.model_json_schema())
    assert compiled.min_tokens is not None
    budget = compiled.min_tokens + extra
    rng = random.Random(extra)
    eos = bundled[1].eos_token_id

    def adversary(logits):
        allowed = [t for t in torch.isfinite(logits).nonzero().flatten().tolist() if t != eos]
        return rng.choice(allowed) if allowed else eos

    text, _ = generate(bundled, compiled.matcher(), budget, adversary)
    model.model_validate_json(text)


def test_a_regex_grammar_is_followed(bundled, grammars):
    compiled = grammars.compile("regex", r"[A-Z][a-z]+ the (fox|owl)")
    text, reason = generate(bundled, compiled.matcher(), 30)
    assert reason == "eos_token" and re.fullmatch(r"[A-Z][a-z]+ the (fox|owl)", text), text


def test_any_object_stays_open_and_still_closes_in_time(bundled, grammars):
    """``{"type": "object"}`` (OpenAI's json_object) allows any keys; the budget still ends it."""
    compiled = grammars.compile("json", {"type": "object"})
    rng = random.Random(1)
    eos = bundled[1].eos_token_id

    def adversary(logits):
        allowed = [t for t in torch.isfinite(logits).nonzero().flatten().tolist() if t != eos]
        return rng.choice(allowed) if allowed else eos

    text, _ = generate(bundled, compiled.matcher(), compiled.min_tokens + 20, adversary)
    assert isinstance(json.loads(text), dict)


def test_the_closer_is_bounded_in_cpu_time(grammars, tokenizer, monkeypatch):
    """A closer that runs out of time gives up: the grammar is then budget-free (no
    ``min_tokens``), and its matchers mask by the grammar alone."""
    import helpers.server.grammar as grammar

    monkeypatch.setattr(grammar, "CLOSER_COMPILE_SECONDS", 0.0)
    monkeypatch.setattr(grammar, "CLOSER_SECONDS", 0.0)
    compiled = grammars.compile("json", Score.model_json_schema())
    assert compiled.min_tokens is None
    free, tight = compiled.matcher(), compiled.matcher()
    logits = torch.zeros(len(tokenizer))
    tight.apply(logits, 1)
    masked = torch.isfinite(logits).nonzero().flatten().tolist()
    assert allowed_tokens(free, len(tokenizer)) == masked
