"""One rank of a tensor-parallel model, as a process of its own. (Lesson 11.)

    python -m helpers.sharding.worker --rank 0 --world-size 2 --store /tmp/helpers-ranks-x/store

``helpers.sharding.processes.start_ranks`` starts one of these per rank; nobody needs to start
one by hand. The rank joins the process group (``torch.distributed`` with gloo on a CPU, NCCL
on a GPU of its own) through the store file its parent named, reads only its own slices of the
model from the checkpoint (``load_shard``), says it is ready, and then answers commands.

The conversation with the parent is one JSON object a line: commands on standard input, each
with an ``id``, and answers on standard output with the same ``id`` (``{"ok": true, ...}`` or
``{"ok": false, "error": ...}``; the ready answer's ``id`` is 0), so that the parent can tell a
late answer to a command it gave up on (an interrupted cell) from the one it waits for.
Between answers the rank says ``{"alive": true}`` every ``--heartbeat`` seconds, from a thread
of its own, even while its main thread waits in an all-reduce: a rank that falls silent is hung
or stopped, and the parent can name it. Anything else the process prints goes to standard
error, which the parent keeps in a log.

The rank ends at once, whatever it is doing, when its standard input closes (the parent
stopped the group, or the notebook's kernel ended in any way, a crash included) or when its
parent process is gone (a child the kernel had forked may hold standard input open); it then
removes the group's folder, so no rank and no folder outlive the notebook that started them.
It ignores SIGINT: the notebook's Interrupt button (and Ctrl-C at a terminal) signals the
kernel's whole process group, and what an interrupt means for the group is the parent's call.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta


def rss_bytes() -> int:
    """This process's resident memory (what it holds in RAM now), bytes; on systems without
    /proc, its peak instead. (Lesson 11.)"""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _lifeline(commands: queue.Queue, end) -> None:
    """Read commands from stdin; end the process the moment stdin closes."""
    for line in sys.stdin:
        if line.strip():
            commands.put(line)
    end()


def _heartbeat(seconds: float, parent: int | None, say, end) -> None:
    """Say the rank is alive every ``seconds``; end the process once its parent is gone (it then
    has another parent: the system's first process, or a reaper)."""
    while parent is None or os.getppid() == parent:
        try:
            say(alive=True)
        except OSError:                         # nobody reads the answers any more
            break
        time.sleep(seconds)
    end()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="one rank of a tensor-parallel model")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--store", required=True, help="the store file the ranks meet at")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--model", default=None, help="folder of the checkpoint (bundled)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a collective may wait for the other ranks")
    parser.add_argument("--heartbeat", type=float, default=0.5,
                        help="seconds between the rank's signs of life")
    parser.add_argument("--parent", type=int, default=None,
                        help="the process id of the notebook: the rank ends with it")
    parser.add_argument("--workdir", default=None,
                        help="the group's folder, removed when the rank ends")
    args = parser.parse_args(argv)

    signal.signal(signal.SIGINT, signal.SIG_IGN)      # an interrupt is the parent's to handle
    answers = os.fdopen(os.dup(1), "w", buffering=1)   # the protocol's own channel
    os.dup2(2, 1)                                      # stray prints go to the log
    commands: queue.Queue = queue.Queue()
    writing = threading.Lock()

    def answer(**fields) -> None:
        with writing:                                  # one line at a time, from two threads
            answers.write(json.dumps(fields) + "\n")

    def end() -> None:
        if args.workdir:
            shutil.rmtree(args.workdir, ignore_errors=True)
        os._exit(0)

    threading.Thread(target=_lifeline, args=(commands, end), daemon=True).start()
    threading.Thread(target=_heartbeat, args=(args.heartbeat, args.parent, answer, end),
                     daemon=True).start()

    started = time.perf_counter()
    import torch
    import torch.distributed as dist

    from ..models import resolve_model_name
    from .comm import DistributedCommunicator
    from .decode import greedy_decode
    from .model import load_shard, weight_bytes

    torch.set_num_threads(args.threads)
    device = torch.device(f"cuda:{args.rank}" if args.backend == "nccl" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.FileStore(args.store, args.world_size)
    dist.init_process_group(args.backend, store=store, rank=args.rank,
                            world_size=args.world_size, timeout=timedelta(seconds=args.timeout))
    comm = DistributedCommunicator()
    model, bytes_read = load_shard(resolve_model_name(args.model), args.rank, args.world_size,
                                   comm, device=str(device))
    answer(ok=True, op="ready", id=0, rank=args.rank, pid=os.getpid(), device=str(device),
           weight_bytes=weight_bytes(model), bytes_read=bytes_read, rss_bytes=rss_bytes(),
           seconds=time.perf_counter() - started)

    while True:
        command = json.loads(commands.get())
        op = command.get("op")
        reply = functools.partial(answer, op=op, id=command.get("id"))   # the command's id
        try:
            if op == "generate":
                comm.enabled = bool(command.get("communicate", True))
                ids = torch.tensor(command["input_ids"], device=device)
                run = greedy_decode(model, ids, int(command["new_tokens"]), comm)
                comm.enabled = True
                reply(ok=True, **run.as_dict())
            elif op == "allreduce":
                tensor = torch.ones(int(command["numel"]), device=device)
                seconds = []
                for _ in range(int(command.get("repeats", 20))):
                    start = time.perf_counter()
                    comm.all_reduce(tensor)
                    seconds.append(time.perf_counter() - start)
                    tensor.fill_(1.0)
                reply(ok=True, seconds=seconds)
            elif op == "memory":
                reply(ok=True, rss_bytes=rss_bytes(), weight_bytes=weight_bytes(model))
            elif op == "stop":
                reply(ok=True)
                dist.destroy_process_group()
                return
            else:
                reply(ok=False, error=f"unknown command {op!r}")
        except Exception as error:              # reported to the parent, which stops the group
            traceback.print_exc()
            reply(ok=False, error=f"{type(error).__name__}: {error}")


if __name__ == "__main__":
    main()
