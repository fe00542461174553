"""Details of the OpenAI protocol that the request parsers (``helpers.server.openai_bodies``) get right.

* a prompt given as one flat list of token ids is one prompt, however long;
* tool calling (``tools``, ``tool_choice``, ``functions``, tool messages in the history) is
  refused with a 422 naming the field, while its "off" values are accepted;
* chat ``top_logprobs`` goes up to 20 (OpenAI's range), completions ``logprobs`` up to 5;
* ``max_tokens: null`` means the same as no ``max_tokens``;
* ``stream_options`` needs ``stream: true``.

Most tests call the parsers directly; two go through the HTTP app in this process, serving a
tiny random Llama-style model (``tiny_llama`` in conftest.py).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from helpers.server.guards import ApiError
from helpers.server.openai_bodies import MAX_PROMPTS, parse_chat, parse_completion
from helpers.server.routes_lorax import parse_lorax

MODEL = "bundled"
USER = [{"role": "user", "content": "hi"}]


def refusal(parser, body) -> ApiError:
    """The ApiError ``parser`` raises for ``body`` (a 422, as validation errors are)."""
    with pytest.raises(ApiError) as caught:
        parser(body, MODEL)
    assert caught.value.status == 422 and caught.value.error_type == "validation"
    return caught.value


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": USER, **fields}


# --- 1. a flat list of token ids is one prompt ----------------------------------------------

@pytest.mark.parametrize("length", [1, MAX_PROMPTS, MAX_PROMPTS + 1, 20, 500])
def test_a_flat_list_of_token_ids_is_one_prompt(length):
    ids = list(range(100, 100 + length))
    call = parse_completion({"model": MODEL, "prompt": ids}, MODEL)
    assert call.prompts == [ids]


def test_a_list_of_prompts_is_still_bounded():
    for many in (["Jack"] * (MAX_PROMPTS + 1), [[1, 2]] * (MAX_PROMPTS + 1)):
        error = refusal(parse_completion, {"model": MODEL, "prompt": many})
        assert "`prompt`" in error.message and f"at most {MAX_PROMPTS}" in error.message
    # exactly MAX_PROMPTS prompts are fine
    call = parse_completion({"model": MODEL, "prompt": [[1, 2]] * MAX_PROMPTS}, MODEL)
    assert call.prompts == [[1, 2]] * MAX_PROMPTS
    # a long list that is not all integers is a list of prompts: refused before validating it
    for mixed in ([5] * 40 + ["Jack"], [5] * 40 + [[5]], [True] * 40, [5.0] * 40):
        error = refusal(parse_completion, {"model": MODEL, "prompt": mixed})
        assert "`prompt`" in error.message


def test_token_ids_must_not_be_negative():
    for prompt in ([5, -1], [[5, -1]]):
        error = refusal(parse_completion, {"model": MODEL, "prompt": prompt})
        assert "`prompt`" in error.message and "non-negative" in error.message


# --- 2. tool calling is refused, naming the field --------------------------------------------

@pytest.mark.parametrize("name, value", [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "auto"),
    ("tool_choice", "required"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("parallel_tool_calls", True),
    ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", "auto"),
    ("function_call", {"name": "f"}),
    ("tools", {"type": "function"}),                 # not even a list
])
def test_tool_fields_are_refused_by_name(name, value):
    error = refusal(parse_chat, chat(**{name: value}))
    assert error.message.startswith(f"`{name}` is not supported by this server")
    assert "cannot call tools" in error.message


@pytest.mark.parametrize("name, value", [
    ("tools", None), ("tools", []), ("tool_choice", None), ("tool_choice", "none"),
    ("parallel_tool_calls", None), ("parallel_tool_calls", False), ("functions", None),
    ("functions", []), ("function_call", None), ("function_call", "none"),
])
def test_tool_fields_set_to_off_are_accepted(name, value):
    """No tools, or "call no tool": what this server does anyway."""
    call = parse_chat(chat(**{name: value}), MODEL)
    assert call.messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("message, field, words", [
    ({"role": "tool", "content": "42", "tool_call_id": "call_1"}, "role", "'tool'"),
    ({"role": "function", "content": "42", "name": "f"}, "role", "'function'"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
     "tool_calls", "tool"),
    ({"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
     "function_call", "tool"),
    ({"role": "user", "content": "hi", "tool_call_id": "call_1"}, "tool_call_id", "tool"),
])
def test_tool_messages_in_the_history_are_refused_by_name(message, field, words):
    messages = [{"role": "user", "content": "What is 6 x 7?"}, message,
                {"role": "user", "content": "Thanks"}]
    error = refusal(parse_chat, {"model": MODEL, "messages": messages})
    assert error.message.startswith(f"`messages[1].{field}`"), error.message
    assert words in error.message


def test_assistant_messages_without_tool_calls_are_accepted():
    messages = [{"role": "user", "content": "Jack"},
                {"role": "assistant", "content": "and Jill", "tool_calls": None,
                 "function_call": None},
                {"role": "assistant", "content": "went up", "tool_calls": []},
                {"role": "user", "content": "the hill"}]
    call = parse_chat({"model": MODEL, "messages": messages}, MODEL)
    assert [m["content"] for m in call.messages] == ["Jack", "and Jill", "went up", "the hill"]


def test_other_unknown_chat_fields_are_still_refused():
    error = refusal(parse_chat, chat(frobnicate=1))
    assert "`frobnicate`" in error.message


# --- 3. top_logprobs up to 20 -----------------------------------------------------------------

@pytest.mark.parametrize("top", [0, 1, 5, 6, 19, 20])
def test_chat_top_logprobs_goes_up_to_20(top):
    call = parse_chat(chat(logprobs=True, top_logprobs=top), MODEL)
    assert call.logprobs == top
    assert call.params.alternatives == (top or None)


@pytest.mark.parametrize("top", [-1, 21, 100])
def test_chat_top_logprobs_outside_0_to_20_is_refused(top):
    error = refusal(parse_chat, chat(logprobs=True, top_logprobs=top))
    assert "`top_logprobs`" in error.message and "20" in error.message


def test_completions_logprobs_stays_at_most_5():
    assert parse_completion({"model": MODEL, "prompt": "J", "logprobs": 5}, MODEL).logprobs == 5
    for bad in (6, 20, -1):
        error = refusal(parse_completion, {"model": MODEL, "prompt": "J", "logprobs": bad})
        assert "`logprobs`" in error.message and "5" in error.message


def test_lorax_alternatives_keep_their_bound():
    body = {"inputs": "Jack", "parameters": {"return_k_alternatives": 10}}
    assert parse_lorax(body).params.alternatives == 10
    for name in ("return_k_alternatives", "top_n_tokens"):
        with pytest.raises(ApiError, match="alternatives") as caught:
            parse_lorax({"inputs": "Jack", "parameters": {name: 11}})
        assert caught.value.status == 422


# --- 4. max_tokens: null is the same as leaving it out ----------------------------------------

def test_completions_max_tokens_null_is_the_default_16():
    missing = parse_completion({"model": MODEL, "prompt": "Jack"}, MODEL)
    null = parse_completion({"model": MODEL, "prompt": "Jack", "max_tokens": None}, MODEL)
    assert missing.params.max_new_tokens == null.params.max_new_tokens == 16
    given = parse_completion({"model": MODEL, "prompt": "Jack", "max_tokens": 3}, MODEL)
    assert given.params.max_new_tokens == 3


def test_chat_max_tokens_null_is_the_same_as_missing():
    missing = parse_chat(chat(), MODEL).params.max_new_tokens
    for fields in ({"max_tokens": None}, {"max_completion_tokens": None},
                   {"max_tokens": None, "max_completion_tokens": None}):
        assert parse_chat(chat(**fields), MODEL).params.max_new_tokens == missing
    assert missing is None                 # the server's default (capped by the room left)
    assert parse_chat(chat(max_tokens=5, max_completion_tokens=None),
                      MODEL).params.max_new_tokens == 5
    assert parse_chat(chat(max_tokens=None, max_completion_tokens=7),
                      MODEL).params.max_new_tokens == 7


# --- 5. stream_options needs stream: true ------------------------------------------------------

@pytest.mark.parametrize("stream", [None, False, "missing"])
@pytest.mark.parametrize("parser, body", [
    (parse_completion, {"model": MODEL, "prompt": "Jack"}),
    (parse_chat, chat()),
])
def test_stream_options_without_streaming_is_refused(parser, body, stream):
    body = {**body, "stream_options": {"include_usage": True}}
    if stream != "missing":
        body["stream"] = stream
    error = refusal(parser, body)
    assert "`stream_options`" in error.message and "stream" in error.message


@pytest.mark.parametrize("parser, body", [
    (parse_completion, {"model": MODEL, "prompt": "Jack"}),
    (parse_chat, chat()),
])
def test_stream_options_null_or_with_streaming_is_accepted(parser, body):
    assert not parser({**body, "stream_options": None}, MODEL).include_usage
    assert not parser({**body, "stream": False, "stream_options": None}, MODEL).include_usage
    call = parser({**body, "stream": True, "stream_options": {"include_usage": True}}, MODEL)
    assert call.stream and call.include_usage
    error = refusal(parser, {**body, "stream": True, "stream_options": {"include_usage": "yes"}})
    assert "include_usage" in error.message


# --- through the HTTP app -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def app_client(tiny_llama):
    """``post(route, body)``: the app serving a tiny random model, asked in this process."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from helpers.server import Engine, create_app

    model, tokenizer = tiny_llama
    engine = Engine(model, tokenizer, adapters_dir=None, max_batch_size=2,
                    model_id="tiny").start()
    app = create_app(engine, manage_engine=False)

    def post(route, body):
        async def main():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://server") as c:
                return await c.post(route, json=body, timeout=60)

        return asyncio.run(main())

    yield post
    engine.stop()


def test_a_flat_list_of_20_token_ids_is_served_as_one_prompt(app_client):
    ids = list(range(100, 120))
    reply = app_client("/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 3})
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert len(answer["choices"]) == 1
    assert answer["usage"]["prompt_tokens"] == 20


def test_top_logprobs_20_gives_20_alternatives_per_token(app_client):
    body = {"model": "tiny", "messages": USER, "max_tokens": 3, "logprobs": True,
            "top_logprobs": 20, "temperature": 0, "ignore_eos_token": True}
    reply = app_client("/v1/chat/completions", body)
    assert reply.status_code == 200, reply.text
    content = reply.json()["choices"][0]["logprobs"]["content"]
    assert content
    for entry in content:
        assert len(entry["top_logprobs"]) == 20
        values = [alt["logprob"] for alt in entry["top_logprobs"]]
        assert values == sorted(values, reverse=True)
        assert entry["logprob"] == pytest.approx(values[0])     # greedy: the likeliest token


# --- through the HTTP app: seeds, stop sequences with logprobs, errors in OpenAI's words ----------

def test_each_seed_and_copy_draws_its_own_sample(app_client):
    """n=3 with seed 1234 and n=3 with seed 1235 share no completion (copies are not seeded
    seed + 1, seed + 2, ...), and the same request with the same seed gives the same three."""
    def draw(seed):
        body = {"model": "tiny", "prompt": "Jack and Jill", "max_tokens": 8, "n": 3,
                "temperature": 1.0, "seed": seed, "ignore_eos_token": True}
        reply = app_client("/v1/completions", body)
        assert reply.status_code == 200, reply.text
        return {choice["text"] for choice in reply.json()["choices"]}

    first, second = draw(1234), draw(1235)
    assert len(first) == 3 and len(second) == 3
    assert not first & second
    assert draw(1234) == first


def _text_and_tokens(route: str, reply, stream: bool) -> tuple[str, list[str]]:
    """The text an OpenAI answer returns, and the tokens its logprobs list."""
    chat = "chat" in route
    if stream:
        chunks = [json.loads(line[5:]) for line in reply.text.splitlines()
                  if line.startswith("data:") and "[DONE]" not in line]
        choices = [c["choices"][0] for c in chunks if c.get("choices")]
    else:
        choices = reply.json()["choices"]
    text, tokens = "", []
    for choice in choices:
        logprobs = choice.get("logprobs")
        if chat:
            text += (choice.get("delta") or choice.get("message") or {}).get("content") or ""
            tokens += [entry["token"] for entry in (logprobs or {}).get("content") or []]
        else:
            text += choice["text"]
            tokens += (logprobs or {}).get("tokens") or []
    return text, tokens


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_logprob_tokens_cover_the_text_when_a_stop_begins_inside_a_token(app_client, route,
                                                                          stream):
    """A stop sequence that begins inside a token: the text keeps that token's part before
    the stop, and the tokens listed with their log probabilities still cover the text."""
    body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "ignore_eos_token": True,
            **({"messages": USER, "logprobs": True} if "chat" in route
               else {"prompt": "Jack and Jill", "logprobs": 1})}
    free, tokens = _text_and_tokens(route, app_client(route, body), False)
    assert "".join(tokens) == free
    starts = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    # the first token of two characters or more whose tail and the next token's first
    # character make a stop sequence found nowhere earlier in the answer
    stop, cut_at = next((tokens[i][1:] + tokens[i + 1][:1], starts[i] + 1)
                        for i in range(len(tokens) - 1) if len(tokens[i]) >= 2
                        and tokens[i + 1] and free.find(tokens[i][1:] + tokens[i + 1][:1])
                        == starts[i] + 1)
    text, listed = _text_and_tokens(route, app_client(route, {**body, "stop": [stop],
                                                              "stream": stream}), stream)
    assert text == free[:cut_at]
    assert "".join(listed).startswith(text) and len("".join(listed)) > len(text)


def test_an_openai_request_hears_of_the_field_it_sent(app_client):
    """An adapter named in OpenAI's ``model`` field: the error names ``model``, the field the
    client sent, not LoRAX's ``adapter_id``."""
    for route, body in [("/v1/completions", {"prompt": "Jack"}),
                        ("/v1/chat/completions", {"messages": USER})]:
        reply = app_client(route, {"model": "sad ", "max_tokens": 2, **body})
        assert reply.status_code == 422, reply.text
        message = reply.json()["error"]["message"]
        assert message.startswith("`model` 'sad '") and "adapter_id" not in message


@pytest.mark.parametrize("prompt", [[1.5, 2.5], [[1.0, 2.0]], [5, 6.5], 3.5])
def test_a_prompt_of_numbers_that_are_not_integers_gets_one_message(prompt):
    error = refusal(parse_completion, {"model": MODEL, "prompt": prompt})
    assert error.message.startswith("`prompt` must be a text, a list of texts, a list of "
                                    "token ids (integers)"), error.message
    assert error.message.count("`prompt`") == 1 and "(float)" in error.message
