"""The server benchmark's side-by-side run against ``transformers serve --continuous-batching``.

``transformers serve`` is the OpenAI-compatible server that ships with transformers (its CLI:
``transformers serve --help``). With ``--continuous-batching`` it generates with transformers'
own continuous batching on a paged KV cache. Both servers get the same requests on the same
route kind, OpenAI's streaming ``POST /v1/completions``: the same prompts, the same number of
new tokens with the end-of-sequence token ignored (ours: ``ignore_eos_token``; theirs: a
per-request generation config with ``eos_token_id`` -1, which their batching reads as "no end
token"), greedy (``temperature`` 0), on the same device (``--device`` of both), the same
number of torch threads on a CPU. The tokens are counted from each stream's ``usage`` (their
server may put several tokens in one event).

Their server loads the model from the same local folder (offline: ``HF_HUB_OFFLINE=1``), and
builds its batching manager on the first request, which takes seconds: a warm-up request
comes first.

``ServerProcess`` is the part any such server of another project shares (start it in a process
of its own, wait for /health, warm it up, stop it and what it started, keep its log); vLLM's
OpenAI server is another one (``vllm_serve.py``, for ``vllm_compare.py`` and ``tests/vllm``).
The streaming client (``openai_stream``, ``openai_at_once``) serves every server alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import httpx

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
#: Tokens one step of their server may read: the course prompts of 64 clients at once (8
#: tokens each at most) and their decode tokens fit several times over.
MAX_BATCH_TOKENS = 1024


def transformers_command() -> list[str] | None:
    """The ``transformers`` command of this environment, or None if it has none."""
    beside = pathlib.Path(sys.executable).parent / "transformers"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("transformers")
    return [found] if found else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """An OpenAI-compatible server of another project, in a process of its own on this
    machine (``transformers serve`` here, vLLM in ``vllm_serve.py``). A subclass says how to
    start it (``command``, ``environment``) and what its ``/v1/completions`` needs besides the
    prompt and length (``extra``). ``with server as url:`` starts it (unless ``start()`` did),
    waits for /health and two warm-up completions, and stops it at the end of the block. Its
    output goes to a temporary log file (``logs()`` gives the last lines)."""

    #: How messages name the server.
    name = "server"

    def __init__(self, timeout: float = 300.0):
        self.timeout = timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        prefix = self.name.replace(" ", "-") + "-"
        self.log = tempfile.NamedTemporaryFile(prefix=prefix, suffix=".log", delete=False)

    def command(self) -> list[str]:
        """The command line that starts the server on ``self.port``."""
        raise NotImplementedError

    def environment(self) -> dict:
        """The server's environment variables (all of them)."""
        return dict(os.environ)

    def extra(self) -> dict:
        """What the server's /v1/completions needs besides the prompt and length."""
        return {}

    def start(self) -> "ServerProcess":
        """Start the process without waiting for it (it takes seconds to import and load:
        start it early, and enter the ``with`` block when it is needed). The process leads a
        session of its own, so that stopping it stops the processes it started too."""
        if self.process is None:
            self.process = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=self.log,
                stderr=subprocess.STDOUT, env=self.environment(), start_new_session=True)
        return self

    def __enter__(self) -> str:
        try:
            self.start()
            self.wait()
            asyncio.run(self._warm_up())
        except BaseException:
            self.__exit__()
            raise
        return self.url

    def wait(self) -> None:
        """Wait until the server answers /health (``RuntimeError`` with its last lines if it
        exits or does not answer in time)."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                with _NO_PROXY.open(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not start; its last lines:\n{self.logs()}")

    async def _warm_up(self) -> None:
        async with httpx.AsyncClient(timeout=self.timeout) as client:
            for _ in range(2):
                await openai_stream(client, self.url, "Jack and Jill", 8, self.extra())

    def logs(self, lines: int = 30) -> str:
        text = pathlib.Path(self.log.name).read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def __exit__(self, *exc) -> None:
        """Stop the process and every process it started (safe to call twice, or without a
        ``with`` block), and delete the log."""
        if self.log.closed:                       # stopped already
            return
        if self.process is not None and self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait(5)
        if self.process is not None:
            self._signal(signal.SIGKILL)      # children that outlived their parent
        self.log.close()
        pathlib.Path(self.log.name).unlink(missing_ok=True)

    def _signal(self, number: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, number)


class TransformersServe(ServerProcess):
    """``transformers serve --continuous-batching`` on one local model folder, on ``device``
    (the device our server uses in the same comparison: "cpu", "cuda", "cuda:1"), with
    ``threads`` torch threads; ``with TransformersServe(path, threads, clients, context,
    device) as url:`` starts it."""

    name = "transformers serve"

    def __init__(self, model_path: str, threads: int, clients: int, context: int,
                 device: str = "cpu", timeout: float = 300.0):
        super().__init__(timeout)
        self.model_path, self.threads, self.device = model_path, threads, device
        # Their cache would take 90% of the device's free memory (14 GB on a laptop's CPU):
        # give it room for ``clients`` requests of the model's whole context instead, in
        # blocks of 256 tokens (their page size). A step reads at most MAX_BATCH_TOKENS
        # tokens (their attention masks are sized by it: 2.7 GB at 16384).
        self.num_blocks = math.ceil(clients * context / 256) + 1
        self.max_batch_tokens = MAX_BATCH_TOKENS

    def command(self) -> list[str]:
        command = transformers_command()
        if command is None:
            raise RuntimeError("this environment has no `transformers` command")
        return command + [
            "serve", "--continuous-batching", "--device", self.device, "--host", "127.0.0.1",
            "--port", str(self.port), "--log-level", "warning",
            "--cb-num-blocks", str(self.num_blocks),
            "--cb-max-batch-tokens", str(self.max_batch_tokens), self.model_path]

    def environment(self) -> dict:
        return {**os.environ, "OMP_NUM_THREADS": str(self.threads), "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false"}

    def extra(self) -> dict:
        return theirs_extra(self.model_path)


def theirs_extra(model_path: str) -> dict:
    """What their /v1/completions needs besides the prompt and length: the model it serves,
    and the end token switched off in a per-request generation config."""
    return {"model": model_path, "generation_config": json.dumps(
        {"eos_token_id": -1, "do_sample": False})}


#: What our /v1/completions needs besides the prompt and length.
OURS_EXTRA = {"ignore_eos_token": True, "stream_options": {"include_usage": True}}


async def openai_stream(client: httpx.AsyncClient, url: str, prompt: str, new_tokens: int,
                        extra: dict) -> dict:
    """One streaming ``/v1/completions`` request: its TTFT (to the first event with text), end
    time, tokens (from the stream's ``usage``) and text."""
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            **extra}
    start = time.perf_counter()
    first, tokens, pieces = None, None, []
    async with client.stream("POST", url + "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{reply.status_code}: {(await reply.aread()).decode()}")
        async for line in reply.aiter_lines():
            data = line[5:].strip() if line.startswith("data:") else None
            if not data or data == "[DONE]":
                continue
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(str(event["error"]))
            for choice in event.get("choices") or []:
                if choice.get("text") and first is None:
                    first = time.perf_counter()
                pieces.append(choice.get("text") or "")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
                break          # the last event (their server may keep the stream open)
    end = time.perf_counter()
    if tokens is None:
        raise RuntimeError("the stream ended without usage")
    return {"start": start, "ttft": (first or end) - start, "end": end, "tokens": tokens,
            "text": "".join(pieces)}


async def openai_at_once(url: str, jobs, extra: dict) -> tuple[list[dict], float]:
    """Every job ``(prompt, new_tokens)`` at once, each on its own connection; the results
    and the wall time from the first request sent to the last stream's end."""
    limits = httpx.Limits(max_connections=len(jobs) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(openai_stream(client, url, prompt, n, extra)
                                         for prompt, n in jobs))
    return results, max(r["end"] for r in results) - start
