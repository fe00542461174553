"""Lesson 07's checks pass the course's functions, say "not written yet" for a stub, and catch
the mistakes learners make in time_stream (TTFT and the gaps between tokens, from a stream)
and generate_all (concurrent requests, answers in request order), each with a hint at its
symptom. Neither check needs a server; the last test runs both functions against one."""

import asyncio
import gc
import time
import warnings

import pytest

from helpers.checks import (check_generate_all, check_time_stream, generate_all_reference,
                            time_stream_reference)
from tests.answers import Exercise
from tests.checking import assert_caught, assert_not_written, assert_passes


# ---- time_stream: typical mistakes -----------------------------------------------------------

def _timed(send, clock, start_after_send=False, start_at_first=False, with_ttft=False,
           since_first=False, keep_special=False, skip_special=False, scale=1.0,
           twice=False):
    start = None if (start_after_send or start_at_first) else clock()
    events = send()
    if start_after_send:
        start = clock()
    stamps, text, final = [], "", ""
    for event in events:
        if skip_special and event.token.special:
            continue
        now = clock()
        if start is None:
            start = now
        stamps.append(now)
        if keep_special or not event.token.special:
            text += event.token.text
        final = event.generated_text or final
    ttft = (stamps[0] - start) * scale
    if with_ttft:
        gaps = [b - a for a, b in zip([start] + stamps, stamps)]
    elif since_first:
        gaps = [s - stamps[0] for s in stamps[1:]]
    else:
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return ttft, [g * scale for g in gaps], text + (final if twice else "")


def stream_clock_started_at_the_first_token(send, clock=time.perf_counter):
    return _timed(send, clock, start_at_first=True)


def stream_clock_started_after_send(send, clock=time.perf_counter):
    return _timed(send, clock, start_after_send=True)


def stream_gaps_starting_with_the_ttft(send, clock=time.perf_counter):
    return _timed(send, clock, with_ttft=True)


def stream_gaps_since_the_first_token(send, clock=time.perf_counter):
    return _timed(send, clock, since_first=True)


def stream_text_with_special_tokens(send, clock=time.perf_counter):
    return _timed(send, clock, keep_special=True)


def stream_special_token_not_timed(send, clock=time.perf_counter):
    return _timed(send, clock, skip_special=True)


def stream_in_milliseconds(send, clock=time.perf_counter):
    return _timed(send, clock, scale=1e3)


def stream_text_twice(send, clock=time.perf_counter):
    return _timed(send, clock, twice=True)


def stream_with_the_machines_clock(send, clock=time.perf_counter):
    return _timed(send, time.perf_counter)


def stream_without_a_clock_argument(send):
    return _timed(send, time.perf_counter)


def stream_read_whole_before_timing(send, clock=time.perf_counter):
    start = clock()
    events = list(send())
    stamps = [clock() for _ in events]
    text = "".join(e.token.text for e in events if not e.token.special)
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])], text


def stream_time_of_the_first_token(send, clock=time.perf_counter):
    ttft, gaps, text = _timed(send, clock)
    return clock() - sum(gaps), gaps, text


def stream_ttft_as_a_string(send, clock=time.perf_counter):
    ttft, gaps, text = _timed(send, clock)
    return f"{ttft:.6f}", gaps, text


def stream_gaps_as_strings(send, clock=time.perf_counter):
    ttft, gaps, text = _timed(send, clock)
    return ttft, [f"{g:.6f}" for g in gaps], text


def stream_as_in_the_lesson(send, clock=time.perf_counter):
    start = clock()
    stamps, text = [], ""
    for event in send():
        stamps.append(clock())
        if not event.token.special:
            text += event.token.text
    return stamps[0] - start, [now - before for before, now in zip(stamps, stamps[1:])], text


def stream_with_next(send, clock=time.perf_counter):
    """Right, written another way: the first event read apart."""
    start = clock()
    events = iter(send())
    first = next(events)
    stamps = [clock()]
    text = "" if first.token.special else first.token.text
    for event in events:
        stamps.append(clock())
        text += "" if event.token.special else event.token.text
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])], text


STREAM_MISTAKES = {
    stream_clock_started_at_the_first_token: "the clock started when the first token arrived",
    stream_clock_started_after_send: "4.0 ms short, the time send() itself took",
    stream_gaps_starting_with_the_ttft: "starts with the TTFT",
    stream_gaps_since_the_first_token: "that is the time since the first token",
    stream_text_with_special_tokens: "a special token: time it like any token",
    stream_special_token_not_timed: "the special token ('<|endoftext|>') is a token too",
    stream_in_milliseconds: "that is in milliseconds",
    stream_text_twice: "text holds the answer twice",
    stream_with_the_machines_clock: "take every time stamp with clock(), the argument",
    stream_without_a_clock_argument: "must take the clock as an argument",
    stream_read_whole_before_timing: "the stream was read to its end (list(...)?)",
    stream_time_of_the_first_token: "the clock's reading when the first token came",
    stream_ttft_as_a_string: "ttft (seconds) should be a number (an int or a float), got str",
    stream_gaps_as_strings: "gap 0 (seconds) should be a number (an int or a float), got str",
}


# ---- generate_all: typical mistakes ----------------------------------------------------------

async def all_one_after_another(aclient, requests):
    return [(await aclient.generate(**request)).generated_text for request in requests]


async def all_in_the_order_they_finish(aclient, requests):
    texts = []
    for next_done in asyncio.as_completed([aclient.generate(**r) for r in requests]):
        texts.append((await next_done).generated_text)
    return texts


async def all_replies_not_texts(aclient, requests):
    return list(await asyncio.gather(*(aclient.generate(**r) for r in requests)))


async def all_prompts_only(aclient, requests):
    replies = await asyncio.gather(*(aclient.generate(r["prompt"], max_new_tokens=r["max_new_tokens"])
                                     for r in requests))
    return [reply.generated_text for reply in replies]


async def all_without_awaiting_the_gather(aclient, requests):
    return asyncio.gather(*(aclient.generate(**r) for r in requests))


async def all_tasks_in_a_set(aclient, requests):
    tasks = {asyncio.ensure_future(aclient.generate(**r)) for r in requests}
    await asyncio.wait(tasks)
    return sorted(task.result().generated_text for task in tasks)


def all_with_asyncio_run(aclient, requests):
    return asyncio.run(generate_all_reference(aclient, requests))


def all_request_as_one_argument(aclient, requests):
    async def go():
        replies = await asyncio.gather(*(aclient.generate(r) for r in requests))
        return [reply.generated_text for reply in replies]
    return go()


async def all_two_at_a_time(aclient, requests):
    texts = []
    for i in range(0, len(requests), 2):
        replies = await asyncio.gather(*(aclient.generate(**r) for r in requests[i:i + 2]))
        texts += [reply.generated_text for reply in replies]
    return texts


async def all_but_the_last_together(aclient, requests):
    if len(requests) < 2:
        return [(await aclient.generate(**r)).generated_text for r in requests]
    replies = list(await asyncio.gather(*(aclient.generate(**r) for r in requests[:-1])))
    replies.append(await aclient.generate(**requests[-1]))
    return [reply.generated_text for reply in replies]


async def all_as_in_the_lesson(aclient, requests):
    replies = await asyncio.gather(*(aclient.generate(**request) for request in requests))
    return [reply.generated_text for reply in replies]


async def all_with_tasks(aclient, requests):
    """Right, written another way: a task per request, awaited in order."""
    tasks = [asyncio.create_task(aclient.generate(**r)) for r in requests]
    return [(await task).generated_text for task in tasks]


GATHER_MISTAKES = {
    all_one_after_another: "went out one after another",
    all_in_the_order_they_finish: "in the order they finished",
    all_replies_not_texts: "reply.generated_text",
    all_prompts_only: "missing or different: {'adapter_id': 'rhymes', 'adapter_source': 'local'}",
    all_without_awaiting_the_gather: "something still to be awaited",
    all_tasks_in_a_set: "all there but in another order",
    all_with_asyncio_run: "define it with `async def`",
    all_request_as_one_argument: "prompt went out as the whole request, a dict",
    all_two_at_a_time: "at most 2 of the 3 requests were in flight at once",
    all_but_the_last_together: "at most 2 of the 3 requests were in flight at once",
}


# ---- the tests -------------------------------------------------------------------------------

@pytest.mark.parametrize("check, solution", [(check_time_stream, time_stream_reference),
                                             (check_generate_all, generate_all_reference)])
def test_check_passes_the_course_function_quickly(check, solution):
    start = time.perf_counter()
    assert_passes(check, solution)
    assert time.perf_counter() - start < 1


@pytest.mark.parametrize("check, solution", [(check_time_stream, time_stream_reference),
                                             (check_generate_all, generate_all_reference)])
def test_check_says_not_written_for_a_stub(check, solution):
    assert_not_written(check, fallback=solution)


def test_an_async_stub_is_not_written_yet():
    async def stub(aclient, requests):
        raise NotImplementedError()
    assert_not_written(check_generate_all, fallback=generate_all_reference)
    from tests.checking import run
    line, returned = run(check_generate_all, stub)
    assert "not written yet" in line and returned is generate_all_reference


def test_other_right_answers_pass():
    for exercise in EXERCISES:
        for right in exercise.right:
            assert_passes(exercise.check, right)


@pytest.mark.parametrize("mistake", STREAM_MISTAKES, ids=lambda f: f.__name__)
def test_time_stream_check_catches(mistake):
    assert_caught(check_time_stream, mistake, symptom=STREAM_MISTAKES[mistake],
                  fallback=time_stream_reference)


@pytest.mark.parametrize("mistake", GATHER_MISTAKES, ids=lambda f: f.__name__)
def test_generate_all_check_catches(mistake):
    assert_caught(check_generate_all, mistake, symptom=GATHER_MISTAKES[mistake],
                  fallback=generate_all_reference)


def test_a_generate_all_that_never_ends_is_stopped_with_a_hint():
    async def waits_forever(aclient, requests):
        await asyncio.Event().wait()

    start = time.perf_counter()
    assert_caught(check_generate_all, waits_forever, symptom="did not finish within 2 s",
                  fallback=generate_all_reference)
    assert time.perf_counter() - start < 3


def test_the_checks_work_inside_a_running_event_loop():
    """A notebook cell runs inside an event loop: the check must still run the coroutine."""
    async def in_a_cell():
        caught = assert_caught(check_generate_all, all_with_asyncio_run,
                               symptom="already run inside an event loop",
                               fallback=generate_all_reference)
        return assert_passes(check_generate_all, generate_all_reference), caught

    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no "coroutine ... was never awaited" either
        passed, _ = asyncio.run(in_a_cell())
        gc.collect()
    assert "right on all 4 cases" in passed


@pytest.mark.filterwarnings("ignore:The `dict` method is deprecated:DeprecationWarning")
def test_both_reference_functions_work_against_the_course_server():
    pytest.importorskip("lorax")
    from lorax import AsyncClient, Client

    from helpers.server import serve_in_background

    server = serve_in_background(name="test-checks-lesson07", threads=1, device="cpu",
                                 max_batch_size=4, env={"HF_HUB_OFFLINE": "1"})
    try:
        client = Client(server.url, timeout=60)
        ttft, gaps, text = time_stream_reference(
            lambda: client.generate_stream("Jack and Jill", max_new_tokens=8, ignore_eos_token=True))
        assert ttft > 0 and len(gaps) == 7 and all(g >= 0 for g in gaps)
        assert text == client.generate("Jack and Jill", max_new_tokens=8,
                                       ignore_eos_token=True).generated_text
        requests = [dict(prompt=p, max_new_tokens=n) for p, n in
                    (("Jack and Jill", 12), ("Humpty Dumpty sat", 3), ("What comes up must", 6))]
        texts = asyncio.run(generate_all_reference(AsyncClient(server.url, timeout=60), requests))
        assert texts == [client.generate(**r).generated_text for r in requests]
    finally:
        server.stop()


# ---- timing read exactly, requests left as they were -----------------------------------------

def stream_reading_the_clock_twice(send, clock=time.perf_counter):
    start, last = clock(), None
    ttft, gaps, text = None, [], ""
    for event in send():
        if last is None:
            ttft = clock() - start
        else:
            gaps.append(clock() - last)
        last = clock()                          # a second reading: later than the first
        if not event.token.special:
            text += event.token.text
    return ttft, gaps, text


def stream_ttft_at_the_first_text(send, clock=time.perf_counter):
    start, ttft = clock(), None
    stamps, text = [], ""
    for event in send():
        now = clock()
        stamps.append(now)
        if not event.token.special:
            if ttft is None:                    # the first token that shows
                ttft = now - start
            text += event.token.text
    return ttft, [b - a for a, b in zip(stamps, stamps[1:])], text


async def all_taking_the_prompt_out(aclient, requests):
    replies = await asyncio.gather(*(aclient.generate(r.pop("prompt"), **r) for r in requests))
    return [reply.generated_text for reply in replies]


TIMING = {
    stream_reading_the_clock_twice: "the clock was read twice for one event",
    stream_ttft_at_the_first_text: "that is the time to the first token that is not special",
}
IN_PLACE = {all_taking_the_prompt_out: "changed its input requests in place"}


EXERCISES = [
    Exercise("time_stream", check_time_stream, (), time_stream_reference,
             right=[stream_as_in_the_lesson, stream_with_next], wrong={**STREAM_MISTAKES, **TIMING}),
    Exercise("generate_all", check_generate_all, (), generate_all_reference,
             right=[all_as_in_the_lesson, all_with_tasks], wrong={**GATHER_MISTAKES, **IN_PLACE}),
]


def stream_text_before_the_clock(send, clock=time.perf_counter):
    start = clock()
    stamps, text = [], ""
    for event in send():
        if not event.token.special:
            text += event.token.text
        stamps.append(clock())
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])], text


STREAM_MISTAKES[stream_text_before_the_clock] = "read clock() first thing for each event"
