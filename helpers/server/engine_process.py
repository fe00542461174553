"""The engine in a process of its own (unless ``--engine thread``), as in vLLM and SGLang, so
that the model never waits for the HTTP side: Python runs one thread at a time, and sharing the
event loop's process, a 2-core CPU's single stream got about 60 % of the bare decode loop's
speed. (Lesson 07.)

    HTTP process (uvicorn)                              engine process
    routes ── Question("submit", submission) ───────────▶  command loop ──▶ Engine.submit
           ◀── Answer (a Handle's fields, or an error)       │         (scheduler thread)
    reader thread  ◀──────── Events, one message per step ── Engine.deliver
      └─▶ each submission's sink

The HTTP process imports neither torch nor transformers, and its routes cannot tell an
``EngineProcess`` from an ``Engine``. When the engine process dies, the requests in flight get
a 503 and ``supervisor.py`` starts a new one.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as NoAnswerYet   # Python 3.10: not TimeoutError
from dataclasses import dataclass

from . import errors, startup
from .contract import Handle, Sink, Submission, deliver
from .options import ENGINE_OPTIONS, check, device, torch_threads
from .supervisor import START_TIMEOUT, STOPPED, Supervisor

log = logging.getLogger("helpers.server")

#: Threads that admit submissions (tokenize, load an adapter, compile a grammar).
SUBMIT_WORKERS = 8
#: Python's thread switch interval (default 5 ms): the command loop must answer within a
#: fraction of a decode step.
SWITCH_INTERVAL = 0.0005
#: Seconds the HTTP side waits for an answer before a 503 (a submission may download an adapter).
ANSWER_SECONDS = {"ask": 10.0, "submit": 300.0}
#: The engine process says it is alive every HEARTBEAT seconds; silent for SILENCE seconds,
#: it is reported unhealthy (stopped or hung).
HEARTBEAT = 1.0
SILENCE = 10.0
#: The engine's attributes that the HTTP side reads.
LIMITS = ("model_id", "kv_cache", "max_batch_size", "max_queue", "max_input_tokens",
          "max_total_tokens", "max_prompt_chars", "default_max_new_tokens", "vocab_size",
          "special_ids")


# --- the messages ---------------------------------------------------------------------------

@dataclass
class Question:             # HTTP -> engine: one of _EngineSide.questions, with its arguments
    call: int
    question: str
    args: tuple = ()


@dataclass
class Cancel:                 # HTTP -> engine: a submission's client went away
    number: int


@dataclass
class Stop:                   # HTTP -> engine: finish and exit; engine -> HTTP: the last word
    pass


@dataclass
class Ready:                  # engine -> HTTP: the engine's limits, or why it could not start
    limits: dict
    error: tuple | None = None      # (error class name, message)


@dataclass
class Answer:                 # engine -> HTTP: the answer to a Question
    call: int
    ok: bool
    value: object             # the result; or (error class name, message)


@dataclass
class Events:                 # engine -> HTTP: one step's events, (number, sequence, event)
    items: list


@dataclass
class Alive:                  # engine -> HTTP: the heartbeat, the counters, a scheduler failure
    counters: dict
    failure: str | None = None


def build_engine(settings: dict):
    """The engine (not started) for the server's options, ``adapters_dir`` (None: the course's)
    and ``model_id``; ``ValueError`` (``options.check``) before the model loads."""
    import torch

    from ..models import load_model
    from .engine import Engine

    settings = dict(settings)
    adapters_dir, model_id = settings.pop("adapters_dir", None), settings.pop("model_id", None)
    where = device(settings.get("device"))
    judged = check(settings, device=where)
    startup.report("loading the model")
    began = time.monotonic()
    model, tokenizer = load_model(judged["model"], device=where, dtype=judged["dtype"])
    startup.report("model loaded in %.1f s", time.monotonic() - began)
    torch.set_num_threads(torch_threads(judged["threads"], where))
    if adapters_dir is None:
        from ..lora import ADAPTERS_DIR as adapters_dir
    options = {name: judged[name] for name in ENGINE_OPTIONS}
    if judged["kv_cache"] == "paged":             # the paged layout's runner (lesson 10)
        options.update(compile=judged["compile"], cuda_graphs=judged["cuda_graphs"],
                       graph_sizes=judged["cuda_graph_sizes"])
    return Engine(model, tokenizer, adapters_dir=adapters_dir, model_id=model_id, **options)


# --- the engine process -----------------------------------------------------------------------

def run_engine_process(conn, settings: dict) -> None:
    """The engine process: build the engine, say ``Ready`` (or why not), then serve until told
    to stop or the HTTP process goes away. Ctrl-C and SIGTERM are the HTTP process's to handle:
    it drains its requests, then sends ``Stop``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=settings["log_level"].upper(),
                        format="%(levelname)s %(name)s (engine): %(message)s")
    started = time.monotonic()
    try:
        engine = build_engine(settings)
    except Exception as err:
        if not isinstance(err, ValueError):
            log.error("the engine could not start:\n%s", traceback.format_exc())
            err = RuntimeError(f"{type(err).__name__}: {err}")
        conn.send(Ready({}, (type(err).__name__, str(err))))
        return
    sys.setswitchinterval(SWITCH_INTERVAL)
    engine.start()
    startup.report("the engine is ready (%.1f s)", time.monotonic() - started)
    conn.send(Ready({name: getattr(engine, name) for name in LIMITS}))
    _EngineSide(conn, engine).serve()
    # Stopped, and said so: leave at once (tearing torch and the model down took seconds).
    sys.stderr.flush()
    os._exit(0)


class _EngineSide:
    """The engine process's command loop: one message at a time from the HTTP process."""

    def __init__(self, conn, engine):
        self.conn = conn
        self.engine = engine
        self.handles: dict[int, Handle] = {}         # by the HTTP side's number
        self.pool = ThreadPoolExecutor(SUBMIT_WORKERS, thread_name_prefix="submit")
        self._send_lock = threading.Lock()
        engine.deliver = self.deliver                # every step's events: one message
        self.questions = {"submit": self.submit, "snapshot": self.snapshot, "info": engine.info,
                          "adapters_available": engine.adapters_available,
                          "adapters_loaded": engine.adapters_loaded, "tokenize": engine.tokenize}

    def send(self, message) -> None:
        with self._send_lock, contextlib.suppress(OSError, ValueError):   # the HTTP side is gone
            self.conn.send(message)

    def serve(self) -> None:
        next_beat = 0.0
        try:
            while True:
                if time.monotonic() >= next_beat:   # on a clock, however busy the pipe is
                    self.send(Alive(self.snapshot(), None if self.engine.healthy
                                    else self.engine._failure or "the engine stopped"))
                    next_beat = time.monotonic() + HEARTBEAT
                if not self.conn.poll(HEARTBEAT):
                    continue
                message = self.conn.recv()
                if isinstance(message, Stop):
                    break
                if isinstance(message, Cancel):
                    handle = self.handles.pop(message.number, None)
                    if handle is not None:
                        self.engine.cancel(handle)
                elif message.question == "submit":     # it may block: a worker thread
                    self.pool.submit(self._answer, message)
                else:
                    self._answer(message)
        except (EOFError, OSError):          # the HTTP process went away
            pass
        finally:
            self.engine.stop()
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.send(Stop())

    def _answer(self, message: Question) -> None:
        try:
            self.send(Answer(message.call, True, self.questions[message.question](*message.args)))
        except errors.EngineError as err:
            self.send(Answer(message.call, False, (type(err).__name__, err.message)))
        except Exception as err:            # a bug: the HTTP side answers 500, the log says why
            log.error("the engine process failed on a request:\n%s", traceback.format_exc())
            self.send(Answer(message.call, False, ("RuntimeError", f"{type(err).__name__}: {err}")))

    def snapshot(self) -> dict:
        return {**self.engine.snapshot(), "submissions_held": len(self.handles)}

    def submit(self, number: int, submission: Submission) -> tuple:
        handle = self.engine.submit(submission, tag=number)
        self.handles[number] = handle
        if handle.finished:              # its last event may have gone out already
            self.handles.pop(number, None)
        return handle.prompts, handle.sequences, handle.seeds

    def deliver(self, outgoing: list) -> None:
        """The engine's events of one step, to the HTTP process in one message."""
        items = []
        for request, event in outgoing:
            handle = request.handle
            if handle.count(event):              # its last event: nothing more to keep
                self.handles.pop(handle.tag, None)
            items.append((handle.tag, request.sequence, event))
        self.send(Events(items))


# --- the HTTP process's side --------------------------------------------------------------------

class EngineProcess(Supervisor):
    """An ``Engine`` in a process of its own (``settings``: ``build_engine``'s), seen from the
    HTTP process and restarted when it dies (``supervisor.py``). (Lesson 07.)"""

    def __init__(self, settings: dict, start_timeout: float = START_TIMEOUT, on_give_up=None):
        super().__init__(run_engine_process, settings, start_timeout, on_give_up)
        self._numbers = itertools.count()         # the submissions' numbers
        self._call_ids = itertools.count()

    def stop(self, timeout: float = 5.0) -> None:
        if self._process is not None:
            with contextlib.suppress(OSError, ValueError):     # it is gone already
                self._send(Stop())
        super().stop(timeout)

    @property
    def healthy(self) -> bool:
        return (self._process is not None and self._process.is_alive()
                and self._failure is None and not self._stopping and not self._restarting
                and time.monotonic() - self._heard < SILENCE)

    def submit(self, submission: Submission, sink: Sink) -> Handle:
        """``Engine.submit`` in the engine process (blocks); events reach ``sink`` from the
        reader thread."""
        number = next(self._numbers)
        handle = Handle(number, [], 0, [], sink)      # completed by the answer
        with self._lock:
            self._handles[number] = handle    # events may come before the answer does
        try:
            handle.prompts, handle.sequences, handle.seeds = self._call(
                "submit", number, submission, late=lambda _: self._send(Cancel(number)))
        except BaseException:
            self._forget(handle)
            raise
        if handle.finished:
            self._forget(handle)
        return handle

    def cancel(self, handle: Handle) -> None:
        if handle.finished or handle.cancelled:
            return
        handle.cancelled = True
        self._forget(handle)                            # its client is gone: no more events
        with contextlib.suppress(OSError, ValueError):  # the engine process is gone already
            self._send(Cancel(handle.id))

    def info(self) -> dict:
        return {**self._call("info"), "engine": "process", "engine_restarts": self.restarts}

    def adapters_available(self) -> list[str]:
        return self._call("adapters_available")

    def adapters_loaded(self) -> list[str]:
        return self._call("adapters_loaded")

    def tokenize(self, text: str) -> list[dict]:
        return self._call("tokenize", text)

    def _send(self, message) -> None:
        with self._lock:
            self._conn.send(message)

    def _call(self, question: str, *args, late=None):
        """Ask the engine process and wait for its answer; raise its error, or ``Unavailable`` if
        none came in time. ``late(value)`` undoes a good answer that comes after that."""
        seconds = ANSWER_SECONDS["submit" if question == "submit" else "ask"]
        stopped = errors.Unavailable(STOPPED)
        if not self.healthy:
            raise stopped
        call = next(self._call_ids)
        future: Future = Future()
        with self._lock:
            self._calls[call] = future
        deadline = time.monotonic() + seconds
        try:
            self._send(Question(call, question, args))
        except (OSError, ValueError):
            with self._lock:
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
                        future.add_done_callback(
                            lambda done: done.result()[0] and late(done.result()[1]))
                    raise errors.Unavailable(f"the server's engine did not answer within "
                                             f"{seconds:g} s") from None
        if ok:
            return value
        error, text = value                 # an EngineError's name, or "RuntimeError"
        raise getattr(errors, error, RuntimeError)(text)

    def _read(self) -> None:
        """The reader thread: the engine process's messages, until it ends."""
        crashed = False
        try:
            while True:
                message = self._conn.recv()
                self._heard = time.monotonic()
                if isinstance(message, Alive):
                    self._heard_counters(message.counters)
                    if message.failure and not self._failure:
                        self._failure = message.failure
                        log.error("the engine process reports: %s", message.failure)
                elif isinstance(message, Events):     # to the submissions not cancelled
                    with self._lock:
                        known = [(self._handles[number], sequence, event)
                                 for number, sequence, event in message.items
                                 if number in self._handles]
                    deliver(known, forget=self._forget)
                elif isinstance(message, Answer):
                    with self._lock:
                        future = self._calls.pop(message.call, None)
                    if future is not None:
                        future.set_result((message.ok, message.value))
                elif isinstance(message, Stop):
                    break
        except (EOFError, OSError):
            crashed = not self._stopping
            if crashed:
                self._crashed()
        finally:
            self._failure = self._failure or "the engine process ended"
            self._fail_everything(crashed)
        if crashed:
            self._restart()

    def _forget(self, handle) -> None:
        with self._lock:
            self._handles.pop(handle.id, None)
