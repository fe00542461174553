"""Start the lesson-07 server from a terminal: it listens on 127.0.0.1 unless told otherwise
(it has no authentication). (Lesson 07.)

    python -m helpers.server --port 8080 --max-batch-size 8    # --help lists every option
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time

import uvicorn

from . import options, startup
from .background import bind

log = logging.getLogger("helpers.server")


def build_parser() -> argparse.ArgumentParser:
    """One flag per server option, and two for ``serve_in_background``."""
    parser = argparse.ArgumentParser(
        prog="python -m helpers.server",
        description="A LoRAX-compatible server: continuous batching, one LoRA adapter per "
                    "request, JSON mode (lesson 07 of Efficiently Serving LLMs).")
    options.add_arguments(parser)
    parser.add_argument("--port-file", default=None,
                        help="write the port actually used to this file once listening")
    parser.add_argument("--watch-stdin", action="store_true",
                        help="exit when standard input closes or the parent process dies (used "
                             "by serve_in_background: the server ends with its notebook)")
    return parser


class Server(uvicorn.Server):
    """uvicorn's server, stopping as TGI and vLLM do: on SIGTERM or SIGINT it admits nothing
    new (503), gives the requests running ``drain`` seconds, ends the others with an error,
    then exits with status 0 (uvicorn would raise the signal again: a traceback, or -15)."""

    def __init__(self, config, runs, drain: float):
        super().__init__(config)
        self.runs, self.drain = runs, drain
        self.deadline: float | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.deadline is None:
            log.warning("stopping: %d request(s) running get %g s to finish",
                        len(self.runs.active), self.drain)
            self.runs.stopping = True
            self.deadline = time.monotonic() + self.drain
        else:                                  # a second Ctrl-C: end them now
            self.stop_now()

    def stop_now(self) -> None:
        """Stop without waiting for the requests running (from any thread)."""
        self.runs.stopping = True
        self.deadline = 0.0

    async def on_tick(self, counter: int) -> bool:
        if self.deadline is not None and not self.should_exit and (
                not self.runs.active or time.monotonic() >= self.deadline):
            self.runs.end("the server is shutting down")
            self.should_exit = True
        return await super().on_tick(counter)


def _watch_parent(server) -> None:
    """Stop the server when the process that started it goes away: our stdin closes, or (POSIX)
    we get a new parent."""
    stop = threading.Event()

    def exit_soon():
        if stop.is_set():
            return
        stop.set()
        server.stop_now()
        timer = threading.Timer(15.0, lambda: os._exit(0))   # if a graceful stop hangs
        timer.daemon = True
        timer.start()

    def read_stdin():
        with contextlib.suppress(OSError, ValueError):
            while sys.stdin.buffer.read(1024):
                pass
        exit_soon()

    def poll_parent(parent: int):
        while not stop.wait(2.0):
            if os.getppid() != parent:    # the parent died and we were adopted
                exit_soon()

    threading.Thread(target=read_stdin, daemon=True).start()
    if os.name == "posix":
        threading.Thread(target=poll_parent, args=(os.getppid(),), daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # Until the server runs, SIGTERM stops the start-up as Ctrl-C does: quietly.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        serve(parser, args)
    except KeyboardInterrupt:
        print(f"{parser.prog}: stopped before it was ready", file=sys.stderr)


def serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    try:                                  # every flag checked before anything loads
        if args.threads is not None:
            options.torch_threads(args.threads, "cpu")
        if not args.drain_seconds >= 0:
            raise ValueError(f"--drain-seconds {args.drain_seconds}: must be 0 or more")
        sock = bind(args.host, args.port)
    except ValueError as err:
        parser.error(str(err))

    from . import guards
    from .app import create_app
    from .engine_process import EngineProcess, build_engine

    settings = {name: getattr(args, name) for name in
                ("model", "device", "dtype", "threads", "kv_cache", "compile", "cuda_graphs",
                 "cuda_graph_sizes", "log_level", *options.ENGINE_OPTIONS)}
    settings["adapters_dir"] = args.adapters      # None: the course's (build_engine says which)
    settings["model_id"] = args.model or os.environ.get("COURSE_MODEL") or "bundled"
    gave_up = []

    def give_up(message: str) -> None:   # the engine process crashed too often: stop, loudly
        gave_up.append(message)
        server.should_exit = True

    began = time.monotonic()
    try:
        if args.engine == "process":
            engine = EngineProcess(settings, on_give_up=give_up).start()
        else:
            engine = build_engine(settings)
            startup.report("the engine is ready (%.1f s)", time.monotonic() - began)
    except ValueError as err:
        parser.error(str(err))
    except RuntimeError as err:           # the engine's own log above says where
        print(f"{parser.prog}: error: the engine could not start: {err}", file=sys.stderr)
        sys.exit(1)
    try:
        app = create_app(engine)
        if guards.is_loopback(args.host):     # only this machine's names (see LoopbackHosts)
            app.add_middleware(guards.LoopbackHosts)
        sock.listen(128)
        port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level=args.log_level, access_log=False,
                                timeout_graceful_shutdown=3, lifespan="on",
                                http=guards.http_protocol())    # slow headers are cut off
        server = Server(config, app.state.runs, args.drain_seconds)
        if args.watch_stdin:
            _watch_parent(server)
        if args.port_file:
            tmp = args.port_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(str(port))
            os.replace(tmp, args.port_file)
        print(f"helpers.server: serving {engine.model_id} on http://{args.host}:{port}",
              flush=True)
        server.run(sockets=[sock])
    finally:
        engine.stop()                     # also when the start-up was interrupted
    if gave_up:
        sys.exit(f"helpers.server: {gave_up[0]}")      # exit status 1


if __name__ == "__main__":
    main()
