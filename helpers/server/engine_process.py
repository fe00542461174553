"""The engine in a process of its own, so that the model never waits for the HTTP side; and a
supervisor that restarts it when it dies. (Lesson 07.)

Python runs one thread of a process at a time (the global interpreter lock, the GIL). When the
scheduler thread and the event loop share a process, every token the event loop writes to a
client is time in which the scheduler cannot run the model's Python code, and the two hand the
lock back and forth at every step. On a 2-core CPU a single streaming client got about 60 % of
the bare decode loop's tokens per second that way. vLLM (its "engine core") and SGLang (its
scheduler) run the model in a separate process for this reason, and so does this server unless
told ``--engine thread``:

    HTTP process (uvicorn)                              engine process
    routes ── Submit(submission) ───────────────────▶  command loop ──▶ Engine.submit
           ◀── Answer (a Handle's fields, or an error)       │         (scheduler thread)
    reader thread  ◀──────── Events, one message per step ── Engine.deliver
      └─▶ each submission's sink

The two processes talk over a ``multiprocessing`` pipe; every message is one of the small
dataclasses below. A submission crosses once and is answered once. The HTTP process holds no
model and no tokenizer: it imports neither torch nor transformers (the chat template and the
tokenizer run in the engine's process, in ``admission.py``).

``EngineProcess`` is a ``contract.EngineClient``, as ``Engine`` is, so the routes do not know
which one they talk to. When the engine process dies (killed, out of memory), the requests in
flight fail with a 503 that says so, ``/health`` answers 503 while a new engine process starts
(after a pause that doubles with each crash), and ``/metrics`` counts the restarts. When
the process crashes once more after ``MAX_RESTARTS`` restarts within ``RESTART_WINDOW``
seconds, it gives up: ``on_give_up`` is called (the server then exits with status 1).
"""

from __future__ import annotations

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
from dataclasses import dataclass, field

from . import errors, metrics, startup
from .contract import ErrorEvent, Handle, Sink, Submission, deliver
from .options import ENGINE_OPTIONS, check, device, torch_threads

log = logging.getLogger("helpers.server")

#: Threads of the engine process that admit submissions (tokenize, load an adapter, compile a
#: grammar) while the scheduler runs.
SUBMIT_WORKERS = 8
#: How long a thread of the engine process waits for Python's lock before the running thread
#: must give it up (Python's default is 5 ms). The scheduler runs almost all the time; the
#: command loop must still answer within a fraction of a decode step.
SWITCH_INTERVAL = 0.0005
#: How long the HTTP process waits for the engine process to load the model.
START_TIMEOUT = 600.0
#: How long the HTTP side waits for an answer before it gives up with a 503: to a question
#: (its counters, its adapters) and to a submission (which may download an adapter or
#: compile a grammar).
ANSWER_SECONDS = {"ask": 10.0, "submit": 300.0}
#: The engine process says it is alive every HEARTBEAT seconds; after SILENCE seconds without
#: a word from it, the HTTP side reports it unhealthy (a stopped or hung process).
HEARTBEAT = 1.0
SILENCE = 10.0
#: Restarts after a crash: the first after RESTART_PAUSE seconds, each next one after twice
#: the pause before; more than MAX_RESTARTS crashes within RESTART_WINDOW seconds: give up.
RESTART_PAUSE = 1.0
MAX_RESTARTS = 3
RESTART_WINDOW = 300.0


# --- the messages ---------------------------------------------------------------------------

@dataclass
class Submit:                 # HTTP -> engine: admit and queue a submission
    call: int
    number: int               # the HTTP process's name for the submission
    submission: Submission


@dataclass
class Cancel:                 # HTTP -> engine: its client went away
    number: int


@dataclass
class Ask:                    # HTTP -> engine: one of _EngineSide.questions, with its arguments
    call: int
    question: str
    args: tuple = ()


@dataclass
class Stop:                   # HTTP -> engine: finish and exit
    pass


@dataclass
class Ready:                  # engine -> HTTP: the model is loaded; the engine's limits
    limits: dict


@dataclass
class StartFailed:            # engine -> HTTP: the engine could not start
    error: str
    message: str


@dataclass
class Answer:                 # engine -> HTTP: the answer to a Submit or an Ask
    call: int
    ok: bool
    value: object             # the result; or (error class name, message)


@dataclass
class Events:                 # engine -> HTTP: one step's events
    items: list = field(default_factory=list)   # (number, sequence, event)


@dataclass
class Alive:                  # engine -> HTTP: the heartbeat, with the engine's counters
    counters: dict


@dataclass
class Failed:                 # engine -> HTTP: the scheduler stopped
    message: str


@dataclass
class Stopped:                # engine -> HTTP: the last message
    pass


#: The engine's attributes that the HTTP side reads (the routes and app.py).
LIMITS = ("model_id", "kv_cache", "max_batch_size", "max_queue", "max_input_tokens",
          "max_total_tokens", "max_prompt_chars", "default_max_new_tokens", "vocab_size",
          "special_ids")


def build_engine(settings: dict):
    """Load the model and make the engine the settings ask for (not started). ``settings``:
    the server's options (``options.OPTIONS``; a missing one takes its default), with
    ``adapters_dir`` (None: the course's adapters) and ``model_id``. Every setting is judged
    (``options.check``) before the model loads: ``ValueError`` for one that makes no sense."""
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
    if adapters_dir is None:                      # the course's shipped adapters
        from ..lora import ADAPTERS_DIR as adapters_dir
    options = {name: judged[name] for name in ENGINE_OPTIONS}
    if judged["kv_cache"] == "paged":             # the paged layout's runner (lesson 10)
        options.update(compile=judged["compile"], cuda_graphs=judged["cuda_graphs"],
                       graph_sizes=judged["cuda_graph_sizes"])
    return Engine(model, tokenizer, adapters_dir=adapters_dir, model_id=model_id, **options)


# --- the engine process -----------------------------------------------------------------------

def run_engine_process(conn, settings: dict) -> None:
    """The engine process: build the engine, say ``Ready`` (or why not), then serve commands
    until told to stop or until the HTTP process goes away (its end of the pipe closes).
    Ctrl-C and a SIGTERM sent to the whole process group are left to the HTTP process: it
    drains its requests first, then stops this one (``Stop``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=settings["log_level"].upper(),
                        format="%(levelname)s %(name)s (engine): %(message)s")
    started = time.monotonic()
    try:
        engine = build_engine(settings)
    except ValueError as err:
        conn.send(StartFailed("ValueError", str(err)))
        return
    except Exception as err:
        log.error("the engine could not start:\n%s", traceback.format_exc())
        conn.send(StartFailed("RuntimeError", f"{type(err).__name__}: {err}"))
        return
    sys.setswitchinterval(SWITCH_INTERVAL)
    engine.start()
    startup.report("the engine is ready (%.1f s)", time.monotonic() - started)
    conn.send(Ready({name: getattr(engine, name) for name in LIMITS}))
    _EngineSide(conn, engine).serve()
    # Stopped, and said so. What is left is the interpreter tearing torch and the model down,
    # which took seconds on a busy CPU and does nothing that matters: leave at once.
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
        self._reported_failure = False
        engine.deliver = self.deliver                # every step's events: one message
        #: What the HTTP side may ask (``Ask``), and who answers.
        self.questions = {"snapshot": self.snapshot, "info": engine.info,
                          "adapters_available": engine.adapters_available,
                          "adapters_loaded": engine.adapters_loaded, "tokenize": engine.tokenize}

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
                    self.send(Alive(self.snapshot()))
                    next_beat = time.monotonic() + HEARTBEAT
                if not self.conn.poll(HEARTBEAT):
                    continue
                message = self.conn.recv()
                if isinstance(message, Stop):
                    break
                self.dispatch(message)
        except (EOFError, OSError):          # the HTTP process went away
            pass
        finally:
            self.engine.stop()
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.send(Stopped())

    def dispatch(self, message) -> None:
        if isinstance(message, Submit):
            self.pool.submit(self._answer, message.call, self._submit, message)
        elif isinstance(message, Cancel):
            handle = self.handles.pop(message.number, None)
            if handle is not None:
                self.engine.cancel(handle)
        elif isinstance(message, Ask) and message.question in self.questions:
            self._answer(message.call, self.questions[message.question], *message.args)
        else:
            log.error("unknown message from the HTTP process: %r", message)

    def _answer(self, call: int, function, *args) -> None:
        """Run ``function`` and send its result (or its error) as the answer to ``call``."""
        try:
            self.send(Answer(call, True, function(*args)))
        except errors.EngineError as err:
            self.send(Answer(call, False, (type(err).__name__, err.message)))
        except Exception as err:            # a bug: the HTTP side answers 500, the log says why
            log.error("the engine process failed on a request:\n%s", traceback.format_exc())
            self.send(Answer(call, False, ("RuntimeError", f"{type(err).__name__}: {err}")))

    def snapshot(self) -> dict:
        """The engine's counters, and the submissions this process still keeps."""
        return {**self.engine.snapshot(), "submissions_held": len(self.handles)}

    def _submit(self, message: Submit) -> tuple:
        handle = self.engine.submit(message.submission, tag=message.number)
        self.handles[message.number] = handle
        if handle.finished:              # its last event may have gone out already
            self.handles.pop(message.number, None)
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

    def _check_health(self) -> None:
        if not self._reported_failure and not self.engine.healthy:
            self._reported_failure = True
            self.send(Failed(self.engine._failure or "the engine stopped"))


# --- the HTTP process's side --------------------------------------------------------------------

class EngineProcess:
    """An ``Engine`` in a process of its own, seen from the HTTP process,
    and restarted when it dies. (Lesson 07.)

    The arguments are ``build_engine``'s settings (the server's options). ``start()`` starts
    the process and waits until the model is loaded; ``ValueError`` if the engine refuses its
    options, ``RuntimeError`` if the process fails otherwise. ``stop()`` ends it.
    ``on_give_up(message)`` is called when it has crashed too often to restart again.
    """

    def __init__(self, settings: dict, start_timeout: float = START_TIMEOUT, on_give_up=None):
        self.settings = settings
        self.start_timeout = start_timeout
        self.on_give_up = on_give_up
        self.restarts = 0                     # engine processes started after a crash
        self._crashes: list[float] = []       # when each crash happened
        self._handles: dict[int, Handle] = {}     # submissions in flight, by number
        self._calls: dict[int, Future] = {}
        self._numbers = itertools.count()     # the submissions' numbers
        self._call_ids = itertools.count()    # the messages that wait for an answer
        self._lock = threading.Lock()         # the pipe's sending end, and the maps above
        self._failure: str | None = None
        self._restarting = False
        self._stopping = False
        self._process = None
        #: The counters of the engine processes that died, and the latest ones heard from the
        #: running one: a restart never sets /metrics back.
        self._carried: dict = {}
        self._latest: dict = {}
        self._cut = 0                         # sequences a crash ended (counted as failed)

    # --- life cycle -------------------------------------------------------------------------

    def _start_process(self) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")   # never fork a process with threads
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=run_engine_process,
                                        args=(child_conn, self.settings),
                                        name="helpers.server engine", daemon=True)
        self._process.start()
        child_conn.close()
        for name, value in self._wait_ready(self.start_timeout).items():
            setattr(self, name, value)
        self._failure = None
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
            message = self._conn.recv()
        except EOFError:                  # it died without a word (its log says why)
            self._process.join(10)
            raise RuntimeError(f"the engine process exited with code "
                               f"{self._process.exitcode} before it was ready") from None
        if isinstance(message, Ready):
            return message.limits
        self._process.join(10)
        raise (ValueError if message.error == "ValueError" else RuntimeError)(message.message)

    def start(self) -> "EngineProcess":
        """Start the engine process, unless it runs already, and wait until it is ready."""
        if self._process is None:
            try:
                self._start_process()
            except BaseException:             # refused, failed, or Ctrl-C while loading
                if self._process is not None and self._process.is_alive():
                    self._process.kill()
                    self._process.join(5)
                self._process = None           # a later start() tries again
                raise
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        if self._process is None:             # never started
            return
        try:
            self._send(Stop())
        except (OSError, ValueError):     # it is gone already
            pass
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        reader = getattr(self, "_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout)

    @property
    def healthy(self) -> bool:
        return (self._process is not None and self._process.is_alive()
                and self._failure is None and not self._stopping and not self._restarting
                and time.monotonic() - self._heard < SILENCE)

    # --- what the routes call (contract.EngineClient) -----------------------------------------

    def submit(self, submission: Submission, sink: Sink) -> Handle:
        """``Engine.submit``, in the engine process: one message, answered once. Blocks: call
        it from a worker thread. The events go to ``sink`` from the reader thread."""
        number = next(self._numbers)
        handle = Handle(number, [], 0, [], sink)      # completed by the answer
        with self._lock:
            self._handles[number] = handle    # events may come before the answer does
        try:
            prompts, sequences, seeds = self._call(
                "submit", lambda call: Submit(call, number, submission),
                late=lambda _: self._send(Cancel(number)))
        except BaseException:
            with self._lock:
                self._handles.pop(number, None)
            raise
        handle.prompts, handle.sequences, handle.seeds = prompts, sequences, seeds
        if handle.finished:
            with self._lock:
                self._handles.pop(number, None)
        return handle

    def cancel(self, handle: Handle) -> None:
        if handle.finished or handle.cancelled:
            return
        handle.cancelled = True
        with self._lock:
            self._handles.pop(handle.id, None)          # its client is gone: no more events
        try:
            self._send(Cancel(handle.id))
        except (OSError, ValueError):     # the engine process is gone: nothing runs anyway
            pass

    def snapshot(self) -> dict:
        """The running engine's counters plus those of the engine processes that died before
        it, and every sequence a crash cut counted as failed: they never go down."""
        now = self._ask("snapshot")
        if self._process.is_alive():      # not a dead engine's, already carried
            self._heard_counters(now)
        total = metrics.combine(self._carried, now)
        total["failed"] = {"error": total.get("failed", 0), "engine_crash": self._cut}
        return total

    def _heard_counters(self, counters: dict) -> None:
        with self._lock:         # the heartbeat's and a snapshot's: whichever is further on
            self._latest = metrics.combine(self._latest, counters, max)

    def info(self) -> dict:
        return {**self._ask("info"), "engine": "process", "engine_restarts": self.restarts}

    def adapters_available(self) -> list[str]:
        return self._ask("adapters_available")

    def adapters_loaded(self) -> list[str]:
        return self._ask("adapters_loaded")

    def tokenize(self, text: str) -> list[dict]:
        return self._ask("tokenize", text)

    # --- talking to the engine process -------------------------------------------------------

    def _send(self, message) -> None:
        with self._lock:
            self._conn.send(message)

    def _ask(self, question: str, *args):
        return self._call("ask", lambda call: Ask(call, question, args))

    def _call(self, kind: str, message, late=None):
        """Send ``message(call)`` and wait for its answer, ``ANSWER_SECONDS[kind]`` at most;
        raise the engine's error if it failed, ``Unavailable`` if no answer came. ``late(value)``
        runs if a good answer comes after that: it undoes what nobody waits for any more."""
        stopped = errors.Unavailable("the server is not running (its engine process stopped)")
        if not self.healthy:
            raise stopped
        call = next(self._call_ids)
        future: Future = Future()
        with self._lock:
            self._calls[call] = future
        deadline = time.monotonic() + ANSWER_SECONDS[kind]
        try:
            self._send(message(call))
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
                                             f"{ANSWER_SECONDS[kind]:g} s") from None
        if ok:
            return value
        error, text = value
        kind_of_error = getattr(errors, error, None)
        if isinstance(kind_of_error, type) and issubclass(kind_of_error, errors.EngineError):
            raise kind_of_error(text)
        raise RuntimeError(text)

    def _read(self) -> None:
        """The reader thread: the engine process's answers and events, until it ends."""
        crashed = False
        try:
            while True:
                message = self._conn.recv()
                self._heard = time.monotonic()
                if isinstance(message, Alive):
                    self._heard_counters(message.counters)
                elif isinstance(message, Events):
                    self._deliver(message.items)
                elif isinstance(message, Answer):
                    with self._lock:
                        future = self._calls.pop(message.call, None)
                    if future is not None:
                        future.set_result((message.ok, message.value))
                elif isinstance(message, Failed):
                    self._failure = message.message
                    log.error("the engine process reports: %s", message.message)
                elif isinstance(message, Stopped):
                    break
        except (EOFError, OSError):
            crashed = not self._stopping
            if crashed:
                self._process.join(1)
                log.error("the engine process ended (exit code %s)", self._process.exitcode)
                with self._lock:
                    self._carried = metrics.combine(self._carried, self._latest)
                    self._latest = {}
        finally:
            self._failure = self._failure or "the engine process ended"
            self._fail_everything(crashed)
        if crashed:
            self._restart()

    def _deliver(self, items: list) -> None:
        """One step's events, to their submissions' sinks (those not cancelled meanwhile)."""
        with self._lock:
            known = [(self._handles[number], sequence, event)
                     for number, sequence, event in items if number in self._handles]
        for handle in deliver(known):
            with self._lock:
                self._handles.pop(handle.id, None)

    def _fail_everything(self, crashed: bool) -> None:
        """The engine process is gone: every submission still waiting for it gets an error."""
        with self._lock:
            calls, self._calls = self._calls, {}
            handles = list(self._handles.values())
            self._handles.clear()
        for future in calls.values():
            if not future.done():
                future.set_result((False, ("Unavailable", "the server is not running (its "
                                           "engine process stopped)")))
        why = ("the server's engine process stopped; it is being restarted" if crashed
               else "the server's engine process stopped")
        if crashed:
            self._cut += sum(h.sequences - h.done for h in handles if h.sequences)
        for handle in handles:      # one error ends the whole submission (sequence: None)
            handle.done = handle.sequences
            handle.deliver([(None, ErrorEvent(why, status=503, error_type="unavailable"))])

    def _restart(self) -> None:
        """After a crash: a new engine process, after a pause that doubles with each crash
        in the window (a restart that fails counts as one more); or give up."""
        while not self._stopping:
            now = time.monotonic()
            self._crashes = [t for t in self._crashes if now - t < RESTART_WINDOW] + [now]
            if len(self._crashes) > MAX_RESTARTS:
                message = (f"the engine process crashed {len(self._crashes)} times within "
                           f"{RESTART_WINDOW:g} s: giving up")
                log.error(message)
                if self.on_give_up is not None:
                    self.on_give_up(message)
                return
            self._restarting = True
            pause = RESTART_PAUSE * 2 ** (len(self._crashes) - 1)
            log.warning("restarting the engine process in %g s (crash %d; at most %d "
                        "restarts in %g s)", pause, len(self._crashes), MAX_RESTARTS,
                        RESTART_WINDOW)
            time.sleep(pause)
            if self._stopping:
                break
            try:
                self._start_process()
            except Exception as err:
                if not self._stopping:
                    log.error("the engine process could not be restarted: %s", err)
                continue                           # one more crash
            finally:
                self._restarting = False
            if self._stopping:                     # stop() came while it was starting
                self.stop()
                return
            self.restarts += 1
            log.warning("the engine process is running again (restart %d)", self.restarts)
            return
        self._restarting = False

