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
