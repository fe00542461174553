"""How the profiler (``profile.py``) sorts a sampled stack into what a server was doing.

A stack is py-spy's list of frames, outermost first, each ``"function (file)"``. vLLM's stacks
go by vLLM module (``RULES``); ours by the course's functions and files (``ENGINE_RULES`` for
the engine process, ``HTTP_RULES`` for the HTTP process), the model call winning over the
course's code around it. ``GROUPS`` puts both servers' categories into the same columns
(``COLUMNS``), so that a step of one can be set beside a step of the other. The rules name
files and functions of both servers: when either moves its code, they move with it.
"""

from __future__ import annotations

import re

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
OUR_PREFILL = "model forward: eager (lesson 08's own pass: a batch with an adapter row)"
OUR_EAGER = "model forward: eager (elsewhere)"
OUR_INPUTS = "the step's inputs (PackedStep.__call__, PackedInputs.build, PagedForward.build)"
OUR_SCHEDULER = "scheduler: admission, bookkeeping, block manager (Engine.step, kv.py)"
OUR_SAMPLER = "sampler (TokenChooser, sampling.py)"
OUR_OUTPUTS = "handing out tokens (_hand_out, Sequence.accept)"
OUR_DETOK = "detokenizing (IncrementalDecoder, tokens.py)"
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
               "_run_model (helpers/server/runner.py)"}
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
    *[(name, "helpers/server/tokens.py", OUR_DETOK)         # IncrementalDecoder
      for name in ("add", "flush", "_decode", "pending")],
    *[(name, ENGINE, None) for name in ("cancelled", "adjusts_logits")],
    ("choose", ENGINE, OUR_SAMPLER),
    *[(name, ENGINE, OUR_OUTPUTS) for name in ("_hand_out", "accept", "_add_text", "_finish",
                                               "fail", "deliver_to_sinks")],
    ("deliver", "helpers/server/contract.py", OUR_OUTPUTS),
    *[(name, ENGINE, OUR_LOOP) for name in ("_loop", "_run")],
    *[(name, ENGINE, OUR_INTAKE) for name in ("submit", "__init__")],
    (None, ENGINE, OUR_SCHEDULER),
    (None, "helpers/server/kv.py", OUR_SCHEDULER),
    (None, "helpers/server/scheduling.py", OUR_SCHEDULER),
    ("_call", "helpers/server/runner.py", OUR_DECODE),
    ("pick", "helpers/server/runner.py", OUR_SCHEDULER),
    (None, "helpers/server/runner.py", OUR_INPUTS),         # PackedStep.__call__: its tensors
    (None, "helpers/server/graphs.py", OUR_INPUTS),         # staging a graph's inputs
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
            if "_forward (helpers/paged/batching.py)" in frames:   # lesson 08's own pass
                return OUR_PREFILL
            # Compiled code runs in the packed step alone (a stack that py-spy caught in part
            # may lack the frames further out).
            if compiled or "_call (helpers/server/runner.py)" in frames:
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
              "`PackedStep.__call__` around the model call, `PackedInputs.build`)",
    "scheduler": "the scheduler and its KV blocks (vLLM's engine core; ours: `Engine.step` and "
                 "its KV layout, admission into the batch, booking tokens, the block manager)",
    "engine loop": "the loop around the steps (vLLM: the engine core's loop, its calls to the "
                   "worker; ours: the scheduler thread's loop, the command loop, taking requests "
                   "in: tokenizing and checking them)",
    "IPC": "serializing and sending between processes (vLLM: msgpack, ZMQ, the shared-memory "
           "queue; ours: pickling, the pipe between the HTTP and the engine process)",
    "outputs": "turning tokens into outputs and text (vLLM: output processing and detokenizing,"
               " in its API server; ours: `_hand_out`, `Sequence.accept`, `IncrementalDecoder`, in the "
               "engine process)",
    "API server": "the HTTP side: HTTP, the OpenAI routes, streaming, the event loop (vLLM: its "
                  "API server, tokenizing too; ours: the HTTP process but its IPC, the pipe's "
                  "reader thread too)",
    "spin-wait": "spinning on the shared-memory queue, waiting for the other process (vLLM's "
                 "engine core and worker; ours blocks instead, which costs no samples)",
    "other": "the rest",
}


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
