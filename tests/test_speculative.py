"""Lesson 09: speculative decoding.

Greedy speculation must give exactly the tokens of plain greedy decoding
(``generate_with_cache``), whatever the proposer guesses: for the draft model and prompt
lookup, k = 1..8, answers that end at end-of-text and at max_new_tokens, on the bundled GPT-2
(with the shipped draft) and on a tiny random Llama (rotary positions, 4 heads sharing 2 kv
heads, with a tiny random Llama as its draft), and with a LoRA adapter on the target. After a
rejected guess the cache holds what plain decoding's cache holds at the same position. With
sampling, the rejection rule gives tokens distributed as the target's p (a counting test on a
tiny vocabulary).
"""

import copy

import pytest
import torch

from helpers import generate_with_cache, load_adapters, load_model
from helpers.speculative import (DRAFT_MODEL_DIR, DraftModelProposer, PromptLookupProposer,
                                 Proposal, accept_or_resample, speculative_generate,
                                 time_against_transformers, time_forward_passes, time_plain,
                                 time_speculation, verify_greedy)

from .conftest import COURSE_PROMPTS, random_llama

pytestmark = pytest.mark.usefixtures("one_thread")   # see tests/conftest.py

# The course's prompts (their answers end at end-of-text within 30 tokens), a prompt whose
# answer repeats it (prompt lookup has something to find) and the start of a story (it runs
# past 30 tokens).
REPEATS = ("Humpty Dumpty sat on a wall. Humpty Dumpty had a great fall. All the king's horses "
           "and all the king's men could not put Humpty together again. Humpty Dumpty sat")
STORY = "Once upon a time, there was a kind owl named Leo. He lived"
PROMPTS = COURSE_PROMPTS + [REPEATS, STORY]


class EosAt:
    """The tokenizer with another end-of-text token: a random model never writes the real one,
    so its tests name a token it does write, to end an answer early."""

    def __init__(self, tokenizer, eos_token_id):
        self.tokenizer, self.eos_token_id = tokenizer, eos_token_id

    def __call__(self, *args, **kwargs):
        return self.tokenizer(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self.tokenizer.decode(*args, **kwargs)


@pytest.fixture(scope="module")
def draft():
    return load_model(DRAFT_MODEL_DIR, device="cpu")[0]


@pytest.fixture(scope="module")
def llama_pair(tiny_llama):
    """A tiny random Llama target and its draft: the same model cut to its first layer (so
    that the two agree on some tokens and not on others, as a trained draft would)."""
    model, tokenizer = tiny_llama
    draft = random_llama(tokenizer, layers=1)
    draft.load_state_dict(model.state_dict(), strict=False)   # layer 1's weights are left out
    return model, draft, tokenizer


def proposers(draft):
    return {"draft": DraftModelProposer(draft), "lookup": PromptLookupProposer()}


def check_identical(model, tokenizer, draft, prompt, max_new_tokens, stats):
    """Every k and both proposers give plain greedy's tokens; counts guesses for ``stats``."""
    expected = generate_with_cache(model, tokenizer, prompt, max_new_tokens).token_ids
    for name, proposer in proposers(draft).items():
        for k in range(1, 9):
            got = speculative_generate(model, tokenizer, prompt, proposer, k=k,
                                       max_new_tokens=max_new_tokens)
            assert got.token_ids == expected, (name, k, prompt)
            assert got.text == tokenizer.decode(expected)
            stats[name] = [a + b for a, b in zip(stats.get(name, [0, 0]),
                                                  (got.accepted, got.proposed - got.accepted))]
    return expected


def test_greedy_is_token_identical_on_the_bundled_model(bundled, draft):
    model, tokenizer = bundled
    stats, lengths = {}, []
    for prompt in PROMPTS:
        lengths.append(len(check_identical(model, tokenizer, draft, prompt, 30, stats)))
    assert min(lengths) < 30 and max(lengths) == 30      # some end at EOS, some at the limit
    for name, (accepted, rejected) in stats.items():      # the test saw both outcomes
        assert accepted > 0 and rejected > 0, name


def test_greedy_is_token_identical_on_a_tiny_llama(llama_pair):
    model, draft, tokenizer = llama_pair
    stats = {}
    for prompt in COURSE_PROMPTS:
        plain = generate_with_cache(model, tokenizer, prompt, 24, stop_at_eos=False).token_ids
        check_identical(model, tokenizer, draft, prompt, 24, stats)
        # the same prompt ending at the answer's 10th token, made end-of-text
        early = EosAt(tokenizer, plain[9])
        got = check_identical(model, early, draft, prompt, 24, stats)
        assert got == plain[:plain.index(plain[9])]
    for name, (accepted, rejected) in stats.items():
        assert accepted > 0 and rejected > 0, name


def test_a_llama_draft_of_another_vocabulary_is_refused(llama_pair, bundled):
    model, _, tokenizer = llama_pair
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1)).eval()
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_generate(model, tokenizer, "Jack and Jill", DraftModelProposer(other))


def test_course_draft_serves_the_bundled_model_only(bundled, llama_pair, capsys):
    """The draft comes back for the bundled model; for a model whose tokenizer differs, None
    and a Needs that skips with one line naming the tokenizer."""
    from helpers import course_draft, load_tokenizer

    model, tokenizer = bundled
    draft, needs = course_draft(model, tokenizer)
    assert draft is not None and needs.ok
    other_tokenizer = load_tokenizer()
    other_tokenizer.add_tokens(["<extra>"])
    draft, needs = course_draft(model, other_tokenizer)
    assert draft is None and needs.missing("Section 5")
    assert capsys.readouterr().out == ("Section 5: skipped, the course's draft does not share "
                                       "this model's tokenizer.\n")


def _cache_tensors(cache):
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


@pytest.mark.parametrize("which", ["bundled", "llama"])
def test_the_cache_after_a_rejected_guess_is_plain_decodings(which, bundled, llama_pair):
    model, tokenizer = bundled if which == "bundled" else (llama_pair[0], llama_pair[2])
    prompt = tokenizer("Jack and Jill")["input_ids"]
    plain = generate_with_cache(model, tokenizer, "Jack and Jill", 8, stop_at_eos=False).token_ids
    with torch.no_grad():
        # plain decoding: the prompt and the first 3 answer tokens in the cache
        ids = torch.tensor([prompt + plain[:3]])
        reference = model(input_ids=ids, use_cache=True).past_key_values
        cache = model(input_ids=torch.tensor([prompt]), use_cache=True).past_key_values
    wrong = (plain[3] + 1) % len(tokenizer)
    # guesses: answer tokens 2 and 3 (right), then a wrong one, then two more
    new = verify_greedy(model, cache, plain[0], [plain[1], plain[2], wrong, plain[4], plain[5]])
    assert new == plain[1:4]
    assert cache.get_seq_length() == reference.get_seq_length() == len(prompt) + 3
    for ours, theirs in zip(_cache_tensors(cache), _cache_tensors(reference)):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_the_draft_cache_follows_the_accepted_text(bundled, draft):
    """After a verify rejected some guesses, the draft's next proposal crops its cache to the
    accepted text: its cache then equals a fresh prefill of that text."""
    model, tokenizer = bundled
    proposer = DraftModelProposer(draft)
    ids = tokenizer("Once upon a time, there was a little fox named Tom.")["input_ids"]
    proposer.start(model, ids)
    first = proposer.propose(ids, 6).tokens
    accepted = ids + first[:2] + [(first[2] + 1) % len(tokenizer)]    # 2 kept, then another
    second = proposer.propose(accepted, 3).tokens
    assert proposer.cached_ids == accepted + second[:-1]
    with torch.no_grad():
        fresh = draft(input_ids=torch.tensor([accepted + second[:-1]]), use_cache=True)
    for ours, theirs in zip(_cache_tensors(proposer.cache), _cache_tensors(fresh.past_key_values)):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_an_adapter_on_the_target(bundled, draft):
    """The entities adapter answers in JSON: prompt lookup and the draft (without the adapter)
    propose, the adapted target verifies; the tokens are the adapter's own."""
    model, tokenizer = bundled
    adapted = copy.deepcopy(model)
    lora = load_adapters(adapted, ["entities"])
    lora.set_rows(["entities"])
    prompt = "Input: Tom the fox met Lily the owl at the river and found a red ball.\nOutput:"
    expected = generate_with_cache(adapted, tokenizer, prompt, 40)
    assert expected.text.strip().startswith('{"characters": ["Tom the fox"')
    for proposer in proposers(draft).values():
        for k in (2, 5):
            got = speculative_generate(adapted, tokenizer, prompt, proposer, k=k, max_new_tokens=40)
            assert got.token_ids == expected.token_ids
            assert got.proposed > 0 and got.accepted < got.proposed   # guesses were rejected


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    proposer = PromptLookupProposer(max_ngram=2)
    assert proposer.propose([5, 6, 7, 8, 9, 5, 6], 3).tokens == [7, 8, 9]
    assert proposer.propose([5, 6, 1, 5, 6, 2, 5, 6], 3).tokens == [2, 5, 6]   # the latest
    assert proposer.propose([1, 2, 3, 4], 3).tokens == []                       # no match
    assert proposer.propose([1, 9, 9, 2, 1], 2).tokens == [9, 9]               # a 1-gram
    assert proposer.propose([7, 7], 4).tokens == [7]                           # stops at the end


# --- sampling ------------------------------------------------------------------------------

# A vocabulary of 4 tokens. The target p and the proposer q disagree on purpose: q likes
# token 0, which p rarely writes, and never proposes token 3.
P = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]])
Q = torch.tensor([0.7, 0.2, 0.1, 0.0])
DRAWS = 20_000
# Chi-square with 3 degrees of freedom (4 tokens): 16.27 is its 0.1 % critical value. A
# correct rule fails this with probability 0.001 for a random seed (and never with the fixed
# seed below, the test being deterministic); a wrong rule is far beyond it with 20 000 draws:
# the proposer's own q scores about 9 000 here, and one probability off by 0.02 about 30.
CRITICAL = 16.27


def chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def sample_first_two(q_row, seed=0):
    """DRAWS runs of one verify with one guess drawn from ``q_row`` (or the fixed guess 0 when
    q_row is None, as prompt lookup): counts of the first token written, and of the second
    one when the guess was kept (the extra token from p's second row)."""
    generator = torch.Generator().manual_seed(seed)
    first, second = torch.zeros(4), torch.zeros(4)
    for _ in range(DRAWS):
        guess = 0 if q_row is None else int(torch.multinomial(q_row, 1, generator=generator))
        proposal = Proposal([guess], None if q_row is None else q_row[None])
        kept, token = accept_or_resample(P, proposal, generator)
        first[guess if kept else token] += 1
        if kept:
            second[token] += 1
    return first, second


@pytest.mark.parametrize("q_row", [Q, None], ids=["draft q", "lookup guess"])
def test_rejection_sampling_writes_the_targets_distribution(q_row):
    first, second = sample_first_two(q_row)
    assert chi_square(first, P[0]) < CRITICAL
    assert chi_square(second, P[1]) < CRITICAL
    # the same counting test catches a rule that keeps every guess
    guesses = torch.bincount(torch.multinomial(Q, DRAWS, replacement=True,
                                               generator=torch.Generator().manual_seed(1)),
                             minlength=4).float()
    assert chi_square(guesses, P[0]) > 100 * CRITICAL


def test_sampling_is_seeded_and_runs_with_both_proposers(bundled, draft):
    model, tokenizer = bundled
    for proposer in proposers(draft).values():
        runs = [speculative_generate(model, tokenizer, "Once upon a time", proposer, k=4,
                                     max_new_tokens=30, temperature=1.0, seed=seed).token_ids
                for seed in (0, 0, 1)]
        assert runs[0] == runs[1] and len(runs[0]) > 0


# --- the lesson's measurements -----------------------------------------------------------
# Structure and token identity only: the times themselves depend on the machine.

MEASURED = ["Jack and Jill", "Humpty Dumpty sat on a wall. Humpty Dumpty had a great fall. "
            "Humpty Dumpty sat"]


def test_time_forward_passes_times_each_token_count(bundled):
    model, tokenizer = bundled
    ids = tokenizer("Once upon a time, there was a fox.")["input_ids"]
    seconds = time_forward_passes(model, ids, [1, 3, 5], rounds=2, reps=2)
    assert list(seconds) == [1, 3, 5] and all(0 < t < 10 for t in seconds.values())
    for bad, words in ((dict(ns=[]), "ns"), (dict(ns=[0]), "ns"), (dict(rounds=0), "rounds"),
                       (dict(reps=1.5), "reps"), (dict(prompt_ids=[]), "prompt_ids")):
        args = dict(prompt_ids=ids, ns=[1]) | bad
        with pytest.raises(ValueError, match=words):
            time_forward_passes(model, args.pop("prompt_ids"), args.pop("ns"), **args)


def test_time_plain_and_time_speculation_keep_plain_greedys_tokens(bundled, draft):
    model, tokenizer = bundled
    plain = time_plain(model, tokenizer, MEASURED, 16, stop_at_eos=False, repeats=2)
    expected = [generate_with_cache(model, tokenizer, p, 16, stop_at_eos=False).token_ids
                for p in MEASURED]
    assert plain["token_ids"] == expected
    assert plain["tokens_per_second"] > 0
    assert plain["seconds_per_token"] == pytest.approx(1 / plain["tokens_per_second"])
    keys = {"acceptance", "alpha", "tokens_per_verify", "tokens_per_second", "speedup",
            "seconds_per_guess", "seconds_per_verify", "same_as_plain", "runs"}
    for proposer in proposers(draft).values():
        results = time_speculation(model, tokenizer, MEASURED, proposer, [1, 3], 16,
                                   plain=plain)
        assert list(results) == [1, 3]
        for k, res in results.items():
            assert set(res) == keys
            assert res["same_as_plain"] and [r.token_ids for r in res["runs"]] == expected
            assert 0 <= res["acceptance"] <= 1 and 0 <= res["alpha"] <= 1
            assert 1 <= res["tokens_per_verify"] <= k + 1
            assert res["speedup"] == pytest.approx(res["tokens_per_second"]
                                                   / plain["tokens_per_second"])
            accepted = sum(r.accepted for r in res["runs"])
            passes = sum(r.verify_steps for r in res["runs"])
            assert res["tokens_per_verify"] == pytest.approx((accepted + passes) / passes)
    # without plain, it measures plain decoding itself; repeats keep each prompt's fastest run
    alone = time_speculation(model, tokenizer, MEASURED[:1], PromptLookupProposer(), [2], 16,
                             repeats=2)
    assert alone[2]["same_as_plain"] and alone[2]["runs"][0].token_ids == expected[0]


def test_time_against_transformers_gives_the_same_tokens(bundled, draft):
    model, tokenizer = bundled
    for proposer in proposers(draft).values():
        result = time_against_transformers(model, tokenizer, MEASURED, proposer, 3, 16)
        assert set(result) == {"ours", "transformers", "ratio", "same_tokens"}
        assert result["same_tokens"] is True
        assert result["ratio"] == pytest.approx(result["ours"] / result["transformers"])


def test_the_measurements_refuse_bad_input(bundled):
    model, tokenizer = bundled
    lookup = PromptLookupProposer()
    for prompts in ("Jack and Jill", [], ["Jack", 3]):
        with pytest.raises(ValueError, match="prompts"):
            time_plain(model, tokenizer, prompts)
    with pytest.raises(ValueError, match="repeats"):
        time_plain(model, tokenizer, MEASURED, repeats=0)
    with pytest.raises(ValueError, match="ks"):
        time_speculation(model, tokenizer, MEASURED, lookup, [0, 2])
    with pytest.raises(ValueError, match="plain"):
        time_speculation(model, tokenizer, MEASURED, lookup, [2], plain={"token_ids": [[1]]})
    with pytest.raises(ValueError, match="proposer"):
        time_against_transformers(model, tokenizer, MEASURED, "ngram", 2)


# --- bad input -----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, words", [
    (dict(k=0), "k "), (dict(k=2.5), "k "), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-1), "temperature"), (dict(prompt=""), "empty"),
    (dict(prompt=["Jack"]), "prompt must be a string"), (dict(proposer="ngram"), "proposer"),
])
def test_bad_input_is_refused(bundled, kwargs, words):
    model, tokenizer = bundled
    args = dict(prompt="Jack and Jill", proposer=PromptLookupProposer()) | kwargs
    with pytest.raises(ValueError, match=words):
        speculative_generate(model, tokenizer, args.pop("prompt"), args.pop("proposer"), **args)


def test_a_verify_pass_needs_an_unread_token(bundled):
    model, tokenizer = bundled
    with torch.no_grad():
        cache = model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=True).past_key_values
    with pytest.raises(ValueError, match="unread"):
        verify_greedy(model, cache, [], [1, 2])
    assert cache.get_seq_length() == 3                      # refused before the pass


def test_bad_proposers_and_distributions_are_refused():
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupProposer(min_ngram=0)
    with pytest.raises(ValueError, match="max_ngram"):
        PromptLookupProposer(max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="draft"):
        DraftModelProposer("gpt2")
    with pytest.raises(ValueError, match="shape"):
        accept_or_resample(P, Proposal([1, 2]))              # 2 guesses need 3 rows of p
    with pytest.raises(ValueError, match="probs"):
        accept_or_resample(P, Proposal([1], torch.ones(1, 5) / 5))


def test_the_lessons_figure():
    from helpers.plots import speculation_figure

    sweeps = {"draft model": {1: (0.7, 900.0), 4: (0.5, 800.0)}, "prompt lookup": {1: (0.2, 950.0)}}
    fig = speculation_figure(sweeps, 1000.0, predicted={"draft model": {1: 950.0, 4: 850.0}})
    accept, speed = fig.axes
    assert len(accept.lines) == 2 and len(speed.lines) == 4     # + the model's line, + plain
    for bad in ({}, {"draft": {}}):
        with pytest.raises(ValueError, match="sweeps"):
            speculation_figure(bad, 1000.0)
    with pytest.raises(ValueError, match="plain_tokens_per_second"):
        speculation_figure(sweeps, 0)
