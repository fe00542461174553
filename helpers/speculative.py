"""Speculative decoding: guess a few tokens cheaply, let the model check them in one pass.

Introduced in lesson 09. At batch 1 a decode step reads every weight of the model to produce
one token, and a pass over 5 tokens costs little more than a pass over 1. So a cheap
**proposer** guesses the next k tokens, and the model reads its last token and the k guesses
in one forward pass with the KV cache (the **verify step**). Position i of that pass gives the
model's own choice after guess i; the guesses are kept as long as they agree with those
choices, and the model's choice at the first disagreement (or after the last guess) comes
for free. Greedy output is therefore exactly what the model writes alone, only in fewer
passes. The cache is cropped back past the last kept guess.

Two proposers share one interface (``start`` a request, then ``propose`` k tokens):

- ``DraftModelProposer``: a smaller model with the same tokenizer, with a KV cache of its own
  kept in step with the accepted text (``helpers/assets/draft``, ``scripts/train_draft.py``);
- ``PromptLookupProposer``: no model at all; finds the last few tokens earlier in the text
  and proposes what followed them there (n-gram prompt lookup).

With sampling (``temperature > 0``) a guess is accepted with probability min(1, p/q) (p: the
model's probability of the guessed token, q: the proposer's), a rejected one is replaced by a
draw from the normalised max(0, p − q), and when every guess passes one more token is drawn
from p. The tokens then follow the model's own distribution exactly (Leviathan et al. 2023,
Chen et al. 2023). A proposer that guesses without a distribution (prompt lookup) counts as
q = 1 for its guess.

The target may be any causal LM of transformers with a ``DynamicCache`` (GPT-2, Llama-style
models with grouped-query attention and rotary positions), also with a LoRA adapter on it.

The lesson's measurements end the module: ``time_forward_passes`` (what a pass over n new
tokens costs), ``time_plain`` and ``time_speculation`` (acceptance, tokens per verify and
tokens/s against k, next to plain greedy decoding), ``time_against_transformers``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .batching import model_context
from .models import Needs, load_model

#: Folder of the draft model trained for the bundled one (``scripts/train_draft.py``; its card
#: is the README.md there). ``load_model(DRAFT_MODEL_DIR)`` loads it with its tokenizer.
DRAFT_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "draft"


@dataclass
class Proposal:
    """What a proposer guessed: ``tokens``, and for each the distribution it was drawn from
    (``probs``, shape (len(tokens), vocabulary)), or None for guesses made without one
    (greedy guesses and prompt lookup: q = 1 for the guessed token). (Lesson 09.)"""

    tokens: list[int]
    probs: torch.Tensor | None = None


@dataclass
class Speculation:
    """What ``speculative_generate`` produced, and how the guesses fared. (Lesson 09.)

    ``steps`` holds one (proposed, accepted) pair per verify pass. The first pass reads the
    prompt too (the prefill) and checks the guesses made from the prompt alone.
    """

    prompt: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    steps: list[tuple[int, int]] = field(default_factory=list)
    seconds: float = 0.0
    propose_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def proposed(self) -> int:
        return sum(p for p, _ in self.steps)

    @property
    def accepted(self) -> int:
        return sum(a for _, a in self.steps)

    @property
    def verify_steps(self) -> int:
        return len(self.steps)

    @property
    def acceptance(self) -> float:
        """Accepted guesses / proposed guesses."""
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def tokens_per_verify(self) -> float:
        """Tokens each verify pass produced: the accepted guesses plus the model's own one."""
        return (self.accepted + len(self.steps)) / len(self.steps) if self.steps else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds else float("nan")


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# --- the verify step ---------------------------------------------------------------------

def _unread_list(unread) -> list[int]:
    unread = [unread] if isinstance(unread, int) else list(unread)
    if not unread:
        raise ValueError("unread must hold at least one token: the newest one, which the "
                         "cache does not hold yet (the whole prompt on the first pass)")
    return unread


@torch.inference_mode()
def verify_greedy(model, cache, unread: int | list[int], proposal: list[int]) -> list[int]:
    """One verify pass, greedy. (Lesson 09.)

    ``cache`` holds the keys and values of every token before ``unread``: the tokens the model
    has not read yet, usually just the newest one (on the first pass the whole prompt, with an
    empty cache, so that the prompt and the first guesses share one pass). Feeds them and the
    guesses in one pass and returns the new tokens: the longest prefix of ``proposal`` that
    matches the model's own greedy choices, then the model's choice after it. On return the
    cache holds every token before the last one returned.
    """
    unread = _unread_list(unread)
    ids = torch.tensor([unread + list(proposal)], device=model.device)
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0]
    # choices[i]: the model's token after guess i (choices[0]: after the unread tokens)
    choices = logits[len(unread) - 1:].argmax(dim=-1).tolist()
    n = 0
    while n < len(proposal) and proposal[n] == choices[n]:
        n += 1
    if n < len(proposal):
        cache.crop(-(len(proposal) - n))       # drop the rejected guesses' keys and values
    return list(proposal[:n]) + [choices[n]]


@torch.inference_mode()
def verify_sampling(model, cache, unread: int | list[int], proposal: Proposal,
                    temperature: float, generator: torch.Generator) -> list[int]:
    """One verify pass with sampling: ``verify_greedy``'s pass and cache handling, with the
    rejection-sampling rule of ``accept_or_resample`` instead of argmax. (Lesson 09.)"""
    unread = _unread_list(unread)
    ids = torch.tensor([unread + list(proposal.tokens)], device=model.device)
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0]
    p = torch.softmax(logits[len(unread) - 1:].float().cpu() / temperature, dim=-1)
    n, token = accept_or_resample(p, proposal, generator)
    if n < len(proposal.tokens):
        cache.crop(-(len(proposal.tokens) - n))
    return list(proposal.tokens[:n]) + [token]


def accept_or_resample(p: torch.Tensor, proposal: Proposal,
                       generator: torch.Generator | None = None) -> tuple[int, int]:
    """The rejection-sampling rule of speculative sampling. (Lesson 09.)

    ``p``: the model's distributions, shape (k + 1, vocabulary): row i after guess i − 1
    (row 0 after the last accepted token). Guess i is kept with probability min(1, p/q); at
    the first rejection a token is drawn from max(0, p − q), normalised; if all k pass, one
    more is drawn from p's last row. Returns (number of guesses kept, the token that follows).
    """
    k = len(proposal.tokens)
    if p.dim() != 2 or p.shape[0] != k + 1:
        raise ValueError(f"p must have shape (k + 1, vocabulary) = ({k + 1}, V), "
                         f"got {tuple(p.shape)}")
    q = proposal.probs
    if q is not None and tuple(q.shape) != (k, p.shape[1]):
        raise ValueError(f"proposal.probs must have shape ({k}, {p.shape[1]}), "
                         f"got {tuple(q.shape)}")
    p = p.float().cpu()
    for i, token in enumerate(proposal.tokens):
        if q is None:                        # a guess without a distribution: q = 1 for it
            q_row = torch.zeros_like(p[i])
            q_row[token] = 1.0
        else:
            q_row = q[i].float().cpu()
        if torch.rand((), generator=generator) < p[i, token] / q_row[token]:
            continue                         # accepted with probability min(1, p/q)
        residual = (p[i] - q_row).clamp(min=0)
        if residual.sum() <= 0:              # p == q up to rounding: nothing left over
            residual = p[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return k, int(torch.multinomial(p[k], 1, generator=generator))


# --- proposers ---------------------------------------------------------------------------

class PromptLookupProposer:
    """Guesses by n-gram lookup in the text so far (prompt and answer). (Lesson 09.)

    Takes the last ``max_ngram`` tokens, finds their latest earlier occurrence, and proposes
    the tokens that followed it; with no match, tries shorter n-grams down to ``min_ngram``;
    with none at all it proposes nothing (the verify pass is then a plain decode step).
    No model: the guesses cost almost nothing, and they are good whenever the answer copies
    the prompt (extraction, rewriting, code editing).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not isinstance(min_ngram, int) or min_ngram < 1:
            raise ValueError(f"min_ngram must be an integer >= 1, got {min_ngram!r}")
        if not isinstance(max_ngram, int) or max_ngram < min_ngram:
            raise ValueError(f"max_ngram must be an integer >= min_ngram ({min_ngram}), "
                             f"got {max_ngram!r}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, model, prompt_ids: list[int]) -> None:
        """A new request: nothing to keep between requests."""

    def propose(self, token_ids: list[int], k: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> Proposal:
        for n in range(min(self.max_ngram, len(token_ids) - 1), self.min_ngram - 1, -1):
            tail = token_ids[-n:]
            # latest start before the tail itself, so that something follows the match
            for start in range(len(token_ids) - n - 1, -1, -1):
                if token_ids[start:start + n] == tail:
                    return Proposal(list(token_ids[start + n:start + n + k]))
        return Proposal([])


class DraftModelProposer:
    """Guesses with a smaller model of the same tokenizer, k decode steps of its own per
    verify. (Lesson 09.)

    The draft keeps its own KV cache. Before guessing it crops that cache back to the longest
    prefix it shares with the accepted text (the rejected guesses go) and reads the tokens it
    has not seen yet, so every verify costs exactly k of its decode steps. Greedy guesses
    (temperature 0) or draws from its distribution at ``temperature``.
    """

    def __init__(self, draft):
        if not callable(draft) or not hasattr(draft, "config"):
            raise ValueError(f"draft must be a causal LM of transformers, "
                             f"got {type(draft).__name__}")
        self.draft = draft
        self.cache, self.cached_ids = None, []

    def start(self, model, prompt_ids: list[int]) -> None:
        """A new request: check the draft fits the model, forget the last request's cache."""
        ours, theirs = _vocab_size(self.draft), _vocab_size(model)
        if ours != theirs:
            raise ValueError(f"the draft's vocabulary ({ours} tokens) differs from the model's "
                             f"({theirs}): a draft must share the model's tokenizer")
        self.cache, self.cached_ids = None, []

    @torch.inference_mode()
    def propose(self, token_ids: list[int], k: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> Proposal:
        keep = _common_prefix(self.cached_ids, token_ids[:-1])   # read at least one token
        if self.cache is not None and keep < len(self.cached_ids):
            self.cache.crop(-(len(self.cached_ids) - keep))
        feed, guesses, rows = token_ids[keep:], [], []
        self.cached_ids = list(token_ids[:keep])
        for _ in range(k):
            ids = torch.tensor([feed], device=self.draft.device)
            out = self.draft(input_ids=ids, past_key_values=self.cache, use_cache=True)
            self.cache, self.cached_ids = out.past_key_values, self.cached_ids + feed
            token, row = _choose(out.logits[0, -1], temperature, generator)
            guesses.append(token)
            rows.append(row)
            feed = [token]
        probs = torch.stack(rows) if temperature > 0 and rows else None
        return Proposal(guesses, probs)


def _vocab_size(model) -> int:
    """The width of the model's logits (its config's vocabulary; an adapter does not change it)."""
    return model.config.vocab_size


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _choose(logits: torch.Tensor, temperature: float, generator) -> tuple[int, torch.Tensor | None]:
    """The next token from one row of logits: argmax, or a draw at ``temperature`` (and the
    distribution it was drawn from)."""
    if temperature == 0:
        return int(logits.argmax()), None
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator)), probs


# --- the loop ----------------------------------------------------------------------------

def _check_request(tokenizer, prompt, proposer, k, max_new_tokens, temperature) -> list[int]:
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    if not (hasattr(proposer, "start") and hasattr(proposer, "propose")):
        raise ValueError(f"proposer must have start() and propose() (a DraftModelProposer or a "
                         f"PromptLookupProposer), got {type(proposer).__name__}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k (tokens proposed per verify) must be an integer >= 1, got {k!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature!r}")
    ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise ValueError("prompt is empty: give the model at least one token to continue")
    return ids


@torch.inference_mode()
def speculative_generate(model, tokenizer, prompt: str, proposer, k: int = 4,
                         max_new_tokens: int = 20, stop_at_eos: bool = True,
                         temperature: float = 0.0, seed: int = 0) -> Speculation:
    """Decode ``prompt`` with speculation: ``proposer`` guesses up to k tokens, one verify pass
    of ``model`` checks them; the first pass reads the prompt and the first guesses together.
    Greedy (temperature 0) gives exactly the tokens of plain greedy decoding
    (``helpers.generate_with_cache``); with sampling, the model's distribution. Batch 1. Runs
    under ``torch.inference_mode`` (a little cheaper than ``no_grad``: compare with plain
    decoding run the same way). (Lesson 09.)"""
    from transformers import DynamicCache

    prompt_ids = _check_request(tokenizer, prompt, proposer, k, max_new_tokens, temperature)
    generator = torch.Generator().manual_seed(seed)
    context = model_context(model) or float("inf")
    out, eos = Speculation(prompt), tokenizer.eos_token_id if stop_at_eos else None
    _sync(model.device)
    start = time.perf_counter()
    proposer.start(model, prompt_ids)
    # the cache holds every token of ids but the unread ones (at first: the whole prompt)
    cache, ids, unread = DynamicCache(), list(prompt_ids), list(prompt_ids)
    while True:
        room = min(k, max_new_tokens - len(out.token_ids) - 1, context - len(ids))
        tick = time.perf_counter()
        proposal = proposer.propose(ids, room, temperature, generator) if room > 0 else Proposal([])
        _sync(model.device)
        tock = time.perf_counter()
        if temperature == 0:
            new = verify_greedy(model, cache, unread, proposal.tokens)
        else:
            new = verify_sampling(model, cache, unread, proposal, temperature, generator)
        _sync(model.device)
        out.propose_seconds += tock - tick
        out.verify_seconds += time.perf_counter() - tock
        out.steps.append((len(proposal.tokens), len(new) - 1))
        if not _keep(out, new, eos, max_new_tokens):
            break
        ids, unread = ids + new, new[-1:]
    out.seconds = time.perf_counter() - start
    out.text = tokenizer.decode(out.token_ids)
    return out


def _keep(out: Speculation, new: list[int], eos, max_new_tokens: int) -> bool:
    """Append the tokens of the last pass to ``out`` up to end-of-text or the limit; True while
    decoding goes on."""
    for token in new:
        if token == eos or len(out.token_ids) == max_new_tokens:
            return False
        out.token_ids.append(token)
    return len(out.token_ids) < max_new_tokens


# --- the same through transformers --------------------------------------------------------

@torch.no_grad()
def transformers_speculative(model, tokenizer, prompt: str, k: int = 4, draft=None,
                             max_new_tokens: int = 20, stop_at_eos: bool = True) -> Speculation:
    """Greedy speculation by transformers' ``generate``: with ``draft``, assisted generation
    (``assistant_model=draft``, k tokens proposed every time: a constant schedule and no
    confidence cut-off, as ours); without, prompt lookup (``prompt_lookup_num_tokens=k``).
    What the library does, for comparison; only ``token_ids``, ``text`` and ``seconds`` are
    filled in. End-of-text is left out of the text, as in ours. (Lesson 09.)"""
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    _check_request(tokenizer, prompt, PromptLookupProposer(), k, max_new_tokens, 0.0)
    settings = dict(do_sample=False, max_new_tokens=max_new_tokens,
                    pad_token_id=tokenizer.eos_token_id,
                    eos_token_id=tokenizer.eos_token_id if stop_at_eos else None)
    if draft is None:
        config, extra = GenerationConfig(prompt_lookup_num_tokens=k, **settings), {}
    else:
        config = GenerationConfig(num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                                  assistant_confidence_threshold=0.0, **settings)
        extra = {"assistant_model": draft}
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    out = Speculation(prompt)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()   # assisted generation warns about its own inner call
    try:
        _sync(model.device)
        start = time.perf_counter()
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                **extra)[0, ids.shape[1]:].tolist()
        _sync(model.device)
        out.seconds = time.perf_counter() - start
    finally:
        hf_logging.set_verbosity(verbosity)
    if stop_at_eos and tokenizer.eos_token_id in tokens:
        tokens = tokens[:tokens.index(tokenizer.eos_token_id)]
    out.token_ids, out.text = tokens, tokenizer.decode(tokens)
    return out


def course_draft(model, tokenizer):
    """The course's draft model for ``model``, and the ``Needs`` that says whether it can serve:
    (draft, needs), with draft None when it cannot. The draft was trained for the bundled model;
    its guesses are token ids, which mean something only to a model with the same vocabulary,
    and another model ($COURSE_MODEL) usually comes with a tokenizer of its own. (Lesson 09.)"""
    draft, draft_tokenizer = load_model(DRAFT_MODEL_DIR, device=model.device)
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab() or _vocab_size(draft) != _vocab_size(model):
        return None, Needs("the course's draft", "does not share this model's tokenizer")
    return draft, Needs("the course's draft")


# --- the lesson's measurements --------------------------------------------------------------

def _check_prompts(prompts) -> list[str]:
    if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompts must be a non-empty list of strings, got {prompts!r}")
    return list(prompts)


def _check_repeats(repeats) -> int:
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    return repeats


def _fastest(run, prompts, repeats):
    """``run(prompt)`` for every prompt, ``repeats`` rounds taking turns; per prompt the run
    with the least ``seconds`` (the one least disturbed by other work on the machine)."""
    best = [None] * len(prompts)
    for _ in range(repeats):
        for i, prompt in enumerate(prompts):
            result = run(prompt)
            if best[i] is None or result.seconds < best[i].seconds:
                best[i] = result
    return best


@torch.inference_mode()
def time_forward_passes(model, prompt_ids, ns, rounds: int = 4, reps: int = 5) -> dict[int, float]:
    """Seconds of one forward pass that feeds n new tokens after a KV cache holding
    ``prompt_ids``, for each n in ``ns``: {n: seconds}. The cache is cropped back after every
    pass, so each sees the same cache; each n keeps its fastest of ``rounds`` × ``reps``
    passes, the rounds going over every n in turn (a busy moment of the machine cannot spoil
    one n alone). What a verify pass over k guesses (k + 1 tokens) costs. (Lesson 09.)"""
    ns = list(ns)
    if not ns or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in ns):
        raise ValueError(f"ns must be a non-empty list of token counts >= 1, got {ns!r}")
    for name, value in (("rounds", rounds), ("reps", reps)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    ids = torch.as_tensor(prompt_ids, device=model.device).view(1, -1)
    if ids.shape[1] == 0:
        raise ValueError("prompt_ids is empty: the cache must hold at least one token")
    cache = model(input_ids=ids, use_cache=True).past_key_values
    seconds = {n: float("inf") for n in ns}
    for _ in range(rounds):
        for n in ns:
            new = torch.ones(1, n, dtype=torch.long, device=model.device)
            for _ in range(reps):
                _sync(model.device)
                start = time.perf_counter()
                model(input_ids=new, past_key_values=cache, use_cache=True)
                _sync(model.device)
                seconds[n] = min(seconds[n], time.perf_counter() - start)
                cache.crop(-n)
    return seconds


@dataclass
class _Timed:
    token_ids: list[int]
    seconds: float


def time_plain(model, tokenizer, prompts, max_new_tokens: int = 40, stop_at_eos: bool = False,
               repeats: int = 1) -> dict:
    """Plain greedy decoding (``helpers.generate_with_cache``) of every prompt, timed under
    ``torch.inference_mode`` as ``speculative_generate`` runs. Returns ``tokens_per_second``
    (all the answers' tokens over all their seconds), ``seconds_per_token`` and ``token_ids``
    (one list per prompt). With ``repeats`` > 1 each prompt's fastest run counts. The yardstick
    of ``time_speculation``. (Lesson 09.)"""
    from .generation import generate_with_cache

    prompts, repeats = _check_prompts(prompts), _check_repeats(repeats)

    def run(prompt):
        with torch.inference_mode():
            out = generate_with_cache(model, tokenizer, prompt, max_new_tokens,
                                      stop_at_eos=stop_at_eos)
        return _Timed(out.token_ids, out.latency)

    runs = _fastest(run, prompts, repeats)
    tokens, seconds = sum(len(r.token_ids) for r in runs), sum(r.seconds for r in runs)
    return dict(tokens_per_second=tokens / seconds, seconds_per_token=seconds / tokens,
                token_ids=[r.token_ids for r in runs])


def time_speculation(model, tokenizer, prompts, proposer, ks, max_new_tokens: int = 40,
                     stop_at_eos: bool = False, repeats: int = 1, plain: dict | None = None
                     ) -> dict[int, dict]:
    """Greedy ``speculative_generate`` of every prompt with ``proposer`` at each k in ``ks``,
    measured against plain greedy decoding (``plain``: what ``time_plain`` returned for the
    same prompts and settings; measured here when None). (Lesson 09.)

    Returns {k: measures}, the measures over all prompts together:

    - ``acceptance``: accepted guesses / proposed guesses;
    - ``alpha``: accepted / (accepted + rejections), the chance that one guess passes, as the
      cost model uses it (every rejection ends a run of accepted guesses);
    - ``tokens_per_verify``: (accepted guesses + verify passes) / verify passes;
    - ``tokens_per_second`` and ``speedup`` (over plain decoding's tokens/s);
    - ``seconds_per_guess`` (the proposer's time over its guesses: a draft step) and
      ``seconds_per_verify`` (one verify pass), from the same runs;
    - ``same_as_plain``: True when every answer has plain decoding's tokens;
    - ``runs``: the ``Speculation`` of each prompt.

    With ``repeats`` > 1 each prompt's fastest run counts.
    """
    prompts, repeats = _check_prompts(prompts), _check_repeats(repeats)
    ks = list(ks)
    if not ks or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in ks):
        raise ValueError(f"ks must be a non-empty list of integers >= 1 (tokens proposed per "
                         f"verify), got {ks!r}")
    if plain is None:
        plain = time_plain(model, tokenizer, prompts, max_new_tokens, stop_at_eos, repeats)
    elif not (isinstance(plain, dict) and len(plain.get("token_ids", ())) == len(prompts)):
        raise ValueError(f"plain must be what time_plain returned for these {len(prompts)} "
                         f"prompts")
    results = {}
    for k in ks:
        runs = _fastest(lambda p: speculative_generate(model, tokenizer, p, proposer, k=k,
                                                       max_new_tokens=max_new_tokens,
                                                       stop_at_eos=stop_at_eos),
                        prompts, repeats)
        accepted, proposed = sum(r.accepted for r in runs), sum(r.proposed for r in runs)
        rejections = sum(a < p for r in runs for p, a in r.steps)
        passes = sum(r.verify_steps for r in runs)
        tokens_per_second = sum(len(r.token_ids) for r in runs) / sum(r.seconds for r in runs)
        results[k] = dict(
            acceptance=accepted / proposed if proposed else float("nan"),
            alpha=accepted / (accepted + rejections) if accepted + rejections else float("nan"),
            tokens_per_verify=(accepted + passes) / passes,
            tokens_per_second=tokens_per_second,
            speedup=tokens_per_second / plain["tokens_per_second"],
            seconds_per_guess=(sum(r.propose_seconds for r in runs) / proposed
                               if proposed else float("nan")),
            seconds_per_verify=sum(r.verify_seconds for r in runs) / passes,
            same_as_plain=[r.token_ids for r in runs] == plain["token_ids"],
            runs=runs)
    return results


def time_against_transformers(model, tokenizer, prompts, proposer, k: int,
                              max_new_tokens: int = 40, repeats: int = 1) -> dict:
    """Our greedy speculation against transformers' doing the same (``transformers_speculative``:
    assisted generation for a ``DraftModelProposer``, with its draft; prompt lookup for a
    ``PromptLookupProposer``), same prompts, same k, both under ``torch.inference_mode``, after
    one warm-up call of each. Returns ``ours`` and ``transformers`` (tokens/s over all prompts),
    ``ratio`` (ours / theirs) and ``same_tokens`` (True when every answer is the same). With
    ``repeats`` > 1 the two take turns and each prompt's fastest run counts. (Lesson 09.)"""
    prompts, repeats = _check_prompts(prompts), _check_repeats(repeats)
    if isinstance(proposer, DraftModelProposer):
        draft = proposer.draft
    elif isinstance(proposer, PromptLookupProposer):
        draft = None
    else:
        raise ValueError(f"proposer must be a DraftModelProposer or a PromptLookupProposer "
                         f"(what transformers can do too), got {type(proposer).__name__}")

    def ours(prompt):
        return speculative_generate(model, tokenizer, prompt, proposer, k=k,
                                    max_new_tokens=max_new_tokens)

    def theirs(prompt):
        with torch.inference_mode():
            return transformers_speculative(model, tokenizer, prompt, k=k, draft=draft,
                                            max_new_tokens=max_new_tokens)

    ours(prompts[0]), theirs(prompts[0])                  # warm-up of both paths
    best = {"ours": [None] * len(prompts), "transformers": [None] * len(prompts)}
    for _ in range(repeats):
        for i, prompt in enumerate(prompts):
            for name, run in (("ours", ours), ("transformers", theirs)):
                result = run(prompt)
                if best[name][i] is None or result.seconds < best[name][i].seconds:
                    best[name][i] = result
    speed = {name: sum(len(r.token_ids) for r in runs) / sum(r.seconds for r in runs)
             for name, runs in best.items()}
    return dict(ours=speed["ours"], transformers=speed["transformers"],
                ratio=speed["ours"] / speed["transformers"],
                same_tokens=([r.token_ids for r in best["ours"]]
                             == [r.token_ids for r in best["transformers"]]))
