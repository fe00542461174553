"""Admission: which waiting requests join the batch, in which order. (Lesson 07.)

``Engine.step`` (engine.py) calls ``take_waiting`` once a turn. The policy is the order in
which the queue is read; the KV layout says whether there is room for each request
(``kv.py``); the free slots say how many may join. The policy is the server's
``--admission`` option:

* ``fcfs``: first come, first served (the default, as in vLLM and TGI);
* ``shortest``: the shortest prompt first (a short request is not stuck behind long ones; a
  long one may wait while short ones keep coming).

Either way, a request the KV layout cannot hold yet ends the turn's admission: with ``fcfs``
nothing overtakes it, so a large request is never starved by small ones.
"""

from __future__ import annotations


def first_come(waiting):
    """The request that came first."""
    return waiting[0]


def shortest_prompt(waiting):
    """The request with the shortest prompt (the first of them, on a tie)."""
    return min(waiting, key=lambda sequence: len(sequence.prompt_ids))


POLICIES = {"fcfs": first_come, "shortest": shortest_prompt}


def take_waiting(waiting, free: int, fits, policy, stats) -> list:
    """Up to ``free`` requests taken from ``waiting`` (a deque) in the order ``policy`` picks
    them, while ``fits(request)`` finds room for each (it reserves that room); those whose
    client went away are dropped on the way (and counted in ``stats["cancelled"]``)."""
    taken = []
    while waiting and len(taken) < free:
        sequence = policy(waiting)
        if sequence.cancelled:
            waiting.remove(sequence)
            stats["cancelled"] += 1
            continue
        if not fits(sequence):
            break
        waiting.remove(sequence)
        taken.append(sequence)
    return taken
