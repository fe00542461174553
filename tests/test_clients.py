"""Every client dialect the lesson-07 server speaks, each driven by its real client library.

* lorax-client: the upstream client's own test module (predibase/lorax,
  ``clients/python/tests/test_client.py``) ported to this server: the same cases, with the
  texts that depended on upstream's model replaced by checks against this server's model.
* huggingface_hub's ``InferenceClient`` (TGI's protocol, and its chat completion).
* openai: chat completions, several sequences, echo with log probabilities (what evaluation
  harnesses send), token-id prompts, penalties, logit bias, stop sequences and log probs.

One server runs for the module (a process on a free port of 127.0.0.1); answers are compared
with the bundled model run in this process.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections import Counter

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
lorax = pytest.importorskip("lorax")
openai = pytest.importorskip("openai")
hub = pytest.importorskip("huggingface_hub")

from lorax import AsyncClient, Client  # noqa: E402
from lorax.errors import NotFoundError, ValidationError  # noqa: E402
from lorax.types import FinishReason, InputToken  # noqa: E402

from helpers import generate_sequential  # noqa: E402
from helpers.lora import ADAPTERS_DIR  # noqa: E402
from helpers.server import serve_in_background  # noqa: E402

pytestmark = [
    # lorax-client 0.6.3 calls pydantic's deprecated .dict() on every request
    pytest.mark.filterwarnings("ignore:The `dict` method is deprecated:DeprecationWarning"),
    pytest.mark.usefixtures("one_thread"),   # see tests/conftest.py
]


@pytest.fixture(scope="module")
def url():
    kv = os.environ.get("COURSE_SERVER_KV")    # "contiguous": the same tests on lesson 03's cache
    server = serve_in_background(name="test-clients", threads=1, adapters=ADAPTERS_DIR,
                                 device="cpu", max_batch_size=8, kv_cache=kv,
                                 env={"HF_HUB_OFFLINE": "1"})
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def greedy(bundled):
    """``greedy(prompt, n)``: what the bundled model writes alone, greedily."""
    model, tokenizer = bundled
    cache = {}

    def run(prompt, n):
        if (prompt, n) not in cache:
            cache[prompt, n] = generate_sequential(model, tokenizer, [(prompt, n)])[0]
        return cache[prompt, n]

    return run


def prompt_logprobs(bundled, ids: list[int]) -> list[float]:
    """Each token's log probability after the ones before it (from the second token on)."""
    model, _ = bundled
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=model.device)).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[i, ids[i + 1]]) for i in range(len(ids) - 1)]


# --- lorax-client: the upstream client's tests, ported ------------------------------------------
# Upstream runs them against a hosted flan-t5-xxl and a URL that does not exist; here against
# this server and a path of it that does not exist (a 404 with error_type "not_found").

@pytest.fixture(scope="module")
def fake_url(url):
    return url + "/models/fake_model123"


def check_one_token(response, tokenizer, with_prefill: bool):
    details = response.details
    assert details.finish_reason in (FinishReason.Length, FinishReason.EndOfSequenceToken)
    assert details.generated_tokens == 1
    assert details.seed is None                            # greedy: no seed
    assert len(details.tokens) == 1
    token = details.tokens[0]
    assert token.text == tokenizer.decode([token.id])
    assert token.special == (token.id in tokenizer.all_special_ids)
    assert response.generated_text == ("" if token.special else token.text)
    if with_prefill:
        ids = tokenizer("test")["input_ids"]
        assert len(details.prefill) == len(ids)
        assert details.prefill[0] == InputToken(id=ids[0], text=tokenizer.decode([ids[0]]),
                                                logprob=None)
        assert [t.id for t in details.prefill] == ids
        assert all(t.logprob <= 0 for t in details.prefill[1:])


def test_generate(url, bundled):
    response = Client(url).generate("test", max_new_tokens=1, decoder_input_details=True)
    check_one_token(response, bundled[1], with_prefill=True)


def test_generate_best_of(url):
    response = Client(url).generate("test", max_new_tokens=1, best_of=2, do_sample=True,
                                    decoder_input_details=True)
    assert response.details.seed is not None
    assert response.details.best_of_sequences is not None
    assert len(response.details.best_of_sequences) == 1
    assert response.details.best_of_sequences[0].seed is not None
    assert response.details.best_of_sequences[0].seed != response.details.seed


def test_generate_not_found(fake_url):
    with pytest.raises(NotFoundError):
        Client(fake_url).generate("test")


def test_generate_validation_error(url):
    with pytest.raises(ValidationError):
        Client(url).generate("test", max_new_tokens=10_000)


def test_generate_stream(url, bundled):
    responses = list(Client(url).generate_stream("test", max_new_tokens=1))
    assert len(responses) == 1
    response = responses[0]
    assert response.details.finish_reason in (FinishReason.Length,
                                              FinishReason.EndOfSequenceToken)
    assert response.details.generated_tokens == 1
    assert response.details.seed is None
    token = response.token
    assert response.generated_text == ("" if token.special else token.text)
    assert token.text == bundled[1].decode([token.id])


def test_generate_stream_not_found(fake_url):
    with pytest.raises(NotFoundError):
        list(Client(fake_url).generate_stream("test"))


def test_generate_stream_validation_error(url):
    with pytest.raises(ValidationError):
        list(Client(url).generate_stream("test", max_new_tokens=10_000))


def test_generate_async(url, bundled):
    response = asyncio.run(AsyncClient(url).generate("test", max_new_tokens=1,
                                                     decoder_input_details=True))
    check_one_token(response, bundled[1], with_prefill=True)


def test_generate_async_best_of(url):
    response = asyncio.run(AsyncClient(url).generate(
        "test", max_new_tokens=1, best_of=2, do_sample=True, decoder_input_details=True))
    assert response.details.seed is not None
    assert len(response.details.best_of_sequences) == 1
    assert response.details.best_of_sequences[0].seed is not None


def test_generate_async_not_found(fake_url):
    with pytest.raises(NotFoundError):
        asyncio.run(AsyncClient(fake_url).generate("test"))


def test_generate_async_validation_error(url):
    with pytest.raises(ValidationError):
        asyncio.run(AsyncClient(url).generate("test", max_new_tokens=10_000))


async def _collect(stream):
    return [event async for event in stream]


def test_generate_stream_async(url):
    responses = asyncio.run(_collect(AsyncClient(url).generate_stream("test",
                                                                       max_new_tokens=1)))
    assert len(responses) == 1
    assert responses[0].details.generated_tokens == 1
    assert responses[0].details.seed is None


def test_generate_stream_async_not_found(fake_url):
    with pytest.raises(NotFoundError):
        asyncio.run(_collect(AsyncClient(fake_url).generate_stream("test")))


def test_generate_stream_async_validation_error(url):
    with pytest.raises(ValidationError):
        asyncio.run(_collect(AsyncClient(url).generate_stream("test", max_new_tokens=10_000)))


# --- lorax-client: beyond the upstream tests ----------------------------------------------------

def test_unknown_adapter_is_not_found_not_invalid(url):
    with pytest.raises(NotFoundError, match="no-such-adapter"):
        Client(url).generate("Jack", adapter_id="no-such-adapter", max_new_tokens=2)


def test_prefill_logprobs_are_the_models(url, bundled):
    prompt = "Jack and Jill went up the hill"
    details = Client(url).generate(prompt, max_new_tokens=1,
                                   decoder_input_details=True).details
    ids = bundled[1](prompt)["input_ids"]
    assert [t.id for t in details.prefill] == ids
    assert details.prefill[0].logprob is None
    assert [t.logprob for t in details.prefill[1:]] == pytest.approx(
        prompt_logprobs(bundled, ids), abs=1e-4)


def test_best_of_picks_the_likeliest(url):
    response = Client(url).generate("Once upon a time", max_new_tokens=12, best_of=3,
                                    do_sample=True, temperature=1.5)
    sequences = [response.details] + response.details.best_of_sequences
    assert len({s.seed for s in sequences}) == 3

    def mean(s):
        return sum(t.logprob for t in s.tokens) / len(s.tokens)

    assert mean(response.details) == max(mean(s) for s in sequences)
    best_of_texts = [s.generated_text for s in response.details.best_of_sequences]
    assert all(isinstance(text, str) for text in best_of_texts)


def test_temperature_zero_is_greedy_for_lorax(url, greedy):
    client = Client(url)
    assert client.generate("What comes up must", max_new_tokens=10, temperature=0,
                           do_sample=True).generated_text == greedy("What comes up must", 10)


# --- huggingface_hub's InferenceClient (TGI's protocol) -----------------------------------------

@pytest.fixture
def hf(url, monkeypatch):
    """An InferenceClient for the server. huggingface_hub refuses every request, even to
    127.0.0.1, while HF_HUB_OFFLINE is set (it reads the flag once, at import, into
    ``huggingface_hub.constants``): both are unset for the test."""
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return hub.InferenceClient(url)


def test_hf_text_generation_with_details(hf, bundled, greedy):
    prompt = "Jack and Jill"
    out = hf.text_generation(prompt, max_new_tokens=6, details=True,
                             decoder_input_details=True, top_n_tokens=3)
    assert out.generated_text == greedy(prompt, 6)
    details = out.details
    ids = bundled[1](prompt)["input_ids"]
    assert [t.id for t in details.prefill] == ids and details.prefill[0].logprob is None
    assert details.generated_tokens == len(details.tokens) == 6
    assert len(details.top_tokens) == 6
    for token, top in zip(details.tokens, details.top_tokens):
        # (huggingface_hub leaves these nested entries as dicts)
        assert len(top) == 3 and top[0]["id"] == token.id      # greedy: the likeliest
        assert top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"]
        assert [t["special"] for t in top] == [False] * 3
    assert hf.text_generation(prompt, max_new_tokens=6) == greedy(prompt, 6)


def test_hf_stream_with_details(hf, greedy):
    events = list(hf.text_generation("Humpty Dumpty sat", max_new_tokens=5, stream=True,
                                     details=True))
    assert "".join(e.token.text for e in events) == greedy("Humpty Dumpty sat", 5)
    assert events[-1].details.generated_tokens == 5 and events[-1].details.finish_reason


def test_hf_grammar_json_and_regex(hf):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    text = hf.text_generation("Jack and Jill", max_new_tokens=40,
                              grammar={"type": "json", "value": schema})
    answer = json.loads(text)
    assert set(answer) == {"name", "age"} and isinstance(answer["age"], int)
    pattern = "(yes|no), [a-z]{2,8}"
    text = hf.text_generation("Jack and Jill", max_new_tokens=10,
                              grammar={"type": "regex", "value": pattern})
    assert re.fullmatch(pattern, text), text


def test_hf_typical_p_and_frequency_penalty(hf, greedy):
    # typical_p keeps the tokens whose surprise is closest to the distribution's entropy,
    # as few as make up typical_p of the mass: at 0.01 only one, whatever the seed.
    texts = {hf.text_generation("Once upon a time", max_new_tokens=15, do_sample=True,
                                typical_p=0.01, seed=seed) for seed in (1, 2, 3)}
    assert len(texts) == 1
    sampled = {hf.text_generation("Once upon a time", max_new_tokens=15, do_sample=True,
                                  typical_p=0.9, temperature=1.5, seed=seed) for seed in (1, 2, 3)}
    assert len(sampled) > 1
    # A story repeats its hero's name; the penalty makes the model pick another word.
    prompt = "Once upon a time"
    plain = greedy(prompt, 60)
    penalised = hf.text_generation(prompt, max_new_tokens=60, frequency_penalty=2.0)
    assert penalised != plain


def test_hf_watermark_is_refused_clearly(hf):
    with pytest.raises(hub.errors.ValidationError, match="watermark"):
        hf.text_generation("Jack", max_new_tokens=2, watermark=True)


def test_hf_best_of(hf):
    out = hf.text_generation("Once upon a time", max_new_tokens=5, best_of=2, do_sample=True,
                             details=True)
    assert len(out.details.best_of_sequences) == 1
    assert out.details.seed is not None and out.details.best_of_sequences[0].seed is not None


def test_hf_chat_completion(hf, greedy):
    # Built from a URL, the client sends "model": "dummy": the server's base model.
    reply = hf.chat_completion([{"role": "user", "content": "Jack and Jill"}], max_tokens=12)
    assert reply.choices[0].message.content == greedy("Jack and Jill", 12)
    chunks = list(hf.chat_completion([{"role": "user", "content": "Jack and Jill"}],
                                     max_tokens=12, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == greedy("Jack and Jill", 12)
    # huggingface_hub sends a json_schema format in TGI's shape ({"type": "json_object",
    # "value": schema}).
    schema = {"type": "object", "properties": {"up": {"type": "boolean"}}, "required": ["up"]}
    reply = hf.chat_completion([{"role": "user", "content": "Jack and Jill"}], max_tokens=20,
                               response_format={"type": "json_schema", "json_schema": {
                                   "name": "up", "schema": schema}})
    assert isinstance(json.loads(reply.choices[0].message.content)["up"], bool)
    with pytest.raises(hub.errors.HfHubHTTPError) as caught:
        hf.chat_completion([{"role": "user", "content": "hi"}], model="gpt-4", max_tokens=2)
    assert caught.value.response.status_code == 404
    assert "gpt-4" in caught.value.response.text


# --- openai -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="not-needed", max_retries=0)


def test_chat_completions(oai, greedy, bundled):
    messages = [{"role": "system", "content": "You write nursery rhymes."},
                {"role": "user", "content": "Jack and Jill"}]
    reply = oai.chat.completions.create(model="bundled", messages=messages, max_tokens=15,
                                        temperature=0)
    # The bundled template leaves the system message out and the user's text is the start
    # of the passage: the answer is the greedy continuation of "Jack and Jill".
    assert reply.choices[0].message.content == greedy("Jack and Jill", 15)
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(bundled[1]("Jack and Jill")["input_ids"])
    chunks = list(oai.chat.completions.create(model="bundled", messages=messages,
                                              max_tokens=15, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy("Jack and Jill", 15)
    assert chunks[-1].usage.completion_tokens == 15


def test_chat_model_selects_the_adapter(oai, url):
    messages = [{"role": "user", "content": "Input: Tom the fox met Lily the owl at the river "
                                            "and found a red ball.\nOutput:"}]
    titled = oai.chat.completions.create(model="title", messages=messages, max_tokens=20)
    plain = oai.chat.completions.create(model="bundled", messages=messages, max_tokens=20)
    expected = oai.completions.create(model="title", prompt=messages[0]["content"],
                                      max_tokens=20)
    assert titled.choices[0].message.content == expected.choices[0].text
    assert titled.choices[0].message.content != plain.choices[0].message.content
    assert titled.model == "title"
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        oai.chat.completions.create(model="gpt-4", messages=messages, max_tokens=2)


def test_chat_response_format(oai):
    messages = [{"role": "user", "content": "Jack and Jill"}]
    reply = oai.chat.completions.create(model="bundled", messages=messages, max_tokens=30,
                                        response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"hill": {"type": "boolean"}},
              "required": ["hill"], "additionalProperties": False}
    reply = oai.chat.completions.create(
        model="bundled", messages=messages, max_tokens=30,
        response_format={"type": "json_schema", "json_schema": {"name": "h", "schema": schema}})
    assert isinstance(json.loads(reply.choices[0].message.content)["hill"], bool)


def test_chat_logprobs_and_n(oai):
    reply = oai.chat.completions.create(model="bundled", messages=[
        {"role": "user", "content": "Once upon a time"}], max_tokens=8, n=3, seed=4,
        logprobs=True, top_logprobs=2)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for choice in reply.choices:
        content = choice.logprobs.content
        assert "".join(t.token for t in content) == choice.message.content
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert len({c.message.content for c in reply.choices}) > 1   # n > 1 samples


def test_n_and_best_of(oai):
    reply = oai.completions.create(model="bundled", prompt=["Once upon a time", "Jack"],
                                   max_tokens=8, n=2, best_of=3, temperature=1.2, seed=1,
                                   logprobs=0)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert reply.usage.completion_tokens == 2 * 3 * 8 or reply.usage.completion_tokens < 48

    def mean(choice):
        values = choice.logprobs.token_logprobs
        return sum(values) / len(values)

    for first, second in (reply.choices[0:2], reply.choices[2:4]):
        assert mean(first) >= mean(second)       # the best first


def test_echo_with_logprobs_scores_the_prompt(oai, bundled):
    """The loglikelihood request of lm-evaluation-harness: echo, logprobs, max_tokens 0 or 1,
    prompts as token ids."""
    tokenizer = bundled[1]
    ids = tokenizer("Jack and Jill went up the hill")["input_ids"]
    expected = prompt_logprobs(bundled, ids)
    for max_tokens in (0, 1):
        reply = oai.completions.create(model="bundled", prompt=[ids], max_tokens=max_tokens,
                                       temperature=0, logprobs=1, echo=True, seed=1234)
        logprobs = reply.choices[0].logprobs
        assert len(logprobs.tokens) == len(ids) + max_tokens
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert logprobs.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=1e-4)
        for token, value, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:],
                                     logprobs.top_logprobs[1:]):
            assert max(top.values()) >= value - 1e-6          # is it greedy? readable
        assert reply.choices[0].text.startswith("Jack and Jill went up the hill")
        assert "".join(logprobs.tokens) == reply.choices[0].text
        assert logprobs.text_offset[1] == len(logprobs.tokens[0])
        assert reply.usage.completion_tokens == max_tokens


def test_streamed_echo_and_several_choices(oai, bundled, greedy):
    tokenizer = bundled[1]
    prompt = "Jack and Jill"
    chunks = list(oai.completions.create(model="bundled", prompt=prompt, max_tokens=5,
                                         temperature=0, echo=True, logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == prompt + greedy(prompt, 5)
    first = chunks[0].choices[0].logprobs            # the echoed prompt comes first
    assert first.tokens == [tokenizer.decode([i]) for i in tokenizer(prompt)["input_ids"]]
    assert first.token_logprobs[0] is None and first.text_offset[0] == 0
    chunks = list(oai.completions.create(model="bundled", prompt=["Once upon a time", "Jack"],
                                         max_tokens=6, n=2, seed=3, stream=True))
    texts = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert sorted(texts) == [0, 1, 2, 3]
    finished = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1, 2, 3]


def test_prompt_shapes(oai, greedy, bundled):
    tokenizer = bundled[1]
    texts = ["Jack and Jill", "Humpty Dumpty sat"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    expected = [greedy(t, 6) for t in texts]
    for prompt in (texts, ids):
        reply = oai.completions.create(model="bundled", prompt=prompt, max_tokens=6,
                                       temperature=0)
        assert [c.text for c in reply.choices] == expected
    reply = oai.completions.create(model="bundled", prompt=ids[0], max_tokens=6, temperature=0)
    assert [c.text for c in reply.choices] == expected[:1]


def test_models_retrieve(oai):
    assert oai.models.retrieve("bundled").id == "bundled"
    assert oai.models.retrieve("title").id == "title"
    assert {m.id for m in oai.models.list()} >= {"bundled", "entities", "title"}
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        oai.models.retrieve("gpt-4")


def test_penalties_and_logit_bias(oai, greedy, bundled):
    tokenizer = bundled[1]
    prompt = "Once upon a time"        # a story: its hero's name comes back, and "the", ...
    plain = greedy(prompt, 60)

    def complete(**extra):
        return oai.completions.create(model="bundled", prompt=prompt, max_tokens=60,
                                      temperature=0, **extra).choices[0].text

    def most_repeated(text):
        return Counter(tokenizer(text)["input_ids"]).most_common(1)[0][1]

    assert complete() == plain
    for name in ("frequency_penalty", "presence_penalty"):
        penalised = complete(**{name: 2.0})
        assert penalised != plain, name
        assert most_repeated(penalised) <= most_repeated(plain), name
    first = tokenizer(plain)["input_ids"][0]
    assert tokenizer(complete(logit_bias={str(first): -100}))["input_ids"][0] != first
    forced = tokenizer(" pail")["input_ids"][0]
    reply = oai.completions.create(model="bundled", prompt=prompt, max_tokens=3,
                                   temperature=0, logit_bias={str(forced): 100})
    assert tokenizer(reply.choices[0].text)["input_ids"] == [forced] * 3


def test_temperature_zero_is_greedy_everywhere(oai, greedy, url):
    prompt = "The rain in Spain falls"
    want = greedy(prompt, 10)
    assert oai.completions.create(model="bundled", prompt=prompt, max_tokens=10,
                                  temperature=0, top_p=0.1).choices[0].text == want
    assert oai.chat.completions.create(model="bundled", max_tokens=10, temperature=0,
                                       messages=[{"role": "user", "content": prompt}]
                                       ).choices[0].message.content == want
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 10, "temperature": 0,
                                             "do_sample": True, "top_k": 5}}
    assert httpx.post(url + "/generate", json=body).json()["generated_text"] == want


@pytest.mark.parametrize("stop", [" hill", "ill", " to fetch", "."])
def test_logprobs_cover_a_text_cut_at_a_stop_sequence(oai, greedy, stop):
    prompt = "Jack and Jill"
    full = greedy(prompt, 20)
    want = full[:full.index(stop)]
    reply = oai.completions.create(model="bundled", prompt=prompt, max_tokens=20,
                                   temperature=0, stop=[stop], logprobs=1)
    choice = reply.choices[0]
    assert choice.text == want and choice.finish_reason == "stop"
    logprobs = choice.logprobs
    # The tokens listed cover the text: each begins in it, the one the stop starts in too
    # when part of it is in the text.
    assert "".join(logprobs.tokens).startswith(want)
    for offset, token in zip(logprobs.text_offset, logprobs.tokens):
        assert offset < len(want) and full[offset:offset + len(token)] == token
    chunks = list(oai.completions.create(model="bundled", prompt=prompt, max_tokens=20,
                                         temperature=0, stop=[stop], logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == logprobs.tokens
    chunks = list(oai.chat.completions.create(model="bundled", max_tokens=20, temperature=0,
                                              messages=[{"role": "user", "content": prompt}],
                                              stop=[stop], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


# --- the chat template ----------------------------------------------------------------------------

def test_the_bundled_tokenizer_ships_a_chat_template(bundled):
    from helpers.server.tokens import render_chat as render

    tokenizer = bundled[1]
    assert tokenizer.chat_template
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Jack and Jill"},
                {"role": "assistant", "content": " went up the hill."},
                {"role": "user", "content": "Humpty Dumpty"}]
    assert render(tokenizer, messages) == \
        "Jack and Jill went up the hill.<|endoftext|>Humpty Dumpty"


# --- pieces, without a server ---------------------------------------------------------------------

@pytest.mark.parametrize("stop", [".", "ll", " hill", "hill to"])
def test_held_back_stream_never_sends_a_stop_sequence(stop):
    """OpenAI's streams leave a stop sequence out, so text that could still become one is held
    back; whatever the stop, the chunks add up to the text before it, and the tokens released
    (whole) cover that text: the one the stop begins in too, when part of it is there."""
    from helpers.server.routes_openai import Held

    pieces = [" went", " up", " the", " hill", " to", " fetch", " a", " pail", " of", " water",
              ".", " Jack"]
    full = "".join(pieces)
    cut_at = full.index(stop)
    ends = [len("".join(pieces[:i + 1])) for i in range(len(pieces))]
    last = next(i for i, end in enumerate(ends) if end >= cut_at + len(stop))
    held, sent, released = Held([stop]), "", []
    for i, piece in enumerate(pieces[:last + 1]):
        token = {"id": i, "text": piece, "logprob": -0.5, "special": False}
        text, tokens = (held.add(token) if i < last else held.finish(token, full[:cut_at]))
        sent += text
        released += [t["text"] for _, t in tokens]
        assert stop not in sent
    assert sent == full[:cut_at]
    assert "".join(released).startswith(sent)
    starts = [end - len(piece) for end, piece in zip(ends, pieces)]
    assert len(released) == sum(start < cut_at for start in starts[:last + 1])
