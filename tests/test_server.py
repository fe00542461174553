"""The lesson-07 server, driven over loopback by the real clients (lorax-client, openai, httpx).

Two servers run for this module, each in its own process on a free port of 127.0.0.1:
``server`` (8 slots, a long queue) for most tests, and ``small_server`` (2 slots, a queue of 1,
its own adapters folder with some traps in it) for the queue, disconnect and adapter-safety
tests. Answers are compared with ``generate_sequential`` on a copy of the model in this process
(with the same adapter set for the row, when there is one).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from enum import Enum
from typing import Annotated

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")
httpx = pytest.importorskip("httpx")
lorax = pytest.importorskip("lorax")
openai = pytest.importorskip("openai")

from pydantic import BaseModel, Field  # noqa: E402

from helpers import generate_sequential, load_model  # noqa: E402
from helpers.corpus import task_prompt  # noqa: E402
from helpers.lora import ADAPTERS_DIR, load_adapters  # noqa: E402
from helpers.server import serve_in_background  # noqa: E402

from .conftest import COURSE_PROMPTS  # noqa: E402

SENTENCE = "Tom the fox met Lily the owl at the river and found a red ball."
ADAPTERS = ["entities", "rhymes", "sad", "title"]
HAVE_ADAPTERS = all((ADAPTERS_DIR / name / "adapter_model.safetensors").is_file()
                    for name in ADAPTERS)
pytestmark = [
    # lorax-client 0.6.3 calls pydantic's deprecated .dict() on every request
    pytest.mark.filterwarnings("ignore:The `dict` method is deprecated:DeprecationWarning"),
    pytest.mark.usefixtures("one_thread"),   # see tests/conftest.py
]


def need_adapters():
    if not HAVE_ADAPTERS:
        pytest.skip(f"the shipped adapters {ADAPTERS} are missing from {ADAPTERS_DIR}")


@pytest.fixture(scope="module")
def traps(tmp_path_factory):
    """An adapters folder with one good adapter and three that must be refused."""
    need_adapters()
    root = tmp_path_factory.mktemp("adapters")
    folder = root / "adapters"
    folder.mkdir()
    shutil.copytree(ADAPTERS_DIR / "entities", folder / "entities")
    pickled = folder / "pickled"                    # weights only as a pickle
    pickled.mkdir()
    shutil.copy(ADAPTERS_DIR / "entities" / "adapter_config.json", pickled)
    (pickled / "adapter_model.bin").write_bytes(b"not loaded, ever")
    outside = root / "outside"                      # a good adapter outside the folder ...
    shutil.copytree(ADAPTERS_DIR / "title", outside)
    try:                                            # ... reached through a link
        (folder / "escape").symlink_to(outside, target_is_directory=True)
    except OSError:
        pass
    return folder


@pytest.fixture(scope="module")
def servers(traps):
    """Both servers, started at once (each takes seconds to import torch and load the model).
    On the CPU, as the reference, so that answers can be compared exactly."""
    kv = os.environ.get("COURSE_SERVER_KV")    # "contiguous": the same tests on lesson 03's cache
    started = {
        "main": serve_in_background(name="test-server", threads=1, adapters=ADAPTERS_DIR,
                                    device="cpu", max_batch_size=8, max_queue=64, kv_cache=kv,
                                    env={"HF_HUB_OFFLINE": "1"}, wait=False),
        "small": serve_in_background(name="test-small-server", threads=1, adapters=traps,
                                     device="cpu", max_batch_size=2, max_queue=1, kv_cache=kv,
                                     env={"HF_HUB_OFFLINE": "1"}, wait=False),
    }
    yield started
    for server in started.values():
        server.stop()


@pytest.fixture(scope="module")
def server(servers, reference):
    # (the reference model loads while the servers start)
    return servers["main"].wait().url


@pytest.fixture(scope="module")
def small_server(servers):
    return servers["small"].wait().url


@pytest.fixture(scope="module")
def reference():
    """``expected(prompt, max_new_tokens, adapter=None)``: what one request alone gives."""
    need_adapters()
    model, tokenizer = load_model(device="cpu")
    lora = load_adapters(model, {name: ADAPTERS_DIR / name for name in ADAPTERS})
    cache = {}

    def expected(prompt, max_new_tokens, adapter=None, stop_at_eos=True):
        key = (prompt, max_new_tokens, adapter, stop_at_eos)
        if key not in cache:
            with lora.rows([adapter]):
                cache[key] = generate_sequential(model, tokenizer, [(prompt, max_new_tokens)],
                                                 stop_at_eos=stop_at_eos)[0]
        return cache[key]

    expected.tokenizer = tokenizer
    return expected


def healthy(url) -> bool:
    return httpx.get(url + "/health", timeout=10).status_code == 200


def metrics(url) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {line.split()[0].removeprefix("helpers_server_"): float(line.split()[1])
            for line in text.splitlines() if line and not line.startswith("#")}


# --- lorax-client ------------------------------------------------------------------------------

def test_health_and_info(server):
    assert healthy(server)
    info = httpx.get(server + "/info").json()
    assert info["max_batch_size"] == 8 and info["max_total_tokens"] == 256
    assert info["max_best_of"] == 4 and info["max_stop_sequences"] == 4
    assert set(ADAPTERS) <= set(info["adapters_available"])
    assert info["engine"] == "process"          # the default: the model in its own process


def test_streams_that_hang_up_leave_nothing_in_the_engine(server):
    """Clients that hang up mid-stream (LoRAX, and OpenAI with n=2 copies of 4 prompts): their
    rows are cancelled, and the engine keeps none of their submissions (with the engine in a
    process of its own, each is let go as soon as it is cancelled or finished)."""
    lorax_body = {"inputs": "Jack and Jill", "parameters": {"max_new_tokens": 200,
                                                            "ignore_eos_token": True}}
    openai_body = {"prompt": COURSE_PROMPTS[:4], "max_tokens": 200, "n": 2, "stream": True,
                   "ignore_eos_token": True}
    with httpx.Client(timeout=30) as client:
        for path, body in [("/generate_stream", lorax_body)] * 4 + [
                ("/v1/completions", openai_body)] * 2:
            with client.stream("POST", server + path, json=body) as reply:
                assert reply.status_code == 200
                next(reply.iter_lines())           # one event, then hang up
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and metrics(server)["running"] > 0:
        time.sleep(0.05)
    figures = metrics(server)
    assert figures["running"] == 0 and figures["submissions_held"] == 0
    assert figures["up"] == 1


def test_generate_equals_sequential(server, reference):
    client = lorax.Client(server)
    for prompt in COURSE_PROMPTS:
        answer = client.generate(prompt, max_new_tokens=12)
        assert answer.generated_text == reference(prompt, 12)
        details = answer.details
        assert details.generated_tokens == len(details.tokens)
        assert details.prompt_tokens == len(reference.tokenizer(prompt)["input_ids"])
        assert details.finish_reason.value in ("length", "eos_token")
        assert details.seed is None
        assert "".join(t.text for t in details.tokens if not t.special) == answer.generated_text


def test_generate_stream(server, reference):
    events = list(lorax.Client(server).generate_stream("Jack and Jill", max_new_tokens=15))
    text = "".join(e.token.text for e in events if not e.token.special)
    assert text == events[-1].generated_text == reference("Jack and Jill", 15)
    assert all(e.generated_text is None and e.details is None for e in events[:-1])
    last = events[-1].details
    assert last.generated_tokens == len(events) and last.prompt_tokens == 3


def test_a_request_that_ends_at_eos_says_so(server, reference):
    # "The rain in Spain falls" ends its sentence and then the model writes EOS.
    events = list(lorax.Client(server).generate_stream("The rain in Spain falls",
                                                       max_new_tokens=30))
    assert events[-1].details.finish_reason.value == "eos_token"
    assert events[-1].token.special and events[-1].token.id == reference.tokenizer.eos_token_id
    assert events[-1].generated_text == reference("The rain in Spain falls", 30)


def test_async_client_three_concurrent_requests(server, reference):
    async def main():
        client = lorax.AsyncClient(server)

        async def one(prompt, n):
            text = ""
            async for event in client.generate_stream(prompt, max_new_tokens=n):
                if not event.token.special:
                    text += event.token.text
            return text

        plain = await client.generate("Humpty Dumpty sat", max_new_tokens=8)
        streamed = await asyncio.gather(one("Jack and Jill", 40), one("What comes up must", 10),
                                        one("Humpty Dumpty sat", 10))
        return plain, streamed

    plain, streamed = asyncio.run(main())
    assert plain.generated_text == reference("Humpty Dumpty sat", 8)
    assert streamed == [reference("Jack and Jill", 40), reference("What comes up must", 10),
                        reference("Humpty Dumpty sat", 10)]


def test_adapters_equal_each_row_alone(server, reference):
    client = lorax.Client(server)
    prompt = task_prompt(SENTENCE)
    answers = {name: client.generate(prompt, adapter_id=name, max_new_tokens=20).generated_text
               for name in [None] + ADAPTERS}
    for name, text in answers.items():
        assert text == reference(prompt, 20, name), name
    assert all(answers[name] != answers[None] for name in ADAPTERS)   # they do change it
    assert set(ADAPTERS) <= set(httpx.get(server + "/info").json()["adapters_loaded"])


def test_stop_sequences_and_return_full_text(server, reference):
    client = lorax.Client(server)
    full = reference("Jack and Jill", 20)             # " went up the hill to fetch a pail ..."
    answer = client.generate("Jack and Jill", max_new_tokens=20, stop_sequences=[" hill"])
    assert answer.details.finish_reason.value == "stop_sequence"
    assert answer.generated_text == full[:full.index(" hill") + len(" hill")]
    answer = client.generate("Jack and Jill", max_new_tokens=5, return_full_text=True)
    assert answer.generated_text == "Jack and Jill" + reference("Jack and Jill", 5)


def test_seeded_sampling_is_reproducible(server):
    client = lorax.Client(server)

    def draw(seed, **extra):
        return client.generate("Once upon a time", max_new_tokens=20, do_sample=True,
                               temperature=1.5, seed=seed, **extra)

    first, again, other = draw(7), draw(7), draw(8)
    assert first.generated_text == again.generated_text
    assert first.generated_text != other.generated_text
    assert first.details.seed == 7
    assert isinstance(draw(None).details.seed, int)           # a seed is drawn and reported
    narrow = draw(3, top_k=1)                                  # top_k=1 is greedy
    assert narrow.generated_text == client.generate("Once upon a time",
                                                    max_new_tokens=20).generated_text
    assert draw(5, top_p=0.5).generated_text == draw(5, top_p=0.5).generated_text


def test_alternatives_and_logprobs(server):
    answer = lorax.Client(server).generate("Jack and Jill", max_new_tokens=3,
                                           return_k_alternatives=3)
    for token in answer.details.tokens:
        assert token.logprob <= 0
        assert len(token.alternative_tokens) == 3
        assert token.alternative_tokens[0].id == token.id     # greedy: the top alternative


# --- OpenAI ------------------------------------------------------------------------------------

def test_openai_completions(server, reference):
    client = openai.OpenAI(base_url=server + "/v1", api_key="not-needed", max_retries=0)
    prompt = task_prompt(SENTENCE)
    reply = client.completions.create(model="bundled", prompt="Jack and Jill", max_tokens=12,
                                      temperature=0)
    assert reply.choices[0].text == reference("Jack and Jill", 12)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 12 and reply.usage.prompt_tokens == 3
    # The adapter goes in `model`; several prompts give several choices.
    reply = client.completions.create(model="title", prompt=[prompt, "Jack and Jill"],
                                      max_tokens=10)
    assert [c.text for c in reply.choices] == [reference(prompt, 10, "title"),
                                               reference("Jack and Jill", 10, "title")]
    # Streaming, with a stop sequence that OpenAI leaves out of the text.
    full = reference("Jack and Jill", 20)
    chunks = list(client.completions.create(model="bundled", prompt="Jack and Jill",
                                            max_tokens=20, stop=[" pail"], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full[:full.index(" pail")]
    assert chunks[-1].choices[0].finish_reason == "stop"
    with pytest.raises(openai.NotFoundError, match="no-such-adapter"):
        client.completions.create(model="no-such-adapter", prompt="Jack", max_tokens=2)
    with pytest.raises(openai.UnprocessableEntityError, match="best_of"):
        client.completions.create(model="bundled", prompt="Jack", max_tokens=2, best_of=9)


# --- JSON mode ---------------------------------------------------------------------------------

class Colour(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Pet(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=20)


class Owner(BaseModel):                     # nested objects
    pet: Pet
    town: str = Field(max_length=10)


class Shopping(BaseModel):                  # arrays
    items: list[str] = Field(max_length=3)
    count: int


class Ball(BaseModel):                      # enums
    colour: Colour
    size: int = Field(ge=1, le=3)


class Score(BaseModel):                     # integers
    points: int
    rank: int = Field(ge=1, le=10)


class Title(BaseModel):                     # strings with a max length
    title: str = Field(max_length=12)
    subtitle: str = Field(max_length=6)


class Entities(BaseModel):                  # what the entities adapter was trained to write
    characters: list[Annotated[str, Field(max_length=12)]] = Field(max_length=3)
    animals: list[Annotated[str, Field(max_length=12)]] = Field(max_length=3)
    place: str = Field(max_length=15)
    object: str = Field(max_length=20)


@pytest.mark.parametrize("model", [Owner, Shopping, Ball, Score, Title])
def test_json_mode_follows_the_schema(server, model):
    answer = lorax.Client(server).generate(
        task_prompt(SENTENCE), max_new_tokens=80,
        response_format={"type": "json_object", "schema": model.model_json_schema()})
    model.model_validate(json.loads(answer.generated_text))


def test_json_mode_with_the_entities_adapter(server):
    schema = Entities.model_json_schema()
    answer = lorax.Client(server).generate(task_prompt(SENTENCE), adapter_id="entities",
                                           max_new_tokens=100,
                                           response_format={"type": "json_object",
                                                            "schema": schema})
    Entities.model_validate_json(answer.generated_text)
    client = openai.OpenAI(base_url=server + "/v1", api_key="not-needed", max_retries=0)
    reply = client.completions.create(
        model="entities", prompt=task_prompt(SENTENCE), max_tokens=100,
        extra_body={"response_format": {"type": "json_object", "schema": schema}})
    Entities.model_validate_json(reply.choices[0].text)


# --- many clients at once ------------------------------------------------------------------------

def test_32_concurrent_streams_with_mixed_adapters(server, reference):
    prompts = COURSE_PROMPTS + [task_prompt(SENTENCE)]
    adapters = [None] + ADAPTERS
    jobs = [(prompts[i % len(prompts)], 6 + i % 11, adapters[i % len(adapters)])
            for i in range(32)]

    async def main():
        client = lorax.AsyncClient(server)

        async def one(prompt, n, adapter):
            events = [e async for e in client.generate_stream(prompt, max_new_tokens=n,
                                                              adapter_id=adapter)]
            assert "".join(e.token.text for e in events if not e.token.special) \
                == events[-1].generated_text
            return events[-1].generated_text

        return await asyncio.gather(*(one(*job) for job in jobs))

    before = metrics(server)
    answers = asyncio.run(main())
    assert answers == [reference(*job) for job in jobs]
    after = metrics(server)
    assert after["rows_max"] == 8                      # the batch was full ...
    assert after["steps_decode"] - before["steps_decode"] < sum(n for _, n, _ in jobs) / 3
    assert after["running"] == 0 and after["waiting"] == 0


# --- min_p, in both dialects; TGI's /tokenize ----------------------------------------------------

def test_min_p_of_one_samples_the_greedy_answer_on_both_routes(server, reference):
    """min_p keeps the tokens at least min_p times as likely as the likeliest: at 1 only the
    likeliest is left, so a sampled answer is the greedy one, through LoRAX's parameters and
    OpenAI's body alike; out of its range it is refused, naming the field as the client
    wrote it."""
    prompt, n = COURSE_PROMPTS[0], 12
    want = reference(prompt, n)
    lorax_answer = httpx.post(server + "/generate", timeout=60, json={
        "inputs": prompt, "parameters": {"max_new_tokens": n, "do_sample": True,
                                         "temperature": 1.5, "seed": 3, "min_p": 1.0}})
    assert lorax_answer.status_code == 200 and lorax_answer.json()["generated_text"] == want
    openai_answer = httpx.post(server + "/v1/completions", timeout=60, json={
        "model": "bundled", "prompt": prompt, "max_tokens": n, "temperature": 1.5, "seed": 3,
        "min_p": 1.0})
    assert openai_answer.status_code == 200
    assert openai_answer.json()["choices"][0]["text"] == want
    for path, body, field in (
            ("/generate", {"inputs": prompt, "parameters": {"min_p": 1.5}}, "parameters.min_p"),
            ("/v1/completions", {"model": "bundled", "prompt": prompt, "min_p": -0.1}, "min_p")):
        refused = httpx.post(server + path, json=body, timeout=30)
        assert refused.status_code == 422 and f"`{field}` must be between 0 and 1" in refused.text


def test_tokenize_gives_the_prompts_tokens_with_their_offsets(server, reference):
    """TGI's /tokenize: the tokens a prompt is read as (client text never becomes a special
    token), each with its text and where it starts and stops in the input."""
    tokenizer = reference.tokenizer
    text = "Jack and Jill <|endoftext|> went up"
    reply = httpx.post(server + "/tokenize", json={"inputs": text}, timeout=30)
    assert reply.status_code == 200
    tokens = reply.json()
    assert [t["id"] for t in tokens] == tokenizer(text, split_special_tokens=True)["input_ids"]
    assert tokenizer.eos_token_id not in [t["id"] for t in tokens]
    assert all(t["text"] == text[t["start"]:t["stop"]] for t in tokens)
    assert "".join(text[a["stop"]:b["start"]] for a, b in zip(tokens, tokens[1:])).strip() == ""
    assert tokens[0]["start"] == 0 and tokens[-1]["stop"] == len(text)
    missing = httpx.post(server + "/tokenize", json={"parameters": {}}, timeout=30)
    assert missing.status_code == 422 and "inputs" in missing.text


def test_a_client_that_leaves_frees_its_slot(small_server, reference):
    """Two slots: two long streams run, a third request waits; the first one's client leaves;
    the waiting request gets its slot, and the other long one is undisturbed."""
    prompt_b, prompt_c = "What comes up must", "Humpty Dumpty sat"

    async def stream_text(client, prompt, n, started=None, ignore_eos=False):
        body = {"inputs": prompt,
                "parameters": {"max_new_tokens": n, "ignore_eos_token": ignore_eos}}
        async with client.stream("POST", small_server + "/generate_stream", json=body) as reply:
            assert reply.status_code == 200
            async for line in reply.aiter_lines():
                if line.startswith("data:"):
                    event = json.loads(line[5:])
                    if started is not None:
                        started.set()
        return event["generated_text"]

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            long_body = {"inputs": "Jack and Jill",
                         "parameters": {"max_new_tokens": 250, "ignore_eos_token": True}}
            async with client.stream("POST", small_server + "/generate_stream",
                                     json=long_body) as long_reply:
                lines = long_reply.aiter_lines()
                async for line in lines:
                    if line.startswith("data:"):
                        break                            # the long request is running
                b_started = asyncio.Event()
                b = asyncio.create_task(stream_text(client, prompt_b, 150, b_started, True))
                await asyncio.wait_for(b_started.wait(), 30)
                c = asyncio.create_task(stream_text(client, prompt_c, 8))
                for _ in range(100):                     # c waits: both slots are taken
                    if metrics(small_server)["waiting"] == 1:
                        break
                    await asyncio.sleep(0.02)
                assert metrics(small_server)["running"] == 2
                assert not c.done()
            # Leaving the block closed the long stream's connection.
            return await asyncio.wait_for(asyncio.gather(b, c), 60)

    before = metrics(small_server)
    text_b, text_c = asyncio.run(main())
    assert text_b == reference(prompt_b, 150, stop_at_eos=False)
    assert text_c == reference(prompt_c, 8)
    after = metrics(small_server)
    assert after["cancelled"] == before.get("cancelled", 0) + 1
    assert after["running"] == 0 and after["waiting"] == 0
    assert healthy(small_server)


def test_a_full_queue_answers_429(small_server):
    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"inputs": "Jack and Jill",
                    "parameters": {"max_new_tokens": 250, "ignore_eos_token": True}}

            async def hold():
                async with client.stream("POST", small_server + "/generate_stream",
                                         json=body) as reply:
                    async for line in reply.aiter_lines():
                        if line.startswith("data:"):
                            await asyncio.sleep(30)     # keep the slot until cancelled

            async def until(running, waiting):
                for _ in range(300):
                    m = metrics(small_server)
                    if m["running"] == running and m["waiting"] == waiting:
                        return
                    await asyncio.sleep(0.02)
                raise AssertionError(f"never saw {running} running, {waiting} waiting: {m}")

            holders = []
            for running in (1, 2):                      # one at a time: the queue holds one
                holders.append(asyncio.create_task(hold()))
                await until(running, 0)                 # both slots taken
            waiter = asyncio.create_task(client.post(small_server + "/generate", json=body))
            await until(2, 1)                           # and the queue (of 1) full
            refused = await client.post(small_server + "/generate", json=body)
            try:
                await lorax.AsyncClient(small_server).generate("Jack", max_new_tokens=2)
                typed = None
            except lorax.errors.OverloadedError as err:
                typed = err
            for task in holders + [waiter]:
                task.cancel()
            await asyncio.gather(*holders, waiter, return_exceptions=True)
            return refused, typed

    refused, typed = asyncio.run(main())
    assert refused.status_code == 429
    assert refused.json()["error_type"] == "overloaded"
    assert typed is not None
    for _ in range(100):                                 # the cancelled requests leave
        if metrics(small_server)["running"] == 0:
            break
        time.sleep(0.05)
    assert healthy(small_server)
    assert lorax.Client(small_server).generate("Jack and Jill", max_new_tokens=3).generated_text


# --- bad requests --------------------------------------------------------------------------------

def _lorax(prompt="Jack and Jill", **parameters):
    return {"inputs": prompt, "parameters": {"max_new_tokens": 5, **parameters}}


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
BAD_REQUESTS = [
    # (id, route, body (dict, or bytes sent as they are), status, words the error must hold)
    ("not-json", "/generate", b'{"inputs": "Jack', 400, "not valid JSON"),
    ("empty-body", "/generate", b"", 400, "empty"),
    ("not-an-object", "/generate", [1, 2], 422, "object"),
    ("no-inputs", "/generate", {"parameters": {}}, 422, "inputs"),
    ("inputs-not-text", "/generate", {"inputs": 12}, 422, "inputs"),
    ("empty-inputs", "/generate", {"inputs": ""}, 422, "inputs"),
    ("max-new-tokens-as-text", "/generate", _lorax(max_new_tokens="10"), 422, "max_new_tokens"),
    ("max-new-tokens-zero", "/generate", _lorax(max_new_tokens=0), 422, "max_new_tokens"),
    ("max-tokens-negative", "/v1/completions",
     {"model": "bundled", "prompt": "Jack", "max_tokens": -1}, 422, "max_tokens"),
    ("max-new-tokens-over-cap", "/generate", _lorax(max_new_tokens=400), 422, "max_new_tokens"),
    ("input-too-long", "/generate", _lorax("Jack and Jill " * 60), 422, "at most 128"),
    ("bool-as-int", "/", _lorax(do_sample=1), 422, "do_sample"),
    ("best-of-greedy", "/", _lorax(best_of=2), 422, "sampling"),
    ("best-of-streamed", "/", {**_lorax(best_of=2, do_sample=True), "stream": True}, 422,
     "stream"),
    ("best-of-on-the-stream-route", "/generate_stream", _lorax(best_of=2, do_sample=True), 422,
     "cannot be streamed"),
    ("best-of-with-seed", "/generate", _lorax(best_of=2, do_sample=True, seed=3), 422, "seed"),
    ("watermark", "/generate", _lorax(watermark=True), 422, "watermark"),
    ("merged-adapters", "/generate",
     _lorax(merged_adapters={"ids": ["entities", "title"], "weights": [0.5, 0.5]}), 422,
     "merged_adapters"),
    ("typical-p-one", "/generate", _lorax(typical_p=1.5), 422, "typical_p"),
    ("grammar-and-format", "/generate",
     _lorax(grammar={"type": "regex", "value": "a+"}, response_format={"type": "json_object"}),
     422, "grammar"),
    ("grammar-unknown", "/generate", _lorax(grammar={"type": "xml", "value": "a"}), 422,
     "grammar"),
    ("top-n-tokens-too-many", "/generate", _lorax(top_n_tokens=50), 422, "alternatives"),
    ("unknown-parameter", "/generate", _lorax(frobnicate=3), 422, "frobnicate"),
    ("temperature-negative", "/generate", _lorax(temperature=-1.0), 422, "temperature"),
    ("top-p-over-one", "/generate", _lorax(top_p=1.5), 422, "top_p"),
    ("too-many-stops", "/generate", _lorax(stop=["a", "b", "c", "d", "e"]), 422, "stop"),
    ("unknown-adapter", "/generate", _lorax(adapter_id="nope"), 404, "nope"),
    ("adapter-path", "/generate", _lorax(adapter_id="../model", adapter_source="local"), 422,
     "../model"),
    ("adapter-absolute-path", "/generate", _lorax(adapter_id="/etc", adapter_source="local"),
     422, "/etc"),
    ("adapter-source-s3", "/generate", _lorax(adapter_id="x", adapter_source="s3"), 422, "s3"),
    ("hub-offline", "/generate", _lorax(adapter_id="someone/some-adapter", adapter_source="hub"),
     503, "offline"),
    ("schema-invalid", "/generate",
     _lorax(response_format={"type": "json_object", "schema": {"type": "nonsense"}}), 422,
     "schema"),
    ("schema-not-object", "/generate",
     _lorax(response_format={"type": "json_object", "schema": [1]}), 422, "schema"),
    ("format-unknown", "/generate", _lorax(response_format={"type": "xml"}), 422,
     "response_format"),
    ("json-too-short", "/generate",
     _lorax(max_new_tokens=3, response_format={"type": "json_object", "schema": SCHEMA}), 422,
     "shortest"),
    ("openai-n", "/v1/completions", {"model": "bundled", "prompt": "Jack", "n": 9}, 422, "`n`"),
    ("openai-best-of-below-n", "/v1/completions",
     {"model": "bundled", "prompt": "Jack", "n": 3, "best_of": 2}, 422, "best_of"),
    ("openai-best-of-streamed", "/v1/completions",
     {"model": "bundled", "prompt": "Jack", "best_of": 2, "stream": True}, 422, "best_of"),
    ("openai-no-prompt", "/v1/completions", {"model": "bundled"}, 422, "prompt"),
    ("openai-logit-bias-key", "/v1/completions",
     {"model": "bundled", "prompt": "Jack", "logit_bias": {"x": 1}}, 422, "logit_bias"),
    ("openai-logit-bias-value", "/v1/completions",
     {"model": "bundled", "prompt": "Jack", "logit_bias": {"5": 101}}, 422, "logit_bias"),
    ("openai-logit-bias-no-such-token", "/v1/completions",
     {"model": "bundled", "prompt": "Jack", "logit_bias": {"99999": 1}}, 422, "logit_bias"),
    ("openai-penalty", "/v1/completions",
     {"model": "bundled", "prompt": "Jack", "presence_penalty": 2.5}, 422, "presence_penalty"),
    ("openai-token-ids-empty", "/v1/completions", {"model": "bundled", "prompt": [[]]}, 422,
     "prompt"),
    ("openai-token-id-unknown", "/v1/completions",
     {"model": "bundled", "prompt": [5, 999999]}, 422, "token"),
    ("chat-no-messages", "/v1/chat/completions", {"model": "bundled", "messages": []}, 422,
     "messages"),
    ("chat-image-part", "/v1/chat/completions",
     {"model": "bundled", "messages": [{"role": "user", "content": [
         {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 422, "image_url"),
    ("chat-message-without-content", "/v1/chat/completions",
     {"model": "bundled", "messages": [{"role": "user"}]}, 422, "messages[0].content"),
    ("chat-messages-all-empty", "/v1/chat/completions",
     {"model": "bundled", "messages": [{"role": "system", "content": ""},
                                       {"role": "user", "content": ""}]}, 422,
     "every `content` of the 2 messages"),
    ("chat-bad-role", "/v1/chat/completions",
     {"model": "bundled", "messages": [{"role": "robot", "content": "hi"}]}, 422, "role"),
    ("chat-unknown-model", "/v1/chat/completions",
     {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "gpt-4"),
    ("chat-top-logprobs-alone", "/v1/chat/completions",
     {"model": "bundled", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     422, "logprobs"),
    ("no-such-route", "/nowhere", {}, 404, "/nowhere"),
    ("body-too-large", "/generate", {"inputs": "x" * (1 << 20)}, 413, "bytes"),
]


@pytest.mark.parametrize("route, body, status, words",
                         [case[1:] for case in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_requests_get_the_right_status(server, route, body, status, words):
    if isinstance(body, bytes):
        reply = httpx.post(server + route, content=body,
                           headers={"Content-Type": "application/json"}, timeout=30)
    else:
        reply = httpx.post(server + route, json=body, timeout=30)
    assert reply.status_code == status, reply.text
    error = reply.json()
    assert set(error) == {"error", "error_type"}
    expected_type = {404: "not_found", 503: "unavailable"}.get(status, "validation")
    assert error["error_type"] == expected_type
    message = error["error"]["message"] if route.startswith("/v1/") else error["error"]
    assert words in message
    assert healthy(server)


def test_wrong_method_and_stream_errors_keep_lorax_shape(server):
    reply = httpx.get(server + "/generate")
    assert reply.status_code == 405 and reply.json()["error_type"] == "validation"
    with pytest.raises(lorax.errors.ValidationError, match="max_new_tokens"):
        list(lorax.Client(server).generate_stream("Jack", max_new_tokens=1000))
    with pytest.raises(lorax.errors.NotFoundError, match="nope"):
        list(lorax.Client(server).generate_stream("Jack", max_new_tokens=2, adapter_id="nope"))


def test_adapter_safety(small_server):
    """Names only, inside the adapters folder, safetensors only."""
    cases = {"pickled": (422, "safetensors"),     # weights only as adapter_model.bin
             "escape": (422, "outside"),          # a link to a folder outside
             "title": (404, "title")}             # shipped, but not in this server's folder
    for name, (status, words) in cases.items():
        reply = httpx.post(small_server + "/generate", json=_lorax(adapter_id=name), timeout=30)
        if name == "escape" and reply.status_code == 404:
            continue                              # this system could not make the link
        assert reply.status_code == status, (name, reply.text)
        assert words in reply.json()["error"]
    reply = httpx.post(small_server + "/generate", json=_lorax(adapter_id="entities"), timeout=30)
    assert reply.status_code == 200
    assert httpx.get(small_server + "/info").json()["adapters_available"] == ["entities"]



# --- the process around it -----------------------------------------------------------------------

def test_the_server_ends_when_its_stdin_closes(servers, small_server):
    """What happens when the notebook's kernel dies (restart, crash, kill -9): the pipe to the
    server's stdin closes, and the server exits on its own."""
    process = servers["small"].process
    process.stdin.close()
    process.wait(30)
    with pytest.raises(httpx.ConnectError):
        httpx.get(small_server + "/health", timeout=2)


def test_starting_again_under_a_name_replaces_the_old_server(servers, server, tmp_path):
    """Re-running a notebook cell: the server started before under that name is stopped."""
    from helpers.server.background import _RUNNING

    old = servers["main"]
    assert _RUNNING["test-server"] is old and old.running
    with pytest.raises(ValueError, match="log_level"):   # a bad option: refused, nothing stops
        serve_in_background(name="test-server", log_level="nonsense", timeout=60)
    assert old.running
    with pytest.raises(RuntimeError, match="did not start"):   # no such model: exits at once
        serve_in_background(name="test-server", model=str(tmp_path / "missing"), timeout=60,
                            env={"HF_HUB_OFFLINE": "1"})
    assert not old.running
    assert "test-server" not in _RUNNING


# --- pieces, without a server --------------------------------------------------------------------

def test_the_bodies_lorax_client_sends_are_understood():
    from lorax.types import Parameters, Request

    from helpers.server.openai_bodies import parse_completion
    from helpers.server.routes_lorax import parse_lorax

    parameters = Parameters(adapter_id="entities", do_sample=True, max_new_tokens=7, seed=3,
                            stop=["."], temperature=0.5, top_k=5, top_p=0.9, details=True,
                            return_full_text=True, repetition_penalty=1.2, truncate=50,
                            return_k_alternatives=2,
                            response_format={"type": "json_object", "schema": {"type": "object"}})
    body = Request(inputs="Jack", stream=True, parameters=parameters).model_dump(by_alias=True)
    call = parse_lorax(json.loads(json.dumps(body)))
    params = call.params
    assert (call.prompts, call.stream, params.adapter_id, params.max_new_tokens, params.seed) \
        == (["Jack"], True, "entities", 7, 3)
    assert params.sampling and params.stop == ["."] and params.alternatives == 2
    assert params.grammar == ("json", {"type": "object"}) and params.truncate == 50
    call = parse_completion(
        {"model": "title", "prompt": "Jack", "max_tokens": 3, "temperature": 0, "echo": True},
        "bundled")
    assert call.prompts == ["Jack"] and call.params.adapter_id == "title"
    assert not call.params.sampling and call.echo and not call.stream
    assert not call.params.prompt_logprobs          # echo without logprobs: text only


def test_engine_errors_become_statuses():
    """The engine raises its own errors; the HTTP side answers each with its status, in the
    body shape of the protocol the client spoke. 404 is "not_found", never "validation"
    (lorax-client would raise ValidationError for it)."""
    from helpers.server import create_app, errors

    class Refusing:
        """Just enough of an engine to reach ``submit``, which raises ``error``."""
        model_id, healthy, restarts = "bundled", True, 0
        error: Exception = errors.EngineError("unset")

        def submit(self, submission, sink):
            raise self.error

    engine = Refusing()
    app = create_app(engine, manage_engine=False)
    cases = [(errors.InvalidRequest("bad"), 422, "validation"),
             (errors.TooLarge("big"), 413, "validation"),
             (errors.NotFound("no adapter 'x'"), 404, "not_found"),
             (errors.Overloaded("busy"), 429, "overloaded"),
             (errors.Unavailable("stopping"), 503, "unavailable"),
             (errors.GenerationFailed("failed"), 500, "generation")]

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            answers = []
            for error, _, _ in cases:
                engine.error = error
                lorax_reply = await client.post("/generate", json={"inputs": "Jack"})
                openai_reply = await client.post("/v1/completions",
                                                 json={"model": "bundled", "prompt": "Jack"})
                answers.append((lorax_reply, openai_reply))
            return answers

    for (error, status, error_type), (lorax_reply, openai_reply) in zip(cases,
                                                                        asyncio.run(main())):
        assert lorax_reply.status_code == openai_reply.status_code == status
        assert lorax_reply.json() == {"error": error.message, "error_type": error_type}
        assert openai_reply.json()["error"] == {"message": error.message, "type": error_type,
                                                "param": None, "code": status}


def _engine_answers(engine, jobs):
    """Run (prompt, max_new_tokens) jobs through an engine in this process, all at once."""
    from helpers.server.contract import ErrorEvent, GenerationParams, Submission, TokenEvent

    async def main():
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        for tag, (prompt, n) in enumerate(jobs):
            def sink(events, tag=tag):
                loop.call_soon_threadsafe(lambda: [queue.put_nowait((tag, e)) for _, e in events])
            engine.submit(Submission(GenerationParams(max_new_tokens=n), [prompt]), sink)
        answers = {}
        while len(answers) < len(jobs):
            tag, event = await asyncio.wait_for(queue.get(), 60)
            if isinstance(event, TokenEvent) and event.finish is not None:
                answers[tag] = event.finish.text
            elif isinstance(event, ErrorEvent):
                answers[tag] = event
        return [answers[i] for i in range(len(jobs))]

    return asyncio.run(main())


def test_the_engine_serves_a_llama_style_model(tiny_llama):
    """Rotary positions and grouped-query attention (2 kv heads for 4 heads): continuous
    batching in the engine gives what one request at a time gives."""
    from helpers.server import Engine

    model, tokenizer = tiny_llama
    jobs = [(COURSE_PROMPTS[i % 5] + " and" * (i % 3), 3 + 2 * i) for i in range(7)]
    engine = Engine(model, tokenizer, adapters_dir=None, max_batch_size=3).start()
    try:
        assert _engine_answers(engine, jobs) == generate_sequential(model, tokenizer, jobs)
    finally:
        engine.stop()


def test_a_failing_model_fails_its_requests_not_the_server(tiny_llama, monkeypatch):
    from helpers.server import Engine, create_app

    model, tokenizer = tiny_llama
    engine = Engine(model, tokenizer, adapters_dir=None, max_batch_size=2).start()
    app = create_app(engine, manage_engine=False)
    forward = type(model).forward
    failures = [1]

    def flaky(self, *args, **kwargs):
        if failures:
            failures.pop()
            raise RuntimeError("CUDA error at /opt/secret/kernel.cu:42 (simulated)")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", flaky)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            body = {"inputs": "Jack and Jill", "parameters": {"max_new_tokens": 4}}
            failed = await client.post("/generate", json=body)
            served = await client.post("/generate", json=body)
            health = await client.get("/health")
            return failed, served, health

    try:
        failed, served, health = asyncio.run(main())
    finally:
        engine.stop()
    assert failed.status_code == 500
    assert failed.json() == {"error": "generation failed; the server's log has the details",
                             "error_type": "generation"}
    assert served.status_code == 200 and health.status_code == 200
    assert "/opt/secret" not in failed.text and "RuntimeError" not in failed.text


def test_paged_engine_metrics_count_prefix_cache_hits(tiny_llama):
    """On the paged KV cache, /metrics counts the prompt tokens looked up in the prefix cache
    and those found: requests that share a long prefix, one after another, make the hit
    counter grow by the prefix's full blocks. The pool's blocks show as gauges."""
    from helpers.server import Engine, create_app

    model, tokenizer = tiny_llama
    prefix = "Once upon a time a little fox lived by the river and ran up the hill. " * 3
    engine = Engine(model, tokenizer, adapters_dir=None, max_batch_size=2,
                    block_size=16).start()
    app = create_app(engine, manage_engine=False)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            async def scrape():
                text = (await client.get("/metrics")).text
                return {line.split()[0].removeprefix("helpers_server_"): float(line.split()[1])
                        for line in text.splitlines() if line and not line.startswith("#")}

            pages = [await scrape()]
            for prompt in COURSE_PROMPTS[:3]:
                reply = await client.post("/generate", json={
                    "inputs": prefix + prompt, "parameters": {"max_new_tokens": 2}})
                assert reply.status_code == 200
                pages.append(await scrape())
            # The blocks go back to the pool just after the last token is handed out.
            for _ in range(50):
                if pages[-1]["kv_blocks_used"] == 0:
                    break
                await asyncio.sleep(0.1)
                pages[-1] = await scrape()
            return pages

    try:
        pages = asyncio.run(main())
    finally:
        engine.stop()
    lengths = [len(tokenizer(prefix + prompt)["input_ids"]) for prompt in COURSE_PROMPTS[:3]]
    shared_blocks = len(tokenizer(prefix)["input_ids"]) // 16   # full blocks inside the prefix
    assert shared_blocks >= 2
    queries = [page["prefix_cache_queries"] for page in pages]
    hits = [page["prefix_cache_hits"] for page in pages]
    assert queries == [0, lengths[0], lengths[0] + lengths[1], sum(lengths)]
    assert hits[:2] == [0, 0]                                  # nothing cached yet
    assert hits[2] - hits[1] >= 16 * shared_blocks and hits[3] - hits[2] >= 16 * shared_blocks
    assert all(page["kv_blocks_total"] == engine.kv.cache.manager.num_blocks for page in pages)
    assert pages[-1]["kv_blocks_used"] == 0                    # all done: every block free
