"""The engine in a process of its own (``helpers.server.engine_process``): the same answers as
the engine in a thread, its errors carried across, nothing left behind in the engine process,
and a clear failure when that process dies.

The server (``python -m helpers.server``) runs this way by default, so ``test_server.py``,
``test_clients.py``, ``test_hardening.py`` and ``test_attacks.py`` test it through HTTP too.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from helpers.lora import ADAPTERS_DIR
from helpers.server.contract import (ErrorEvent, GenerationParams, PromptEvent, Submission,
                                     TokenEvent)
from helpers.server.engine_process import EngineProcess
from helpers.server.errors import InvalidRequest, NotFound, Unavailable
from helpers.server.options import DEFAULTS, ENGINE_OPTIONS

from .conftest import COURSE_PROMPTS
from .test_engine import _last, expected_ids, run, sink_to, tokens_of


def nowhere(events):
    """A sink for a submission whose events nobody reads."""

pytestmark = pytest.mark.usefixtures("one_thread")   # see tests/conftest.py


def settings(**changes) -> dict:
    values = {name: DEFAULTS[name] for name in ENGINE_OPTIONS}
    values.update(model=None, device="cpu", dtype=None, threads=1, kv_cache="contiguous",
                  log_level="warning", adapters_dir=ADAPTERS_DIR, model_id="bundled",
                  max_batch_size=4, max_queue=16)
    values.update(changes)
    return values


@pytest.fixture(scope="module")
def engine():
    engine = EngineProcess(settings()).start()
    yield engine
    engine.stop()
    assert not engine._process.is_alive()


@pytest.fixture(scope="module")
def reference():
    from helpers import load_model

    return load_model(device="cpu")


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_greedy_answers_are_the_threads_engines(engine, reference):
    requests = [(p, GenerationParams(max_new_tokens=n))
                for p, n in zip(COURSE_PROMPTS, [3, 9, 17, 5, 12])]
    for (prompt, params), events in zip(requests, run(engine, requests)):
        assert tokens_of(events) == expected_ids(reference, prompt, params.max_new_tokens)
        assert events[-1].finish.prompt_tokens == len(reference[1](prompt)["input_ids"])


def test_scores_samples_and_biases_cross_the_process(engine, reference):
    """Prompt log probabilities, seeded sampling and logit_bias: the engine process gives what
    the engine in this process gives."""
    from helpers.server.engine import Engine

    model, tokenizer = reference
    here = Engine(model, tokenizer, adapters_dir=ADAPTERS_DIR, max_batch_size=4).start()
    requests = [
        ("Jack and Jill", GenerationParams(max_new_tokens=3, prompt_logprobs=True)),
        ("Humpty Dumpty sat", GenerationParams(max_new_tokens=8, do_sample=True, seed=7,
                                               temperature=0.9, top_k=20)),
        ("The rain in Spain", GenerationParams(max_new_tokens=4, logit_bias={262: 100.0})),
    ]
    try:
        want = run(here, requests)
    finally:
        here.stop()
    got = run(engine, requests)
    assert isinstance(got[0][0], PromptEvent) and got[0][0].tokens[0]["logprob"] is None
    assert got[0][0].tokens == want[0][0].tokens
    for mine, theirs in zip(got, want):
        assert tokens_of(mine) == tokens_of(theirs)
    assert set(tokens_of(got[2])) == {262}


def test_the_engines_errors_are_raised_here(engine):
    with pytest.raises(InvalidRequest, match="max-total-tokens"):
        engine.submit(Submission(GenerationParams(max_new_tokens=10_000), ["Jack and Jill"]),
                      nowhere)
    with pytest.raises(InvalidRequest, match="empty"):
        engine.submit(Submission(GenerationParams(), [""]), nowhere)
    with pytest.raises(NotFound):
        engine.submit(Submission(GenerationParams(adapter_id="no-such-adapter"),
                                 ["Jack and Jill"]), nowhere)
    assert engine.healthy and not engine._handles


def test_a_nan_row_fails_alone_across_the_process(engine, reference):
    broken = GenerationParams(max_new_tokens=5, do_sample=True, temperature=1e-40, seed=1)
    good = GenerationParams(max_new_tokens=6)
    results = run(engine, [("Jack and Jill", broken), (COURSE_PROMPTS[0], good)])
    assert isinstance(results[0][-1], ErrorEvent) and "NaN" in results[0][-1].message
    assert tokens_of(results[1]) == expected_ids(reference, COURSE_PROMPTS[0], 6)


def test_nothing_is_kept_once_submissions_finish(engine):
    """Each side keeps a submission (its handle; in the engine process its requests, grammars
    and adapter) until its last event, and not longer: nothing piles up."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}}
    requests = [("Jack and Jill", GenerationParams(max_new_tokens=30, grammar=("json", schema)))
                for _ in range(3)] + [("Jack", GenerationParams(max_new_tokens=2))]
    run(engine, requests)
    assert not engine._handles
    assert wait_for(lambda: engine.snapshot()["running"] == 0)


def test_cancel_reaches_the_engine_process(engine):
    before = engine.snapshot().get("cancelled", 0)

    async def main():
        queue = asyncio.Queue()
        params = GenerationParams(max_new_tokens=200, ignore_eos_token=True)
        handle = engine.submit(Submission(params, ["Jack and Jill"]),
                               sink_to(asyncio.get_running_loop(), queue))
        await queue.get()                  # it is running
        engine.cancel(handle)
        return handle

    handle = asyncio.run(main())
    assert wait_for(lambda: engine.snapshot().get("cancelled", 0) == before + 1)
    assert wait_for(lambda: engine.snapshot()["running"] == 0)
    assert handle.cancelled and not handle.finished
    assert not engine._handles             # nothing is kept for it on either side
    assert engine._call("snapshot")["running"] == 0


def test_a_dead_engine_process_fails_its_requests_and_is_restarted():
    """The engine process dies mid-answer: its request fails with a 503 that says so, the
    engine is unhealthy while a new process starts, then serves again, and counts the
    restart."""
    engine = EngineProcess(settings()).start()
    events = []

    async def main():
        queue = asyncio.Queue()
        params = GenerationParams(max_new_tokens=250, ignore_eos_token=True)
        engine.submit(Submission(params, ["Jack and Jill"]),
                      sink_to(asyncio.get_running_loop(), queue))
        events.append((await queue.get())[1])
        engine._process.kill()                       # the engine process dies mid-answer
        while not _last(events[-1]):
            events.append((await asyncio.wait_for(queue.get(), 30))[1])

    try:
        asyncio.run(main())
        assert isinstance(events[0], TokenEvent)
        assert isinstance(events[-1], ErrorEvent) and events[-1].status == 503
        assert "restarted" in events[-1].message
        assert not engine.healthy
        with pytest.raises(Unavailable, match="engine process"):
            engine.submit(Submission(GenerationParams(max_new_tokens=2), ["Jack"]), nowhere)
        assert wait_for(lambda: engine.healthy, timeout=120)
        assert engine.restarts == 1
        assert tokens_of(run(engine, [("Jack and Jill", GenerationParams(max_new_tokens=3))])[0])
        assert engine.info()["engine_restarts"] == 1
    finally:
        engine.stop()


def test_an_engine_process_that_keeps_crashing_is_given_up(monkeypatch):
    """More crashes than MAX_RESTARTS within the window: no restart, ``on_give_up`` is told
    (the server then exits with status 1)."""
    from helpers.server import supervisor

    monkeypatch.setattr(supervisor, "MAX_RESTARTS", 0)
    told = []
    engine = EngineProcess(settings(), on_give_up=told.append).start()
    try:
        engine._process.kill()
        assert wait_for(lambda: told, timeout=30)
        assert "giving up" in told[0] and engine.restarts == 0
        assert not engine.healthy
    finally:
        engine.stop()


def test_a_hung_engine_process_gets_503s_and_late_answers_are_undone(monkeypatch):
    """A stopped (hung) engine process: questions and submissions give up after their
    deadline with Unavailable, /health fails after SILENCE seconds without a word, and a
    submission whose answer comes too late is cancelled once it comes."""
    import os
    import signal

    from helpers.server import engine_process

    monkeypatch.setattr(engine_process, "ANSWER_SECONDS", {"ask": 1.0, "submit": 1.0})
    monkeypatch.setattr(engine_process, "SILENCE", 3.0)
    engine = EngineProcess(settings()).start()
    pid = engine._process.pid
    try:
        submission = Submission(GenerationParams(max_new_tokens=200, ignore_eos_token=True),
                                ["Jack and Jill"])
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(Unavailable, match="did not answer within 1 s"):
            engine.snapshot()
        with pytest.raises(Unavailable, match="did not answer"):
            engine.submit(submission, nowhere)
        assert wait_for(lambda: not engine.healthy, timeout=10)
        os.kill(pid, signal.SIGCONT)
        assert wait_for(lambda: engine.healthy, timeout=10)
        # The late submission ran, and was cancelled as soon as its answer came.
        assert wait_for(lambda: engine.snapshot().get("cancelled", 0) == 1)
        assert engine.snapshot()["running"] == 0 and not engine._handles
    finally:
        os.kill(pid, signal.SIGCONT)
        engine.stop()


def getter(engine):
    """``await get(path)``: a GET of the server's app for ``engine``, in this process (no
    socket)."""
    import httpx

    from helpers.server import create_app

    app = create_app(engine, manage_engine=False)

    async def get(path):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            return await c.get(path)

    return get


def test_metrics_still_answer_when_the_engine_process_is_gone():
    engine = EngineProcess(settings()).start()
    get = getter(engine)

    try:
        assert "helpers_server_up 1" in asyncio.run(get("/metrics")).text
        engine._process.kill()
        assert wait_for(lambda: not engine.healthy)
        page = asyncio.run(get("/metrics"))
        assert page.status_code == 200
        assert "helpers_server_up 0" in page.text and "helpers_server_running" not in page.text
        assert "helpers_server_responses" in page.text      # the HTTP side's own figures
        assert asyncio.run(get("/health")).status_code == 503
    finally:
        engine.stop()


def test_options_the_engine_refuses_are_a_value_error():
    with pytest.raises(ValueError, match="max_input_tokens .* must be smaller"):
        EngineProcess(settings(max_input_tokens=200, max_total_tokens=100)).start()


def counters(page: str) -> dict:
    """Every counter sample of a /metrics page, read by Prometheus' own text parser:
    ``{(name, labels): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(page) if family.type == "counter"
            for sample in family.samples}


def test_counters_never_go_down_across_a_restart_and_cut_requests_count_as_failed():
    """The engine process dies with two requests running: /health says so at once, and
    after the restart no counter of /metrics is lower than before, the requests the engine
    had counted are still counted, and the two cut ones are counted as failed by reason."""
    engine = EngineProcess(settings()).start()
    get = getter(engine)

    async def two_running_then_killed():
        queue = asyncio.Queue()
        params = GenerationParams(max_new_tokens=250, ignore_eos_token=True)
        for _ in range(2):
            engine.submit(Submission(params, ["Jack and Jill"]),
                          sink_to(asyncio.get_running_loop(), queue))
        await queue.get()                             # they are running
        running = await get("/metrics")
        engine._process.kill()
        return running.text, (await get("/health")).status_code

    try:
        run(engine, [("Humpty Dumpty sat", GenerationParams(max_new_tokens=4))] * 3)
        before, health = asyncio.run(two_running_then_killed())
        assert health == 503
        assert wait_for(lambda: engine.healthy, timeout=120)
        after = counters(asyncio.run(get("/metrics")).text)
        before = counters(before)
        assert before[("helpers_server_requests_total", ())] == 5
        lower = {key: (value, after.get(key)) for key, value in before.items()
                 if not after.get(key, -1) >= value}
        assert not lower, lower
        assert after[("helpers_server_failed_total", (("reason", "engine_crash"),))] == 2
        assert after[("helpers_server_engine_restarts_total", ())] == 1
    finally:
        engine.stop()
