"""No request can hurt the lesson-07 server or its neighbours: each way a client could make
it crash, leak, stall or say too much, tried and answered with a clear 4xx (or, for the
operator's broken file, a 5xx that gives nothing away).

One server process (``hardened``) runs the bundled model on the CPU with an adapters folder
of broken adapters; its memory is read from the operating system (RSS) to check that refused
bodies and prompts are not kept. The tests that need a slow model or an exception inside the
server run the app in this process on a tiny random Llama. The pieces (``guards``,
``metrics``, ``adapters``) are also tested alone, without a server.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import select
import shutil
import socket
import threading
import time
from collections import Counter

import pytest
import torch

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")

from helpers.lora import ADAPTERS_DIR  # noqa: E402
from helpers.server import guards, metrics as metrics_module, serve_in_background  # noqa: E402
from helpers.server.adapters import BrokenAdapter, check_adapter_files  # noqa: E402
from helpers.server.contract import GenerationParams  # noqa: E402
from helpers.server.guards import ApiError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")    # see tests/conftest.py

GOOD = "entities"


def need_adapter():
    if not (ADAPTERS_DIR / GOOD / "adapter_model.safetensors").is_file():
        pytest.skip(f"the shipped adapter {GOOD!r} is missing from {ADAPTERS_DIR}")


# --- an adapters folder of broken adapters ----------------------------------------------------

@pytest.fixture(scope="module")
def broken_folder(tmp_path_factory):
    """One good adapter and one of each way an adapter folder can be broken."""
    need_adapter()
    folder = tmp_path_factory.mktemp("hardening") / "served-adapters"
    folder.mkdir()
    good = ADAPTERS_DIR / GOOD
    shutil.copytree(good, folder / GOOD)
    weights = (good / "adapter_model.safetensors").read_bytes()
    config = (good / "adapter_config.json").read_text()

    def make(name, weights_bytes=weights, config_text=config):
        (folder / name).mkdir()
        (folder / name / "adapter_model.safetensors").write_bytes(weights_bytes)
        (folder / name / "adapter_config.json").write_text(config_text)

    make("truncated", weights[:len(weights) // 2])
    make("garbage", bytes(range(256)) * 64)
    make("badconfig", config_text='{"r": 8, "lora_alpha": ')
    make("hugerank", config_text=json.dumps({**json.loads(config), "r": 100000}))
    # Valid files, but for another model: the layer names exist, the shapes do not fit.
    from safetensors.torch import save_file

    save_file({"base_model.model.transformer.h.0.attn.c_attn.lora_A.weight": torch.zeros(8, 77),
               "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight": torch.zeros(99, 8)},
              str(folder / "wrongshape.safetensors"))
    make("wrongshape", (folder / "wrongshape.safetensors").read_bytes(),
         json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                     "target_modules": ["c_attn"]}))
    (folder / "wrongshape.safetensors").unlink()
    return folder


@pytest.fixture(scope="module")
def hardened(broken_folder):
    """The bundled model's server on the CPU: 8 slots, a queue of 64, the broken adapters."""
    server = serve_in_background(name="test-hardening", threads=1, adapters=broken_folder,
                                 device="cpu", max_batch_size=8, max_queue=64,
                                 env={"HF_HUB_OFFLINE": "1"})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def url(hardened):
    return hardened.url


def rss(server) -> int:
    """The server process' resident memory, in bytes."""
    return psutil.Process(server.pid).memory_info().rss


def post(url, path, body, **kwargs):
    return httpx.post(url + path, json=body, timeout=60, **kwargs)


def lorax(prompt="Jack and Jill", **parameters):
    return {"inputs": prompt, "parameters": {"max_new_tokens": 4, **parameters}}


def error_text(reply) -> str:
    error = reply.json()["error"]
    return error["message"] if isinstance(error, dict) else error


def healthy(url) -> bool:
    return httpx.get(url + "/health", timeout=10).status_code == 200


# --- /metrics, read by Prometheus' own text parser ---------------------------------------------

def parse_prometheus(text: str) -> dict:
    """``{family: {"type", "help", "samples": [(name, labels, value)]}}``, read by
    prometheus_client's parser (what a scraper reads; it refuses a malformed line). A sample
    away from its own HELP and TYPE lines would make a family without them. The parser names a
    counter's samples ``<name>_total``; here they keep the name the page gives them."""
    from prometheus_client.parser import text_string_to_metric_families

    families = {}
    for family in text_string_to_metric_families(text):
        assert family.name not in families and family.documentation, family.name
        families[family.name] = {"type": family.type, "help": family.documentation,
                                  "samples": [(sample.name.removesuffix("_total")
                                               if family.type == "counter" else sample.name,
                                               sample.labels, sample.value)
                                              for sample in family.samples]}
    return families


def value(families, name, **labels) -> float:
    for sample, sample_labels, number in families[name]["samples"]:
        if sample == name and sample_labels == labels:
            return number
    raise KeyError(name)


def check_histogram(family) -> tuple[list, float]:
    """The (le, cumulative count) pairs of a histogram, checked: rising edges, counts that
    never fall, +Inf last and equal to _count."""
    buckets = [(float(labels["le"]), number) for name, labels, number in family["samples"]
               if name.endswith("_bucket")]
    count = [number for name, _, number in family["samples"] if name.endswith("_count")]
    total = [number for name, _, number in family["samples"] if name.endswith("_sum")]
    assert buckets and len(count) == 1 and len(total) == 1
    edges = [edge for edge, _ in buckets]
    assert edges == sorted(edges) and edges[-1] == math.inf
    counts = [number for _, number in buckets]
    assert counts == sorted(counts) and counts[-1] == count[0]
    return buckets, count[0]


def scrape(url) -> dict:
    reply = httpx.get(url + "/metrics", timeout=10)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/plain")
    return parse_prometheus(reply.text)


# --- the body: its size while it arrives, its type, its JSON -------------------------------

def _raw_request(url, head: bytes, chunks, timeout=30.0) -> tuple[bytes, int]:
    """Send ``head``, then each chunk until the server answers or closes the connection;
    the head of the server's answer and how many body bytes were sent."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sent = 0
    try:
        sock.sendall(head)
        sock.setblocking(False)
        pending = b""
        chunks = iter(chunks)
        while not _readable(sock):            # until the server says something
            if not pending:
                pending = next(chunks, b"")
                if not pending:
                    break                     # all sent
            if not _writable(sock, 0.05):
                continue
            try:
                n = sock.send(pending)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += n
            pending = pending[n:]
        sock.setblocking(True)
        answer = b""
        try:
            while b"\r\n\r\n" not in answer:
                part = sock.recv(65536)
                if not part:
                    break
                answer += part
        except ConnectionResetError:
            pass
        return answer, sent
    finally:
        sock.close()


def _writable(sock, wait: float) -> bool:
    return bool(select.select([], [sock], [], wait)[1])


def _readable(sock, wait: float = 0.0) -> bool:
    return bool(select.select([sock], [], [], wait)[0])


def _chunked(total: int, size: int = 1 << 16):
    chunk = b"x" * size
    for _ in range(total // size):
        yield f"{size:x}\r\n".encode() + chunk + b"\r\n"
    yield b"0\r\n\r\n"


def test_a_chunked_body_over_the_limit_is_refused_while_it_arrives(hardened, url):
    """A 256 MiB chunked body: 413 after about 1 MiB, the connection closed, and the
    server's memory does not grow by the body's size (it used to buffer all of it)."""
    assert post(url, "/generate", lorax()).status_code == 200        # warm
    before = rss(hardened)
    head = (b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    answer, sent = _raw_request(url, head, _chunked(256 << 20))
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"connection: close" in answer.lower()
    assert sent < 64 << 20                       # it stopped reading long before the end
    assert rss(hardened) - before < 32 << 20     # (the body was 256 MiB)
    assert healthy(url)


def test_a_content_length_over_the_limit_is_refused_before_reading(url):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n")
    answer, _ = _raw_request(url, head, [b"{" * 1000])
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          None, "application/json; charset=latin-1"])
@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_a_post_that_is_not_declared_json_gets_415(url, path, content_type):
    """A web page can make a browser POST text/plain (or a form) to this server without a
    CORS preflight; such a body is refused even when it is valid JSON."""
    body = lorax() if path == "/generate" else {"prompt": "Jack", "max_tokens": 2}
    headers = {"Content-Type": content_type} if content_type else {}
    reply = httpx.post(url + path, content=json.dumps(body), headers=headers, timeout=30)
    assert reply.status_code == 415, reply.text
    assert "application/json" in error_text(reply)
    reply = httpx.post(url + path, content=json.dumps(body),
                       headers={"Content-Type": "Application/JSON; charset=UTF-8"}, timeout=60)
    assert reply.status_code == 200, reply.text


BAD_JSON = [
    ("lone-surrogate", b'{"inputs": "Jack \\ud800", "parameters": {"max_new_tokens": 2}}',
     "surrogate"),
    ("lone-low-surrogate-in-a-key", b'{"inputs": "Jack", "\\udc00": 1}', "surrogate"),
    ("lone-surrogate-in-a-stop", b'{"inputs": "Jack", "parameters": {"stop": ["\\udfff"]}}',
     "surrogate"),
    ("deep-array", b"[" * 100000 + b"]" * 100000, "levels deep"),
    ("deep-schema", (b'{"inputs": "Jack", "parameters": {"response_format": {"type": '
                     b'"json_object", "schema": ' + b'{"items": ' * 200 + b'{}' + b'}' * 200
                     + b'}}}'), "levels deep"),
    ("nan", b'{"inputs": "Jack", "parameters": {"temperature": NaN}}', "NaN"),
    ("infinity", b'{"inputs": "Jack", "parameters": {"top_p": Infinity}}', "Infinity"),
    ("minus-infinity", b'{"inputs": "Jack", "parameters": {"top_p": -Infinity}}', "Infinity"),
    ("overflowing-float", b'{"inputs": "Jack", "parameters": {"temperature": 1e999}}',
     "too large"),
    ("huge-integer", b'{"inputs": "Jack", "parameters": {"seed": ' + b"9" * 5000 + b'}}',
     "digits"),
    ("not-utf8", b'{"inputs": "Jack \xff"}', "UTF-8"),
]


@pytest.mark.parametrize("body, words", [c[1:] for c in BAD_JSON], ids=[c[0] for c in BAD_JSON])
def test_bodies_python_would_accept_but_json_does_not_get_400(url, body, words):
    """Each of these used to be a 500 (or a NaN further in)."""
    for path in ("/generate", "/v1/completions"):
        reply = httpx.post(url + path, content=body,
                           headers={"Content-Type": "application/json"}, timeout=30)
        assert reply.status_code == 400, (path, reply.text)
        assert words in error_text(reply)
    assert healthy(url)


# --- numbers the sampler cannot compute with ---------------------------------------------------

BAD_NUMBERS = [
    ("temperature-underflow", "/generate", lorax(temperature=1e-39, do_sample=True),
     "temperature"),
    ("repetition-penalty-underflow", "/generate",
     lorax(repetition_penalty=1e-40, do_sample=True), "repetition_penalty"),
    ("repetition-penalty-huge", "/generate", lorax(repetition_penalty=1e30),
     "repetition_penalty"),
    ("typical-p-zero", "/generate", lorax(typical_p=0.0), "typical_p"),
    ("typical-p-over-one", "/generate", lorax(typical_p=1.5), "typical_p"),
    ("openai-temperature-underflow", "/v1/completions",
     {"prompt": "Jack", "max_tokens": 2, "temperature": 1e-39}, "temperature"),
    ("frequency-penalty", "/v1/completions",
     {"prompt": "Jack", "max_tokens": 2, "frequency_penalty": 2.5}, "frequency_penalty"),
    ("presence-penalty", "/v1/completions",
     {"prompt": "Jack", "max_tokens": 2, "presence_penalty": -3}, "presence_penalty"),
    ("logit-bias-value", "/v1/completions",
     {"prompt": "Jack", "max_tokens": 2, "logit_bias": {"5": 101}}, "logit_bias"),
    ("logit-bias-unknown-token", "/v1/completions",
     {"prompt": "Jack", "max_tokens": 2, "logit_bias": {"1000000": 5}}, "logit_bias"),
    ("logit-bias-too-many", "/v1/completions",
     {"prompt": "Jack", "max_tokens": 2, "logit_bias": {str(i): 1 for i in range(301)}},
     "logit_bias"),
    ("stop-too-long", "/generate", lorax(stop=["x" * 257]), "stop"),
    ("rows-multiplied", "/v1/completions",
     {"prompt": ["Jack"] * 16, "max_tokens": 2, "n": 2, "temperature": 1.0}, "sequences"),
]


@pytest.mark.parametrize("path, body, words", [c[1:] for c in BAD_NUMBERS],
                         ids=[c[0] for c in BAD_NUMBERS])
def test_numbers_out_of_range_get_422(url, path, body, words):
    reply = post(url, path, body)
    assert reply.status_code == 422, reply.text
    assert words in error_text(reply)


def test_a_bad_row_never_fails_its_neighbours(url):
    """Temperature 1e-39 and repetition_penalty 1e-40 with sampling used to make NaN logits
    and a 500 for every row of the batch. Sent among good requests: they are refused at the
    door, and every good request of the same moment is answered."""
    good = [lorax(p, max_new_tokens=12, do_sample=True, seed=i, temperature=0.7)
            for i, p in enumerate(["Jack and Jill", "The rain in Spain", "Humpty Dumpty"])]
    good.append(lorax("What comes up must", max_new_tokens=12, temperature=1e-3))
    bad = [lorax(temperature=1e-39, do_sample=True, max_new_tokens=12),
           lorax(repetition_penalty=1e-40, do_sample=True, max_new_tokens=12),
           lorax(temperature=1e-38, repetition_penalty=1e-40, top_k=5, max_new_tokens=12)]

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            replies = await asyncio.gather(*[client.post(url + "/generate", json=body)
                                             for body in bad + good + bad])
        return replies

    replies = asyncio.run(main())
    refused, answered = replies[:3] + replies[-3:], replies[3:-3]
    assert [r.status_code for r in refused] == [422] * 6
    assert [r.status_code for r in answered] == [200] * 4, [r.text for r in answered]
    assert all(r.json()["generated_text"] for r in answered)


# --- adapters: the client's bad choice, the operator's broken file ----------------------------

@pytest.mark.parametrize("name, status, words", [
    ("truncated", 500, "not a readable safetensors file"),
    ("garbage", 500, "not a readable safetensors file"),
    ("badconfig", 500, "not valid JSON"),
    ("hugerank", 500, "rank"),
    ("wrongshape", 422, "shape mismatch"),
])
def test_a_broken_adapter_gets_a_clear_answer_without_internals(url, broken_folder, name,
                                                              status, words):
    """A file the operator left broken: 500 that names the adapter and what is wrong, and no
    path or traceback. An adapter made for another model: the client's choice, 422."""
    reply = post(url, "/generate", lorax(adapter_id=name))
    assert reply.status_code == status, reply.text
    text = reply.text
    assert words in error_text(reply) and name in error_text(reply)
    for leak in (str(broken_folder), str(broken_folder.parent), "Traceback", "safetensors_rust",
                 "SafetensorError", "JSONDecodeError", 'File "'):
        assert leak not in text
    reply = post(url, "/generate", lorax(adapter_id=GOOD))       # the server carries on
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("adapter_id", ["entities\n", "owner/name\n", "../entities", "x" * 5000])
def test_adapter_ids_are_whole_names(url, adapter_id):
    """A name must match as a whole: "entities\\n" is no adapter name (a regex's "$" would
    let it through); a long one is not echoed in full."""
    reply = post(url, "/generate", lorax(adapter_id=adapter_id))
    assert reply.status_code == 422, reply.text
    assert len(reply.text) < 1000


def test_a_page_that_rebinds_its_name_to_this_machine_is_refused(url, hardened):
    """DNS rebinding: a web page whose name the attacker points at 127.0.0.1 may post JSON
    to the server (to the browser it is the same site), but its requests name the page's
    host. A server listening on 127.0.0.1 answers only requests addressed to this machine."""
    port = hardened.port
    for host in ("attacker.example", f"attacker.example:{port}", "127.0.0.1.nip.io"):
        reply = post(url, "/generate", lorax(), headers={"Host": host})
        assert reply.status_code == 403, (host, reply.text)
        assert "this machine" in reply.json()["error"]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}"):
        assert post(url, "/generate", lorax(), headers={"Host": host}).status_code == 200


def test_info_shows_no_absolute_path(url, broken_folder):
    reply = httpx.get(url + "/info", timeout=10)
    assert reply.status_code == 200
    info = reply.json()
    assert info["adapters_folder"] == broken_folder.name
    assert str(broken_folder.parent) not in reply.text
    assert not re.search(r'"/(tmp|home|root|usr|work|var)/', reply.text)


# --- huge prompts ------------------------------------------------------------------------------

def test_huge_prompts_are_refused_early_and_their_memory_is_given_back(hardened, url):
    """16 prompts of ~1 MB at once (each under the body limit): every one is refused with a
    4xx, a small request sent among them is answered, and the server's memory comes back
    (it used to stay ~1 GB higher)."""
    assert post(url, "/generate", lorax()).status_code == 200
    before = rss(hardened)
    huge = "Jack and Jill went up the hill. " * 31000          # 992,000 characters

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            big = [asyncio.ensure_future(client.post(url + "/generate", json=lorax(huge)))
                   for _ in range(8)]
            big += [asyncio.ensure_future(client.post(
                url + "/v1/completions", json={"prompt": huge, "max_tokens": 2}))
                for _ in range(8)]
            small = await client.post(url + "/generate", json=lorax("Humpty Dumpty"))
            return await asyncio.gather(*big), small

    refused, small = asyncio.run(main())
    assert small.status_code == 200, small.text
    assert {r.status_code for r in refused} <= {413, 422}, [r.text[:200] for r in refused]
    assert all("token" in error_text(r) or "characters" in error_text(r) or "bytes" in
               error_text(r) for r in refused)
    assert rss(hardened) - before < 128 << 20
    assert healthy(url)


# --- what the server says about itself -----------------------------------------------------------

def test_metrics_are_prometheus_text_with_histograms(url):
    before = scrape(url)
    reply = post(url, "/generate", lorax(max_new_tokens=6))
    assert reply.status_code == 200
    after = scrape(url)
    for name, kind in [("helpers_server_requests", "counter"), ("helpers_server_tokens",
                       "counter"), ("helpers_server_cancelled", "counter"),
                       ("helpers_server_failed", "counter"), ("helpers_server_rejected",
                       "counter"), ("helpers_server_waiting", "gauge"),
                       ("helpers_server_running", "gauge"),
                       ("helpers_server_time_to_first_token_seconds", "histogram"),
                       ("helpers_server_time_per_output_token_seconds", "histogram")]:
        assert after[name]["type"] == kind, name
    assert value(after, "helpers_server_requests") == value(before, "helpers_server_requests") + 1
    assert value(after, "helpers_server_tokens") >= value(before, "helpers_server_tokens") + 6
    _, ttft_before = check_histogram(before["helpers_server_time_to_first_token_seconds"])
    _, ttft_after = check_histogram(after["helpers_server_time_to_first_token_seconds"])
    assert ttft_after == ttft_before + 1
    _, per_token = check_histogram(after["helpers_server_time_per_output_token_seconds"])
    assert per_token >= 5
    assert value(after, "helpers_server_responses", code="200") >= 1
    refused = post(url, "/generate", lorax(temperature=-1))
    assert refused.status_code == 422
    assert value(scrape(url), "helpers_server_rejected") == value(after,
                                                                  "helpers_server_rejected") + 1


# --- in this process: a slow model, and exceptions inside the server --------------------------

class InProcessServer:
    """The app on a tiny random Llama served by uvicorn in a thread of this process, so that
    the test can slow the model down and read the engine's counters directly."""

    def __init__(self, model, tokenizer, http="h11", **engine_options):
        from helpers.server import Engine, create_app

        self.engine = Engine(model, tokenizer, adapters_dir=None, **engine_options).start()
        self.app = create_app(self.engine, manage_engine=False)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, log_level="error", access_log=False, lifespan="off",
                                http=http)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.stop()


@pytest.fixture()
def slow_server(tiny_llama, monkeypatch):
    """8 slots, a long queue, and a model that takes 30 ms per forward pass (a row of 200
    tokens runs for 6 s at least) and does not start until ``slow_server.go`` is set."""
    model, tokenizer = tiny_llama
    forward = type(model).forward
    go = threading.Event()

    def slow(self, *args, **kwargs):
        go.wait(60)
        time.sleep(0.03)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", slow)
    server = InProcessServer(model, tokenizer, max_batch_size=8, max_queue=100,
                             max_total_tokens=256, max_input_tokens=32)
    server.go = go
    yield server
    go.set()
    server.close()


def test_72_clients_that_hang_up_leave_no_row_behind(slow_server):
    """72 non-streaming requests of 200 tokens (8 running, 64 waiting), half LoRAX and half
    OpenAI; the model starts producing tokens and every client hangs up. Every one of the 72
    is cancelled, none runs to its end, and a fresh request is served. (Before, a hang-up was
    noticed only after 0.5 s without a token, so a row that was producing was never
    cancelled and 72 hang-ups slowed the next request from 0.1 s to 1.5 s.)"""
    engine = slow_server.engine
    stats = engine.stats
    before = {key: stats.get(key, 0) for key in ("cancelled", "finished", "requests")}

    async def hang_up_72():
        writers = []
        for i in range(72):
            if i % 2:
                path, body = "/generate", {"inputs": "Jack and Jill", "parameters": {
                    "max_new_tokens": 200, "ignore_eos_token": True}}
            else:
                path, body = "/v1/completions", {"prompt": "Jack and Jill", "max_tokens": 200,
                                                 "ignore_eos_token": True}
            data = json.dumps(body).encode()
            reader, writer = await asyncio.open_connection("127.0.0.1", slow_server.port)
            writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                         f"application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                         + data)
            await writer.drain()
            writers.append(writer)
        for _ in range(3000):                    # all 72 accepted
            if stats["requests"] - before["requests"] == 72:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError(f"the 72 requests were not all accepted: {engine.snapshot()}")
        slow_server.go.set()                     # the model produces tokens ...
        while stats["tokens"] < 16:              # (the first 8 rows have 2 tokens each)
            await asyncio.sleep(0.005)
        for writer in writers:                   # ... while every client hangs up
            writer.close()
        for _ in range(3000):
            snapshot = engine.snapshot()
            if snapshot["running"] == 0 and snapshot["waiting"] == 0:
                return snapshot
            await asyncio.sleep(0.01)
        raise AssertionError(f"rows were left behind: {engine.snapshot()}")

    asyncio.run(hang_up_72())
    assert stats["requests"] - before["requests"] == 72
    assert stats["cancelled"] - before["cancelled"] == 72
    assert stats["finished"] - before["finished"] == 0
    reply = httpx.post(slow_server.url + "/generate", timeout=60,
                       json={"inputs": "Jack", "parameters": {"max_new_tokens": 3}})
    assert reply.status_code == 200
    assert stats["finished"] - before["finished"] == 1


def test_slow_headers_are_cut_off(tiny_llama):
    """Slowloris: a client that sends its headers a byte at a time would hold its connection
    for ever (uvicorn has no deadline for headers). With ``guards.http_protocol`` the
    connection is closed once the deadline passes; a normal client is served, and a request
    that takes longer than the deadline to answer is not cut."""
    model, tokenizer = tiny_llama
    server = InProcessServer(model, tokenizer, http=guards.http_protocol(0.5), max_batch_size=2)
    try:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        start = time.monotonic()
        closed = False
        for byte in b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100:
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            if _readable(sock, 0.05):
                closed = sock.recv(100) == b""
                break
        sock.close()
        assert closed and time.monotonic() - start < 5
        with httpx.Client(base_url=server.url, timeout=60) as client:
            body = {"inputs": "Jack", "parameters": {"max_new_tokens": 2}}
            assert client.post("/generate", json=body).status_code == 200
            time.sleep(0.8)                      # idle past the deadline: a new connection
            assert client.post("/generate", json=body).status_code == 200
    finally:
        server.close()


def _asgi_client(app):
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://server")


def test_a_500_says_nothing_about_the_exception(tiny_llama, monkeypatch, caplog):
    """An unexpected exception: the client gets a request id, the log gets the traceback."""
    from helpers.server import Engine, create_app

    model, tokenizer = tiny_llama
    engine = Engine(model, tokenizer, adapters_dir=None, max_batch_size=2)
    secret = "/srv/secret/path/of/the/operator"

    def broken_submit(*args, **kwargs):
        raise RuntimeError(f"cannot open {secret}")

    monkeypatch.setattr(engine, "submit", broken_submit)
    app = create_app(engine, manage_engine=False)

    async def main():
        async with _asgi_client(app) as client:
            return (await client.post("/generate", json=lorax()),
                    await client.post("/v1/completions", json={"prompt": "Jack"}))

    with caplog.at_level("ERROR", logger="helpers.server"):
        replies = asyncio.run(main())
    for reply in replies:
        assert reply.status_code == 500
        message = error_text(reply)
        assert secret not in reply.text and "RuntimeError" not in reply.text
        request_id = re.search(r"request id (\w+)", message).group(1)
        assert request_id in caplog.text and secret in caplog.text


def test_a_stream_that_fails_says_nothing_about_the_exception(tiny_llama, monkeypatch, caplog):
    """A bug that strikes once a stream has started: its error event holds a request id, the
    server's log the exception (nothing else could answer: the 200 was sent)."""
    from helpers.server import Engine, create_app, serving

    model, tokenizer = tiny_llama
    engine = Engine(model, tokenizer, adapters_dir=None, max_batch_size=2).start()
    app = create_app(engine, manage_engine=False)
    secret = "/srv/secret/state"

    async def broken_next(self):
        raise RuntimeError(f"bug near {secret}")

    monkeypatch.setattr(serving.Run, "next", broken_next)

    async def main():
        async with _asgi_client(app) as client:
            return [await client.post(path, json=body) for path, body in [
                ("/generate_stream", lorax()),
                ("/v1/completions", {"prompt": "Jack", "max_tokens": 3, "stream": True}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                          "max_tokens": 3, "stream": True})]]

    try:
        with caplog.at_level("ERROR", logger="helpers.server"):
            replies = asyncio.run(main())
    finally:
        engine.stop()
    for reply in replies:
        assert reply.status_code == 200                  # the stream had started
        assert "request id" in reply.text and "error" in reply.text
        assert secret not in reply.text and "RuntimeError" not in reply.text
    assert caplog.text.count(secret) >= 3


# --- the pieces alone ----------------------------------------------------------------------

class FakeRequest:
    """Just enough of a Starlette request for ``guards``: headers, a body stream, receive."""

    def __init__(self, chunks=(), headers=None, delay=0.0, disconnect_after=None):
        self.headers = headers or {}
        self.chunks = list(chunks)
        self.delay = delay
        self.read = 0
        self.disconnect_after = disconnect_after

    async def stream(self):
        for chunk in self.chunks:
            if self.delay:
                await asyncio.sleep(self.delay)
            self.read += 1
            yield chunk

    async def receive(self):
        if self.disconnect_after is None:
            await asyncio.sleep(3600)
        await asyncio.sleep(self.disconnect_after)
        return {"type": "http.disconnect"}


def test_read_body_stops_at_the_first_chunk_past_the_limit():
    request = FakeRequest([b"x" * 1000] * 100)
    with pytest.raises(guards.RefusedBody) as caught:
        asyncio.run(guards.read_body(request, limit=4500))
    assert caught.value.status == 413 and request.read == 5          # 5000 > 4500: stop
    assert caught.value.headers == {"Connection": "close"}
    assert asyncio.run(guards.read_body(FakeRequest([b"ab", b"cd"]), limit=4)) == b"abcd"
    with pytest.raises(guards.RefusedBody) as caught:                  # declared too large
        asyncio.run(guards.read_body(FakeRequest([b"x"], {"content-length": "5"}), limit=4))
    assert caught.value.status == 413
    with pytest.raises(guards.RefusedBody) as caught:
        asyncio.run(guards.read_body(FakeRequest([b"x"], {"content-length": "-1"}), limit=4))
    assert caught.value.status == 400


def test_a_body_that_trickles_in_times_out():
    """Slowloris: a body sent a byte at a time is cut off after the timeout (408)."""
    request = FakeRequest([b"x"] * 1000, delay=0.05)
    with pytest.raises(guards.RefusedBody) as caught:
        asyncio.run(guards.read_body(request, timeout=0.3))
    assert caught.value.status == 408 and request.read < 20


def test_require_json():
    for good in ("application/json", "application/json; charset=utf-8",
                 "APPLICATION/JSON;charset=\"UTF-8\""):
        guards.require_json(FakeRequest(headers={"content-type": good}))
    for bad in (None, "text/plain", "application/jsonp", "multipart/form-data",
                "application/json; charset=utf-16"):
        with pytest.raises(ApiError) as caught:
            guards.require_json(FakeRequest(headers={"content-type": bad} if bad else {}))
        assert caught.value.status == 415


def test_parse_json_is_strict_and_cheap():
    assert guards.parse_json(b'{"a": "\\ud83d\\ude00", "b": [1.5, -2]}') == {
        "a": "\U0001F600", "b": [1.5, -2]}                  # a surrogate PAIR is a character
    assert guards.parse_json(b'{"a": "[[[[' + b"[" * 200 + b'"}')      # brackets in a string
    nested = b"[" * guards.MAX_JSON_DEPTH + b"]" * guards.MAX_JSON_DEPTH
    assert guards.parse_json(nested)
    for bad in (b"[" * (guards.MAX_JSON_DEPTH + 1) + b"]" * (guards.MAX_JSON_DEPTH + 1),
                b'{"a": NaN}', b'[Infinity]', b"[1e400]", b'["\\udbff"]', b" ", b"\xfe"):
        with pytest.raises(ApiError) as caught:
            guards.parse_json(bad)
        assert caught.value.status == 400, bad
    assert guards.json_depth('[{"a": "]]]]"}, [[1]]]') == 3


def test_check_ranges():
    """GenerationParams.check, the one check of every parameter (a 422 naming the field).
    Token ids outside the vocabulary are the engine's to refuse (tests/test_engine.py)."""
    from helpers.server.app import status_of
    from helpers.server.errors import InvalidRequest
    from helpers.server.serving import check_rows

    GenerationParams(temperature=0.5, repetition_penalty=1.2, typical_p=1.0,
                     frequency_penalty=-2, presence_penalty=2,
                     logit_bias={5: -100, 7: 100}).check()
    for bad in [dict(temperature=1e-39), dict(temperature=math.nan), dict(top_p=math.inf),
                dict(repetition_penalty=1e-40), dict(repetition_penalty=101.0),
                dict(typical_p=0.0), dict(frequency_penalty=2.01), dict(presence_penalty=-math.inf),
                dict(logit_bias={-1: 1.0}),
                dict(logit_bias={1: math.nan}), dict(stop=["y" * 300])]:
        with pytest.raises(InvalidRequest) as caught:
            GenerationParams(**bad).check()
        assert status_of(caught.value) == (422, "validation")
        assert next(iter(bad)) in caught.value.message
    check_rows(16, 1, 1)
    check_rows(4, 2, 4)
    with pytest.raises(ApiError):
        check_rows(16, 1, 2)


def test_cancel_on_disconnect():
    gone = []

    async def forever():
        try:
            await asyncio.sleep(3600)
        finally:
            gone.append("cleaned up")

    async def quick():
        return 42

    with pytest.raises(guards.ClientGone):
        asyncio.run(guards.cancel_on_disconnect(FakeRequest(disconnect_after=0.05), forever(),
                                                lambda: gone.append("on_gone")))
    assert gone == ["on_gone", "cleaned up"]
    assert asyncio.run(guards.cancel_on_disconnect(FakeRequest(), quick())) == 42


def test_histogram_and_page_render():
    page = metrics_module.Metrics()
    started = time.perf_counter() - 0.03         # a request read 30 ms ago
    first = time.perf_counter()
    page.ttft.observe(first - started)           # its first token, as serving.Run observes it
    page.per_token.observe(time.perf_counter() - first)          # its second
    page.responses.update([200, 422, 429, 499])  # as guards.AnswerGuard counts; 499 is a
                                                 # hang-up, not a refusal
    families = parse_prometheus(page.render({"running": 3, "waiting": 1, "tokens": 2}))
    buckets, count = check_histogram(families["helpers_server_time_to_first_token_seconds"])
    assert count == 1 and dict(buckets)[0.025] == 0 and dict(buckets)[0.05] == 1
    assert value(families, "helpers_server_running") == 3
    assert families["helpers_server_running"]["type"] == "gauge"
    assert value(families, "helpers_server_cancelled") == 0       # shown before it happens
    assert value(families, "helpers_server_rejected") == 2
    assert value(families, "helpers_server_responses", code="422") == 1


def test_check_adapter_files(broken_folder):
    check_adapter_files(broken_folder / GOOD)
    with pytest.raises(BrokenAdapter, match="more than an adapter of this model can be"):
        check_adapter_files(broken_folder / GOOD, max_bytes=1000)    # (the file is 800 kB)
    for name, words in [("truncated", "safetensors"), ("garbage", "safetensors"),
                        ("badconfig", "JSON"), ("hugerank", "rank")]:
        with pytest.raises(BrokenAdapter, match=words) as caught:
            check_adapter_files(broken_folder / name)
        assert str(broken_folder) not in str(caught.value)


def test_hub_adapters_are_capped(monkeypatch):
    """Every hub adapter stays loaded until the server stops: a client naming adapter after
    adapter would grow its memory without end. Past MAX_HUB_ADAPTERS (loaded or being
    fetched) a new one is refused before anything is downloaded."""
    from helpers.server import adapters, errors

    store = adapters.AdapterStore(torch.nn.Linear(2, 2), None, threading.RLock())
    fetched = []

    def offline(repo_id, token):
        fetched.append(repo_id)
        raise errors.Unavailable("offline")

    monkeypatch.setattr(adapters, "_fetch_from_hub", offline)
    with pytest.raises(errors.Unavailable, match="offline"):
        store.resolve("someone/adapter", "hub")
    assert store._fetching == set()              # a failed fetch gives its place back
    store._fetching.update(f"hub:owner/a{i}" for i in range(adapters.MAX_HUB_ADAPTERS))
    with pytest.raises(errors.Unavailable, match="limit"):
        store.resolve("someone/adapter", "hub")
    assert fetched == ["someone/adapter"]


def test_a_client_that_stops_reading_is_dropped():
    """A stream whose client neither reads nor hangs up: once one write has waited past the
    deadline, the answer is abandoned (the server then closes the connection)."""
    sent = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(100):
            await send({"type": "http.response.body", "body": b"x" * 1000, "more_body": True})

    async def send(message):
        sent.append(message["type"])
        if len(sent) > 2:
            await asyncio.sleep(3600)            # the client's buffers are full

    counted = Counter()
    middleware = guards.AnswerGuard(app, counted, timeout=0.1)
    asyncio.run(asyncio.wait_for(middleware({"type": "http"}, None, send), 10))
    assert len(sent) == 3 and counted == {200: 1}

    async def failing(scope, receive, send):
        raise ValueError("a bug, not a slow client")

    with pytest.raises(ValueError):
        asyncio.run(guards.AnswerGuard(failing, Counter(), 0.1)({"type": "http"}, None, send))
