"""Benchmark of lesson 07: the server under 16 concurrent streaming clients versus the same 16
requests one after another.

    python benchmarks/bench_server.py            # full run (about a minute on a laptop CPU)
    python benchmarks/bench_server.py --quick    # one repetition, for a smoke test

The server runs in its own process (``helpers.server.serve_in_background``), as in the lesson;
this process is the clients (httpx, streaming ``POST /generate_stream``, reading the
server-sent events as they come). Each request is a course prompt with ``max_new_tokens`` new
tokens and ``ignore_eos_token`` (so that every request produces exactly that many tokens,
and both runs do the same work). Greedy.

What it measures, after a warm-up request:

1. one after another: each request alone on an idle server. Tokens/s = all tokens / wall time;
   TTFT (time to first token: from sending the request to its first event) = "idle" TTFT.
2. concurrently: the 16 requests at once. Tokens/s = all tokens / wall time from the first
   request sent to the last event received; the clients' TTFT = TTFT "under load".
3. probes: while a concurrent run streams, single-token requests sent one after another
   measure the TTFT of a request that joins a busy batch (it waits for the current step, then
   its prefill is merged in).

Target (lesson 07, this CPU): concurrent tokens/s >= 4x one-after-another. Also checks that
both runs return the same texts.

Writes ``benchmarks/results/bench_server.json`` and ``.md`` and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from helpers.server import serve_in_background  # noqa: E402
from results_io import write_results  # noqa: E402  (benchmarks/ is on sys.path)

PROMPTS = ["The quick brown fox jumped over the", "The rain in Spain falls", "What comes up must",
           "Jack and Jill", "Humpty Dumpty sat"]
TARGETS = {"speedup": 4.0}


def percentile(values, q):
    """The q-th percentile (0-100) by linear interpolation between closest ranks."""
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q / 100
    low, high = int(k), min(int(k) + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (k - low)


def summary(values):
    return {"p50": percentile(values, 50), "p95": percentile(values, 95), "min": min(values),
            "max": max(values), "n": len(values)}


async def stream(client: httpx.AsyncClient, url: str, prompt: str, new_tokens: int) -> dict:
    """One streaming request: its TTFT, its end time, its tokens and its text."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": new_tokens,
                                             "ignore_eos_token": True}}
    start = time.perf_counter()
    first = None
    tokens = 0
    text = None
    async with client.stream("POST", url + "/generate_stream", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{reply.status_code}: {await reply.aread()}")
        async for line in reply.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(event["error"])
            if first is None:
                first = time.perf_counter()
            tokens += 1
            if event.get("generated_text") is not None:
                text = event["generated_text"]
    end = time.perf_counter()
    return {"start": start, "ttft": first - start, "end": end, "tokens": tokens, "text": text}


async def one_after_another(url, jobs):
    async with httpx.AsyncClient(timeout=300) as client:
        start = time.perf_counter()
        results = [await stream(client, url, prompt, n) for prompt, n in jobs]
        return results, time.perf_counter() - start


async def concurrently(url, jobs, probes=0):
    limits = httpx.Limits(max_connections=len(jobs) + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        start = time.perf_counter()
        tasks = [asyncio.create_task(stream(client, url, prompt, n)) for prompt, n in jobs]
        probe_ttfts = []
        if probes:
            await asyncio.sleep(0.05)
            for _ in range(probes):
                if all(task.done() for task in tasks):
                    break
                probe = await stream(client, url, PROMPTS[0], 1)
                probe_ttfts.append(probe["ttft"])
        results = await asyncio.gather(*tasks)
        return results, max(r["end"] for r in results) - start, probe_ttfts


def markdown(result):
    seq, con = result["one_after_another"], result["concurrent"]
    ttft = result["ttft_seconds"]
    lines = [
        "# Server benchmark (lesson 07)",
        "",
        f"Model: `{result['model']}`; {result['machine']}; server: {result['threads']} torch "
        f"thread(s), max batch size {result['max_batch_size']}; {result['clients']} requests x "
        f"{result['new_tokens']} new tokens (EOS ignored), streamed over HTTP on 127.0.0.1; "
        f"{result['reps']} repetition(s), median; load average before the run "
        f"{', '.join(f'{x:.1f}' for x in result['load_average'] or [])}.",
        "",
        "| run | wall time (s) | tokens | tokens/s | TTFT p50 (ms) | TTFT p95 (ms) |",
        "|---|---|---|---|---|---|",
        f"| one after another (idle server) | {seq['seconds']:.2f} | {seq['tokens']} | "
        f"{seq['tokens_per_second']:.0f} | {ttft['idle']['p50'] * 1e3:.1f} | "
        f"{ttft['idle']['p95'] * 1e3:.1f} |",
        f"| {result['clients']} concurrent clients | {con['seconds']:.2f} | {con['tokens']} | "
        f"{con['tokens_per_second']:.0f} | {ttft['under_load']['p50'] * 1e3:.1f} | "
        f"{ttft['under_load']['p95'] * 1e3:.1f} |",
        "",
        f"- concurrent vs one after another: **{result['speedup']:.2f}x** the tokens/s "
        f"(per repetition {min(result['speedup_per_run']):.2f}-"
        f"{max(result['speedup_per_run']):.2f}; target >= {TARGETS['speedup']}x).",
        f"- TTFT of a request that joins the busy batch (single-token probes sent while the "
        f"{result['clients']} clients stream): p50 {ttft['probe_under_load']['p50'] * 1e3:.1f} "
        f"ms, p95 {ttft['probe_under_load']['p95'] * 1e3:.1f} ms "
        f"({ttft['probe_under_load']['n']} probes).",
        f"- server steps during one concurrent run: {result['server_steps']['decode']} decode, "
        f"{result['server_steps']['prefill']} prefill; largest batch "
        f"{result['server_steps']['rows_max']} rows.",
        f"- same texts in both runs: {result['same_texts']}.",
        "",
        "Targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}"
                                for k, v in result["targets_met"].items()),
        "",
    ]
    return "\n".join(lines)


def metrics(url):
    text = httpx.get(url + "/metrics", timeout=10).text
    return {line.split()[0].removeprefix("helpers_server_"): float(line.split()[1])
            for line in text.splitlines() if line}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repetition instead of 3")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (after a warm-up)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent requests (16)")
    parser.add_argument("--new-tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="server slots (default: clients + 4, so that probes find a slot)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server "
                        "(default 1, as the other benchmarks: the bundled model is tiny)")
    parser.add_argument("--probes", type=int, default=10,
                        help="single-token probes per concurrent run")
    parser.add_argument("--model", default=None, help="model name or folder (default: bundled)")
    parser.add_argument("--device", default="cpu", help="server device (default cpu)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"),
                        help="output folder")
    args = parser.parse_args(argv)
    reps = args.reps or (1 if args.quick else 3)
    if reps < 1 or args.clients < 1 or args.new_tokens < 1:
        parser.error("--reps, --clients and --new-tokens must be at least 1")
    jobs = [(PROMPTS[i % len(PROMPTS)], args.new_tokens) for i in range(args.clients)]
    max_batch_size = args.max_batch_size or args.clients + 4

    import torch
    import transformers

    result = {
        "model": args.model or "bundled", "reps": reps, "threads": args.threads,
        "clients": args.clients, "new_tokens": args.new_tokens, "max_batch_size": max_batch_size,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    print("starting the server ...", flush=True)
    with serve_in_background(args.model, name="bench-server", threads=args.threads,
                             max_batch_size=max_batch_size, max_queue=4 * args.clients,
                             device=args.device) as url:
        asyncio.run(one_after_another(url, jobs[:2]))        # warm-up
        seq_runs, con_runs, ttft_idle, ttft_load, probes = [], [], [], [], []
        texts_seq = texts_con = None
        for rep in range(reps):
            print(f"repetition {rep + 1}/{reps}: one after another ...", flush=True)
            results, seconds = asyncio.run(one_after_another(url, jobs))
            seq_runs.append((sum(r["tokens"] for r in results), seconds))
            ttft_idle += [r["ttft"] for r in results]
            texts_seq = [r["text"] for r in results]
            print(f"repetition {rep + 1}/{reps}: {args.clients} concurrent ...", flush=True)
            before = metrics(url)
            results, seconds, probe = asyncio.run(concurrently(url, jobs))
            after = metrics(url)
            con_runs.append((sum(r["tokens"] for r in results), seconds))
            ttft_load += [r["ttft"] for r in results]
            texts_con = [r["text"] for r in results]
            # A separate concurrent run with probes, not counted in the tokens/s.
            if args.probes:
                _, _, probe = asyncio.run(concurrently(url, jobs, probes=args.probes))
            probes += probe
    rate = [tokens / seconds for tokens, seconds in seq_runs]
    con_rate = [tokens / seconds for tokens, seconds in con_runs]
    pick = statistics.median
    result["one_after_another"] = {
        "seconds": pick(s for _, s in seq_runs), "tokens": seq_runs[0][0],
        "tokens_per_second": pick(rate), "runs_tokens_per_second": [round(r, 1) for r in rate]}
    result["concurrent"] = {
        "seconds": pick(s for _, s in con_runs), "tokens": con_runs[0][0],
        "tokens_per_second": pick(con_rate),
        "runs_tokens_per_second": [round(r, 1) for r in con_rate]}
    result["speedup"] = pick(con_rate) / pick(rate)
    result["speedup_per_run"] = [round(c / s, 2) for c, s in zip(con_rate, rate)]
    result["ttft_seconds"] = {"idle": summary(ttft_idle), "under_load": summary(ttft_load),
                              "probe_under_load": summary(probes) if probes else
                              {"p50": float("nan"), "p95": float("nan"), "n": 0}}
    result["server_steps"] = {
        "decode": int(after.get("steps_decode", 0) - before.get("steps_decode", 0)),
        "prefill": int(after.get("steps_prefill", 0) - before.get("steps_prefill", 0)),
        "rows_max": int(after.get("rows_max", 0))}
    result["same_texts"] = texts_seq == texts_con
    result["targets_met"] = {f"concurrent >= {TARGETS['speedup']}x tokens/s":
                             result["speedup"] >= TARGETS["speedup"],
                             "same texts": result["same_texts"]}

    write_results(args.out, "bench_server", result, markdown(result))
    return 0 if all(result["targets_met"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
