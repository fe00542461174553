"""Lesson 09's checks: the learner's verify step, prompt lookup and expected tokens per verify.

``verify`` runs on the lesson's model, on a KV cache prefilled with a prompt, beside the
course's ``helpers.speculative.verify_greedy`` on a cache of its own: guesses that are all
right, wrong from the first one, wrong in the middle, no guesses at all, and the first pass
(an empty cache and the whole prompt unread). The new tokens must be the same, and so must
the cache afterwards (its length, then its keys), and the model must run one pass.
``lookup`` is compared with
``helpers.PromptLookupProposer`` on hand-made token lists, ``expected_tokens`` with the
formula of the lesson's cost model (and must return a number). None of them may change the
lists it is given.
"""

from __future__ import annotations

import torch

from ..batching import cache_layers
from ..generation import generate_with_cache
from ..speculative import PromptLookupProposer, verify_greedy
from .core import Hint, expect_close, expect_equal, expect_number, expect_unchanged, run_check
from .lesson01 import recording

__all__ = ["check_expected_tokens", "check_lookup", "check_verify", "course_expected_tokens",
           "course_lookup"]


# ---- verify -------------------------------------------------------------------------------

def _prefill(model, ids):
    from transformers import DynamicCache

    if not ids:
        return DynamicCache()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids], device=model.device), use_cache=True).past_key_values


def _choices(model, cached, unread, guesses):
    """The model's greedy choice after each of unread[-1], guesses[0], ...: one pass, no cache."""
    ids = torch.tensor([cached + unread + guesses], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    return logits[len(cached) + len(unread) - 1:].argmax(dim=-1).tolist()


def _greedy_rule(guesses, choices):
    n = 0
    while n < len(guesses) and n < len(choices) and guesses[n] == choices[n]:
        n += 1
    return guesses[:n] + choices[n:n + 1]


def _verify_cases(model, tokenizer):
    def name(token):
        return repr(tokenizer.decode([token]))

    def names(tokens):
        return "[" + ", ".join(name(t) for t in tokens) + "]"

    def checker(learner, cases):
        vocab = model.get_output_embeddings().weight.shape[0]
        prompt = tokenizer("Jack and Jill")["input_ids"]
        a = generate_with_cache(model, tokenizer, "Jack and Jill", 6, stop_at_eos=False).token_ids
        wrong = lambda t: (t + 1) % vocab                      # any other token
        scenarios = [
            ("guesses 1 and 2 right, guess 3 wrong", prompt, [a[0]], [a[1], a[2], wrong(a[3]), a[4]]),
            ("all 3 guesses right", prompt, [a[0]], [a[1], a[2], a[3]]),
            ("the first guess wrong", prompt, [a[0]], [wrong(a[1]), a[2], a[3]]),
            ("no guesses (a plain decode step)", prompt, [a[0]], []),
            ("the first pass: an empty cache, the whole prompt unread", [], prompt,
             [a[0], a[1], wrong(a[2])]),
        ]
        for label, cached, unread, guesses in scenarios:
            with cases(label):
                ref_cache, cache = _prefill(model, cached), _prefill(model, cached)
                expected = verify_greedy(model, ref_cache, list(unread), list(guesses))
                given_unread, given_guesses = list(unread), list(guesses)
                with recording(model) as calls:
                    got = learner(model, cache, given_unread, given_guesses)
                expect_unchanged("unread", list(unread), given_unread)
                expect_unchanged("guesses", list(guesses), given_guesses)
                if isinstance(got, torch.Tensor):
                    raise Hint(f"verify should return a list of token ids, got a tensor: use "
                               f".tolist()")
                if not isinstance(got, list) or not all(isinstance(t, int) for t in got):
                    raise Hint(f"verify should return a list of token ids (ints), got "
                               f"{type(got).__name__}"
                               + (f" of {type(got[0]).__name__}" if isinstance(got, list) and got else ""))
                n = len(expected) - 1                          # guesses kept
                if got != expected:
                    where = f"with guesses {names(guesses)} after {names(unread[-1:])}"
                    choices = _choices(model, cached, unread, guesses)
                    if guesses and got == _greedy_rule(guesses, choices[1:]):
                        raise Hint(f"{where} you returned {names(got)}, expected {names(expected)}: "
                                   f"your choices are one position late. The logits at the newest "
                                   f"unread token (position len(unread) - 1) give the model's "
                                   f"choice for guess 1: logits[len(unread) - 1:]")
                    if got == expected[:-1] and n == len(guesses):
                        raise Hint(f"{where} you returned {names(got)}, expected {names(expected)}: "
                                   f"every guess was right, and the pass also gives the model's own "
                                   f"token after the last guess (its last position): add it")
                    if got == expected[:-1]:
                        raise Hint(f"{where} you returned {names(got)}, expected {names(expected)}: "
                                   f"after the kept guesses comes the model's own choice where "
                                   f"guess {n + 1} was rejected ({name(expected[-1])}); every pass "
                                   f"writes at least one token")
                    if len(got) > n and got[:n + 1] == guesses[:n + 1]:
                        raise Hint(f"{where} you returned {names(got)}, expected {names(expected)}: "
                                   f"guess {n + 1} ({name(guesses[n])}) was rejected, the model "
                                   f"chose {name(expected[-1])} there: keep only the guesses before "
                                   f"the first mismatch, then the model's choice")
                    expect_equal(f"{where}, the new tokens", names(got), names(expected))
                rejected = len(guesses) - n
                length, want = cache.get_seq_length(), ref_cache.get_seq_length()
                if length > want and length - want == rejected:
                    raise Hint(f"the cache holds {length} positions afterwards, expected {want}: "
                               f"the {rejected} rejected guess(es) are still in it, and the next "
                               f"pass would attend to them: cache.crop(-{rejected})")
                if length != want:
                    raise Hint(f"the cache holds {length} positions afterwards, expected {want}: "
                               f"it keeps everything before the last token returned (the prompt, "
                               f"the unread tokens and the kept guesses); crop only the "
                               f"{rejected} rejected guess(es)")
                for layer, ((k, _), (ek, _)) in enumerate(zip(cache_layers(cache), cache_layers(ref_cache))):
                    if k.shape != ek.shape or not torch.allclose(k.float(), ek.float(), atol=1e-3):
                        raise Hint(f"the cache has the right length but other keys in layer "
                                   f"{layer}: feed the unread tokens and the guesses in one pass "
                                   f"with past_key_values=cache, and crop from the end")
                if len(calls) > 1:
                    fed = [c["input_ids"].shape[-1] for c in calls
                           if isinstance(c["input_ids"], torch.Tensor)]
                    raise Hint(f"the right tokens and cache, but the model ran {len(calls)} "
                               f"passes (fed {fed} tokens) where one is enough: feed the unread "
                               f"tokens and every guess together, in a single pass; that one "
                               f"pass for k guesses is what makes speculative decoding pay")
    return checker


VERIFY_CAUSES = {
    "positive value": "cache.crop takes a negative count: cache.crop(-r) removes the last r "
                      "positions",
    "list index out of range": "the model's choices are one per position from the newest unread "
                               "token on (logits[len(unread) - 1:]): there are len(guesses) + 1 "
                               "of them",
    "index 0 is out of bounds": "the model's choices are one per position from the newest unread "
                                "token on (logits[len(unread) - 1:])",
}


def check_verify(learner_verify, model, tokenizer):
    """Lesson 09: check the learner's ``verify(model, cache, unread, guesses)`` against
    ``helpers.speculative.verify_greedy``: the tokens it returns and the cache it leaves, with
    all guesses right, a rejection at the first and at the third guess, no guesses, and the
    first pass; print one line and return the function the rest of the lesson should use."""
    return run_check("verify", learner_verify, _verify_cases(model, tokenizer),
                     fallback=verify_greedy, causes=VERIFY_CAUSES, gpu=model)


# ---- lookup (prompt lookup) ---------------------------------------------------------------

def course_lookup(ids, k, max_ngram=3):
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the last n
    tokens, longest n first (``helpers.PromptLookupProposer``). (Lesson 09.)"""
    return PromptLookupProposer(max_ngram=max_ngram).propose(list(ids), k).tokens


def _lookup_variant(ids, k, max_ngram, latest=True, longest_first=True, skip_tail=True,
                    after_match=True, overlap=True):
    sizes = range(min(max_ngram, len(ids) - 1), 0, -1)
    for n in (sizes if longest_first else reversed(sizes)):
        tail = ids[-n:]
        last = len(ids) - n - (1 if skip_tail else 0) if overlap else len(ids) - 2 * n
        starts = range(last, -1, -1)
        for start in (starts if latest else reversed(starts)):
            if ids[start:start + n] == tail:
                first = start + n if after_match else start
                return ids[first:first + k]
    return []


LOOKUP_MISTAKES = [
    (dict(latest=False), "you took the first occurrence of the tail; take the latest one (search "
                         "from the end): recent text is the better guess"),
    (dict(longest_first=False), "you tried the shortest n-gram first; try n = max_ngram first and "
                                "go down: a longer match is a surer guess"),
    (dict(skip_tail=False), "the tail matched itself, and nothing follows it: start the search "
                            "before the tail, at len(ids) - n - 1"),
    (dict(after_match=False), "the guesses are the tokens after the match, not the match itself: "
                              "ids[start + n:start + n + k]"),
    (dict(overlap=False), "an earlier occurrence of the tail may overlap the tail itself (a "
                          "token or a phrase repeated): try every start before the tail's, up to "
                          "len(ids) - n - 1, not only the text before the tail (ids[:-n])"),
]


def _lookup_cases(learner, cases):
    repeat = [1, 2, 3, 9, 7, 3, 8, 1, 2, 3]
    scenarios = [
        ("the last 3 tokens found earlier", [[4, 5, 6, 7, 8, 1, 4, 5, 6]], 3, 3),
        ("two earlier occurrences", [[5, 6, 1, 5, 6, 2, 5, 6]], 4, 3),
        ("a 2-gram match, a 1-gram elsewhere", [[5, 6, 9, 1, 6, 2, 5, 6]], 2, 3),
        ("a 3-gram and a 1-gram match", [repeat], 2, 3),
        ("fewer than k tokens after the match", [[3, 1, 2, 3]], 4, 3),
        ("a repeated token, the match overlapping the tail", [[7, 7], [7, 7, 7, 7]], 3, 3),
        ("no match", [[1, 2, 3, 4]], 4, 3),
        ("a single token", [[9]], 2, 3),
        ("max_ngram=1", [repeat], 2, 1),
    ]
    for label, lists, k, max_ngram in scenarios:
        calls = " and ".join(f"lookup({ids}, k={k}" + (f", max_ngram={max_ngram})"
                                                       if max_ngram != 3 else ")")
                             for ids in lists)
        with cases(f"{label}: {calls}"):
            for ids in lists:
                _expect_lookup(learner, ids, k, max_ngram)


def _expect_lookup(learner, ids, k, max_ngram) -> None:
    expected = course_lookup(ids, k, max_ngram)
    given = list(ids)
    got = learner(given, k) if max_ngram == 3 else learner(given, k, max_ngram)
    expect_unchanged("ids", list(ids), given)
    if not isinstance(got, list):
        raise Hint(f"lookup should return a list of token ids, got {type(got).__name__}")
    if got == expected:
        return
    if len(got) > k:
        raise Hint(f"got {len(got)} guesses, at most k = {k} expected")
    if max_ngram != 3 and got == _lookup_variant(ids, k, 3):
        raise Hint(f"got {got}, expected {expected}: use n-grams of at most max_ngram "
                   f"tokens (here {max_ngram})")
    for mistake, hint in LOOKUP_MISTAKES:
        if got == _lookup_variant(ids, k, max_ngram, **mistake):
            raise Hint(f"got {got}, expected {expected}: {hint}")
    expect_equal("the guesses", got, expected)


def check_lookup(learner_lookup):
    """Lesson 09: check the learner's ``lookup(ids, k, max_ngram=3)`` (n-gram prompt lookup)
    against ``helpers.PromptLookupProposer`` on ten token lists; print one line and return
    the function the rest of the lesson should use."""
    return run_check("lookup", learner_lookup, _lookup_cases, fallback=course_lookup)


# ---- expected_tokens (the cost model) -----------------------------------------------------

def course_expected_tokens(alpha, k):
    """Expected tokens written by one verify pass with k guesses, each accepted with
    probability ``alpha``: 1 + alpha + ... + alpha**k. (Lesson 09.)"""
    return (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1


EXPECTED_MISTAKES = [
    (lambda a, k: (1 - a ** k) / (1 - a),
     "that is 1 + α + … + α^(k-1): one term short. A pass with k guesses writes up to k + 1 "
     "tokens, the model's own token after the last kept guess included: (1 − α^(k+1)) / (1 − α)"),
    (lambda a, k: 1 + a * k,
     "1 + k·α counts every guess as if it were checked alone, but guess i is kept only when all "
     "the guesses before it were: with probability α^i"),
    (lambda a, k: a * (1 - a ** k) / (1 - a),
     "that is the expected number of accepted guesses, α + … + α^k: every pass also writes the "
     "model's own token (+1)"),
]


def _expected_cases(learner, cases):
    for alpha, k in ((0.5, 1), (0.8, 4), (0.74, 8), (0.0, 4), (1.0, 3)):
        with cases(f"alpha = {alpha}, k = {k}"):
            expected = course_expected_tokens(alpha, k)
            try:
                got = learner(alpha, k)
            except ZeroDivisionError:
                if alpha == 1:
                    raise Hint("alpha = 1 divides by zero: every guess is accepted, so a pass "
                               "writes k + 1 tokens; return that when alpha == 1") from None
                raise
            got_value = expect_number(f"expected_tokens({alpha}, {k})", got)   # formatted later
            far = abs(got_value - expected) > 1e-9 * max(1, expected)
            if far and alpha == 1:
                raise Hint(f"expected_tokens(1.0, {k}) = {float(got):.4g}, expected {k + 1}: when "
                           f"every guess is accepted a pass writes the k guesses and the model's "
                           f"own token after them")
            if far and 0 < alpha < 1:
                for formula, hint in EXPECTED_MISTAKES:
                    if abs(float(got) - formula(alpha, k)) <= 1e-9 * max(1, expected):
                        raise Hint(f"expected_tokens({alpha}, {k}) = {float(got):.4g}, expected "
                                   f"{expected:.4g}: {hint}")
            expect_close(f"expected_tokens({alpha}, {k})", got, expected, rel=1e-9)


def check_expected_tokens(learner_expected_tokens):
    """Lesson 09: check the learner's ``expected_tokens(alpha, k)`` (tokens per verify pass in
    the cost model) against (1 − α^(k+1)) / (1 − α), α = 0 and α = 1 included; print one line
    and return the function the rest of the lesson should use."""
    return run_check("expected_tokens", learner_expected_tokens, _expected_cases,
                     fallback=course_expected_tokens)
