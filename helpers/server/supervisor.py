"""The supervisor of the engine's process: it starts the process, waits until the model is
loaded, and starts it again when it dies (killed, out of memory). (Lesson 07.)

``EngineProcess`` (``engine_process.py``) is a ``Supervisor``. Too many crashes in a row and it
gives up: ``on_give_up(message)`` (the server then exits with status 1). The counters of the
processes that died are carried over, so that ``/metrics`` never goes down.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

from . import metrics
from .contract import ErrorEvent, Handle

log = logging.getLogger("helpers.server")

#: Seconds the HTTP process waits for the engine process to load the model.
START_TIMEOUT = 600.0
#: The first restart comes after RESTART_PAUSE seconds, each next one after twice the pause
#: before; more than MAX_RESTARTS crashes within RESTART_WINDOW seconds: give up.
RESTART_PAUSE = 1.0
MAX_RESTARTS = 3
RESTART_WINDOW = 300.0
STOPPED = "the server is not running (its engine process stopped)"


class Supervisor:
    """Runs ``target(conn, settings)`` in a process of its own. ``start()`` waits for its first
    message, ``Ready`` (``ValueError`` if it refused its settings, ``RuntimeError`` if it
    failed otherwise). The subclass reads the rest (``_read``, in a thread) and keeps what
    waits for an answer (``_calls``, ``_handles``), which ``_fail_everything`` ends."""

    def __init__(self, target, settings: dict, start_timeout: float = START_TIMEOUT,
                 on_give_up=None):
        self.target = target
        self.settings = settings
        self.start_timeout = start_timeout
        self.on_give_up = on_give_up
        self.restarts = 0                     # processes started after a crash
        self._crashes: list[float] = []       # when each crash happened
        self._lock = threading.Lock()         # the pipe's sending end, and what it guards
        self._failure: str | None = None
        self._restarting = False
        self._stopping = False
        self._process = None
        self._carried: dict = {}              # the counters of the processes that died
        self._latest: dict = {}               # the latest ones heard from the running one
        self._cut = 0                         # sequences a crash ended (counted as failed)
        self._handles: dict[int, Handle] = {}     # submissions in flight, by number
        self._calls: dict[int, Future] = {}       # calls waiting for their answer

    def start(self):
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

    def _start_process(self) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")   # never fork a process with threads
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=self.target, args=(child_conn, self.settings),
                                        name="helpers.server engine", daemon=True)
        self._process.start()
        child_conn.close()
        deadline = time.monotonic() + self.start_timeout
        died = "the engine process exited with code {} before it was ready"
        while not self._conn.poll(0.5):
            if not self._process.is_alive():
                raise RuntimeError(died.format(self._process.exitcode))
            if time.monotonic() > deadline:
                self._process.kill()
                raise RuntimeError(f"the engine process was not ready within "
                                   f"{self.start_timeout:g} s")
        try:
            ready = self._conn.recv()
        except EOFError:                  # it died without a word (its log says why)
            self._process.join(10)
            raise RuntimeError(died.format(self._process.exitcode)) from None
        if ready.error is not None:
            self._process.join(10)
            error, text = ready.error
            raise (ValueError if error == "ValueError" else RuntimeError)(text)
        for name, value in ready.limits.items():
            setattr(self, name, value)
        self._failure = None
        self._heard = time.monotonic()        # when the process last said anything
        self._reader = threading.Thread(target=self._read, name="helpers.server events",
                                        daemon=True)
        self._reader.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Wait for the process to end (the subclass tells it to), killing it if it lingers."""
        self._stopping = True
        if self._process is None:             # never started
            return
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        reader = getattr(self, "_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout)

    def snapshot(self) -> dict:
        """The counters of every engine process so far (a sequence a crash cut: failed)."""
        now = self._call("snapshot")
        if self._process.is_alive():      # not a dead engine's, already carried
            self._heard_counters(now)
        total = metrics.combine(self._carried, now)
        total["failed"] = {"error": total.get("failed", 0), "engine_crash": self._cut}
        return total

    def _heard_counters(self, counters: dict) -> None:
        with self._lock:         # the heartbeat's and a snapshot's: whichever is further on
            self._latest = metrics.combine(self._latest, counters, max)

    def _crashed(self) -> None:
        """The pipe closed without a goodbye: carry the counters over."""
        self._process.join(1)
        log.error("the engine process ended (exit code %s)", self._process.exitcode)
        with self._lock:
            self._carried = metrics.combine(self._carried, self._latest)
            self._latest = {}

    def _fail_everything(self, crashed: bool) -> None:
        """The engine process is gone: everything waiting for it gets an error."""
        with self._lock:
            calls, self._calls = self._calls, {}
            handles = list(self._handles.values())
            self._handles.clear()
        for future in calls.values():
            if not future.done():
                future.set_result((False, ("Unavailable", STOPPED)))
        why = "the server's engine process stopped" + ("; it is being restarted" if crashed else "")
        if crashed:
            self._cut += sum(h.sequences - h.done for h in handles if h.sequences)
        for handle in handles:      # one error ends the whole submission (sequence: None)
            handle.done = handle.sequences
            handle.deliver([(None, ErrorEvent(why, status=503, error_type="unavailable"))])

    def _restart(self) -> None:
        """After a crash: a new process after a pause (a restart that fails is one more crash),
        or give up."""
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
