"""Pipeline parallelism in brief: the layers split into stages that pass activations on.
(Lesson 11.)

Stage 0 holds the embeddings and the first blocks, the last stage the remaining blocks, the
last layer norm and the output layer. A forward pass runs stage after stage: each stage
*sends* its output, one hidden vector a token, to the next, which *receives* it; the last stage
picks the token and sends it back to stage 0 for the next step. Only the activations cross
between stages, once per stage boundary, far less traffic than tensor parallelism's two
all-reduces a block; but while one stage works on a request, the others wait for it: the
pipeline's *bubble*. Engines fill it with several requests (micro-batches) in flight at once,
so that each stage works on one while the next stage works on another.

Here every stage is a thread of this process and a link between two stages is a queue
(``send`` puts a tensor in, ``recv`` takes it out), which is what ``torch.distributed.send``
and ``recv`` do between processes or GPUs. ``pipeline_generate`` records when each stage
worked on which micro-batch, so that a lesson can draw the bubble.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from .model import KVCache, ShardedGPT2


class StageLink:
    """A one-way link between two stages, counting what crosses it. (Lesson 11.)"""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self.sends, self.bytes = 0, 0

    def send(self, micro_batch: int, tensor: torch.Tensor) -> None:
        self.sends += 1
        self.bytes += tensor.numel() * tensor.element_size()
        self._queue.put((micro_batch, tensor))

    def recv(self, timeout: float = 60.0):
        item = self._queue.get(timeout=timeout)
        if isinstance(item, BaseException):
            raise item
        return item

    def fail(self, error: BaseException) -> None:
        self._queue.put(error)


@dataclass
class PipelineRun:
    """What ``pipeline_generate`` produced. (Lesson 11.)

    ``tokens[m]``: micro-batch m's new tokens (a list per row); ``busy[s]``: stage s's work as
    ``(start, stop, micro_batch)`` in seconds from the start; ``forward_bytes`` and
    ``back_bytes``: activations sent on from stage to stage, and tokens sent back, in all."""

    tokens: list = field(default_factory=list)
    busy: list = field(default_factory=list)
    forward_bytes: int = 0
    back_bytes: int = 0
    seconds: float = 0.0

    @property
    def span(self) -> float:
        return self.seconds

    def idle_share(self) -> float:
        """The share of the stages' time spent waiting: the bubble."""
        worked = sum(stop - start for stage in self.busy for start, stop, _ in stage)
        return 1 - worked / (len(self.busy) * self.span)


@dataclass
class PipelineSchedule:
    """When each stage would work if every stage had a device of its own and each piece of
    work took one unit of time (``pipeline_schedule``): ``busy[s]`` as ``(start, stop,
    micro_batch)`` in units, ``span`` the units in all. (Lesson 11.)"""

    busy: list
    span: float

    def idle_share(self) -> float:
        worked = sum(stop - start for stage in self.busy for start, stop, _ in stage)
        return 1 - worked / (len(self.busy) * self.span)


def pipeline_schedule(stages: int, micro_batches: int, steps: int) -> PipelineSchedule:
    """The schedule of ``pipeline_generate``'s work on ideal devices: stage s works on
    micro-batch m's step t once stage s - 1 has (stage 0: once the last stage has picked m's
    token of step t - 1) and once it is done with its previous piece, in the order the run
    takes them; each piece takes one unit. (Lesson 11.)"""
    for name, value in (("stages", stages), ("micro_batches", micro_batches), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    done: dict = {}                               # (stage, micro-batch, step) -> when it ends
    free = [0.0] * stages                         # when each stage is free again
    busy: list = [[] for _ in range(stages)]
    for t in range(steps):
        for m in range(micro_batches):
            for s in range(stages):
                if s > 0:
                    ready = done[s - 1, m, t]
                else:
                    ready = done[stages - 1, m, t - 1] if t > 0 else 0.0
                start = max(ready, free[s])
                done[s, m, t] = free[s] = start + 1
                busy[s].append((start, start + 1, m))
    return PipelineSchedule(busy, max(free))


def stage_blocks(n_blocks: int, stages: int) -> list[range]:
    """The blocks each of ``stages`` stages holds: consecutive, as even as they come.
    (Lesson 11.)"""
    if isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= n_blocks:
        raise ValueError(f"stages must be between 1 and the {n_blocks} blocks, got {stages!r}")
    bounds = [round(i * n_blocks / stages) for i in range(stages + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


@torch.no_grad()
def pipeline_generate(model: ShardedGPT2, micro_batches: list, new_tokens: int,
                      stages: int = 2) -> PipelineRun:
    """Greedy generation with ``model`` (a whole ``ShardedGPT2``: world size 1) split into
    ``stages`` pipeline stages, one thread each, for the ``micro_batches`` (tensors ``(batch,
    length)`` on the model's device) in flight together. The tokens equal those of the model
    unsplit. (Lesson 11.)"""
    if model.world_size != 1:
        raise ValueError("pipeline_generate splits a whole model: give it a world size of 1")
    if not micro_batches:
        raise ValueError("give at least one micro-batch")
    parts = stage_blocks(len(model.h), stages)
    links = [StageLink() for _ in range(stages)]   # links[s]: stage s -> s + 1; the last: to 0
    run = PipelineRun(tokens=[[] for _ in micro_batches], busy=[[] for _ in range(stages)])
    errors: list = []
    start = time.perf_counter()

    def stage(s: int) -> None:
        caches = [KVCache() for _ in micro_batches]
        blocks = [model.h[i] for i in parts[s]]
        first, last = s == 0, s == stages - 1
        try:
            with torch.no_grad():
                for step in range(new_tokens):
                    for m, prompt in enumerate(micro_batches):
                        if first:
                            x = prompt if step == 0 else links[-1].recv()[1]
                            past = caches[m].held(0) if blocks else 0
                        else:
                            m_in, x = links[s - 1].recv()
                            assert m_in == m, "micro-batches arrive in order"
                        began = time.perf_counter() - start
                        if first:
                            positions = torch.arange(past, past + x.shape[1], device=x.device)
                            x = model.wte(x) + model.wpe(positions)
                        for index, block in enumerate(blocks):
                            x = block(x, caches[m], index)
                        if last:
                            logits = model.ln_f(x[:, -1:]) @ model.wte.weight.T
                            x = logits[:, -1].argmax(dim=-1, keepdim=True)
                            run.tokens[m].append(x)
                        run.busy[s].append((began, time.perf_counter() - start, m))
                        if not last:
                            links[s].send(m, x)
                        elif step < new_tokens - 1:
                            links[-1].send(m, x)      # back to stage 0 for the next step
        except BaseException as error:                # noqa: BLE001  stop the other stages
            errors.append(error)
            for link in links:
                link.fail(error)

    if stages == 1:
        stage(0)
    else:
        threads = [threading.Thread(target=stage, args=(s,), daemon=True) for s in range(stages)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]
    run.seconds = time.perf_counter() - start
    run.tokens = [torch.cat(tokens, dim=1).tolist() for tokens in run.tokens]
    run.forward_bytes = sum(link.bytes for link in links[:-1])
    run.back_bytes = links[-1].bytes
    return run
