"""Tensor parallelism with every rank in one process: one thread per rank. (Lesson 11.)

The simplest way to see a sharded model work before any process is started: the ranks' models
(``shard_model``) all live in the notebook, each runs in a thread of its own, and a
``ThreadGroup`` adds up their partial sums. The arithmetic is exactly that of ranks in
separate processes or on separate GPUs; only the time means nothing, since the threads share
the same cores and wait for each other.
"""

from __future__ import annotations

import threading

import torch

from .comm import LeftWaiting, ThreadGroup
from .decode import Decoded, greedy_decode
from .model import ShardedMLP, shard_model, weight_bytes
from .plan import check_world_size, split_qkv


def run_in_threads(group: ThreadGroup, fn, comms: list | None = None) -> list:
    """``fn(rank, comm)`` for every rank of ``group`` at once, one thread each, with the
    rank's communicator (``comms[rank]``, new ones when not given); the results in rank
    order. If a rank raises, the ranks
    waiting for it stop too, and its exception is raised here (the first rank's whose error is
    not only that it was left waiting). (Lesson 11.)"""
    group.start()
    comms = comms or [group.communicator(rank) for rank in range(group.world_size)]
    results, errors = [None] * group.world_size, [None] * group.world_size

    def one(rank):
        why = "finished"
        try:
            with torch.no_grad():                # (grad mode is per thread)
                results[rank] = fn(rank, comms[rank])
        except BaseException as error:           # noqa: BLE001  handed to the caller below
            errors[rank], why = error, f"raised {type(error).__name__}"
        finally:
            group.leave(rank, why)

    threads = [threading.Thread(target=one, args=(rank,), name=f"rank {rank}", daemon=True)
               for rank in range(group.world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    raised = [e for e in errors if e is not None]
    if raised:
        causes = [e for e in raised if not isinstance(e, LeftWaiting)]
        raise (causes or raised)[0]
    return results


class SimulatedTP:
    """``world_size`` ranks of a GPT-2 ``model``, each a thread of this process. (Lesson 11.)

    ``ranks[r]`` is rank r's model and ``comms[r]`` its communicator. ``generate(input_ids,
    new_tokens)`` runs the greedy loop on every rank and returns rank 0's ``Decoded`` after
    checking that every rank chose the same tokens; ``run(fn)`` runs ``fn(rank, model, comm)``
    on every rank and returns the results in rank order. ``split_qkv`` and ``mlp_class`` are
    passed to ``shard_model``. ``ValueError`` when the world size does not divide the heads or
    the MLP's width.
    """

    def __init__(self, model, world_size: int, *, split_qkv=split_qkv, mlp_class=ShardedMLP,
                 timeout: float = 60.0):
        check_world_size(model.config, world_size)
        self.world_size = world_size
        self.group = ThreadGroup(world_size, timeout=timeout)
        self.comms = [self.group.communicator(rank) for rank in range(world_size)]
        self.ranks = [shard_model(model, rank, world_size, comm, split_qkv=split_qkv,
                                  mlp_class=mlp_class)
                      for rank, comm in enumerate(self.comms)]

    def run(self, fn) -> list:
        """``fn(rank, model, comm)`` on every rank at once, one thread each; the results in
        rank order (see ``run_in_threads``)."""
        return run_in_threads(self.group, lambda rank, comm: fn(rank, self.ranks[rank], comm),
                              self.comms)

    def generate(self, input_ids: torch.Tensor, new_tokens: int) -> Decoded:
        """Every rank's greedy loop on ``input_ids`` ``(batch, length)``; rank 0's result.
        ``RuntimeError`` if the ranks chose different tokens."""
        runs = self.run(lambda rank, model, comm: greedy_decode(model, input_ids, new_tokens,
                                                                comm))
        for rank, run in enumerate(runs[1:], 1):
            if run.tokens != runs[0].tokens:
                raise RuntimeError(f"rank {rank} chose other tokens than rank 0")
        return runs[0]

    def weight_bytes(self) -> list[int]:
        """The bytes of weights each rank holds."""
        return [weight_bytes(model) for model in self.ranks]
