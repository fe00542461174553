"""Communicators: how ranks add up their partial sums, and what that costs. (Lesson 11.)

A rank of a tensor-parallel model calls ``comm.all_reduce(tensor)`` after each row split: the
tensor is replaced, in place, by the sum of every rank's tensor (and returned). Every
communicator counts its calls, the bytes it was handed and the seconds it spent, so that a
lesson can print all-reduces and bytes per decode step and the share of a step spent in them.

- ``ThreadGroup`` holds ranks that are threads of one process (*simulated* ranks):
  ``group.communicator(rank)`` gives each its communicator, and an all-reduce waits until
  every rank has handed in its tensor, adds them up in rank order, and gives every rank the
  same sum. A rank that leaves while another waits for it breaks the group at once, with an
  error that says who waited for whom, instead of a hang.
- ``DistributedCommunicator`` calls ``torch.distributed.all_reduce`` on a process group: gloo
  between processes on a CPU, NCCL between GPUs (``helpers.sharding.processes`` starts them).

``enabled = False`` skips the communication (the tensor keeps this rank's partial sum): the
answers are then wrong, which is the point: it measures what a step costs without it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CommCounts:
    """All-reduces called, bytes handed to them and seconds spent in them. (Lesson 11.)"""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def __sub__(self, other: "CommCounts") -> "CommCounts":
        return CommCounts(self.calls - other.calls, self.bytes - other.bytes,
                          self.seconds - other.seconds)


class Communicator:
    """What every communicator shares: the counters, and ``enabled``. (Lesson 11.)

    ``rank`` and ``world_size`` say who this is; ``all_reduce(tensor)`` sums ``tensor`` over
    the ranks in place and returns it; ``counts()`` is a snapshot of the counters."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.enabled = True
        self._calls, self._bytes, self._seconds = 0, 0, 0.0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"all_reduce takes a tensor, got {type(tensor).__name__}")
        start = time.perf_counter()
        if self.enabled and self.world_size > 1:
            self._sum(tensor)
        self._calls += 1
        self._bytes += tensor.numel() * tensor.element_size()
        self._seconds += time.perf_counter() - start
        return tensor

    def _sum(self, tensor: torch.Tensor) -> None:
        raise NotImplementedError

    def counts(self) -> CommCounts:
        return CommCounts(self._calls, self._bytes, self._seconds)

    def reset(self) -> None:
        self._calls, self._bytes, self._seconds = 0, 0, 0.0


class GroupBroken(RuntimeError):
    """The ranks of a ``ThreadGroup`` did not make the same all-reduces. (Lesson 11.)"""


class LeftWaiting(GroupBroken):
    """A rank waited in an all-reduce for another rank that will never come. (Lesson 11.)"""


class ThreadGroup:
    """Ranks that are threads of one process, and the all-reduce between them. (Lesson 11.)

    ``communicator(rank)`` gives rank ``rank`` its communicator; each rank's thread calls
    ``leave(rank)`` when it is done (``helpers.sharding.simulated`` does), so that a rank still
    waiting for it fails at once. ``timeout`` seconds bound any wait.
    """

    def __init__(self, world_size: int, timeout: float = 60.0):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        self.world_size, self.timeout = world_size, timeout
        self._cond = threading.Condition()
        self.start()

    def start(self) -> None:
        """Make the group ready for a new run of its ranks (every rank present again)."""
        with self._cond:
            self._slots: list = [None] * self.world_size
            self._arrived = 0              # ranks waiting in the current all-reduce
            self._round = 0                # all-reduces completed
            self._sum: torch.Tensor | None = None
            self._calls = [0] * self.world_size
            self._left: dict[int, str] = {}

    def communicator(self, rank: int) -> "ThreadCommunicator":
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be between 0 and {self.world_size - 1}, got {rank}")
        return ThreadCommunicator(self, rank)

    def leave(self, rank: int, why: str = "finished") -> None:
        """Rank ``rank`` is done (``why``: "finished", or the error it raised): any rank that
        waits for it, now or later, fails instead of waiting for ever."""
        with self._cond:
            self._left[rank] = why
            self._cond.notify_all()

    def _broken(self, rank: int) -> LeftWaiting:
        gone = ", ".join(f"rank {r} {why} after {self._calls[r]} all-reduces"
                         for r, why in sorted(self._left.items()))
        return LeftWaiting(f"rank {rank} waits in all-reduce number {self._calls[rank] + 1}, "
                           f"but {gone}: every rank must call all_reduce the same number of "
                           f"times, in the same order")

    def all_reduce(self, rank: int, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place; every rank gets the same sum."""
        with self._cond:
            if self._left:
                raise self._broken(rank)
            if self._slots[rank] is not None:
                raise GroupBroken(f"rank {rank} called all_reduce twice at once")
            self._slots[rank], self._arrived = tensor, self._arrived + 1
            this_round = self._round
            if self._arrived == self.world_size:        # the last to arrive adds them up
                shapes = {tuple(t.shape) for t in self._slots}
                if len(shapes) > 1:
                    self._left[rank] = "handed in a tensor of another shape"
                    self._cond.notify_all()
                    raise GroupBroken(f"the ranks handed all_reduce tensors of different "
                                      f"shapes: {sorted(shapes)}")
                total = self._slots[0].clone()
                for other in self._slots[1:]:
                    total += other                        # in rank order, the same for all
                self._sum, self._slots, self._arrived = total, [None] * self.world_size, 0
                self._round += 1
                self._cond.notify_all()
            else:
                deadline = time.monotonic() + self.timeout
                while self._round == this_round:
                    if self._left:
                        self._slots[rank], self._arrived = None, self._arrived - 1
                        raise self._broken(rank)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise GroupBroken(f"rank {rank} waited {self.timeout:g} s in an "
                                          f"all-reduce for the other ranks")
                    self._cond.wait(min(left, 1.0))
            self._calls[rank] += 1
            tensor.copy_(self._sum)


class ThreadCommunicator(Communicator):
    """One simulated rank's communicator (``ThreadGroup.communicator``). (Lesson 11.)"""

    def __init__(self, group: ThreadGroup, rank: int):
        super().__init__(rank, group.world_size)
        self.group = group

    def _sum(self, tensor: torch.Tensor) -> None:
        self.group.all_reduce(self.rank, tensor)


class DistributedCommunicator(Communicator):
    """A rank process's communicator: ``torch.distributed.all_reduce`` on the default process
    group (initialised before, with gloo or NCCL). (Lesson 11.)"""

    def __init__(self):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialised: call "
                             "init_process_group first")
        super().__init__(dist.get_rank(), dist.get_world_size())
        self._dist = dist

    def _sum(self, tensor: torch.Tensor) -> None:
        self._dist.all_reduce(tensor)
        if tensor.device.type == "cuda":           # the seconds counted include the transfer
            torch.cuda.synchronize(tensor.device)
