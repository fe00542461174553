"""The HTTP side every server benchmark shares.

``at_once`` sends every job ``(prompt, new_tokens)`` at once, each on its own connection, on
TGI's ``/generate_stream`` (``stream``) or, given ``extra``, OpenAI's ``/v1/completions``
(``openai_stream``: tokens counted from the stream's usage); ``figures`` turns a run into
tokens/s and TTFT and inter-token percentiles. ``side_by_side`` runs ours and another server
in turns; ``ServerProcess`` starts another project's server (``transformers_serve.py``,
``vllm/serve.py``) in a process of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request

import httpx

from benchmarks import PROMPTS
from benchmarks.timing import Candidate, spread, time_in_turns, wait_until_idle

#: What our /v1/completions needs besides the prompt and length: every request run to its
#: ``max_tokens`` and the token count at the end of the stream.
OURS_EXTRA = {"ignore_eos_token": True, "stream_options": {"include_usage": True}}
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def jobs(clients: int, new_tokens: int) -> list[tuple[str, int]]:
    """``clients`` requests: the course prompts in turn, ``new_tokens`` each."""
    return [(PROMPTS[i % len(PROMPTS)], new_tokens) for i in range(clients)]


def percentile(values, q):
    """The q-th percentile (0-100) by linear interpolation between closest ranks."""
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q / 100
    low, high = int(k), min(int(k) + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (k - low)


def levels_argument(text):
    """``--levels 1,16,64``: the numbers of concurrent clients, sorted."""
    try:
        levels = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}")
    if not levels or levels[0] < 1:
        raise argparse.ArgumentTypeError("the levels must be positive integers")
    return levels


def metrics(url) -> dict[str, float]:
    """Our server's /metrics, without the ``helpers_server_`` prefix."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {line.split()[0].removeprefix("helpers_server_"): float(line.split()[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def our_steps(url: str) -> float:
    """Steps our server has run (decode and prefill: one forward pass each)."""
    figures = metrics(url)
    return figures.get("steps_decode", 0) + figures.get("steps_prefill", 0)


# --- the clients -----------------------------------------------------------------------------

async def events(client: httpx.AsyncClient, url: str, route: str, body: dict):
    """The server-sent events of one streaming request, each with the time it arrived; an
    error status or an error event raises RuntimeError."""
    async with client.stream("POST", url + route, json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{reply.status_code}: {(await reply.aread()).decode()}")
        async for line in reply.aiter_lines():
            data = line[5:].strip() if line.startswith("data:") else ""
            if data and data != "[DONE]":
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(str(event["error"]))
                yield time.perf_counter(), event


async def stream(client: httpx.AsyncClient, url: str, prompt: str, new_tokens: int) -> dict:
    """One request to TGI's ``/generate_stream`` (EOS ignored): its TTFT, the gaps between its
    events, its end time, tokens and text."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": new_tokens,
                                             "ignore_eos_token": True}}
    start = time.perf_counter()
    arrivals, text = [], None
    async for now, event in events(client, url, "/generate_stream", body):
        arrivals.append(now)
        if event.get("generated_text") is not None:
            text = event["generated_text"]
    if not arrivals:
        raise RuntimeError("the stream ended without a token")
    return {"start": start, "ttft": arrivals[0] - start, "end": time.perf_counter(),
            "tokens": len(arrivals), "gaps": [b - a for a, b in zip(arrivals, arrivals[1:])],
            "text": text}


async def openai_stream(client: httpx.AsyncClient, url: str, prompt: str, new_tokens: int,
                        extra: dict) -> dict:
    """One streaming ``/v1/completions`` request, greedy, with ``extra`` in its body: its TTFT
    (to the first event with text), end time, tokens (from the stream's ``usage``) and text."""
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            **extra}
    start = time.perf_counter()
    first, tokens, pieces = None, None, []
    async with contextlib.aclosing(events(client, url, "/v1/completions", body)) as arriving:
        async for now, event in arriving:
            for choice in event.get("choices") or []:
                first = first or (now if choice.get("text") else None)
                pieces.append(choice.get("text") or "")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
                break      # the last event (another server may keep the stream open)
    end = time.perf_counter()
    if tokens is None:
        raise RuntimeError("the stream ended without usage")
    return {"start": start, "ttft": (first or end) - start, "end": end, "tokens": tokens,
            "text": "".join(pieces)}


def at_once(url: str, jobs, extra: dict | None = None, probes: int = 0,
            tolerate_errors: bool = False) -> tuple[list, float, list[float]]:
    """Send every job at once (``extra``: on OpenAI's route, with that in each body; None: on
    TGI's). Returns the results (with ``tolerate_errors``, a failed request is its exception),
    the wall time from the first request sent to the last stream's end, and the TTFTs of
    ``probes`` single-token requests sent one after another while the jobs stream."""
    async def run():
        limits = httpx.Limits(max_connections=len(jobs) + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            def one(prompt, n):
                if extra is None:
                    return stream(client, url, prompt, n)
                return openai_stream(client, url, prompt, n, extra)

            start = time.perf_counter()
            tasks = [asyncio.create_task(one(prompt, n)) for prompt, n in jobs]
            probe_ttfts = []
            if probes:
                await asyncio.sleep(0.05)
                for _ in range(probes):
                    if all(task.done() for task in tasks):
                        break
                    probe_ttfts.append((await one(PROMPTS[0], 1))["ttft"])
            results = await asyncio.gather(*tasks, return_exceptions=tolerate_errors)
            ends = [r["end"] for r in results if isinstance(r, dict)]
            return results, (max(ends) if ends else time.perf_counter()) - start, probe_ttfts
    return asyncio.run(run())


def figures(results: list[dict], seconds: float) -> dict:
    """One run's figures: tokens, tokens/s, TTFT p50 and p95, and (TGI's streams) the gaps
    between two events of one stream, p50 and p95, over every stream."""
    tokens = sum(r["tokens"] for r in results)
    ttfts = [r["ttft"] for r in results]
    out = {"seconds": seconds, "tokens": tokens, "tokens_per_second": tokens / seconds,
           "ttft_p50": percentile(ttfts, 50), "ttft_p95": percentile(ttfts, 95)}
    if results and "gaps" in results[0]:
        gaps = [gap for r in results for gap in r["gaps"]]
        out.update(itl_p50=percentile(gaps, 50), itl_p95=percentile(gaps, 95))
    return out


# --- ours beside another server --------------------------------------------------------------

class Server:
    """A server as a side-by-side run sees it: its URL, what its /v1/completions needs besides
    the prompt and length, and how to read its step count (None: it has none to read)."""

    def __init__(self, url: str, extra: dict, steps=None):
        self.url, self.extra, self.steps = url, extra, steps

    def run(self, clients: int, new_tokens: int) -> dict:
        """``clients`` streaming requests at once: the figures of one run, the streams that
        ended short, each prompt's texts and the steps the server ran."""
        requests = jobs(clients, new_tokens)
        before = self.steps(self.url) if self.steps else 0
        results, seconds, _ = at_once(self.url, requests, self.extra)
        texts: dict[str, set] = {}
        for (prompt, _), r in zip(requests, results):
            texts.setdefault(prompt, set()).add(r["text"])
        return {**figures(results, seconds),
                "steps": self.steps(self.url) - before if self.steps else None,
                "short": sum(r["tokens"] != new_tokens for r in results),
                "texts": {p: sorted(t) for p, t in texts.items()}}


def side_by_side(servers: dict[str, Server], levels, new_tokens: int, turns: int,
                 idle_first: bool = False) -> dict:
    """Every level on every server in each turn, after one untimed round, the order reversed
    from one turn to the next (``timing.time_in_turns``); with ``idle_first`` each run waits
    (untimed) until the CPUs are idle. Returns ``{clients: {server: [run, ...]}}``, the timed
    turns, each run with its ``idle_wait``."""
    runs = {n: {name: [] for name in servers} for n in levels}

    def candidate(n, name):
        waited = []

        def run():
            figures = {**servers[name].run(n, new_tokens), "idle_wait": waited[-1]}
            runs[n][name].append(figures)
            return figures
        return Candidate(run, prepare=lambda: waited.append(wait_until_idle() if idle_first
                                                            else 0.0),
                         clock=lambda figures: figures["seconds"])

    time_in_turns({f"{name}, {n} client(s)": candidate(n, name)
                   for n in levels for name in servers},
                  repeats=turns, warmup=1, alternate=True, progress="side by side:")
    return {n: {name: done[1:] for name, done in by_name.items()}    # [0]: the untimed round
            for n, by_name in runs.items()}


def level_row(clients: int, run: dict, other: str) -> dict:
    """One level of ``side_by_side``: each server's figures over the turns (``timing.spread``),
    ours / ``other``'s tokens/s (the median of the turns' ratios) and the text check."""
    row = {"clients": clients, "tokens": run["ours"][0]["tokens"]}
    for name in ("ours", other):
        keys = ["tokens_per_second", "ttft_p50", "ttft_p95", "seconds"]
        row[name] = {key: spread(r[key] for r in run[name])
                     for key in keys + (["steps"] if run[name][0]["steps"] is not None else [])}
        row[name]["short_streams"] = sum(r["short"] for r in run[name])
    ratios = [a["tokens_per_second"] / b["tokens_per_second"]
              for a, b in zip(run["ours"], run[other])]
    differences = different_texts(run["ours"], run[other], other)
    return {**row, f"ours_over_{other}": statistics.median(ratios),
            f"ours_over_{other}_per_turn": [round(r, 3) for r in ratios],
            "same_texts": not differences, "first_difference": differences[:1]}


def different_texts(ours: list[dict], theirs: list[dict], name: str) -> list[dict]:
    """The prompts whose texts differ between two servers' runs (or within one run of ours):
    ``[{"prompt", "ours", name}]``."""
    return [{"prompt": prompt, "ours": texts, name: other["texts"].get(prompt)}
            for mine, other in zip(ours, theirs) for prompt, texts in mine["texts"].items()
            if len(texts) != 1 or texts != other["texts"].get(prompt)]


# --- a server of another project -------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """An OpenAI-compatible server of another project, in a process of its own on this
    machine. A subclass says how to start it (``command``, ``environment``) and what its
    ``/v1/completions`` needs besides the prompt and length (``extra``). ``with server as
    url:`` starts it (unless ``start()`` did), waits for /health and two warm-up completions,
    and stops it at the end of the block. Its output goes to a temporary log file (``logs()``
    gives the last lines)."""

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
            for _ in range(2):                                   # warm-up requests
                at_once(self.url, [(PROMPTS[3], 8)], self.extra())
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
