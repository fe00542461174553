"""How every benchmark times things: ``time_in_turns`` runs untimed warm-up rounds, then the
timed ones, each round running every candidate once, in turn (a change of load then hits all of
them alike, and a ratio within a round compares runs made under the same conditions). It keeps
every sample, for the median and the spread (``spread``)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class Candidate:
    """One thing to time: ``run`` is what the clock measures; ``prepare`` runs untimed before
    every run (to put a cache back as it was, say); ``clock``, for a function that times itself,
    takes the seconds from what ``run`` returned instead of the wall clock around the call."""

    run: Callable[[], Any]
    prepare: Callable[[], Any] | None = None
    clock: Callable[[Any], float] | None = None


@dataclass
class Timings:
    """What ``time_in_turns`` measured."""

    seconds: dict[str, list[float]]  # per candidate: one sample per timed repetition
    last: dict[str, Any]             # what each candidate's run returned the last time
    threads: int                     # torch threads while timing

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])

    def spread(self, name: str) -> dict:
        return spread(self.seconds[name], self.threads)

    def ratio_per_run(self, over: str, under: str, digits: int) -> list[float]:
        """``over`` / ``under`` for each repetition (both ran in the same round)."""
        return [round(a / b, digits) for a, b in zip(self.seconds[over], self.seconds[under])]


def spread(values, threads: int | None = None) -> dict:
    """Median, min and max of one figure over the repetitions, the runs themselves, and the
    torch threads they ran with (when given)."""
    values = list(values)
    result = {"median": statistics.median(values), "min": min(values), "max": max(values),
              "runs": [round(v, 6) for v in values]}
    if threads is not None:
        result["threads"] = threads
    return result


def synchronize(device) -> None:
    """Wait for the GPU to finish its queued work (a no-op on the CPU), so timings are real."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def time_in_turns(candidates: dict[str, Candidate | Callable[[], Any]], repeats: int,
                  warmup: int = 1, number: int = 1, device="cpu",
                  progress: str | None = None, alternate: bool = False) -> Timings:
    """Time each candidate (``{name: Candidate or function}``) ``repeats`` times, taking turns,
    after ``warmup`` untimed rounds. With ``number`` > 1 a sample is the mean of that many calls
    in a row; ``progress`` prints a line before each timed run; with ``alternate`` every other
    round runs the candidates in the reverse order."""
    if repeats < 1 or warmup < 0 or number < 1:
        raise ValueError(f"need repeats >= 1, warmup >= 0 and number >= 1, got {repeats}, "
                         f"{warmup} and {number}")
    candidates = {name: c if isinstance(c, Candidate) else Candidate(c)
                  for name, c in candidates.items()}
    if number > 1 and any(c.clock for c in candidates.values()):
        raise ValueError("a candidate with its own clock is timed one call at a time (number=1)")
    seconds = {name: [] for name in candidates}
    last = {}
    for repetition in range(warmup + repeats):
        timed = repetition >= warmup
        order = list(candidates.items())
        for name, candidate in (order[::-1] if alternate and repetition % 2 else order):
            if progress and timed:
                print(f"{progress} repetition {repetition - warmup + 1}/{repeats}: {name} ...",
                      flush=True)
            sample, last[name] = _sample(candidate, number, device)
            if timed:
                seconds[name].append(sample)
    return Timings(seconds, last, torch.get_num_threads())


def _sample(candidate: Candidate, number: int, device) -> tuple[float, Any]:
    """One timed sample of ``candidate``: (seconds per call, what its last call returned)."""
    if candidate.prepare is not None:
        candidate.prepare()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(number):
        result = candidate.run()
    synchronize(device)
    wall = (time.perf_counter() - start) / number
    return (candidate.clock(result) if candidate.clock else wall), result


def traced(driver, *args, **kwargs) -> Candidate:
    """A call of one of the course's batching drivers, timed by its own ``Trace`` (whose clock
    covers the whole run): the candidate returns (answers, trace)."""
    from helpers.batching import Trace

    def run():
        trace = Trace()
        return driver(*args, trace=trace, **kwargs), trace
    return Candidate(run, clock=lambda out: out[1].seconds)


def timed_once(fn: Callable[[], Any], device="cpu") -> tuple[Any, float]:
    """One call of ``fn``, not repeated (a set-up, a compilation): what it returned and its
    seconds."""
    return _sample(Candidate(fn), 1, device)[::-1]


def calls_per_sample(fn: Callable[[], Any], at_least_s: float = 5e-4) -> int:
    """How many calls of ``fn`` make one timing sample of at least ``at_least_s`` seconds
    (a single call of a few microseconds is below what one clock reading can resolve)."""
    once = time_in_turns({"once": fn}, repeats=1).seconds["once"][0]
    return max(1, int(at_least_s / max(once, 1e-7)) + 1)


def crop_cache(cache, length: int) -> None:
    """Crop a ``DynamicCache`` back to ``length`` positions, so that every timed step sees the
    same cache. (transformers 5: ``crop(-n)`` removes the last n positions.)"""
    extra = cache.get_seq_length() - length
    if extra < 0:
        raise RuntimeError(f"the cache holds {cache.get_seq_length()} positions, fewer than "
                           f"the {length} to crop it to")
    cache.crop(-extra)


def busy_share(window: float) -> float | None:
    """How busy the machine's CPUs were over the next ``window`` seconds, from 0 (idle) to 1
    (every core busy), read from ``/proc/stat``; None where there is no such file."""
    def totals():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)       # idle + iowait
        return sum(fields), idle

    try:
        total, idle = totals()
        time.sleep(window)
        total2, idle2 = totals()
    except OSError:
        return None
    return 1 - (idle2 - idle) / max(1, total2 - total)


def wait_until_idle(below: float = 0.15, window: float = 0.25, at_most: float = 5.0) -> float:
    """Wait until the CPUs are nearly idle (busy share under ``below`` in a ``window``), at
    most ``at_most`` seconds; returns the seconds waited. For benchmarks that let servers take
    turns: a server may keep a core busy after its last answer (vLLM's processes poll for
    about a second before they sleep), and the next server's run must not pay for it."""
    start = time.perf_counter()
    while time.perf_counter() - start < at_most:
        share = busy_share(window)
        if share is None or share < below:
            break
    return time.perf_counter() - start
