"""What lesson 08 measures, one call each: the padded cache's width step by step, the time to
first token of requests sent one after another to one paged cache, each step's fastest time
over repeated runs, and what the streams see from those steps (their worst pause between two
tokens, a request's first token). (Lesson 08.)

Timings on a busy computer pick up pauses of their own at random steps. The harnesses that
time therefore run the same work several times and keep the shortest time of each piece: the
work is the same in every run (same rows, same order, same steps), only the pauses differ.
"""

from __future__ import annotations

from collections import deque

from ..batching import (Batch, Request, Trace, _check_batch_size, _check_positive_int,
                        cache_layers, filter_batch, generate_next_token, init_batch,
                        merge_batches)
from .batching import PagedKVCache, generate_paged


def padded_cache_widths(model, tokenizer, requests: list[Request], batch_size: int = 8):
    """Lesson 03's continuous batching (``helpers.batching``'s four functions, no stop at EOS),
    recording what its padded KV cache holds after every decode step. (Lesson 08.)

    Returns ``(token_ids, widths)``: each answer's token ids in request order, and per decode
    step ``(width, real)``: the width of the cache tensor (positions per row) and the number
    of real tokens in each row's cache (its prompt and answer so far, no padding).
    """
    _check_batch_size(batch_size)
    if not requests:
        raise ValueError("requests is empty: give at least one (prompt, max_tokens) pair")
    waiting, answers = deque(range(len(requests))), [None] * len(requests)
    batch, widths = Batch.empty(), []

    def retire(batch):
        for rid, tokens, done in zip(batch.request_ids, batch.token_ids, batch.done):
            if done:
                answers[rid] = tokens
        return filter_batch(batch)

    while waiting or len(batch):
        while waiting and len(batch) < batch_size:
            ids = [waiting.popleft() for _ in range(min(batch_size - len(batch), len(waiting)))]
            new = init_batch(tokenizer, [requests[i] for i in ids], request_ids=ids)
            new = generate_next_token(model, tokenizer, new, stop_at_eos=False)
            batch = merge_batches(batch, retire(new))
        if len(batch) == 0:
            continue
        batch = generate_next_token(model, tokenizer, batch, stop_at_eos=False)
        # The mask has one column more than the cache: the token the next step feeds.
        width = cache_layers(batch.past_key_values)[0][0].shape[2]
        widths.append((width, batch.attention_mask[:, :-1].sum(dim=1).tolist()))
        batch = retire(batch)
    return answers, widths


def _prefill_seconds(trace: Trace, request_id: int) -> float:
    return sum(step.seconds for step in trace.steps
               if step.kind == "prefill" and request_id in step.rows)


def ttft_one_after_another(model, tokenizer, requests: list[Request], *,
                           prefix_caching: bool = True, runs: int = 3, num_blocks: int = 64,
                           block_size: int = 16):
    """The time to first token of each request when the requests come one after another to
    one paged cache (so that a later request can find the blocks an earlier one left), the
    fastest of ``runs`` runs, each on a fresh cache. (Lesson 08.)

    A request's time to first token is the time of its prefill passes (it waits for nobody).
    Returns ``(cache, seconds, token_ids)``: the last run's ``PagedKVCache`` (its counters:
    ``prefill_tokens``, ``cached_tokens``, ``manager.hit_blocks``...), each request's fastest
    time to first token, and each answer's token ids.
    """
    _check_positive_int("runs", runs)
    if not requests:
        raise ValueError("requests is empty: give at least one (prompt, max_tokens) pair")
    best = [float("inf")] * len(requests)
    for _ in range(runs):
        cache = PagedKVCache(model, num_blocks, block_size, prefix_caching=prefix_caching)
        token_ids = []
        for i, request in enumerate(requests):
            trace = Trace()
            generate_paged(model, tokenizer, [request], batch_size=1, cache=cache, trace=trace,
                           progress=False)
            best[i] = min(best[i], _prefill_seconds(trace, 0))
            token_ids.append(trace.token_ids[0])
    return cache, best, token_ids


def fastest_step_times(model, tokenizer, requests: list[Request], runs: int = 3, **options):
    """``generate_paged`` on ``requests`` ``runs`` times (``options`` are its keyword
    arguments, e.g. ``batch_size`` and ``max_prefill_tokens``); returns ``(trace, seconds)``:
    the first run's ``Trace`` and, for each of its steps, the shortest time that step took in
    any run. (Lesson 08.)

    Every run takes the same steps with the same rows (the scheduler does not look at the
    clock): a ``RuntimeError`` says so if they ever differ.
    """
    _check_positive_int("runs", runs)
    if "trace" in options:
        raise ValueError("fastest_step_times makes its own traces: leave trace out")
    options.setdefault("progress", False)
    traces = [Trace() for _ in range(runs)]
    for trace in traces:
        generate_paged(model, tokenizer, requests, trace=trace, **options)
    schedule = [(step.kind, step.rows) for step in traces[0].steps]
    if any([(step.kind, step.rows) for step in trace.steps] != schedule for trace in traces):
        raise RuntimeError("the runs took different steps: their times cannot be compared "
                           "step by step")
    seconds = [min(times) for times in zip(*([step.seconds for step in trace.steps]
                                             for trace in traces))]
    return traces[0], seconds


def _step_seconds(trace: Trace, seconds) -> list[float]:
    if seconds is None:
        return [step.seconds for step in trace.steps]
    seconds = list(seconds)
    if len(seconds) != len(trace.steps):
        raise ValueError(f"got {len(seconds)} step times for a trace of {len(trace.steps)} "
                         f"steps: give one per step")
    return seconds


def worst_inter_token_gap(trace: Trace, request_ids, seconds=None) -> float:
    """The longest wait between two consecutive tokens of any of ``request_ids`` (the
    streams). A stream gets a token at the end of every decode step it takes part in; the
    clock adds up ``seconds`` (one per step of the trace, e.g. from ``fastest_step_times``;
    default: the trace's own times). (Lesson 08.)
    """
    seconds = _step_seconds(trace, seconds)
    seen = {rid: [] for rid in request_ids}
    if not seen:
        raise ValueError("request_ids is empty: name the streams to watch")
    clock = 0.0
    for step, took in zip(trace.steps, seconds):
        clock += took
        if step.kind == "decode":
            for rid in step.rows:
                if rid in seen:
                    seen[rid].append(clock)
    gaps = [b - a for times in seen.values() for a, b in zip(times, times[1:])]
    if not gaps:
        raise ValueError(f"none of the requests {sorted(seen)} got two tokens from decode "
                         f"steps in this trace: there is no gap to measure")
    return max(gaps)


def time_to_first_token(trace: Trace, request_id: int, seconds=None) -> float:
    """From the start of the request's first prefill pass to the end of its last one, decode
    steps of other rows in between included: when its first token comes, counted from when
    its prompt began to be read. ``seconds`` as in ``worst_inter_token_gap``. (Lesson 08.)
    """
    seconds = _step_seconds(trace, seconds)
    clock, start, end = 0.0, None, None
    for step, took in zip(trace.steps, seconds):
        if step.kind == "prefill" and request_id in step.rows:
            start = clock if start is None else start
            end = clock + took
        clock += took
    if start is None:
        raise ValueError(f"request {request_id!r} has no prefill pass in this trace")
    return end - start
