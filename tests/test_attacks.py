"""Requests found to break the lesson-07 server when it was attacked from outside: each one
is answered as the protocol says (a 4xx that names the field, or the full answer), never with
a 500 or a silently shortened answer.

* ``logit_bias`` keys that ``str.isdigit`` accepts but ``int`` cannot read (a superscript
  digit, an integer of more than 4300 digits) must be refused like any other bad key.
* A body that is cheap to send but long to validate (200,000 one-token prompts, 30,000
  empty chat messages) is refused by its counts before the per-item validation.
* A stop sequence that starts inside a token: the text is cut at the stop, and that token
  (which holds the stop) is not among the log probabilities.
* A prompt of ONE token, scored (``echo`` with ``logprobs``, or LoRAX's
  ``decoder_input_details``), must come back with its one token (logprob None): the prompt's
  tokens are part of the answer whatever the prompt's length, streamed or not.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from helpers.server import serve_in_background  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")    # see tests/conftest.py


@pytest.fixture(scope="module")
def url():
    server = serve_in_background(name="test-attacks", threads=1, device="cpu",
                                 env={"HF_HUB_OFFLINE": "1"})
    yield server.url
    server.stop()


def post(url, path, body):
    return httpx.post(url + path, json=body, timeout=60)


# --- logit_bias keys ------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["\u00b2", "1" + "0" * 5000], ids=["superscript", "5001-digits"])
def test_logit_bias_key_that_int_cannot_read_is_a_422(url, key):
    r = post(url, "/v1/completions", {"model": "bundled", "prompt": "Jack", "max_tokens": 2,
                                      "logit_bias": {key: 1}})
    assert r.status_code == 422, r.text
    assert "logit_bias" in r.json()["error"]["message"]


# --- a one-token prompt, scored --------------------------------------------------------------

@pytest.fixture(scope="module")
def token_text(url) -> str:
    """The text of token 5 (read from the server: a two-token prompt's echo works)."""
    r = post(url, "/v1/completions", {"model": "bundled", "prompt": [5, 6], "max_tokens": 0,
                                      "echo": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"][0]


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_logprobs_of_a_one_token_prompt(url, max_tokens):
    body = {"model": "bundled", "prompt": [5], "max_tokens": max_tokens, "echo": True,
            "logprobs": 1, "temperature": 0}
    choice = post(url, "/v1/completions", body).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == 1 + max_tokens, logprobs      # the prompt's token too
    assert logprobs["token_logprobs"][0] is None
    assert "".join(logprobs["tokens"]) == choice["text"]


def test_streamed_echo_of_a_one_token_prompt_matches_the_whole_answer(url):
    body = {"model": "bundled", "prompt": [5], "max_tokens": 3, "echo": True, "logprobs": 1,
            "temperature": 0}
    whole = post(url, "/v1/completions", body).json()["choices"][0]["text"]
    streamed, tokens = "", []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            for choice in json.loads(line[5:])["choices"]:
                streamed += choice["text"]
                tokens += (choice["logprobs"] or {}).get("tokens") or []
    assert streamed == whole
    assert "".join(tokens) == whole


def test_decoder_input_details_of_a_one_token_prompt(url, token_text):
    r = post(url, "/generate", {"inputs": token_text, "parameters": {
        "max_new_tokens": 2, "details": True, "decoder_input_details": True}})
    assert r.status_code == 200, r.text
    details = r.json()["details"]
    assert details["prompt_tokens"] == 1          # (the test's premise: one token)
    assert len(details["prefill"]) == 1, details
    assert details["prefill"][0]["logprob"] is None


# --- bodies that are cheap to send and long to check ------------------------------------------

def test_two_hundred_thousand_prompts_are_refused_by_their_count(url):
    r = post(url, "/v1/completions", {"model": "bundled", "prompt": [[1]] * 200_000,
                                      "max_tokens": 1})
    assert r.status_code == 422, r.text
    assert "200000 items; at most 16" in r.json()["error"]["message"]


def test_thirty_thousand_chat_messages_are_refused_by_their_count(url):
    messages = [{"role": "user", "content": ""}] * 30_000
    r = post(url, "/v1/chat/completions", {"model": "bundled", "messages": messages})
    assert r.status_code == 422, r.text
    assert "30000 items; at most 256" in r.json()["error"]["message"]


def test_many_empty_messages_still_count_against_the_prompt_limit(url):
    # 255 characters of text, but 255 messages: each counts for its role and separators too.
    messages = [{"role": "user", "content": "a"}] * 255
    r = post(url, "/v1/chat/completions", {"model": "bundled", "messages": messages})
    assert r.status_code == 413, r.text
    assert "per message" in r.json()["error"]["message"]


# --- a stop sequence inside a token -------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_the_logprob_tokens_cover_a_text_cut_inside_a_token(url, stream):
    """A stop sequence that starts inside a token: the text ends where it starts, and the
    tokens listed with log probabilities are those that begin before that, the one it starts
    in included (part of it is in the text)."""
    plain = post(url, "/v1/completions", {"model": "bundled", "prompt": "Jack and Jill",
                                          "max_tokens": 12, "temperature": 0, "logprobs": 1})
    tokens = plain.json()["choices"][0]["logprobs"]["tokens"]
    # A stop made of a token's second and third characters: it starts inside that token.
    at = next(i for i, t in enumerate(tokens) if i > 0 and len(t) >= 3)
    stop = tokens[at][1:3]
    body = {"model": "bundled", "prompt": "Jack and Jill", "max_tokens": 12, "temperature": 0,
            "logprobs": 1, "stop": [stop], "stream": stream}
    if stream:
        text, got = "", []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and not line.endswith("[DONE]"):
                    for choice in json.loads(line[5:])["choices"]:
                        text += choice["text"]
                        got += (choice["logprobs"] or {}).get("tokens") or []
    else:
        choice = post(url, "/v1/completions", body).json()["choices"][0]
        text, got = choice["text"], choice["logprobs"]["tokens"]
    joined = "".join(tokens)
    cut = joined.index(stop)
    assert text == joined[:cut]                               # cut where the stop starts
    starts = [len("".join(tokens[:i])) for i in range(len(tokens))]
    assert got == [t for t, start in zip(tokens, starts) if start < cut]
    assert "".join(got).startswith(text) and len("".join(got)) > len(text)
