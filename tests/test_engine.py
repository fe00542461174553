"""The lesson-07 engine without HTTP: its scheduler is lesson 03's code, its token choosers do
what each setting promises, and one broken row never hurts the others.

Two engines run for this module on their own copies of the bundled model: one on lesson 03's
contiguous cache and one on lesson 08's paged cache (prefix caching and chunked prefill): the
same ``Engine`` given another KV layout. Requests go in through ``submit`` and their events are read from asyncio queues, as
the HTTP side does.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from helpers import generate_sequential, load_model
from helpers.lora import ADAPTERS_DIR
from helpers.server import admission as admission_module
from helpers.server import kv as kv_module
from helpers.server import sampling
from helpers.server.contract import (ErrorEvent, GenerationParams, PromptEvent, Submission,
                                     TokenEvent)
from helpers.server.engine import Engine
from helpers.server.errors import (GenerationFailed, InvalidRequest, Overloaded, TooLarge,
                                   Unavailable)

from .conftest import COURSE_PROMPTS

pytestmark = pytest.mark.usefixtures("one_thread")   # see tests/conftest.py

HAVE_ADAPTERS = (ADAPTERS_DIR / "entities" / "adapter_model.safetensors").is_file()
#: A prompt whose first 32 tokens (two blocks of 16) other prompts share.
SHARED = ("Once upon a time a small fox lived by the river with her two brothers, and every "
          "morning she ran to the old mill to look for")


@pytest.fixture(scope="module")
def reference():
    """The bundled model and tokenizer, untouched by any engine (for expected answers)."""
    return load_model(device="cpu")


def _engine(kind: str):
    model, tokenizer = load_model(device="cpu")
    options = {"max_prefill_tokens": 16} if kind == "paged" else {}
    return Engine(model, tokenizer, max_batch_size=4, max_queue=16, kv_cache=kind,
                  **options).start()


@pytest.fixture(scope="module", params=["contiguous", "paged"])
def engine(request):
    engine = _engine(request.param)
    yield engine
    engine.stop()


def sink_to(loop, queue):
    """A submission's sink that puts its ``(sequence, event)`` pairs on an asyncio queue."""
    def put(events):
        loop.call_soon_threadsafe(lambda: [queue.put_nowait(e) for e in events])
    return put


def admit(engine, prompt, params):
    """What the engine's admission makes of one prompt (``admission.Admitted``)."""
    return engine.admission.admit(Submission(params, [prompt]))[0]


def run(engine, requests, timeout: float = 120.0) -> list[list]:
    """Submit ``(prompt, params)`` pairs at once; each request's events, in order."""
    async def main():
        loop = asyncio.get_running_loop()
        queues = []
        for prompt, params in requests:
            queue = asyncio.Queue()
            engine.submit(Submission(params, [prompt]), sink_to(loop, queue))
            queues.append(queue)
        results = []
        for queue in queues:
            events = []
            while not events or not _last(events[-1]):
                events.append((await asyncio.wait_for(queue.get(), timeout))[1])
            results.append(events)
        return results

    return asyncio.run(main())


def _last(event) -> bool:
    return isinstance(event, ErrorEvent) or (isinstance(event, TokenEvent) and event.finish)


def tokens_of(events) -> list[int]:
    """The generated token ids, without the EOS that ended the answer (if one did)."""
    ids = [e.token["id"] for e in events if isinstance(e, TokenEvent) and e.token is not None]
    last = events[-1]
    if isinstance(last, TokenEvent) and last.finish.reason == "eos_token":
        ids = ids[:-1]
    return ids


def expected_ids(reference, prompt, max_new_tokens, stop_at_eos=True) -> list[int]:
    """What ``generate_sequential`` (lesson 01's loop) generates, as token ids."""
    model, tokenizer = reference
    text = generate_sequential(model, tokenizer, [(prompt, max_new_tokens)],
                               stop_at_eos=stop_at_eos)[0]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# --- the scheduler is lesson 03's code -------------------------------------------------------

def test_greedy_equals_generate_sequential(engine, reference):
    requests = [(p, GenerationParams(max_new_tokens=n))
                for p, n in zip(COURSE_PROMPTS + [SHARED, SHARED + " a bone"], [3, 9, 17, 5, 12,
                                                                                 20, 7])]
    results = run(engine, requests)
    tokenizer = reference[1]
    for (prompt, params), events in zip(requests, results):
        finish = events[-1].finish
        want = generate_sequential(*reference, [(prompt, params.max_new_tokens)])[0]
        assert finish.text == want, prompt
        text = tokenizer.decode([t for t in tokens_of(events) if t != tokenizer.eos_token_id])
        assert text == want


@pytest.mark.parametrize("kind, function", [("contiguous", "generate_next_token"),
                                             ("paged", "paged_next_token")])
def test_the_engine_calls_lessons_functions(monkeypatch, reference, kind, function):
    """Each forward pass of the engine is the lesson's own step: lesson 03's
    generate_next_token on the contiguous layout, lesson 08's paged_next_token on the paged
    one (one prefill, then one call per decode step)."""
    calls = []
    real = getattr(kv_module, function)

    def spy(*args, **kwargs):
        calls.append(function)
        return real(*args, **kwargs)

    monkeypatch.setattr(kv_module, function, spy)
    engine = _engine(kind)
    try:
        run(engine, [("Jack and Jill", GenerationParams(max_new_tokens=4, ignore_eos_token=True))])
    finally:
        engine.stop()
    assert calls == [function] * 4     # one prefill, three decode steps


def test_ignore_eos_gives_every_token(engine, reference):
    params = GenerationParams(max_new_tokens=30, ignore_eos_token=True)
    events = run(engine, [("What comes up must", params)])[0]
    model, tokenizer = reference
    want = generate_sequential(model, tokenizer, [("What comes up must", 30)],
                               stop_at_eos=False)[0]
    assert len(tokens_of(events)) == 30
    assert events[-1].finish.text == want


# --- prompt scoring, prefill only, token-id prompts -----------------------------------------

def test_prompt_logprobs_equal_a_plain_forward_pass(engine, reference):
    model, tokenizer = reference
    prompt = "Humpty Dumpty sat on a wall"
    ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = [None] + [float(logprobs[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    plain = (COURSE_PROMPTS[0], GenerationParams(max_new_tokens=3))
    events = run(engine, [plain, (prompt, GenerationParams(max_new_tokens=2,
                                                           prompt_logprobs=True))])
    assert not any(isinstance(e, PromptEvent) for e in events[0])
    first = events[1][0]
    assert isinstance(first, PromptEvent)
    assert [t["id"] for t in first.tokens] == ids
    got = [t["logprob"] for t in first.tokens]
    assert got[0] is None
    assert got[1:] == pytest.approx(want[1:], abs=1e-4)
    assert tokens_of(events[1]) == expected_ids(reference, prompt, 2)


def test_max_new_tokens_zero_reads_the_prompt_only(engine):
    params = GenerationParams(max_new_tokens=0, prompt_logprobs=True)
    events = run(engine, [("Jack and Jill", params),
                          ("The rain in Spain", GenerationParams(max_new_tokens=0))])
    scored, plain = events
    assert isinstance(scored[0], PromptEvent) and len(scored) == 2
    for last in (scored[-1], plain[-1]):
        assert last.token is None
        assert last.finish.generated_tokens == 0
        assert last.finish.reason == "length"
        assert last.finish.text == ""
    assert len(plain) == 1


def test_token_id_prompts(engine, reference):
    tokenizer = reference[1]
    ids = tokenizer("The quick brown fox")["input_ids"]
    params = GenerationParams(max_new_tokens=6)
    by_text, by_ids = run(engine, [("The quick brown fox", params), (ids, params)])
    assert tokens_of(by_ids) == tokens_of(by_text)
    assert admit(engine, ids, params).text == "The quick brown fox"
    for bad in ([], [0, engine.vocab_size], [-1], [1.5], [True]):
        with pytest.raises(InvalidRequest):
            admit(engine, bad, params)
    with pytest.raises(InvalidRequest, match="at most"):
        admit(engine, [1] * (engine.max_input_tokens + 1), params)
    kept = admit(engine, [1] * 300, GenerationParams(max_new_tokens=1, truncate=10))
    assert kept.input_ids == [1] * 10


# --- choosing tokens --------------------------------------------------------------------------

def test_logit_bias_moves_the_greedy_token(engine, reference):
    prompt = "Jack and Jill"
    first = expected_ids(reference, prompt, 1)[0]
    events = run(engine, [(prompt, GenerationParams(max_new_tokens=1,
                                                    logit_bias={first: -100.0}))])[0]
    assert tokens_of(events)[0] != first
    other = (first + 1) % engine.vocab_size
    events = run(engine, [(prompt, GenerationParams(max_new_tokens=1,
                                                    logit_bias={other: 100.0}))])[0]
    assert tokens_of(events) == [other]
    with pytest.raises(InvalidRequest, match="logit_bias"):
        admit(engine, prompt, GenerationParams(logit_bias={engine.vocab_size: 1.0}))


def test_penalties_follow_their_formulas():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    x = logits.clone()
    sampling.frequency_presence_penalty(x, Counter({0: 3, 2: 1}), frequency=0.5, presence=0.25)
    assert x.tolist() == [2.0 - 3 * 0.5 - 0.25, -1.0, 0.5 - 0.5 - 0.25, 3.0]
    x = logits.clone()
    sampling.repetition_penalty(x, [0, 1, 1], 2.0)      # HF: divide positive, multiply negative
    assert x.tolist() == [1.0, -2.0, 0.5, 3.0]
    x = logits.clone()
    sampling.add_logit_bias(x, {3: -10.0, 1: 4.0})
    assert x.tolist() == [2.0, 3.0, 0.5, -7.0]


def test_frequency_penalty_stops_repetition(engine):
    """The bundled model repeats itself within 40 tokens; a strong frequency penalty makes
    every generated token a new one."""
    prompt = "Jack and Jill went up the hill"
    plain = run(engine, [(prompt, GenerationParams(max_new_tokens=40, ignore_eos_token=True))])
    assert len(set(tokens_of(plain[0]))) < 40
    penalized = run(engine, [(prompt, GenerationParams(max_new_tokens=40, ignore_eos_token=True,
                                                       frequency_penalty=100.0))])
    assert len(set(tokens_of(penalized[0]))) == 40


def test_typical_p_keeps_the_typical_tokens():
    # probabilities 0.5, 0.25, 0.125, 0.125: entropy 1.75 bits; surprises 1, 2, 3, 3 bits
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])
    logits = probs.log()
    # distance to the entropy (in nats, same order): token 1 (0.25 away), token 0 (0.75),
    # tokens 2 and 3 (1.25)
    kept = sampling.typical_filter(logits, 0.2).isfinite().tolist()
    assert kept == [False, True, False, False]          # 0.25 already covers 0.2
    kept = sampling.typical_filter(logits, 0.7).isfinite().tolist()
    assert kept == [True, True, False, False]           # 0.25 + 0.5 covers 0.7
    assert sampling.typical_filter(logits, 1.0).isfinite().all()


def test_min_p_filter_keeps_the_tokens_near_the_likeliest():
    logits = torch.tensor([0.0, 1.0, 2.0, 2.0 + math.log(0.5) + 1e-6])   # p ∝ 1, e, e², e²/2
    assert sampling.min_p_filter(logits, 0.5).isfinite().tolist() == [False, False, True, True]
    assert sampling.min_p_filter(logits, 1.0).isfinite().tolist() == [False, False, True, False]
    assert sampling.min_p_filter(logits, 0.0).isfinite().all()


def test_top_k_and_top_p_filters():
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    assert sampling.top_k_filter(logits, 2).isfinite().tolist() == [False, False, True, True]
    assert sampling.top_p_filter(logits, 0.5).isfinite().tolist() == [False, False, True, True]
    assert sampling.top_p_filter(logits, 0.3).isfinite().tolist() == [False, False, False, True]


def test_seeded_sampling_is_reproducible(engine):
    def draw(seed):
        params = GenerationParams(max_new_tokens=12, do_sample=True, temperature=1.5,
                                  seed=seed, ignore_eos_token=True)
        return [tokens_of(events) for events in run(engine, [("Jack and Jill", params)] * 2)]

    a1, a2 = draw(7)
    b1, _ = draw(8)
    assert a1 == a2                # the same seed, side by side in one batch
    assert a1 == draw(7)[0]        # ... and again later
    assert a1 != b1


def test_alternatives_are_the_likeliest_tokens(engine, reference):
    events = run(engine, [("Jack and Jill", GenerationParams(max_new_tokens=3,
                                                             alternatives=4))])[0]
    for event in events:
        alternatives = event.token["alternative_tokens"]
        assert len(alternatives) == 4
        assert alternatives[0]["id"] == event.token["id"]        # greedy: the likeliest
        values = [a["logprob"] for a in alternatives]
        assert values == sorted(values, reverse=True)


# --- one broken row fails alone ----------------------------------------------------------------

@pytest.mark.parametrize("broken", [
    GenerationParams(max_new_tokens=5, do_sample=True, temperature=1e-40, seed=1),
    GenerationParams(max_new_tokens=5, do_sample=True, repetition_penalty=1e-40, seed=1),
])
def test_a_nan_row_fails_alone(engine, reference, broken):
    good = [(p, GenerationParams(max_new_tokens=6)) for p in COURSE_PROMPTS[:3]]
    results = run(engine, good[:1] + [("Jack and Jill", broken)] + good[1:])
    failed = results[1]
    assert isinstance(failed[-1], ErrorEvent)
    assert failed[-1].status == 500 and "NaN" in failed[-1].message
    assert "Traceback" not in failed[-1].message
    for (prompt, _), events in zip(good, results[:1] + results[2:]):
        assert tokens_of(events) == expected_ids(reference, prompt, 6)
    assert engine.healthy


def test_a_row_whose_chooser_raises_fails_alone(engine, reference, monkeypatch):
    real = sampling.sample

    def sample(logits, params, generator):
        if params.temperature == 0.5:
            raise RuntimeError("a bug in sampling, at /secret/path.py")
        return real(logits, params, generator)

    monkeypatch.setattr(sampling, "sample", sample)
    bad = GenerationParams(max_new_tokens=4, do_sample=True, temperature=0.5, seed=3)
    results = run(engine, [("Jack and Jill", GenerationParams(max_new_tokens=6)),
                           ("What comes up must", bad)])
    assert tokens_of(results[0]) == expected_ids(reference, "Jack and Jill", 6)
    assert isinstance(results[1][-1], ErrorEvent)
    assert "/secret" not in results[1][-1].message
    assert engine.healthy


def test_a_row_whose_grammar_breaks_fails_alone(engine, reference, monkeypatch):
    class Broken:
        min_tokens = 1

        def matcher(self):
            return self

        def apply(self, logits, budget=None):
            raise MemoryError("the grammar engine gave up")

    monkeypatch.setattr(engine.admission.grammars, "compile", lambda kind, value: Broken())
    grammar = GenerationParams(max_new_tokens=4, grammar=("regex", "[a-z]+"))
    results = run(engine, [("Jack and Jill", grammar),
                           ("Humpty Dumpty sat", GenerationParams(max_new_tokens=5))])
    assert isinstance(results[0][-1], ErrorEvent)
    assert tokens_of(results[1]) == expected_ids(reference, "Humpty Dumpty sat", 5)
    assert engine.healthy


def test_check_finite():
    sampling.check_finite(torch.tensor([0.0, float("-inf")]))
    for bad in (float("nan"), float("inf")):
        with pytest.raises(GenerationFailed):
            sampling.check_finite(torch.tensor([0.0, bad]))


# --- limits, refused early ------------------------------------------------------------------

def test_a_huge_prompt_is_refused_before_tokenizing(engine, monkeypatch):
    calls = []
    real = engine.admission._encoder
    encode_text = admission_module.encode_text

    def spy(tokenizer, text, *args, **kwargs):
        calls.append(len(text))
        return encode_text(tokenizer, text, *args, **kwargs)

    monkeypatch.setattr(admission_module, "encode_text", spy)
    huge = "Jack and Jill went up the hill. " * 32_768          # 1 MiB
    with pytest.raises(InvalidRequest, match="at most 128 tokens"):
        admit(engine, huge, GenerationParams(max_new_tokens=4))
    assert calls == []
    # With truncate only the end is tokenized, and the tokens kept are the end's.
    prepared = admit(engine, huge, GenerationParams(max_new_tokens=4, truncate=20))
    assert calls and calls[0] < 1000
    assert prepared.input_ids == real.encode(huge[-200:]).ids[-20:]
    # A prompt just over the token limit is tokenized and refused by its token count.
    with pytest.raises(InvalidRequest, match="given: 1[0-9][0-9] tokens"):
        admit(engine, "Jack and Jill " * 60, GenerationParams(max_new_tokens=4))


def test_scoring_a_prompt_is_bounded_in_memory(engine, monkeypatch):
    """The logits kept to score a prompt grow with its length times the vocabulary: beyond
    MAX_SCORING_BYTES the request is refused before anything runs."""
    per_token = engine.vocab_size * 4 * admission_module.SCORING_COPIES
    monkeypatch.setattr(admission_module, "MAX_SCORING_BYTES", 5 * per_token)
    scoring = GenerationParams(max_new_tokens=0, prompt_logprobs=True)
    admit(engine, [5] * 5, scoring)                                   # at the bound
    with pytest.raises(TooLarge, match="at most 5 prompt tokens"):
        admit(engine, [5] * 6, scoring)
    admit(engine, [5] * 6, GenerationParams(max_new_tokens=0))        # not scored: no bound


def test_limits_raise_engine_errors(reference):
    model, tokenizer = load_model(device="cpu")
    engine = Engine(model, tokenizer, max_batch_size=1, max_queue=1)
    submission = Submission(GenerationParams(max_new_tokens=2), ["Jack and Jill"])
    with pytest.raises(Unavailable):                  # not started
        engine.submit(submission)
    engine._thread = SimpleNamespace(is_alive=lambda: True)   # "running", but never steps
    engine.submit(submission)
    with pytest.raises(Overloaded):
        engine.submit(submission)
    with pytest.raises(InvalidRequest, match="max-total-tokens"):
        admit(engine, "Jack and Jill", GenerationParams(max_new_tokens=10_000))
    with pytest.raises(InvalidRequest, match="empty"):
        admit(engine, "", GenerationParams())


def test_seeds_and_the_queue_count_every_sequence_of_a_submission():
    """Each prompt and each copy samples with a seed of its own (a given seed: it for the
    first copy, one made from it for each next, the same for each prompt); a submission is queued whole or refused whole
    (one that would not fit waits only when the queue is empty)."""
    model, tokenizer = load_model(device="cpu")
    engine = Engine(model, tokenizer, max_batch_size=1, max_queue=3)
    engine._thread = SimpleNamespace(is_alive=lambda: True)   # "running", but never steps
    sampled = GenerationParams(max_new_tokens=2, temperature=1.0)
    handle = engine.submit(Submission(sampled, ["Jack", "Jack"], copies=2))
    assert handle.sequences == 4 and len(set(handle.seeds)) == 4
    assert engine.snapshot()["waiting"] == 4                  # alone: it may wait whole
    with pytest.raises(Overloaded):
        engine.submit(Submission(GenerationParams(max_new_tokens=2), ["Jill"]))
    engine._waiting.clear()
    seeded = GenerationParams(max_new_tokens=2, temperature=1.0, seed=7)
    seeds = engine.submit(Submission(seeded, ["a", "b"], copies=2)).seeds
    assert seeds[0] == seeds[2] == 7 and seeds[1] == seeds[3] not in (7, 8)
    with pytest.raises(Overloaded):              # 4 waiting + 1 more > 3: nothing is queued
        engine.submit(Submission(GenerationParams(max_new_tokens=2), ["Jill"]))
    assert engine.snapshot()["waiting"] == 4


def test_a_sink_that_fails_loses_only_its_own_events(reference):
    """A submission whose sink raises (its event loop closed): the others still get every
    token, and the scheduler keeps running."""
    model, tokenizer = load_model(device="cpu")
    engine = Engine(model, tokenizer, max_batch_size=4).start()

    def broken(events):
        raise RuntimeError("Event loop is closed")

    try:
        engine.submit(Submission(GenerationParams(max_new_tokens=8), ["Humpty Dumpty"]), broken)
        events = run(engine, [("Jack and Jill", GenerationParams(max_new_tokens=6))])[0]
        assert tokens_of(events) == expected_ids(reference, "Jack and Jill", 6)
        assert engine.healthy
    finally:
        engine.stop()


# --- the paged engine is the contiguous one, on another cache ---------------------------------

@pytest.mark.skipif(not HAVE_ADAPTERS, reason="the shipped adapters are missing")
def test_paged_engine_equals_contiguous_with_adapters_and_shared_prefixes():
    engines = {kind: _engine(kind) for kind in ("contiguous", "paged")}
    requests = []
    for i, adapter in enumerate([None, "entities", None, "title", "entities", None]):
        prompt = SHARED + [" a bone", " a stick", " its tail"][i % 3]
        requests.append((prompt, GenerationParams(max_new_tokens=8 + i, adapter_id=adapter,
                                                  ignore_eos_token=True)))
    requests.append(("Jack and Jill", GenerationParams(max_new_tokens=5, do_sample=True,
                                                       seed=4, top_k=20)))
    try:
        got = {kind: [tokens_of(e) for e in run(engine, requests)]
               for kind, engine in engines.items()}
        cache = engines["paged"].kv.cache
        assert cache.cached_tokens > 0                # the shared prefix was found
        # Every block is given back once the scheduler has dropped the finished rows (just
        # after it sent their last tokens).
        deadline = time.monotonic() + 10
        while any(cache.manager.ref_counts) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(cache.manager.ref_counts)
    finally:
        for engine in engines.values():
            engine.stop()
    assert got["paged"] == got["contiguous"]


def test_prompts_are_tokenized_from_many_threads(engine, reference):
    """Worker threads tokenize prompts at once, with no lock of ours, while another thread
    uses the shared tokenizer with other settings (transformers changes its truncation at each
    call): every prompt gets the tokens the tokenizer gives it alone."""
    import threading

    tokenizer = reference[1]
    prompts = [f"{i} " + " ".join(COURSE_PROMPTS[: 1 + i % 5]) for i in range(64)]
    want = [tokenizer(p)["input_ids"] for p in prompts]
    got, errors = [None] * len(prompts), []

    def work(start):
        try:
            for i in range(start, len(prompts), 4):
                got[i] = admit(engine, prompts[i], GenerationParams(max_new_tokens=1)).input_ids
        except Exception as err:       # pragma: no cover - what the test looks for
            errors.append(err)

    def meddle():
        for _ in range(200):
            engine.tokenizer(prompts[:4], truncation=True, max_length=3)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    threads.append(threading.Thread(target=meddle))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and got == want


# --- the admission policy: one option, the same on either KV layout ------------------------

@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
@pytest.mark.parametrize("admission, first", [("fcfs", "long"), ("shortest", "short")])
def test_the_admission_policy_picks_who_joins_on_either_layout(kv_cache, admission, first):
    """One free slot, three waiting requests: first come first served admits the one that
    came first (the longest prompt), shortest-prompt-first the shortest; the others wait, in
    the order they came. The policy is one option of the engine, whatever its KV layout."""
    model, tokenizer = load_model(device="cpu")
    engine = Engine(model, tokenizer, max_batch_size=1, max_queue=8, kv_cache=kv_cache,
                    admission=admission)
    engine._thread = SimpleNamespace(is_alive=lambda: True)   # "running"; we step by hand
    prompts = {"long": "Once upon a time a small fox lived by the river", "short": "Jack",
               "middle": "Humpty Dumpty sat"}
    params = GenerationParams(max_new_tokens=3, ignore_eos_token=True)
    texts = {}
    for name, prompt in prompts.items():
        handle = engine.submit(Submission(params, [prompt]), lambda events: None)
        texts[handle.prompts[0]] = name
    with engine._model_lock, torch.inference_mode():
        engine.step()
    running = [texts[row.handle.prompts[0]] for row in engine._rows.values()]
    waiting = [texts[row.handle.prompts[0]] for row in engine._waiting]
    assert running == [first]
    assert waiting == [name for name in prompts if name != first]
    assert engine.info()["admission"] == admission


def test_an_unknown_admission_policy_is_refused(reference):
    model, tokenizer = reference
    with pytest.raises(ValueError, match="admission must be one of fcfs, shortest, got 'lifo'"):
        Engine(model, tokenizer, admission="lifo")
