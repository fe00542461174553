"""One rank of a tensor-parallel model, as a process of its own. (Lesson 11.)

    python -m helpers.sharding.worker --rank 0 --world-size 2 --store /tmp/helpers-ranks-x/store

``helpers.sharding.processes.start_ranks`` starts one of these per rank; nobody needs to start
one by hand. The rank joins the process group (``torch.distributed`` with gloo on a CPU, NCCL
on a GPU of its own) through the store file its parent named, reads only its own slices of the
model from the checkpoint (``load_shard``), says it is ready, and then answers commands.

The conversation with the parent is one JSON object a line: commands on standard input,
answers on standard output (``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``).
Anything else the process prints goes to standard error, which the parent keeps in a log.
Standard input is also the lifeline: when it closes (the parent stopped the group, or the
notebook's kernel ended in any way, a crash included), the process exits at once, whatever it
is doing, so no rank outlives the notebook that started it.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
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


def _lifeline(commands: queue.Queue) -> None:
    """Read commands from stdin; exit the process the moment stdin closes."""
    for line in sys.stdin:
        if line.strip():
            commands.put(line)
    os._exit(0)


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
    args = parser.parse_args(argv)

    answers = os.fdopen(os.dup(1), "w", buffering=1)   # the protocol's own channel
    os.dup2(2, 1)                                      # stray prints go to the log
    commands: queue.Queue = queue.Queue()
    threading.Thread(target=_lifeline, args=(commands,), daemon=True).start()

    def answer(**fields) -> None:
        answers.write(json.dumps(fields) + "\n")

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
    answer(ok=True, op="ready", rank=args.rank, pid=os.getpid(), device=str(device),
           weight_bytes=weight_bytes(model), bytes_read=bytes_read, rss_bytes=rss_bytes(),
           seconds=time.perf_counter() - started)

    while True:
        command = json.loads(commands.get())
        op = command.get("op")
        try:
            if op == "generate":
                comm.enabled = bool(command.get("communicate", True))
                ids = torch.tensor(command["input_ids"], device=device)
                run = greedy_decode(model, ids, int(command["new_tokens"]), comm)
                comm.enabled = True
                answer(ok=True, op=op, **run.as_dict())
            elif op == "allreduce":
                tensor = torch.ones(int(command["numel"]), device=device)
                seconds = []
                for _ in range(int(command.get("repeats", 20))):
                    start = time.perf_counter()
                    comm.all_reduce(tensor)
                    seconds.append(time.perf_counter() - start)
                    tensor.fill_(1.0)
                answer(ok=True, op=op, seconds=seconds)
            elif op == "memory":
                answer(ok=True, op=op, rss_bytes=rss_bytes(), weight_bytes=weight_bytes(model))
            elif op == "stop":
                answer(ok=True, op=op)
                dist.destroy_process_group()
                return
            else:
                answer(ok=False, op=op, error=f"unknown command {op!r}")
        except Exception as error:              # reported to the parent, which stops the group
            traceback.print_exc()
            answer(ok=False, op=op, error=f"{type(error).__name__}: {error}")


if __name__ == "__main__":
    main()
