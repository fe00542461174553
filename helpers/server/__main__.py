"""Start the lesson-07 server from a terminal. (Lesson 07.)

    python -m helpers.server --port 8080
    python -m helpers.server --host 127.0.0.1 --port 8080 --model bundled \\
        --adapters helpers/assets/adapters --max-batch-size 8 --max-input-tokens 128 \\
        --max-total-tokens 256 --max-queue 64

Then ``lorax.Client("http://127.0.0.1:8080").generate("Jack and Jill", max_new_tokens=20)``.
The server listens on 127.0.0.1 unless told otherwise: it has no authentication, so think
twice before ``--host 0.0.0.0``.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading

from . import options


def build_parser() -> argparse.ArgumentParser:
    """The command's flags: one per server option (``helpers.server.options``), plus two
    that ``serve_in_background`` uses to talk to the process it starts."""
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


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    if os.name != "nt":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # No Nagle delay: small replies (headers, then the body) must not wait for an ACK.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def _watch_parent(server) -> None:
    """Stop the server when the process that started it goes away: its end of our stdin
    closes (it stopped us, exited or was killed), or (POSIX) we get a new parent."""
    stop = threading.Event()

    def exit_soon():
        if stop.is_set():
            return
        stop.set()
        server.should_exit = True
        timer = threading.Timer(15.0, lambda: os._exit(0))   # if a graceful stop hangs
        timer.daemon = True
        timer.start()

    def read_stdin():
        try:
            while sys.stdin.buffer.read(1024):
                pass
        except (OSError, ValueError):
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

    import uvicorn

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

    try:
        engine = (EngineProcess(settings, on_give_up=give_up).start()
                  if args.engine == "process" else build_engine(settings))
    except ValueError as err:
        parser.error(str(err))
    except RuntimeError as err:           # the engine's own log above says where
        print(f"{parser.prog}: error: the engine could not start: {err}", file=sys.stderr)
        sys.exit(1)
    app = create_app(engine)
    if guards.is_loopback(args.host):     # only this machine's names (see LoopbackHosts)
        app.add_middleware(guards.LoopbackHosts)
    sock = _listen(args.host, args.port)
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=3, lifespan="on",
                            http=guards.http_protocol())    # slow headers are cut off
    server = uvicorn.Server(config)
    if args.watch_stdin:
        _watch_parent(server)
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, args.port_file)
    print(f"helpers.server: serving {engine.model_id} on http://{args.host}:{port}", flush=True)
    server.run(sockets=[sock])
    if gave_up:
        sys.exit(f"helpers.server: {gave_up[0]}")      # exit status 1


if __name__ == "__main__":
    main()
