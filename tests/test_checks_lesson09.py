"""Lesson 09's checks pass the course's code, say "not written yet" for a stub, and catch the
mistakes learners make in the verify step, prompt lookup and the expected tokens per verify,
each with a hint at its symptom."""

import time

import pytest
import torch

from helpers.checks import check_expected_tokens, check_lookup, check_verify
from helpers.checks.lesson09 import course_expected_tokens, course_lookup
from helpers.speculative import verify_greedy
from tests.answers import Exercise
from tests.checking import assert_caught, assert_not_written, assert_passes

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- verify: the lesson's solution and typical mistakes --------------------------------------

def _verify(model, cache, unread, guesses, shift=0, crop=True, keep_rejected=False,
            bonus=True, crop_sign=-1, as_tensor=False):
    ids = torch.tensor([unread + guesses], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0]
    choices = logits[len(unread) - 1 + shift:].argmax(dim=-1).tolist()
    n = 0
    while n < len(guesses) and guesses[n] == choices[n]:
        n += 1
    if crop and n < len(guesses):
        cache.crop(crop_sign * (len(guesses) - n))
    if keep_rejected and n < len(guesses):
        return guesses[:n + 1] + [choices[n]]
    if not bonus and n == len(guesses):
        return guesses[:n]
    tokens = guesses[:n] + [choices[n]]
    return torch.tensor(tokens) if as_tensor else tokens


def verify(model, cache, unread, guesses):                  # as in the lesson
    return _verify(model, cache, unread, guesses)


def verify_without_crop(model, cache, unread, guesses):
    return _verify(model, cache, unread, guesses, crop=False)


def verify_keeping_the_rejected_guess(model, cache, unread, guesses):
    return _verify(model, cache, unread, guesses, keep_rejected=True)


def verify_without_the_bonus_token(model, cache, unread, guesses):
    return _verify(model, cache, unread, guesses, bonus=False)


def verify_one_position_late(model, cache, unread, guesses):
    return _verify(model, cache, unread, guesses, shift=1)


def verify_cropping_with_a_positive_count(model, cache, unread, guesses):
    return _verify(model, cache, unread, guesses, crop_sign=1)


def verify_returning_a_tensor(model, cache, unread, guesses):
    return _verify(model, cache, unread, guesses, as_tensor=True)


def verify_cropping_the_kept_guesses_too(model, cache, unread, guesses):
    new = _verify(model, cache, unread, guesses, crop=False)
    cache.crop(-len(guesses)) if guesses else None        # drops every guess, kept ones too
    return new


def verify_without_the_models_token(model, cache, unread, guesses):
    new = _verify(model, cache, unread, guesses)
    return new[:-1] if len(new) <= len(guesses) else new   # keeps the bonus, drops the correction


def verify_extending_the_guesses(model, cache, unread, guesses):
    new = _verify(model, cache, unread, guesses)
    guesses += new[len(guesses):]                          # the caller's list grows
    return new


def verify_with_a_python_loop(model, cache, unread, guesses):
    """Right, written another way: zip over the guesses and the choices."""
    ids = torch.tensor([unread + guesses], device=model.device)
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    choices = out.logits[0, len(unread) - 1:].argmax(dim=-1).tolist()
    kept = []
    for guess, choice in zip(guesses, choices):
        if guess != choice:
            break
        kept.append(guess)
    if len(kept) < len(guesses):
        cache.crop(len(kept) - len(guesses))
    return kept + [choices[len(kept)]]


VERIFY_MISTAKES = {
    verify_without_crop: "rejected guess(es) are still in it",
    verify_keeping_the_rejected_guess: "keep only the guesses before the first mismatch",
    verify_without_the_bonus_token: "the pass also gives the model's own token after the last guess",
    verify_one_position_late: "one position late",
    verify_cropping_with_a_positive_count: "cache.crop takes a negative count",
    verify_returning_a_tensor: "use .tolist()",
    verify_cropping_the_kept_guesses_too: "crop only the",
    verify_without_the_models_token: "every pass writes at least one token",
    verify_extending_the_guesses: "changed its input guesses in place",
}


# ---- lookup: the lesson's solution and typical mistakes --------------------------------------

def _lookup(ids, k, max_ngram=3, latest=True, longest_first=True, skip_tail=True, after=True,
            fixed_ngram=False):
    sizes = list(range(min(3 if fixed_ngram else max_ngram, len(ids) - 1), 0, -1))
    for n in (sizes if longest_first else sizes[::-1]):
        tail = ids[-n:]
        starts = list(range(len(ids) - n - (1 if skip_tail else 0), -1, -1))
        for start in (starts if latest else starts[::-1]):
            if ids[start:start + n] == tail:
                first = start + n if after else start
                return ids[first:first + k]
    return []


def lookup(ids, k, max_ngram=3):                             # as in the lesson
    return _lookup(ids, k, max_ngram)


def lookup_reversing_ids(ids, k, max_ngram=3):
    ids.reverse()                                           # searched back to front, in place
    for n in range(min(max_ngram, len(ids) - 1), 0, -1):
        head = ids[:n]
        for start in range(1, len(ids) - n + 1):
            if ids[start:start + n] == head:
                return ids[max(start - k, 0):start][::-1]
    return []


def lookup_with_a_dictionary_of_tails(ids, k, max_ngram=3):
    """Right, written another way: for each n, the latest start of every n-gram before the tail."""
    for n in range(min(max_ngram, len(ids) - 1), 0, -1):
        latest = {}
        for start in range(len(ids) - n):
            latest[tuple(ids[start:start + n])] = start
        start = latest.get(tuple(ids[-n:]))
        if start is not None:
            return ids[start + n:start + n + k]
    return []


LOOKUP_MISTAKES = {
    (lambda ids, k, max_ngram=3: _lookup(ids, k, max_ngram, latest=False)): "take the latest one",
    (lambda ids, k, max_ngram=3: _lookup(ids, k, max_ngram, longest_first=False)): "shortest n-gram first",
    (lambda ids, k, max_ngram=3: _lookup(ids, k, max_ngram, skip_tail=False)): "the tail matched itself",
    (lambda ids, k, max_ngram=3: _lookup(ids, k, max_ngram, after=False)): "not the match itself",
    (lambda ids, k, max_ngram=3: _lookup(ids, k, max_ngram, fixed_ngram=True)): "n-grams of at most max_ngram tokens (here 1)",
    (lambda ids, k, max_ngram=3: _lookup(ids, k + 1, max_ngram)): "at most k = ",
    lookup_reversing_ids: "changed its input ids in place",
}
LOOKUP_NAMES = ["earliest occurrence", "shortest first", "tail matches itself", "the match itself",
                "max_ngram ignored", "k + 1 guesses", "ids reversed in place"]


# ---- expected_tokens: the lesson's solution and typical mistakes -----------------------------

def expected_tokens(alpha, k):                               # as in the lesson
    return (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1


def expected_tokens_as_a_sum(alpha, k):
    """Right, written another way: the sum of the series, term by term."""
    return sum(alpha ** i for i in range(k + 1))


EXPECTED_MISTAKES = {
    (lambda a, k: (1 - a ** k) / (1 - a) if a < 1 else k): "one term short",
    (lambda a, k: 1 + a * k): "guess i is kept only when all the guesses before it were",
    (lambda a, k: (1 - a ** (k + 1)) / (1 - a)): "alpha = 1 divides by zero",
    (lambda a, k: a * (1 - a ** k) / (1 - a) if a < 1 else k): "the model's own token (+1)",
    (lambda a, k: (1 - a ** (k + 1)) / (1 - a) if a < 1 else k): "a pass writes the k guesses and the model's own token",
    (lambda a, k: f"{expected_tokens(a, k):.2f}"): "should be a number (an int or a float), got str",
}
EXPECTED_NAMES = ["k terms", "1 + k alpha", "alpha = 1 unhandled", "accepted guesses only",
                  "k at alpha = 1", "a string"]


# ---- the tests -------------------------------------------------------------------------------

def test_verify_check_passes_the_course_functions_quickly(bundled):
    start = time.perf_counter()
    assert_passes(check_verify, verify, *bundled)
    assert time.perf_counter() - start < 10           # ≤ 2 s on a quiet 2-core machine
    assert_passes(check_verify, verify_greedy, *bundled)


def test_verify_check_says_not_written_for_a_stub(bundled):
    assert_not_written(check_verify, *bundled, fallback=verify_greedy)


@pytest.mark.parametrize("mistake", VERIFY_MISTAKES, ids=lambda f: f.__name__)
def test_verify_check_catches(mistake, bundled):
    assert_caught(check_verify, mistake, *bundled, symptom=VERIFY_MISTAKES[mistake],
                  fallback=verify_greedy)


def test_verify_check_runs_on_a_llama_style_model(tiny_llama):
    assert_passes(check_verify, verify, *tiny_llama)
    assert_caught(check_verify, verify_without_crop, *tiny_llama,
                  symptom="rejected guess(es) are still in it", fallback=verify_greedy)


def test_lookup_check_passes_the_course_functions():
    assert_passes(check_lookup, lookup)
    assert_passes(check_lookup, course_lookup)


def test_lookup_check_says_not_written_for_a_stub():
    assert_not_written(check_lookup, fallback=course_lookup)


@pytest.mark.parametrize("mistake", LOOKUP_MISTAKES, ids=LOOKUP_NAMES)
def test_lookup_check_catches(mistake):
    assert_caught(check_lookup, mistake, symptom=LOOKUP_MISTAKES[mistake], fallback=course_lookup)


def test_expected_tokens_check_passes_the_course_functions():
    assert_passes(check_expected_tokens, expected_tokens)
    assert_passes(check_expected_tokens, course_expected_tokens)


def test_expected_tokens_check_says_not_written_for_a_stub():
    assert_not_written(check_expected_tokens, fallback=course_expected_tokens)


@pytest.mark.parametrize("mistake", EXPECTED_MISTAKES, ids=EXPECTED_NAMES)
def test_expected_tokens_check_catches(mistake):
    assert_caught(check_expected_tokens, mistake, symptom=EXPECTED_MISTAKES[mistake],
                  fallback=course_expected_tokens)


def verify_with_the_ids_on_the_cpu(model, cache, unread, guesses):
    ids = torch.tensor([unread + guesses])                          # not on model.device
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0]
    choices = logits[len(unread) - 1:].argmax(dim=-1).tolist()
    n = 0
    while n < len(guesses) and guesses[n] == choices[n]:
        n += 1
    if n < len(guesses):
        cache.crop(-(len(guesses) - n))
    return guesses[:n] + [choices[n]]


# ---- what a GPU refuses, what a pass costs, the case the text names --------------------------

def verify_a_pass_per_guess(model, cache, unread, guesses):
    """The same tokens and cache, but a pass for the unread tokens and one per kept guess."""
    with torch.no_grad():
        ids = torch.tensor([unread], device=model.device)
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
        kept = []
        for guess in guesses:
            if int(logits.argmax()) != guess:
                break
            kept.append(guess)
            ids = torch.tensor([[guess]], device=model.device)
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
    return kept + [int(logits.argmax())]


def verify_in_two_passes(model, cache, unread, guesses):
    """The unread tokens in a pass, the guesses in another."""
    with torch.no_grad():
        first = model(input_ids=torch.tensor([unread], device=model.device),
                      past_key_values=cache, use_cache=True).logits[0, -1:]
        rest = (model(input_ids=torch.tensor([guesses], device=model.device),
                      past_key_values=cache, use_cache=True).logits[0] if guesses
                else first[:0])
    choices = torch.cat([first, rest]).argmax(dim=-1).tolist()
    n = 0
    while n < len(guesses) and guesses[n] == choices[n]:
        n += 1
    if n < len(guesses):
        cache.crop(-(len(guesses) - n))
    return guesses[:n] + [choices[n]]


def verify_with_the_guesses_on_the_cpu(model, cache, unread, guesses):
    ids = torch.cat([torch.tensor([unread], device=model.device),
                     torch.tensor([guesses], dtype=torch.long)], dim=1)      # no device=
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0]
    choices = logits[len(unread) - 1:].argmax(dim=-1).tolist()
    n = 0
    while n < len(guesses) and guesses[n] == choices[n]:
        n += 1
    if n < len(guesses):
        cache.crop(-(len(guesses) - n))
    return guesses[:n] + [choices[n]]


def lookup_before_the_tail_only(ids, k, max_ngram=3):
    """Searches ids[:-n], the text before the tail: a match that overlaps the tail is lost."""
    for n in range(min(max_ngram, len(ids) - 1), 0, -1):
        tail, before = ids[-n:], ids[:-n]
        for start in range(len(before) - n, -1, -1):
            if before[start:start + n] == tail:
                return ids[start + n:start + n + k]
    return []


COSTS = {verify_a_pass_per_guess: "where one is enough", verify_in_two_passes: "where one is enough"}
ON_A_GPU = {verify_with_the_guesses_on_the_cpu: "a tensor made on the CPU met one on the GPU"}
NAMED_CASES = {lookup_before_the_tail_only: "may overlap the tail itself"}


EXERCISES = [
    Exercise("verify", check_verify, ("model", "tokenizer"), verify_greedy,
             right=[verify, verify_with_a_python_loop],
             wrong={**VERIFY_MISTAKES, **COSTS, **ON_A_GPU,
                    verify_with_the_ids_on_the_cpu: "a tensor made on the CPU met one on the GPU"}),
    Exercise("lookup", check_lookup, (), course_lookup,
             right=[lookup, lookup_with_a_dictionary_of_tails],
             wrong={**LOOKUP_MISTAKES, **NAMED_CASES}),
    Exercise("expected_tokens", check_expected_tokens, (), course_expected_tokens,
             right=[expected_tokens, expected_tokens_as_a_sum], wrong=EXPECTED_MISTAKES),
]


def test_right_answers_written_otherwise_pass(bundled):
    assert_passes(check_verify, verify_with_a_python_loop, *bundled)
    assert_passes(check_lookup, lookup_with_a_dictionary_of_tails)
    assert_passes(check_expected_tokens, expected_tokens_as_a_sum)
