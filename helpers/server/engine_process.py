"""The engine in a process of its own, so that the model never waits for the HTTP side.
(Lesson 07.)

Python runs one thread of a process at a time (the global interpreter lock, the GIL). When the
scheduler thread and the event loop share a process, every token the event loop writes to a
client is time in which the scheduler cannot run the model's Python code, and the two hand the
lock back and forth at every step. On a 2-core CPU a single streaming client got about 60 % of
the bare decode loop's tokens per second that way. vLLM (its "engine core") and SGLang (its
scheduler) run the model in a separate process for this reason, and so does this server unless
told ``--engine thread``:

    HTTP process (uvicorn)                              engine process
    routes, runner ── prepare, submit, cancel ───────▶  command loop ──▶ Engine
                    ◀──────── answers ────────────────       │         (scheduler thread)
    reader thread  ◀──────── one message per step ─────  Engine's events
      └─▶ the requests' asyncio queues

The two processes talk over a ``multiprocessing`` pipe (messages are pickled tuples). The
HTTP process keeps a tokenizer of its own (chat templates, decoding token-id prompts), and
nothing else of the model.

``EngineProcess`` has the methods and attributes that the HTTP side uses on an ``Engine``
(``prepare``, ``submit``, ``cancel``, ``snapshot``, ``info``, ``healthy``, ``adapters``,
``metrics``, the limits), so the routes and the runner do not know which one they talk to.
``prepare`` runs in the engine process, since what it makes (a loaded adapter, a compiled
grammar) lives there: the HTTP side gets a copy of the prepared request without the grammar,
with the ``key`` under which the engine process keeps the real one until it is let go.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as NoAnswerYet   # Python 3.10: not TimeoutError
from dataclasses import dataclass, fields

from . import errors
from .engine import ErrorEvent, Handle, Prepared, TokenEvent, send_events
from .metrics import Metrics

log = logging.getLogger("helpers.server")

#: Threads of the engine process that prepare requests (tokenize, load an adapter, compile a
#: grammar) while the scheduler runs.
PREPARE_WORKERS = 8
#: How long a thread of the engine process waits for Python's lock before the running thread
#: must give it up (Python's default is 5 ms). The scheduler runs almost all the time; the
#: command loop must still answer within a fraction of a decode step.
SWITCH_INTERVAL = 0.0005
#: How long the HTTP process waits for the engine process to load the model.
START_TIMEOUT = 600.0
#: How long the HTTP side waits for an answer before it gives up with a 503: to a question
#: ("call": its counters, its adapters), to a submission, and to a preparation (which may
#: download an adapter or compile a grammar).
ANSWER_SECONDS = {"call": 10.0, "submit": 30.0, "prepare": 300.0}
#: The engine process says it is alive every HEARTBEAT seconds; after SILENCE seconds without
#: a word from it, the HTTP side reports it unhealthy (a stopped or hung process).
HEARTBEAT = 1.0
SILENCE = 10.0


def torch_threads(requested: int | None, device) -> int | None:
    """The torch threads to use: ``requested`` if given; on the CPU every core but one (at
    least one), because the HTTP side runs on this machine too (its event loop writes every
    token to its client) and the clients are often on the same machine: a model step that
    takes every core makes each of them wait. None (torch's choice) on a GPU."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads must be at least 1, got {requested}")
        return requested
    if str(device).startswith("cpu"):
        return max(1, (os.cpu_count() or 1) - 1)
    return None


def build_engine(settings: dict):
    """Load the model and make the engine the settings ask for (not started). ``settings``:
    model, device, dtype, threads, kv_cache, adapters_dir, model_id and the Engine's options
    (``options.ENGINE_OPTIONS``). ValueError for settings that make no sense."""
    import torch

    from ..models import load_model
    from .engine import Engine
    from .options import ENGINE_OPTIONS
    from .paged_engine import PagedEngine

    model, tokenizer = load_model(settings["model"], device=settings["device"],
                                  dtype=settings["dtype"])
    threads = torch_threads(settings["threads"], model.device)
    if threads is not None:
        torch.set_num_threads(threads)
    engine_class = PagedEngine if settings["kv_cache"] == "paged" else Engine
    return engine_class(model, tokenizer, adapters_dir=settings["adapters_dir"],
                        model_id=settings["model_id"],
                        **{name: settings[name] for name in ENGINE_OPTIONS})


# --- the engine process -----------------------------------------------------------------------

def run_engine_process(conn, settings: dict) -> None:
    """The engine process: build the engine, say "ready" (or why not), then serve commands
    until told to stop or until the HTTP process goes away (its end of the pipe closes)."""
    logging.basicConfig(level=settings["log_level"].upper(),
                        format="%(levelname)s %(name)s (engine): %(message)s")
    try:
        engine = build_engine(settings)
    except ValueError as err:
        conn.send(("failed", "ValueError", str(err)))
        return
    except Exception as err:
        log.error("the engine could not start:\n%s", traceback.format_exc())
        conn.send(("failed", "RuntimeError", f"{type(err).__name__}: {err}"))
        return
    sys.setswitchinterval(SWITCH_INTERVAL)
    engine.start()
    limits = {name: getattr(engine, name) for name in _LIMITS}
    conn.send(("ready", limits))
    _EngineSide(conn, engine).serve()


#: What the HTTP side may ask the engine process with the "call" command.
_QUERIES = ("snapshot", "info", "adapters_available", "adapters_loaded")
#: The engine's attributes that the HTTP side reads (chat.py, routes_openai.py, app.py).
_LIMITS = ("model_id", "kv_cache", "max_batch_size", "max_queue", "max_input_tokens",
           "max_total_tokens", "max_prompt_chars", "default_max_new_tokens", "vocab_size")


class _Outbox:
    """Stands in for an event loop in the engine process: the engine hands its events to
    ``handle.loop.call_soon_threadsafe`` (``engine.send_events``), and here that sends a
    step's events to the HTTP process in one message. ``handle.queue`` is the number the
    HTTP process gave the request."""

    def __init__(self, side: "_EngineSide"):
        self.side = side

    def call_soon_threadsafe(self, deliver, items) -> None:
        events = [(number, event) for number, _tag, event in items]
        for number, event in events:
            if _ends(event):
                self.side.handles.pop(number, None)
        self.side.send(("events", events))


def _if_good(answer: tuple, then) -> None:
    ok, value = answer
    if ok:
        then(value)


def _ends(event) -> bool:
    """Whether ``event`` is the last one of its request."""
    return isinstance(event, ErrorEvent) or (isinstance(event, TokenEvent)
                                             and event.finish is not None)


class _EngineSide:
    """The engine process's command loop: one message at a time from the HTTP process."""

    def __init__(self, conn, engine):
        self.conn = conn
        self.engine = engine
        self.outbox = _Outbox(self)
        self.prepared: dict[int, Prepared] = {}      # key -> the real prepared request
        self.handles: dict[int, Handle] = {}         # the HTTP side's number -> the engine's
        self.keys = itertools.count(1)
        self.pool = ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="prepare")
        self._send_lock = threading.Lock()
        self._reported_failure = False

    def send(self, message) -> None:
        with self._send_lock:
            try:
                self.conn.send(message)
            except (OSError, ValueError):     # the HTTP process is gone; serve() ends too
                pass

    def serve(self) -> None:
        next_beat = 0.0
        try:
            while True:
                if time.monotonic() >= next_beat:   # on a clock, however busy the pipe is
                    self._check_health()
                    self.send(("alive",))
                    next_beat = time.monotonic() + HEARTBEAT
                if not self.conn.poll(HEARTBEAT):
                    continue
                message = self.conn.recv()
                if message[0] == "stop":
                    break
                self.dispatch(*message)
        except (EOFError, OSError):          # the HTTP process went away
            pass
        finally:
            self.engine.stop()
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.send(("stopped",))

    def dispatch(self, command: str, *args) -> None:
        if command == "prepare":
            self.pool.submit(self._prepare, *args)
        elif command == "submit":
            self._answer(args[0], self._submit, *args[1:])
        elif command == "cancel":
            handle = self.handles.pop(args[0], None)     # no event goes to it any more
            if handle is not None:
                self.engine.cancel(handle)
        elif command == "forget":
            for key in args[0]:
                self.prepared.pop(key, None)
        elif command == "call":
            if args[1] in _QUERIES:
                self._answer(args[0], getattr(self, "_" + args[1]))
            else:
                self.send(("answer", args[0], False, ("RuntimeError",
                                                      f"unknown query {args[1]!r}")))
        else:
            log.error("unknown command from the HTTP process: %r", command)

    def _answer(self, call: int, function, *args) -> None:
        """Run ``function`` and send its result (or its error) as the answer to ``call``."""
        try:
            self.send(("answer", call, True, function(*args)))
        except errors.EngineError as err:
            self.send(("answer", call, False, (type(err).__name__, err.message)))
        except Exception as err:            # a bug: the HTTP side answers 500, the log says why
            log.error("the engine process failed on a request:\n%s", traceback.format_exc())
            self.send(("answer", call, False, ("RuntimeError", f"{type(err).__name__}: {err}")))

    def _prepare(self, call: int, prompt, params) -> None:
        def prepare():
            prepared = self.engine.prepare(prompt, params)
            key = next(self.keys)
            self.prepared[key] = prepared
            # The HTTP side's copy: everything but the compiled grammar.
            return key, {f.name: getattr(prepared, f.name) for f in fields(Prepared)
                         if f.name != "grammar"}
        self._answer(call, prepare)

    def _submit(self, key: int, seed: int | None, number: int) -> None:
        prepared = self.prepared.get(key)
        if prepared is None:
            raise errors.InvalidRequest("this request was let go before it was submitted")
        if seed != prepared.seed:                 # another copy (best_of, n): its own seed
            prepared = copy.copy(prepared)
            prepared.seed = seed
        handle = self.engine.submit(prepared, self.outbox, number)
        self.handles[number] = handle
        if handle.finished:                       # it may have finished already
            self.handles.pop(number, None)

    def _snapshot(self) -> dict:
        return {**self.engine.snapshot(), "prepared_held": len(self.prepared)}

    def _info(self) -> dict:
        return self.engine.info()

    def _adapters_available(self) -> list[str]:
        return self.engine.adapters.available()

    def _adapters_loaded(self) -> list[str]:
        return self.engine.adapters.loaded

    def _check_health(self) -> None:
        if not self._reported_failure and not self.engine.healthy:
            self._reported_failure = True
            self.send(("failed", "Unavailable", self.engine._failure or "the engine stopped"))


# --- the HTTP process's side --------------------------------------------------------------------

@dataclass
class RemotePrepared(Prepared):
    """The HTTP side's copy of a request prepared in the engine process (``grammar`` is None
    here; the engine process keeps the real one under ``key``)."""

    key: int = 0


class _RemoteAdapters:
    """What the routes ask of ``engine.adapters``, asked of the engine process."""

    def __init__(self, engine: "EngineProcess"):
        self._engine = engine

    def available(self) -> list[str]:
        return self._engine._call("call", "adapters_available")

    @property
    def loaded(self) -> list[str]:
        return self._engine._call("call", "adapters_loaded")


class EngineProcess:
    """An ``Engine`` (or ``PagedEngine``) in a process of its own, seen from the HTTP process.
    (Lesson 07.)

    The arguments are ``build_engine``'s settings (the server's options). The constructor
    starts the process and waits until the model is loaded; ``ValueError`` if the engine
    refuses its options, ``RuntimeError`` if the process fails otherwise. ``stop()`` ends it.
    """

    def __init__(self, settings: dict, start_timeout: float = START_TIMEOUT):
        import multiprocessing

        from ..models import load_tokenizer

        self.metrics = Metrics()            # observed here: what the clients' tokens saw
        self.adapters = _RemoteAdapters(self)
        self._handles: dict[int, Handle] = {}
        self._calls: dict[int, Future] = {}
        self._numbers = itertools.count()     # the requests' numbers
        self._call_ids = itertools.count()    # the commands that wait for an answer
        self._send_lock = threading.Lock()
        self._forgotten: deque[int] = deque()   # keys of prepared requests nobody holds
        self._finalizers: dict[int, weakref.finalize] = {}   # by key, until let go
        self._failure: str | None = None
        self._stopping = False

        context = multiprocessing.get_context("spawn")   # never fork a process with threads
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=run_engine_process, args=(child_conn, settings),
                                        name="helpers.server engine", daemon=True)
        self._process.start()
        child_conn.close()
        try:       # this process's tokenizer loads while the engine process loads the model
            self.tokenizer = load_tokenizer(settings["model"])
        except BaseException:
            self._process.kill()
            raise
        limits = self._wait_ready(start_timeout)
        for name, value in limits.items():
            setattr(self, name, value)
        self._heard = time.monotonic()        # when the engine process last said anything
        self._reader = threading.Thread(target=self._read, name="helpers.server events",
                                        daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.5):
            if not self._process.is_alive():
                raise RuntimeError(f"the engine process exited with code "
                                   f"{self._process.exitcode} before it was ready")
            if time.monotonic() > deadline:
                self._process.kill()
                raise RuntimeError(f"the engine process was not ready within {timeout:g} s")
        try:
            kind, *rest = self._conn.recv()
        except EOFError:                  # it died without a word (its log says why)
            self._process.join(10)
            raise RuntimeError(f"the engine process exited with code "
                               f"{self._process.exitcode} before it was ready") from None
        if kind == "ready":
            return rest[0]
        self._process.join(10)
        error, message = rest
        raise (ValueError if error == "ValueError" else RuntimeError)(message)

    # --- life cycle -------------------------------------------------------------------------

    def start(self) -> "EngineProcess":
        return self                          # the process started with the object

    def stop(self, timeout: float = 5.0) -> None:
        if not self._stopping:
            self._stopping = True
            try:
                self._send(("stop",))
            except (OSError, ValueError):     # it is gone already
                pass
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._reader.join(timeout)

    @property
    def healthy(self) -> bool:
        return (self._process.is_alive() and self._failure is None and not self._stopping
                and time.monotonic() - self._heard < SILENCE)

    # --- what the HTTP side calls ------------------------------------------------------------

    def prepare(self, prompt, params) -> RemotePrepared:
        """``Engine.prepare``, done in the engine process. Blocks: call it from a worker
        thread."""
        key, values = self._call("prepare", prompt, params,
                                 late=lambda answer: self._forget_now(answer[0]))
        prepared = RemotePrepared(grammar=None, key=key, **values)
        # ``release`` lets go of it in the engine process. Should that never be called, the
        # engine process lets go when this copy is garbage (told with the next message).
        self._finalizers[key] = weakref.finalize(prepared, self._forget_later, key)
        return prepared

    def release(self, prepared: RemotePrepared) -> None:
        """``prepared`` will be submitted no more: the engine process lets go of it now."""
        finalizer = self._finalizers.pop(prepared.key, None)
        if finalizer is not None and finalizer.detach() is not None:
            self._forget_now(prepared.key)

    def submit(self, prepared: RemotePrepared, loop, queue, tag: int = 0) -> Handle:
        """``Engine.submit``: the events will go to ``queue``, an asyncio.Queue of ``loop``.
        Waits for the engine process's answer (``Overloaded``, ``Unavailable``)."""
        number = next(self._numbers)
        handle = Handle(number, prepared, loop, queue, tag)
        self._handles[number] = handle
        try:
            self._call("submit", prepared.key, prepared.seed, number,
                       late=lambda _: self.cancel(handle))
        except BaseException:
            self._handles.pop(number, None)
            raise
        return handle

    def cancel(self, handle: Handle) -> None:
        if handle.finished or handle.cancelled:
            return
        handle.cancelled = True
        self._handles.pop(handle.id, None)          # its client is gone: no more events
        try:
            self._send(("cancel", handle.id))
        except (OSError, ValueError):     # the engine process is gone: nothing runs anyway
            pass

    def snapshot(self) -> dict:
        return self._call("call", "snapshot")

    def info(self) -> dict:
        return {**self._call("call", "info"), "engine": "process"}

    # --- talking to the engine process -------------------------------------------------------

    def _forget_later(self, key: int) -> None:
        """A RemotePrepared became garbage (this may run in any thread, in the middle of
        anything: it only takes note)."""
        self._finalizers.pop(key, None)
        self._forgotten.append(key)

    def _forget_now(self, key: int) -> None:
        try:
            self._send(("forget", [key]))
        except (OSError, ValueError):     # the engine process is gone, and what it kept
            pass

    def _send(self, message) -> None:
        with self._send_lock:
            if self._forgotten:
                keys = [self._forgotten.popleft() for _ in range(len(self._forgotten))]
                self._conn.send(("forget", keys))
            self._conn.send(message)

    def _call(self, command: str, *args, late=None):
        """Send a command and wait for its answer, ``ANSWER_SECONDS[command]`` at most; raise
        the engine's error if it failed, ``Unavailable`` if no answer came. ``late(value)``
        runs if a good answer comes after that: it undoes what nobody waits for any more."""
        stopped = errors.Unavailable("the server is not running (its engine process stopped)")
        if not self.healthy:
            raise stopped
        call = next(self._call_ids)
        future: Future = Future()
        self._calls[call] = future
        deadline = time.monotonic() + ANSWER_SECONDS[command]
        try:
            self._send((command, call, *args))
        except (OSError, ValueError):
            self._calls.pop(call, None)
            raise stopped from None
        while True:         # until the answer, the deadline, or the reader's end (no answer)
            try:
                ok, value = future.result(timeout=1.0)
                break
            except NoAnswerYet:
                if not self._reader.is_alive():
                    raise stopped from None
                if time.monotonic() > deadline:
                    if late is not None:
                        future.add_done_callback(lambda done: _if_good(done.result(), late))
                    raise errors.Unavailable(f"the server's engine did not answer within "
                                             f"{ANSWER_SECONDS[command]:g} s") from None
        if ok:
            return value
        error, message = value
        kind = getattr(errors, error, None)
        if isinstance(kind, type) and issubclass(kind, errors.EngineError):
            raise kind(message)
        raise RuntimeError(message)

    def _read(self) -> None:
        """The reader thread: the engine process's answers and events, until it ends."""
        try:
            while True:
                kind, *rest = self._conn.recv()
                self._heard = time.monotonic()
                if kind == "events":
                    self._deliver(rest[0])
                elif kind == "answer":
                    call, ok, value = rest
                    future = self._calls.pop(call, None)
                    if future is not None:
                        future.set_result((ok, value))
                elif kind == "failed":
                    self._failure = rest[1]
                    log.error("the engine process reports: %s", rest[1])
                elif kind == "stopped":
                    break
        except (EOFError, OSError):
            if not self._stopping:
                self._process.join(1)
                log.error("the engine process ended (exit code %s)", self._process.exitcode)
        finally:
            self._failure = self._failure or "the engine process ended"
            self._fail_everything()

    def _deliver(self, events: list) -> None:
        outgoing = []
        for number, event in events:
            handle = self._handles.get(number)
            if handle is None:
                continue
            if isinstance(event, TokenEvent) and event.token is not None:
                self.metrics.observe_token(handle)
            if _ends(event):
                handle.finished = True
                del self._handles[number]
            outgoing.append((handle, event))
        send_events(outgoing)

    def _fail_everything(self) -> None:
        """The engine process is gone: every request still waiting for it gets an error."""
        for future in list(self._calls.values()):
            if not future.done():
                future.set_result((False, ("Unavailable", "the server is not running (its "
                                           "engine process stopped)")))
        self._calls.clear()
        handles = list(self._handles.values())
        self._handles.clear()
        for handle in handles:
            handle.finished = True
        send_events([(handle, ErrorEvent("the server's engine process stopped", status=503,
                                         error_type="unavailable"))
                     for handle in handles])
