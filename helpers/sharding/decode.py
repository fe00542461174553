"""The greedy loop every rank runs, timed and counted step by step. (Lesson 11.)

Lesson 01's loop with the KV cache, for a batch of prompts of equal length (no padding): the
first step reads the prompts (the prefill), each later step feeds one token a row (a decode
step). Every rank of a tensor-parallel model runs the same loop on the same input; their
all-reduces keep them in step, and since everything after the last all-reduce is whole on
every rank, they all pick the same tokens. Around each step the loop reads the clock and the
rank's communicator, so that a run says what each step cost and how much of it was spent in
all-reduces.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from .comm import CommCounts, Communicator


@dataclass
class Decoded:
    """What one rank's greedy loop produced. (Lesson 11.)

    ``tokens``: the new token ids, one list a row; ``step_seconds``: each step's wall time
    (step 0 is the prefill); ``step_comm``: each step's all-reduces (``CommCounts``)."""

    tokens: list = field(default_factory=list)
    step_seconds: list = field(default_factory=list)
    step_comm: list = field(default_factory=list)

    @property
    def decode_seconds(self) -> list[float]:
        """The decode steps' times (the prefill left out)."""
        return self.step_seconds[1:]

    def median_step(self) -> float:
        """The median decode step, seconds."""
        return statistics.median(self.decode_seconds)

    def fastest_step(self) -> tuple[float, float]:
        """The fastest decode step: (its seconds, its seconds in all-reduces). On a busy
        machine the fastest step is the one least disturbed by other programs."""
        if len(self.step_seconds) < 2:
            raise ValueError("no decode step was run: ask for at least 2 new tokens")
        i = min(range(1, len(self.step_seconds)), key=self.step_seconds.__getitem__)
        return self.step_seconds[i], self.step_comm[i].seconds

    def comm_per_decode_step(self) -> CommCounts:
        """All-reduces and bytes of one decode step (the same at every step; ``ValueError`` if
        they differ), with the median seconds spent in them."""
        steps = self.step_comm[1:]
        if not steps:
            raise ValueError("no decode step was run: ask for at least 2 new tokens")
        if len({(c.calls, c.bytes) for c in steps}) > 1:
            raise ValueError(f"the decode steps made different all-reduces: "
                             f"{sorted({(c.calls, c.bytes) for c in steps})}")
        return CommCounts(steps[0].calls, steps[0].bytes,
                          statistics.median(c.seconds for c in steps))

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "step_seconds": self.step_seconds,
                "step_comm": [[c.calls, c.bytes, c.seconds] for c in self.step_comm]}

    @classmethod
    def from_dict(cls, data: dict) -> "Decoded":
        return cls(data["tokens"], data["step_seconds"],
                   [CommCounts(*c) for c in data["step_comm"]])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_decode_input(input_ids, new_tokens, vocab_size: int,
                       positions: int) -> tuple[torch.Tensor, int]:
    """``input_ids`` (a tensor or nested lists) as a tensor of shape ``(batch, length)``, and
    ``new_tokens``, checked against a model of ``vocab_size`` token ids and ``positions``
    positions: a ``ValueError`` that names the argument at fault. (Lesson 11.)"""
    if not isinstance(input_ids, torch.Tensor):
        try:
            input_ids = torch.tensor(input_ids)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(f"input_ids must be rows of token ids of equal length ({error})") \
                from None
    if input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty (batch, length) of token ids, got "
                         f"shape {tuple(input_ids.shape)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == \
            torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"input_ids holds {low if low < 0 else high}: the model's token ids "
                         f"go from 0 to {vocab_size - 1}")
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(f"new_tokens must be a positive integer, got {new_tokens!r}")
    length = input_ids.shape[1]
    if length + new_tokens - 1 > positions:         # the last token chosen is never fed back
        raise ValueError(f"new_tokens={new_tokens} after a prompt of {length} tokens needs "
                         f"{length + new_tokens - 1} positions; the model has {positions}: "
                         f"at most {max(positions - length + 1, 0)} new tokens")
    return input_ids, new_tokens


@torch.no_grad()
def greedy_decode(model, input_ids: torch.Tensor, new_tokens: int,
                  comm: Communicator | None = None) -> Decoded:
    """``new_tokens`` greedy tokens for each row of ``input_ids`` ``(batch, length)`` (rows of
    equal length, no padding), with the KV cache; every step timed, and its all-reduces counted
    when the rank's ``comm`` is given. (Lesson 11.)"""
    input_ids, new_tokens = check_decode_input(input_ids, new_tokens, model.wte.num_embeddings,
                                               model.wpe.num_embeddings)
    input_ids = input_ids.to(model.device)
    out, past, step_input, chosen = Decoded(), None, input_ids, []
    for _ in range(new_tokens):
        before = comm.counts() if comm is not None else CommCounts()
        start = time.perf_counter()
        result = model(input_ids=step_input, past_key_values=past, use_cache=True)
        token = result.logits[:, -1].argmax(dim=-1, keepdim=True)
        _sync(token.device)
        out.step_seconds.append(time.perf_counter() - start)
        out.step_comm.append((comm.counts() if comm is not None else CommCounts()) - before)
        past, step_input = result.past_key_values, token
        chosen.append(token)
    out.tokens = torch.cat(chosen, dim=1).tolist()
    return out
