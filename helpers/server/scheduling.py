"""The scheduler's helpers: which waiting requests join the batch, and as which batches they
are read. (Lesson 07.)

``Engine.step`` (engine.py) is the loop lesson 07 reads; the small decisions it makes at every
turn live here, beside it, so that the loop reads as the four steps it is.
"""

from __future__ import annotations

from collections import deque

from ..batching import Batch, batch_from_token_ids


def take_waiting(waiting: deque, free: int, stats) -> list:
    """Up to ``free`` requests from the front of the queue, first come first served; those
    whose client went away are dropped on the way (and counted in ``stats["cancelled"]``)."""
    taken = []
    while waiting and len(taken) < free:
        request = waiting.popleft()
        if request.cancelled:
            stats["cancelled"] += 1
            continue
        taken.append(request)
    return taken


def prefill_batches(requests: list, pad_id: int) -> list[tuple[Batch, int]]:
    """The new requests as batches (lesson 03's ``init_batch``, from token ids), each with the
    logits its prefill keeps: the last position only (1), or every position (0) for the
    requests that asked for their prompt's log probabilities, which get a batch each so that
    nobody else's logits are kept (each one's are bounded at admission: MAX_SCORING_BYTES)."""
    scoring = [[r] for r in requests if r.params.prompt_logprobs]
    others = [r for r in requests if not r.params.prompt_logprobs]
    return [(batch_from_token_ids([r.prompt_ids for r in group],
                                  [max(1, r.max_new_tokens) for r in group],
                                  [r.id for r in group], pad_id), keep)
            for group, keep in [(others, 1)] + [(one, 0) for one in scoring] if group]
