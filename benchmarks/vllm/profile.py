"""Where the time goes in the course server and in real vLLM while each serves 1, 16 and 64
streaming clients (py-spy).

    python -m benchmarks.vllm.profile                 # starts both servers (60-100 s)
    python -m benchmarks.vllm.profile --servers ours  # the course server alone
    python -m benchmarks.vllm.compare --profile       # the same, after the benchmark

The servers, each in its own processes, both started at the beginning and up for the whole
run (as in ``compare.py``, defaults against defaults, one torch thread each):

- ours (``helpers.server.serve_in_background(threads=1)``): the HTTP process (uvicorn, the
  routes, writing the SSE streams, the thread that reads the engine's pipe) and the engine
  process (``engine_process.py``: the scheduler's turn ``Engine.step``, the compiled
  step ``PackedStep``, lesson 08's eager ``paged_next_token`` for batches with an adapter row,
  choosing the tokens, handing them out and detokenizing them, the pipe's writer);
- vLLM (``serve.py``): the API server (HTTP, tokenizing prompts, detokenizing outputs),
  the engine core (the scheduler) and a worker (the model runner).

For each level, that many streaming requests are sent at once (as in ``compare.py``: course
prompts, 64 new tokens, EOS ignored, greedy): one untimed round, then again and again for at
least ``--seconds``, while ``py-spy record`` samples each of the server's processes (100 times
a second, Python stacks, every thread; py-spy leaves out threads it sees idle). The servers
take turns (ours first at the first level, vLLM first at the next, ...); the one not being
profiled sits idle (the report gives the CPU it used meanwhile). py-spy reads the processes'
memory without pausing them (``--nonblocking``: pausing vLLM's worker and its 40-odd threads
100 times a second made its steps several times slower), so a sample may now and then mix two
moments; sampling still takes CPU time from this 2-core machine: the proportions count, not
the speed.

The summary, per level, server and process: the samples sorted into what the server was doing,
by the innermost frame that says so (``stacks.py``: vLLM's by vLLM module; ours by the
course's functions: model forward, sampler, the step's inputs, scheduler, engine loop, IPC,
outputs and detokenizing, API server, waiting), in milliseconds of samples per engine step
(vLLM's steps: ``vllm:iteration_tokens_total_count`` of its /metrics; ours: ``steps_decode +
steps_prefill`` of our /metrics, as ``compare.py`` counts them); the
CPU seconds each process used (/proc); the functions with the most samples of their own (self)
and in their stack (cumulative); the server's modules (innermost frame of the server's own
code). Writes ``benchmarks/results/profile_servers.md`` and ``.json`` (``report.py``).
"""

from __future__ import annotations

import argparse
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
from contextlib import ExitStack, contextmanager
from importlib.metadata import version

from benchmarks.results_io import load_average, machine, write_results
from benchmarks.serving import OURS_EXTRA, at_once, jobs, levels_argument, metrics, our_steps
from benchmarks.timing import wait_until_idle
from benchmarks.vllm.report import SERVERS, WORDS, markdown
from benchmarks.vllm.serve import (VllmServe, command_line, descendants, vllm_python,
                                   vllm_steps, vllm_versions)
from benchmarks.vllm.stacks import (BLOCKED, frame_file, innermost_module, our_category,
                                    vllm_category)

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAME = "profile_servers"
LEVELS = (1, 16, 64)
RATE = 100                       # samples a second


class Target:
    """One server as the profiler sees it: its name (``SERVERS``), URL, what its requests need
    besides prompt and length, how to read its step count, its processes (``{part: pid}``),
    its parts in order with their names, what it is (versions, settings), how to sort a stack
    (``classify(frames, part)``), the start of its own files' paths, and the counters to
    record per level (ours: decode, prefill and compiled steps, compiles)."""

    def __init__(self, name: str, url: str, extra: dict, steps, processes, parts: dict,
                 describe, classify, prefix: str, counters=None):
        self.name, self.url, self.extra, self.steps = name, url, extra, steps
        self.processes, self.parts, self.describe = processes, parts, describe
        self.classify, self.prefix, self.counters = classify, prefix, counters


def vllm_target(server: VllmServe) -> Target:
    return Target("vllm", server.url, server.extra(), vllm_steps, server.processes,
                  {"api_server": "API server", "engine_core": "engine core",
                   "worker": "worker"},
                  lambda: vllm_versions(server.python), vllm_category, "vllm/")


def our_target(url: str, pid: int) -> Target:
    """Ours, served at ``url`` by the process ``pid`` (``BackgroundServer.pid``)."""
    def describe():
        import httpx

        info = httpx.get(url + "/info", timeout=10).json()
        return {"torch": version("torch"), "transformers": version("transformers"),
                "info": {k: v for k, v in info.items()
                         if k in ("kv_cache", "max_batch_size", "engine", "model_id",
                                  "kv_block_size", "max_prefill_tokens") or "compile" in k}}

    def counters():
        figures = metrics(url)
        return {key: figures.get(key, 0) for key in
                ("steps_decode", "steps_prefill", "steps_compiled", "compiles")}

    return Target("ours", url, OURS_EXTRA, our_steps, lambda: our_processes(pid),
                  {"http": "HTTP process", "engine": "engine process"}, describe,
                  our_category, "helpers/", counters)


def our_processes(pid: int) -> dict[str, int]:
    """Our server's processes: the HTTP process (``pid``) and its engine process (the one
    child started by multiprocessing's spawn, beside its resource tracker)."""
    found = {"http": pid}
    for child in descendants(pid):
        if "spawn_main" in command_line(child):
            found.setdefault("engine", child)
    return found


def py_spy() -> str:
    """The py-spy command: beside vLLM's Python (``make bench-vllm`` installs it there), beside
    this Python, or on the PATH."""
    folders = [pathlib.Path(sys.executable).parent]
    try:
        folders.insert(0, pathlib.Path(vllm_python()).parent)
    except RuntimeError:                 # no vLLM environment: profiling ours alone
        pass
    for folder in folders:
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
    folder = pathlib.Path(tempfile.mkdtemp(prefix="profile-servers-"))
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
                recorder.wait(5)
            stacks[part] = read_raw(folder / f"{part}.txt")
            if not stacks[part]:
                print(f"    py-spy recorded nothing for {part} (pid {pids[part]})", flush=True)
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

def summarise(stacks, steps: int, classify=vllm_category, part: str = "",
              prefix: str = "vllm/", top: int = 8) -> dict:
    """One process's samples: by category, by module of the server, and the top functions."""
    total = sum(count for _, count in stacks)
    categories, modules = collections.Counter(), collections.Counter()
    own, anywhere = collections.Counter(), collections.Counter()
    threads, busy_threads = collections.Counter(), collections.Counter()
    in_thread = collections.Counter()          # (thread, frame): busy samples
    roots = collections.Counter()              # (thread, its outermost frame): busy samples
    whole = []
    for frames, count in stacks:
        thread = ""
        if frames[0].startswith("thread"):           # "thread (1234): MainThread"
            thread, frames = frames[0], frames[1:]
        threads[thread.partition(": ")[2] or "?"] += count
        if not frames:                   # a thread caught between two Python frames
            frames = ["(no Python frame)"]
        category = classify(frames, part)
        categories[category] += count
        if category == BLOCKED:          # the lists below are of busy samples
            continue
        modules[innermost_module(frames, prefix) or f"(no {prefix[:-1]} frame)"] += count
        own[frames[-1]] += count
        for frame in set(frames):
            anywhere[frame] += count
        roots[thread, frames[0]] += count
        whole.append((thread, frames, count))
    # Frames in (nearly) every busy sample of each thread they are in are the threads'
    # start-up (``main``, ``run``, the thread's function): they say nothing. Counted over
    # the stacks that start where most of the thread's do (py-spy, not pausing the process,
    # now and then catches a stack without its outer frames).
    root = {}
    for (thread, frame), n in sorted(roots.items(), key=lambda item: item[1]):
        root[thread] = frame                       # the commonest comes last
    for thread, frames, count in whole:
        if frames[0] == root[thread]:
            busy_threads[thread] += count
            for frame in set(frames):
                in_thread[thread, frame] += count
    start_up = set(anywhere)
    for (thread, frame), n in in_thread.items():
        if n < 0.9 * busy_threads[thread]:
            start_up.discard(frame)
    cumulative = [(f, n) for f, n in anywhere.most_common()
                  if frame_file(f).startswith(prefix) and f not in start_up][:top]
    per_step = (1e3 / RATE / steps) if steps else float("nan")
    busy = total - categories.get(BLOCKED, 0)
    return {"samples": total, "busy_samples": busy, "threads": dict(threads.most_common()),
            "categories": {name: {"samples": n, "ms_per_step": n * per_step}
                           for name, n in categories.most_common()},
            "modules": dict(modules.most_common(top)), "self": own.most_common(top),
            "cumulative": cumulative}


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) the process has used, from /proc (Linux); NaN once gone."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def profile_level(target: Target, clients: int, new_tokens: int, seconds: float,
                  idle_pids=()) -> dict:
    """One untimed round, then sample the server's processes while ``clients`` requests at
    once are sent again and again for at least ``seconds``. ``idle_pids``: the other server's
    processes, whose CPU time meanwhile is recorded too."""
    pids = target.processes()
    requests = jobs(clients, new_tokens)
    at_once(target.url, requests, target.extra)                  # the untimed round
    steps_before = target.steps(target.url)
    counters_before = target.counters() if target.counters else {}
    cpu_before = {part: cpu_seconds(pid) for part, pid in pids.items()}
    idle_before = sum(cpu_seconds(pid) for pid in idle_pids)
    runs = tokens = 0
    with sampling(pids) as stacks:
        start = time.perf_counter()
        while runs == 0 or time.perf_counter() - start < seconds:
            results, _, _ = at_once(target.url, requests, target.extra)
            tokens += sum(r["tokens"] for r in results)
            runs += 1
        wall = time.perf_counter() - start
        cpu = {part: cpu_seconds(pid) - cpu_before[part] for part, pid in pids.items()}
        idle_cpu = sum(cpu_seconds(pid) for pid in idle_pids) - idle_before
    steps = int(target.steps(target.url) - steps_before)
    row = {"clients": clients, "seconds": wall, "runs": runs, "tokens": tokens,
           "steps": steps, "cpu_seconds": cpu, "idle_other_cpu_seconds": idle_cpu,
           "processes": {part: summarise(stacks.get(part, []), steps, target.classify, part,
                                         target.prefix) for part in pids}}
    if target.counters:
        after = target.counters()
        row["counters"] = {key: int(after[key] - counters_before.get(key, 0)) for key in after}
    return row


def profile(targets: dict[str, Target], levels=LEVELS, new_tokens: int = 64,
            seconds: float = 10.0) -> dict:
    """Every level in turn on started servers (``{name: Target}``), the servers taking turns
    within a level; the result ``markdown`` writes."""
    print(f"profiling {', '.join(WORDS[n] for n in targets)} with py-spy ({py_spy()}) ...",
          flush=True)
    load_before = load_average()
    described = {name: target.describe() for name, target in targets.items()}
    rows = []
    for index, clients in enumerate(levels):
        order = list(targets) if index % 2 == 0 else list(targets)[::-1]
        row = {"clients": clients, "servers": {}}
        for name in order:
            print(f"  {WORDS[name]}: {clients} client(s), {seconds:g} s or more ...", flush=True)
            idle = [pid for other, target in targets.items() if other != name
                    for pid in target.processes().values()]
            wait_until_idle()                   # vLLM polls for ~1 s after its last answer
            row["servers"][name] = profile_level(targets[name], clients, new_tokens, seconds,
                                                 idle)
        rows.append(row)
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": machine(), "servers": described, "rate": RATE,
            "new_tokens": new_tokens, "seconds": seconds, "load_average": load_before,
            "load_average_after": load_average(),
            "parts": {name: target.parts for name, target in targets.items()},
            "levels": rows}

# --- running it -----------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="least time each level is sampled on each server (10)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--levels", type=levels_argument, default=list(LEVELS),
                        help="concurrent clients, comma-separated (1,16,64)")
    parser.add_argument("--servers", default=",".join(SERVERS),
                        help="which servers, comma-separated (ours,vllm)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    chosen = [n.strip() for n in args.servers.split(",") if n.strip()]
    if not chosen or any(n not in SERVERS for n in chosen):
        parser.error(f"--servers: a comma-separated list of {', '.join(SERVERS)}")
    with ExitStack() as stack:
        targets = start_servers(stack, chosen)
        result = profile(targets, args.levels, args.new_tokens, args.seconds)
    write_results(args.out, NAME, result, markdown(result))
    return 0


def start_servers(stack: ExitStack, chosen) -> dict[str, Target]:
    """Start the chosen servers at once, wait for both, warm them up; ``stack`` stops them."""
    print(f"starting {' and '.join(WORDS[n] for n in chosen)} "
          f"{'(vLLM: 60-100 s) ' if 'vllm' in chosen else ''}...", flush=True)
    vllm = ours = None
    if "vllm" in chosen:
        vllm = VllmServe().start()
        stack.callback(vllm.__exit__)
    if "ours" in chosen:
        from helpers.server import serve_in_background

        ours = serve_in_background(name="profile-servers", threads=1, wait=False)
        stack.callback(ours.stop)
    targets = {}
    if ours is not None:
        url = ours.wait(600).url          # it compiles its step at start-up, beside vLLM's
        at_once(url, jobs(2, 8), OURS_EXTRA)                      # warm-up
        targets["ours"] = our_target(url, ours.pid)
    if vllm is not None:
        stack.enter_context(vllm)                        # waits for /health, warms up
        targets["vllm"] = vllm_target(vllm)
    return {n: targets[n] for n in SERVERS if n in targets}


if __name__ == "__main__":
    sys.exit(main())
