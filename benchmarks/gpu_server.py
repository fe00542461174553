"""The course server on a GPU, with and without CUDA graphs (lesson 10): the checks and the
figures a GPU run records. Part of ``make test-gpu`` (``scripts/run_lessons_gpu.py`` calls
``run``); alone, from the repository's root:

    python -m benchmarks.gpu_server --out results/gpu --budget 300
    python -m benchmarks.gpu_server --allow-cpu --quick     # check this script on a CPU

1. Same tokens: two compiled engines in this process, graphs on and off, at 1, 3, 16 and 64
   requests at once and 16 staggered, and one request against lesson 01's loop.
2. No capture or compile after start-up: about 1,000 mixed steps (adapters, long prompts);
   the counts stay, no request fails, the GPU memory in use ends where it began.
3. The model step at 1, 8 and 64 rows with lesson 10's pieces: eager, compiled, graph replay.
4. Two servers (graphs off, then on) under 1, 16 and 64 streaming clients.

Targets (an H100 or H200): gap at 1 client p50 <= 0.7 ms; model step at 1 row <= 0.3 ms; 64
clients >= 1.5x the tokens/s without graphs. ``run`` returns {"lines", "checks", "figures"}
and writes gpu_server.json in ``out_dir``; a part that does not fit in ``budget_seconds`` is
skipped and says so.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

from benchmarks import PROMPTS
from benchmarks.serving import at_once, figures, jobs
from helpers import load_model
from helpers.batching import generate_sequential
from helpers.compilation import rerun_each_replay
from helpers.server import Engine, GenerationParams, serve_in_background
from helpers.server.contract import ErrorEvent, Submission, TokenEvent

ADAPTERS = ["entities", "rhymes", "sad", "title"]
NEW_TOKENS = 64
TARGETS = {"gap_ms_1_client": 0.7, "step_ms_1_row": 0.3, "graphs_speedup_64": 1.5}


# --- in-process engines -----------------------------------------------------------------------

def start_engine(graphs: bool, device: str, capture=None):
    """The server's engine in this process (to hand it requests and read its counters without
    HTTP in between), compiled, with CUDA graphs on or off, started."""
    model, tokenizer = load_model(device=device)
    return Engine(model, tokenizer, max_batch_size=64, max_queue=256, compile="on",
                  cuda_graphs="on" if graphs else "off", capture=capture).start()


def submit_all(engine, requests, spacing: float = 0.0) -> list[list[int]]:
    """Submit (prompt, params) pairs (``spacing`` seconds apart); each one's token ids."""
    done = [threading.Event() for _ in requests]
    tokens: list[list[int]] = [[] for _ in requests]

    class Sink:
        def __init__(self, i):
            self.i = i

        def __call__(self, events):
            for _, event in events:
                if isinstance(event, ErrorEvent):
                    tokens[self.i].append(f"error: {event.message}")
                    done[self.i].set()
                elif isinstance(event, TokenEvent):
                    if event.token is not None:
                        tokens[self.i].append(event.token["id"])
                    if event.finish is not None:
                        done[self.i].set()

    for i, (prompt, params) in enumerate(requests):
        engine.submit(Submission(params, [prompt]), Sink(i))
        if spacing:
            time.sleep(spacing)
    for event in done:
        if not event.wait(300):
            raise RuntimeError("a request did not finish within 300 s")
    return tokens


def requests_of(count: int, new_tokens: int = NEW_TOKENS, adapter=None):
    return [(PROMPTS[i % len(PROMPTS)], GenerationParams(max_new_tokens=new_tokens,
                                                         ignore_eos_token=True,
                                                         adapter_id=adapter))
            for i in range(count)]


def same_tokens(graphed, plain, reference) -> tuple[dict, list[str]]:
    """Part 1: the graphed engine's tokens against the plain one's, and lesson 01's."""
    checks, lines = {}, []
    model, tokenizer = reference
    for clients in (1, 3, 16, 64):
        requests = requests_of(clients)
        a, b = submit_all(graphed, requests), submit_all(plain, requests)
        checks[f"same_tokens_{clients}"] = a == b
        lines.append(f"{clients} requests at once: graphs on and off give the same tokens: "
                     f"{a == b}")
    requests = requests_of(16)
    a, b = submit_all(graphed, requests, spacing=0.003), submit_all(plain, requests)
    checks["same_tokens_staggered"] = a == b
    lines.append(f"16 requests 3 ms apart: same tokens: {a == b}")
    texts = generate_sequential(model, tokenizer, [(PROMPTS[0], NEW_TOKENS)], stop_at_eos=False)
    want = tokenizer(texts[0], add_special_tokens=False)["input_ids"]
    got = submit_all(graphed, requests_of(1))[0]
    checks["lesson_01_tokens"] = got == want
    lines.append(f"one request against lesson 01's loop: same tokens: {got == want}")
    return checks, lines


def no_recapture(graphed, steps: int = 1000) -> tuple[dict, list[str]]:
    """Part 2: mixed traffic for about ``steps`` steps; the counts, failures and memory."""
    device = graphed.model.device
    # Every adapter once first: loading one adds its weights to the stacks (memory that stays,
    # by design), so the memory in use is compared from there on.
    submit_all(graphed, [(PROMPTS[0], GenerationParams(max_new_tokens=2, adapter_id=name))
                          for name in ADAPTERS])
    before = graphed.snapshot()
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    memory_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    waves = 0
    long_prompt = " ".join(PROMPTS * 4)            # about 90 tokens: a prompt read in chunks
    while graphed.snapshot().get("steps_decode", 0) + graphed.snapshot().get(
            "steps_prefill", 0) - before.get("steps_decode", 0) - before.get(
            "steps_prefill", 0) < steps:
        adapter = ADAPTERS[waves % len(ADAPTERS)] if waves % 3 == 1 else None
        requests = requests_of(1 + (waves * 7) % 40, 8 + (waves * 5) % 40)
        requests += requests_of(2, 12, adapter) + [(long_prompt, GenerationParams(max_new_tokens=9))]
        submit_all(graphed, requests, spacing=0.001 * (waves % 2))
        waves += 1
    after = graphed.snapshot()
    memory_after = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    steps_run = (after["steps_decode"] + after["steps_prefill"] - before.get("steps_decode", 0)
                 - before.get("steps_prefill", 0))
    checks = {"captures_fixed": after["cuda_graph_captures"] == before["cuda_graph_captures"],
              "compiles_fixed": after["compiles"] == before["compiles"],
              "no_failures": after.get("failed", 0) == before.get("failed", 0),
              "no_eager_instead": after.get("steps_eager_instead", 0) == 0,
              "memory_steady": memory_after - memory_before <= 2**20}
    fallbacks = after.get("cuda_graph_fallbacks", {})
    lines = [f"{int(steps_run)} mixed steps in {waves} waves (adapters, long prompts, 1-43 rows): "
             f"captures {before['cuda_graph_captures']} -> {after['cuda_graph_captures']}, "
             f"compiles {before['compiles']} -> {after['compiles']}, failed requests "
             f"{int(after.get('failed', 0) - before.get('failed', 0))}, steps run eager instead "
             f"{int(after.get('steps_eager_instead', 0))}",
             f"replays {int(after['cuda_graph_replays'] - before.get('cuda_graph_replays', 0))}, "
             f"padding rows {int(after['cuda_graph_padded_rows'])}, without a graph by reason "
             f"{dict(fallbacks)}; GPU memory in use {memory_before / 2**20:.1f} -> "
             f"{memory_after / 2**20:.1f} MiB; graphs reserved "
             f"{after['cuda_graph_memory_bytes'] / 2**20:.1f} MiB"]
    return checks, lines


def step_times(model, tokenizer, rows=(1, 8, 64), repeats: int = 3) -> tuple[dict, list[str]]:
    """Part 3: ms per model step of lesson 10's static-cache decode step: eager, compiled,
    and the replay of its CUDA graph; each size's fastest step."""
    from helpers.compilation import (capture_steps, course_prompts, static_decode_step,
                                     time_decode, time_graphed)

    prompts = course_prompts(tokenizer, n=max(rows))
    steps, length = 20, prompts.shape[1] + 21
    step = static_decode_step(model)
    compiled = torch.compile(step, dynamic=False)
    measured = {name: time_decode(model, prompts, rows, step=fn, steps=steps, repeats=repeats,
                                  max_cache_len=length, progress=False)
                for name, fn in (("eager", step), ("compiled", compiled))}
    graphs = capture_steps(compiled, model, rows, max_cache_len=length)
    measured["graph replay"] = time_graphed(model, graphs, prompts, rows,
                                            tokenizer.pad_token_id, steps, repeats)
    figures = {name: {r: t.seconds_per_step * 1e3 for r, t in by_rows.items()}
               for name, by_rows in measured.items()}
    lines = ["ms per model step   " + "".join(f"{f'{r} rows':>10}" for r in rows)]
    lines += [f"{name:19s}" + "".join(f"{values[r]:10.3f}" for r in rows)
              for name, values in figures.items()]
    return figures, lines


# --- the HTTP server ----------------------------------------------------------------------------

def serve_levels(device: str, graphs: str, levels, new_tokens: int, turns: int) -> dict:
    """Start a server (its default flags, ``--cuda-graphs graphs``), send each level's clients
    at once ``turns`` times, keep each level's best tokens/s turn; its figures, by level."""
    server = serve_in_background(device=device, cuda_graphs=graphs, timeout=600,
                                 name=f"gpu-{graphs}")
    try:
        at_once(server.url, jobs(1, 4))                                  # a warm-up request
        out = {}
        for clients in levels:
            best = None
            for _ in range(turns):
                results, seconds, _ = at_once(server.url, jobs(clients, new_tokens))
                run = figures(results, seconds)
                run = {"tokens_per_s": run["tokens_per_second"],
                       "ttft_p50_ms": run["ttft_p50"] * 1e3, "gap_p50_ms": run["itl_p50"] * 1e3,
                       "gap_p95_ms": run["itl_p95"] * 1e3, "texts": [r["text"] for r in results]}
                if best is None or run["tokens_per_s"] > best["tokens_per_s"]:
                    best = run
            out[clients] = best
        return out
    finally:
        server.stop()


# --- all of it ------------------------------------------------------------------------------------

def run(out_dir: Path, budget_seconds: float = 300.0, quick: bool = False,
        allow_cpu: bool = False) -> dict:
    """Parts 1-4 within ``budget_seconds`` (a part that would start past it is skipped);
    returns {"lines", "checks", "figures"} and writes ``out_dir/gpu_server.json``."""
    start = time.monotonic()
    cuda = torch.cuda.is_available()
    if not cuda and not allow_cpu:
        raise RuntimeError("the GPU server check needs a CUDA device")
    device = "cuda" if cuda else "cpu"
    # On a CPU, the stand-in capture (each replay runs the step again), to check this script.
    capture = None if cuda else rerun_each_replay
    lines, checks, figures = [f"device: {torch.cuda.get_device_name() if cuda else 'cpu'}"], {}, {}

    def left() -> float:
        return budget_seconds - (time.monotonic() - start)

    def say(line: str) -> None:
        lines.append(line)
        print(f"[gpu_server {time.monotonic() - start:6.1f} s] {line}", flush=True)

    began = time.monotonic()
    graphed = start_engine(True, device, capture)
    say(f"graphed engine ready in {time.monotonic() - began:.1f} s "
        f"(captures {graphed.snapshot()['cuda_graph_captures']}, "
        f"compiles {graphed.snapshot()['compiles']})")
    plain = start_engine(False, device)
    try:
        reference = (plain.model, plain.tokenizer)
        part, part_lines = same_tokens(graphed, plain, reference)
        checks.update(part)
        for line in part_lines:
            say(line)
        if left() > 60:
            part, part_lines = no_recapture(graphed, steps=200 if quick else 1000)
            checks.update(part)
            for line in part_lines:
                say(line)
        else:
            say("skipped the 1,000 mixed steps: time budget")
        if left() > 30:
            rows = (1, 8) if quick else (1, 8, 64)
            figures["step_ms"], part_lines = step_times(*reference, rows, 2 if quick else 5)
            for line in part_lines:
                say(line)
    finally:
        graphed.stop()
        plain.stop()
        del graphed, plain
        if cuda:
            torch.cuda.empty_cache()
    levels = (1, 16) if quick else (1, 16, 64)
    if left() > 90:
        servers = {}
        for graphs in ("off", "on" if cuda else "off"):
            servers[graphs] = serve_levels(device, graphs, levels, 32 if quick else NEW_TOKENS,
                                           turns=1 if quick else 3)
        say("clients  graphs  tokens/s  TTFT p50 ms  gap p50 ms  gap p95 ms")
        for clients in levels:
            for graphs, results in servers.items():
                r = results[clients]
                say(f"{clients:7d}  {graphs:6s}  {r['tokens_per_s']:8.0f}  {r['ttft_p50_ms']:11.2f}"
                    f"  {r['gap_p50_ms']:10.3f}  {r['gap_p95_ms']:10.3f}")
        if "on" in servers:
            on, off = servers["on"], servers["off"]
            checks["server_same_texts"] = all(on[c]["texts"] == off[c]["texts"] for c in levels)
            top = levels[-1]
            figures["server"] = {g: {c: {k: v for k, v in r.items() if k != "texts"}
                                     for c, r in res.items()} for g, res in servers.items()}
            figures["graphs_speedup"] = on[top]["tokens_per_s"] / off[top]["tokens_per_s"]
            say(f"{top} clients, graphs on / off: {figures['graphs_speedup']:.2f}x tokens/s; the "
                f"servers' texts are the same: {checks['server_same_texts']}")
    else:
        say("skipped the servers: time budget")
    if figures.get("step_ms") and "server" in figures:
        targets = {"gap_ms_1_client": figures["server"]["on"][1]["gap_p50_ms"],
                   "step_ms_1_row": figures["step_ms"]["graph replay"][1],
                   "graphs_speedup_64": figures["graphs_speedup"]}
        for name, value in targets.items():
            met = value >= TARGETS[name] if name.startswith("graphs") else value <= TARGETS[name]
            say(f"target {name}: {value:.3f} against {TARGETS[name]} ({'met' if met else 'missed'})")
    say(f"checks: {checks}; {time.monotonic() - start:.0f} s in all")
    result = {"lines": lines, "checks": checks, "figures": figures}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_server.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/gpu"))
    parser.add_argument("--budget", type=float, default=300.0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--allow-cpu", action="store_true")
    args = parser.parse_args(argv)
    result = run(args.out, args.budget, args.quick, args.allow_cpu)
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
