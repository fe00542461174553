"""Lesson 07's checks: the learner's ``time_stream`` and ``generate_all``, two pieces of a
serving client.

Neither check talks to a server: a check must be quick and give the same answer on every run,
and a real server's timings change from run to run. So ``time_stream`` gets a scripted stream
of lorax-client-like events and a fake clock that moves when the stream says so (the request
being sent, the prefill, each decode step): the expected TTFT and gaps are known exactly.
Reading an event's token moves the fake clock a microsecond, and so does reading the clock, so
a stamp taken after the loop's work, or a second reading for one event, shows. One stream
starts with a special token, which the TTFT counts like any other. ``generate_all`` gets a fake
``AsyncClient`` whose answers come back in the reverse of the order they were sent, and which
notes how many requests were in flight at once: all of them must be; the request dicts must
come back as they were given. The times must be numbers, the text a string: the lesson then uses both
functions against the running server.

``time_stream_reference`` and ``generate_all_reference`` are the course's versions: what the
checks compare with, and what the lesson goes on with when an answer is missing or wrong.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import threading
import time
import warnings
from types import SimpleNamespace

from .core import Hint, expect_number, expect_unchanged, run_check, snapshot

__all__ = ["check_time_stream", "check_generate_all", "time_stream_reference",
           "generate_all_reference"]


# ---- the course's versions ----------------------------------------------------------------

def time_stream_reference(send, clock=time.perf_counter):
    """Send one streaming request with ``send()`` and time it from the client's side.
    (Lesson 07.)

    send:  a function that sends the request and returns its stream of events (lorax-client's
           ``generate_stream`` events: ``event.token.text``, ``event.token.special``).
    clock: what tells the time, in seconds.
    Returns ``(ttft, gaps, text)``: seconds from calling ``send()`` to the first token, the
    seconds between each token and the one before it (one fewer than the tokens), and the text
    of the tokens that are not special.
    """
    start = clock()                       # before send(): some clients send the request in it
    stamps, text = [], ""
    for event in send():
        stamps.append(clock())            # first thing: nothing of ours delays the stamp
        if not event.token.special:
            text += event.token.text
    ttft = stamps[0] - start
    gaps = [now - before for before, now in zip(stamps, stamps[1:])]
    return ttft, gaps, text


async def generate_all_reference(aclient, requests):
    """Send every request at once with ``aclient.generate(**request)`` and return the answers'
    texts in the order of ``requests``, whatever order they finish in. (Lesson 07.)"""
    replies = await asyncio.gather(*(aclient.generate(**request) for request in requests))
    return [reply.generated_text for reply in replies]


# ---- time_stream --------------------------------------------------------------------------

class FakeClock:
    """A clock that moves only when told to (``clock.advance(s)``), and by a tick each time it
    is read: ``clock()`` is the time, as a real clock it is never the same twice, so that two
    readings for one event show; ``clock.now`` reads it without the tick."""

    def __init__(self, start: float = 100.0):
        self.now = start

    def __call__(self) -> float:
        now = self.now
        self.now += TICK
        return now

    def advance(self, seconds: float) -> None:
        self.now += seconds


#: What reading an event's token costs on the fake clock: the work of a loop's body, small but
#: not nothing, so that a stamp taken after it shows (the text: "read clock() first thing").
READ_COST = 1e-6
#: What reading the clock costs on the fake clock.
TICK = 1e-6
#: How near a time must be to a wrong one for the hint to name that mistake (a few reads).
NEAR = 20 * READ_COST


class _Event:
    """A lorax-client-like stream event; reading ``event.token`` moves the fake clock by
    READ_COST, as the work a loop does with it takes time."""

    def __init__(self, clock, token_id, text, special=False, final=None):
        self._clock = clock
        self._token = SimpleNamespace(id=token_id, text=text, logprob=-0.5, special=special)
        self.generated_text, self.details = final, None

    @property
    def token(self):
        self._clock.advance(READ_COST)
        return self._token


class ScriptedStream:
    """``send()`` of a request whose answer is ``tokens`` (text, special), with the time each
    part takes: ``connect`` inside ``send()`` (as a client that sends the request and waits for
    the reply's headers before it returns), ``prefill`` until the first token, then ``steps``,
    one gap per further token."""

    def __init__(self, clock, tokens, connect, prefill, steps):
        assert len(steps) == len(tokens) - 1
        self.clock, self.tokens, self.connect = clock, tokens, connect
        self.delays = [prefill] + list(steps)
        self.sent = 0
        self.read = 0
        self.arrivals: list[float] = []      # the clock when each event was handed over

    def __call__(self):
        self.sent += 1
        self.clock.advance(self.connect)
        return self._events()

    def _events(self):
        final = "".join(text for text, special in self.tokens if not special)
        for i, ((text, special), delay) in enumerate(zip(self.tokens, self.delays)):
            self.clock.advance(delay)
            self.read = i + 1
            last = i == len(self.tokens) - 1
            self.arrivals.append(self.clock.now)
            yield _Event(self.clock, 300 + i, text, special, final if last else None)


STORY = [(" on", False), (" a", False), (" wall", False), (".", False),
         ("<|endoftext|>", True), ("Once", False)]

STREAMS = [
    ("6 tokens, one of them the special end-of-text token",
     dict(tokens=STORY, connect=0.004, prefill=0.030, steps=[0.010, 0.012, 0.002, 0.025, 0.011])),
    ("an answer of one token", dict(tokens=[(" down", False)], connect=0.003, prefill=0.020,
                                    steps=[])),
    ("a long queue, then an answer that starts with the special end-of-text token",
     dict(tokens=STORY[4:] + [(" upon", False)], connect=0.005, prefill=1.500,
          steps=[0.009, 0.013])),
]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _expect_timings(result, clock_start, stream: ScriptedStream):
    """Compare ``(ttft, gaps, text)`` with the script; the hint names the likely mistake."""
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        size = f" of {len(result)}" if isinstance(result, (tuple, list)) else ""
        raise Hint(f"should return three things, (ttft, gaps, text), got "
                   f"{type(result).__name__}{size}")
    ttft, gaps, text = result
    n = len(stream.tokens)
    if stream.sent != 1:
        raise Hint(f"send() was called {stream.sent} times: call it once, it sends the request")
    if stream.read < n:
        raise Hint(f"only {stream.read} of the {n} events were read: go through the whole stream")
    stamps = list(stream.arrivals)               # when each token arrived
    want_ttft = stamps[0] - clock_start
    want_gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    want_text = "".join(text for text, special in stream.tokens if not special)
    expect_number("ttft (seconds)", ttft)        # the lesson multiplies and formats it
    late = float(ttft) - want_ttft
    stamped_late = 1e-9 < late <= 10 * READ_COST     # told after the gaps' count is checked
    if abs(float(ttft) - 1e3 * want_ttft) < 1e-6 and want_ttft:
        raise Hint(f"ttft is {float(ttft):.4g}: that is in milliseconds; return seconds, as the "
                   f"clock gives them")
    if abs(float(ttft) - stamps[0]) < NEAR:
        raise Hint(f"ttft is {float(ttft):.6g}: the clock's reading when the first token came, "
                   f"not a duration; subtract the reading taken before calling send()")
    if abs(float(ttft) - want_ttft) > 1e-9 and not stamped_late:
        got = float(ttft)
        if abs(got) < 1e-9:
            raise Hint(f"ttft is 0, expected {_ms(want_ttft)}: the clock started when the first "
                       f"token arrived; start it before calling send(), so that the TTFT "
                       f"counts the request's trip, the queue and the prefill")
        if abs(got - (want_ttft - stream.connect)) < 1e-9:
            raise Hint(f"ttft is {_ms(got)}, expected {_ms(want_ttft)}: {_ms(stream.connect)} "
                       f"short, the time send() itself took. Start the clock before calling "
                       f"send(): some clients (openai's) send the request and wait for the "
                       f"reply's headers inside that call")
        if (n > 1 and abs(got - (stamps[-1] - clock_start)) < NEAR and isinstance(gaps, (list, tuple))
                and all(abs(float(g)) < NEAR for g in gaps if isinstance(g, (int, float)))):
            raise Hint(f"ttft is {_ms(got)}, expected {_ms(want_ttft)}, and every gap is about 0: all "
                       f"tokens got the same time, so the stream was read to its end (list(...)?) "
                       f"before the times were taken; take clock() in the loop, as each event "
                       f"arrives")
        if n > 1 and abs(got - (stamps[-1] - clock_start)) < NEAR:
            raise Hint(f"ttft is {_ms(got)}, expected {_ms(want_ttft)}: that is the time to the "
                       f"last token; the TTFT ends at the first one")
        first_text = next((i for i, (_, special) in enumerate(stream.tokens) if not special), 0)
        if first_text and abs(got - (stamps[first_text] - clock_start)) < NEAR:
            raise Hint(f"ttft is {_ms(got)}, expected {_ms(want_ttft)}: that is the time to the "
                       f"first token that is not special; the special "
                       f"{stream.tokens[0][0]!r} came first, and it is a token like any other "
                       f"(made by the prefill): the TTFT ends when the first event arrives")
        raise Hint(f"ttft is {_ms(got)}, expected {_ms(want_ttft)} (from calling send() to the "
                   f"first token)")
    if not isinstance(gaps, (list, tuple)):
        raise Hint(f"gaps should be a list of seconds, got {type(gaps).__name__}")
    gaps = list(gaps)
    if len(gaps) == n and n > 1 and abs(gaps[0] - want_ttft) < 1e-9:
        raise Hint(f"gaps holds {n} numbers for {n} tokens and starts with the TTFT: the gaps are "
                   f"the {n - 1} times between one token and the next; the TTFT is returned "
                   f"on its own")
    n_special = sum(special for _, special in stream.tokens)
    if n_special and len(gaps) == len(want_gaps) - n_special:
        raise Hint(f"gaps holds {len(gaps)} numbers, expected {len(want_gaps)}: the special "
                   f"token ({[t for t, sp in stream.tokens if sp][0]!r}) is a token too, made by "
                   f"a decode step like the others: time it, and leave only its text out")
    if len(gaps) != len(want_gaps):
        raise Hint(f"gaps holds {len(gaps)} numbers, expected {len(want_gaps)}: one for each "
                   f"token after the first (the time since the token before it)")
    if stamped_late:
        raise Hint(f"ttft is {late * 1e6:.0f} µs longer than the time to the first token: the "
                   f"stamp was taken after the loop read the event (event.token ...); read "
                   f"clock() first thing for each event, so that nothing of yours delays it")
    for i, (got, want) in enumerate(zip(gaps, want_gaps)):
        got = expect_number(f"gap {i} (seconds)", got)
        if abs(got - want) > 1e-9:
            if 0 < want - got < NEAR:
                raise Hint(f"gap {i} is {(want - got) * 1e6:.0f} µs shorter than the time "
                           f"between tokens {i} and {i + 1}: the clock was read twice for one "
                           f"event, and the gap began at the later reading (a real clock moves "
                           f"between two readings); read clock() once per event and use that "
                           f"one stamp to end one gap and begin the next")
            since_first = stamps[i + 1] - stamps[0]
            since_start = stamps[i + 1] - clock_start
            if abs(got - since_first) < NEAR or abs(got - since_start) < NEAR:
                raise Hint(f"gap {i} is {_ms(got)}, expected {_ms(want)}: that is the time since "
                           f"{'the first token' if abs(got - since_first) < NEAR else 'send()'}, "
                           f"not since the token before it")
            if abs(got - 1e3 * want) < 1e-6:
                raise Hint(f"gap {i} is {got:.4g}: that is in milliseconds; return seconds")
            raise Hint(f"gap {i} (before token {i + 1}) is {_ms(got)}, expected {_ms(want)}")
    if not isinstance(text, str):
        raise Hint(f"text should be a string, got {type(text).__name__}")
    if text != want_text:
        specials = [t for t, special in stream.tokens if special]
        if specials and specials[0] in text:
            raise Hint(f"text holds {specials[0]!r}, a special token: time it like any token, "
                       f"but leave its text out (event.token.special)")
        if text == want_text * 2:
            raise Hint("text holds the answer twice: the last event also carries the whole "
                       "text (generated_text); build it from the tokens or take that, not both")
        raise Hint(f"text is {text!r}, expected {want_text!r} (the texts of the tokens that are "
                   f"not special, in order)")


CLOCK_CAUSES = {
    "unexpected keyword argument 'clock'": "time_stream must take the clock as an argument, "
                                           "def time_stream(send, clock=time.perf_counter), and "
                                           "take every time stamp with clock()",
}


def _time_stream_checker(learner, cases):
    for label, script in STREAMS:
        with cases(label):
            clock = FakeClock()
            stream = ScriptedStream(clock, **script)
            start = clock.now
            result = learner(stream, clock=clock)
            if inspect.isgenerator(result):
                raise Hint("time_stream returned a generator: it should return (ttft, gaps, "
                           "text) once the stream is over (is there a yield left in it?)")
            complete = stream.sent == 1 and stream.read == len(stream.tokens)
            if (complete and isinstance(result, (tuple, list)) and len(result) == 3
                    and _real_clock(result[0])):
                raise Hint("ttft does not match the clock it was given: take every time stamp "
                           "with clock(), the argument (the check passes a clock of its own), "
                           "not time.perf_counter()")
            _expect_timings(result, start, stream)


def _real_clock(ttft) -> bool:
    """True when ``ttft`` looks measured with the machine's own clock, not the fake one: a
    duration under a millisecond (the scripts' are all longer)."""
    try:
        ttft = float(ttft)
    except (TypeError, ValueError):
        return False
    return 0 < abs(ttft) < 1e-3


def check_time_stream(learner_time_stream):
    """Lesson 07: check the learner's ``time_stream(send, clock)`` on scripted streams with a
    fake clock (a stream with a special token, an answer of one token, a long queue before a
    special first token): the TTFT from calling ``send()`` to the first token, the gaps between consecutive tokens, the text
    without special tokens. Print one line; return the function the lesson should use."""
    return run_check("time_stream", learner_time_stream, _time_stream_checker,
                     fallback=time_stream_reference, causes=CLOCK_CAUSES)


# ---- generate_all -------------------------------------------------------------------------

class FakeAsyncClient:
    """An ``AsyncClient`` stand-in: ``await generate(prompt, **parameters)`` answers with a
    text made from the prompt and its parameters. Requests that are in flight together finish
    in the reverse of the order they were sent (the last one first), as a short request
    overtakes a long one; it notes the most requests it had in flight at once."""

    def __init__(self, n_expected: int):
        self.n_expected = n_expected
        self.in_flight = 0
        self.most_in_flight = 0
        self.sent: list[dict] = []
        self.finished: list[str] = []     # the answers, in the order they finished

    @staticmethod
    def answer(prompt, parameters) -> str:
        adapter = parameters.get("adapter_id")
        return f"<{adapter or 'base'}: {prompt} +{parameters.get('max_new_tokens')}>"

    async def generate(self, prompt, **parameters):
        number = len(self.sent)
        self.sent.append(dict(prompt=prompt, **parameters))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        for _ in range(10):                  # let the other requests be sent, if they come
            if len(self.sent) == self.n_expected:
                break
            await asyncio.sleep(0)
        for _ in range(self.n_expected - number):   # the last one sent finishes first
            await asyncio.sleep(0)
        self.in_flight -= 1
        text = self.answer(prompt, parameters)
        self.finished.append(text)
        return SimpleNamespace(generated_text=text, details=None)

    async def generate_stream(self, *args, **kwargs):
        raise AssertionError("generate_all should use generate (one answer per request), not "
                             "generate_stream")
        yield  # pragma: no cover


REQUESTS = [
    ("three adapters at once",
     [dict(prompt="Tom the fox met Lily the owl.", adapter_id=a, adapter_source="local",
           max_new_tokens=n) for a, n in (("rhymes", 80), ("sad", 40), ("title", 20))]),
    ("five requests, the same prompt, adapters and none",
     [dict(prompt="Jack and Jill", adapter_id=a, max_new_tokens=10 + i)
      for i, a in enumerate([None, "sad", None, "rhymes", "sad"])]),
    ("one request", [dict(prompt="Humpty Dumpty sat", max_new_tokens=12)]),
    ("no requests", []),
]


def _given(request: dict) -> dict:
    """A request's parameters that say something (None means "left to the server")."""
    return {k: v for k, v in request.items() if v is not None}


def _run_coroutine(coroutine, timeout: float = 2.0):
    """Run ``coroutine`` to its end in an event loop of its own (a notebook's loop is already
    running in this thread) and return its result, or raise what it raised."""
    box = {}

    async def main():
        result = await coroutine
        if inspect.isawaitable(result):     # handed back unawaited: finish it here, quietly,
            try:                            # so that no "never retrieved" report follows
                await asyncio.wait_for(result, timeout)
            except BaseException:
                pass
        return result

    def target():
        try:
            box["result"] = asyncio.run(main())
        except BaseException as error:      # handed back to the caller's thread
            box["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise Hint(f"generate_all did not finish within {timeout:.0f} s: is every request "
                   f"awaited, and nothing else?")
    if "error" in box:
        raise box["error"]
    return box["result"]


def _call_quietly(learner, client, requests):
    """``learner(client, requests)``; when it calls asyncio.run inside the notebook's running
    loop, a hint instead, without the "coroutine ... was never awaited" warning that the
    coroutine it made prints when it is let go."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="coroutine .* was never awaited")
        try:
            return learner(client, requests)
        except RuntimeError as error:
            if "cannot be called from a running event loop" not in str(error):
                raise
        gc.collect()
    raise Hint("generate_all calls asyncio.run, but a notebook's cells already run inside an "
               "event loop: define it with `async def` and await the answers inside it")


def _generate_all_checker(learner, cases):
    for label, requests in REQUESTS:
        with cases(label):
            client = FakeAsyncClient(len(requests))
            copies = [dict(r) for r in requests]
            before = snapshot(copies)
            coroutine = _call_quietly(learner, client, copies)
            if not inspect.isawaitable(coroutine):
                raise Hint(f"generate_all returned {type(coroutine).__name__}, not a coroutine: "
                           f"define it with `async def` and await the client's answers inside")
            got = _run_coroutine(coroutine)
            expect_unchanged("requests", before, copies)      # the lesson sends them again
            expected = [client.answer(r["prompt"], {k: v for k, v in r.items() if k != "prompt"})
                        for r in requests]
            if len(client.sent) != len(requests):
                raise Hint(f"{len(client.sent)} requests were sent for {len(requests)}: send "
                           f"each request once")
            wanted = [_given(r) for r in requests]
            for number, sent in enumerate(client.sent):
                if _given(sent) in wanted:
                    continue
                i = next((i for i, w in enumerate(wanted)          # the request it came from
                          if all(w.get(k) == v for k, v in _given(sent).items())), number)
                i = min(i, len(wanted) - 1)
                if isinstance(sent.get("prompt"), dict):
                    raise Hint(f"request {i}'s prompt went out as the whole request, a dict: "
                               f"unpack the request into keyword arguments, "
                               f"aclient.generate(**request)")
                missing = {k: v for k, v in wanted[i].items() if sent.get(k) != v}
                raise Hint(f"request {i} went out as {_given(sent)}, not as {wanted[i]} "
                           f"(missing or different: {missing}): pass each request's "
                           f"parameters on, aclient.generate(**request)")
            if len(requests) > 1 and client.most_in_flight == 1:
                raise Hint(f"the {len(requests)} requests went out one after another (never two "
                           f"in flight at once), so each waited for the one before: start them "
                           f"all, then wait for all of them (asyncio.gather)")
            if client.most_in_flight < len(requests):
                raise Hint(f"at most {client.most_in_flight} of the {len(requests)} requests "
                           f"were in flight at once: send them all at once, one "
                           f"asyncio.gather over every request, not in groups or one after "
                           f"another for some of them")
            if inspect.isawaitable(got):
                raise Hint(f"generate_all returned {type(got).__name__}, something still to be "
                           f"awaited: return the answers of `await asyncio.gather(...)`")
            if not isinstance(got, list):
                raise Hint(f"generate_all should return a list of texts, got "
                           f"{type(got).__name__}")
            if got and not all(isinstance(t, str) for t in got):
                bad = next(t for t in got if not isinstance(t, str))
                raise Hint(f"the list holds {type(bad).__name__} objects: return each reply's "
                           f"text, reply.generated_text")
            if len(got) != len(expected):
                raise Hint(f"{len(got)} answers for {len(requests)} requests")
            if got != expected:
                if got == client.finished:
                    raise Hint("the answers are in the order they finished (the last request "
                               "finished first here), not in the order of the requests: "
                               "asyncio.gather returns them in the order it was given them; "
                               "as_completed does not")
                if sorted(got) == sorted(expected):
                    i = next(i for i, (g, e) in enumerate(zip(got, expected)) if g != e)
                    raise Hint(f"the answers are all there but in another order: answer {i} is "
                               f"{got[i]!r}, request {i}'s is {expected[i]!r}; keep the order of "
                               f"the requests (a list, not a set or a sort)")
                i = next(i for i, (g, e) in enumerate(zip(got, expected)) if g != e)
                raise Hint(f"answer {i} is {got[i]!r}, expected {expected[i]!r}")


GATHER_CAUSES = {
    "got multiple values for argument": "pass each request as keywords, aclient.generate(**request)",
    "missing 1 required positional argument: 'prompt'": "each request holds its prompt: "
                                                        "aclient.generate(**request)",
}


def check_generate_all(learner_generate_all):
    """Lesson 07: check the learner's ``async generate_all(aclient, requests)`` with a fake
    ``AsyncClient`` whose answers finish in reverse order: every request sent once with its
    parameters, all of them in flight at once (it counts them), the texts returned in request order (three adapters,
    five requests, one, none). Print one line; return the function the lesson should use."""
    return run_check("generate_all", learner_generate_all, _generate_all_checker,
                     fallback=generate_all_reference, causes=GATHER_CAUSES)
