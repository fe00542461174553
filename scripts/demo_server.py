"""The client calls of lesson 07, end to end, against the course's server (or a real LoRAX).

    python scripts/demo_server.py                      # starts helpers.server in the background
    LORAX_URL=http://my-lorax:8080 python scripts/demo_server.py   # a real LoRAX instead

The one setting is ``LORAX_URL``: unset, the script starts the course's server on a free port
of 127.0.0.1 and stops it at the end; set, every call goes to that endpoint and nothing is
started. (A real LoRAX must serve adapters named like the course's, or set ADAPTERS below.)

Each section is what a lesson cell does: ``Client.generate``; ``generate_stream`` with time to
first token and tokens/s; ``AsyncClient`` with three concurrent requests (100, 10 and 10
tokens, printed in three colours); per-request adapters, alone and three at once; JSON mode
from a pydantic model, alone and with the entity-extraction adapter; the ``openai`` client on
``/v1/completions``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Annotated

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pydantic import BaseModel, Field  # noqa: E402

# lorax-client 0.6.3 calls pydantic's deprecated .dict() on every request.
warnings.filterwarnings("ignore", message="The `dict` method is deprecated")

from lorax import AsyncClient, Client  # noqa: E402

from helpers.corpus import task_prompt  # noqa: E402

ADAPTERS = ["entities", "rhymes", "title"]
SENTENCE = "Tom the fox met Lily the owl at the river and found a red ball."
COLOURS = ["\033[34m", "\033[33m", "\033[32m"]   # blue, yellow, green
RESET = "\033[0m"


@contextlib.contextmanager
def endpoint():
    """LORAX_URL if set, else a course server started for the duration of the block."""
    url = os.environ.get("LORAX_URL")
    if url:
        print(f"using the LoRAX endpoint {url}")
        yield url.rstrip("/")
        return
    from helpers.server import serve_in_background

    start = time.perf_counter()
    with serve_in_background(name="demo", threads=1) as url:
        print(f"course server on {url} (started in {time.perf_counter() - start:.1f} s)")
        yield url


def section(title):
    print(f"\n=== {title} ===")


def generate(client: Client):
    section("Client.generate")
    answer = client.generate("Jack and Jill", max_new_tokens=20)
    print(repr(answer.generated_text))
    print("finish:", answer.details.finish_reason.value, "| tokens:",
          answer.details.generated_tokens, "| prompt tokens:", answer.details.prompt_tokens)


def stream(client: Client):
    section("Client.generate_stream: TTFT and tokens/s")
    start = time.perf_counter()
    times, text = [], ""
    for event in client.generate_stream("Humpty Dumpty sat", max_new_tokens=40,
                                        ignore_eos_token=True):
        times.append(time.perf_counter())
        if not event.token.special:
            text += event.token.text
    ttft = times[0] - start
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")
    gaps = [b - a for a, b in zip(times, times[1:])]
    print(repr(text))
    print(f"TTFT {ttft * 1e3:.1f} ms, then {rate:.0f} tokens/s; per-token latency "
          f"min {min(gaps) * 1e3:.1f} ms, max {max(gaps) * 1e3:.1f} ms (the lesson plots these)")


async def three_at_once(url):
    section("AsyncClient: three concurrent requests (100, 10, 10 tokens)")
    client = AsyncClient(url)
    start = time.perf_counter()

    async def one(i, prompt, n):
        first, tokens = None, 0
        async for event in client.generate_stream(prompt, max_new_tokens=n,
                                                  ignore_eos_token=True):
            now = time.perf_counter()
            first = first or now
            tokens += 1
            if not event.token.special:
                print(f"{COLOURS[i]}{event.token.text}{RESET}", end="", flush=True)
        end = time.perf_counter()
        return i, n, first - start, tokens / (end - first) if end > first else float("nan"), \
            end - start

    results = await asyncio.gather(one(0, "Jack and Jill", 100), one(1, "What comes up must", 10),
                                   one(2, "Humpty Dumpty sat", 10))
    print()
    for i, n, ttft, rate, total in results:
        print(f"{COLOURS[i]}request {i} ({n} tokens){RESET}: TTFT {ttft * 1e3:.0f} ms, "
              f"{rate:.0f} tokens/s, done after {total:.2f} s")


async def adapters(url):
    section("per-request adapters: alone, then all at once")
    prompt = task_prompt(SENTENCE)
    client = Client(url)
    alone = []
    for adapter in [None] + ADAPTERS:
        alone.append(client.generate(prompt, adapter_id=adapter, max_new_tokens=80).generated_text)
        print(f"{adapter or 'base model':>10}: {alone[-1]!r}")
    async_client = AsyncClient(url)
    start = time.perf_counter()
    together = await asyncio.gather(*(async_client.generate(prompt, adapter_id=adapter,
                                                            max_new_tokens=80)
                                      for adapter in [None] + ADAPTERS))
    same = [answer.generated_text for answer in together] == alone
    print(f"the same {len(alone)} at once, one adapter per row of one batch "
          f"({time.perf_counter() - start:.2f} s); same answers as alone: {same}")


Name = Annotated[str, Field(max_length=12)]


class Entities(BaseModel):
    """What the entities adapter was trained to write (helpers.corpus.entities_example)."""

    characters: list[Name] = Field(max_length=3)
    animals: list[Name] = Field(max_length=3)
    place: str = Field(max_length=15)
    object: str = Field(max_length=20)


def json_mode(client: Client):
    section("JSON mode from a pydantic model")
    schema = Entities.model_json_schema()
    for adapter in [None, "entities"]:
        answer = client.generate(task_prompt(SENTENCE), adapter_id=adapter, max_new_tokens=100,
                                 response_format={"type": "json_object", "schema": schema})
        parsed = Entities.model_validate_json(answer.generated_text)
        print(f"{adapter or 'base model':>10}: {parsed!r}")


def openai_completions(url):
    section("the openai client on /v1/completions")
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="not-needed")
    reply = client.completions.create(model="entities", prompt=task_prompt(SENTENCE),
                                      max_tokens=80, temperature=0)
    print(repr(reply.choices[0].text), "| usage:", reply.usage.model_dump(exclude_none=True))


def main():
    with endpoint() as url:
        client = Client(url)
        generate(client)
        stream(client)
        asyncio.run(three_at_once(url))
        asyncio.run(adapters(url))
        json_mode(client)
        openai_completions(url)
        import httpx

        print("\n/info:", json.dumps(httpx.get(url + "/info").json())[:300], "...")


if __name__ == "__main__":
    main()
