"""Choosing each row's next token: the rules a request may set. (Lesson 07.)

The engine runs lesson 03's ``generate_next_token`` with a chooser instead of the greedy
``argmax``. For every row the chooser starts from the model's logits for the next token and

1. adjusts them: the penalties for repeating (``repetition_penalty``,
   ``frequency_presence_penalty``), the request's ``logit_bias``, and its grammar's mask (tokens
   the grammar forbids get -inf, ``helpers.server.grammar``);
2. picks a token: the likeliest one (``greedy``), or a draw (``sample``) from the distribution
   reshaped by temperature, top-k, top-p and typical-p, with the request's own seeded
   ``torch.Generator`` (the same seed gives the same answer, whatever else runs beside it);
3. reports the token's log probability and, if asked, the likeliest alternatives
   (``top_alternatives``).

Each function handles one row (a 1-D tensor of logits) and says in its docstring whose
convention it follows. ``check_finite`` is how one broken row (NaN or +inf from extreme
settings) is told apart, so that it fails alone.

The engine calls ``TokenChooser`` after every forward pass: it applies each row's rules to
its own row of logits (part 4 below) and sets ``request.choice`` (token, log probability,
alternatives); ``Sequence.accept`` then turns the choice into the token's event. A row whose
choice fails (NaN logits from extreme settings, a failing grammar) gets its ``error`` set and
the padding token as its token: it fails alone, and the other rows of the batch carry on.
"""

from __future__ import annotations

from collections import Counter

import torch

from .contract import PromptEvent
from .errors import GenerationFailed


# --- 1. adjusting the logits -----------------------------------------------------------------

def repetition_penalty(logits: torch.Tensor, seen_ids, penalty: float) -> None:
    """Make every token already seen (prompt and answer) less likely, in place. transformers'
    and TGI's rule: a positive logit is divided by ``penalty``, a negative one multiplied, so
    that a penalty > 1 always lowers the token's probability."""
    seen = torch.tensor(sorted(set(seen_ids)), dtype=torch.long, device=logits.device)
    if len(seen) == 0:
        return
    values = logits[seen]
    logits[seen] = torch.where(values > 0, values / penalty, values * penalty)


def frequency_presence_penalty(logits: torch.Tensor, counts: Counter, frequency: float,
                               presence: float) -> None:
    """OpenAI's penalties over the tokens generated so far, in place: a token's logit loses
    ``frequency`` for each time it was generated, and ``presence`` once if it was at all."""
    if not counts:
        return
    ids = torch.tensor(list(counts), dtype=torch.long, device=logits.device)
    times = torch.tensor(list(counts.values()), dtype=logits.dtype, device=logits.device)
    logits[ids] -= frequency * times + presence


def add_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> None:
    """OpenAI's ``logit_bias``: a fixed amount added to the logits of listed token ids."""
    ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
    logits[ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)


def check_finite(logits: torch.Tensor) -> None:
    """A row's logits may hold -inf (forbidden tokens) but never NaN or +inf: those come from
    extreme settings (a temperature of 1e-40, a penalty of 1e-40) and cannot be sampled."""
    if torch.isnan(logits).any() or torch.isposinf(logits).any():
        raise GenerationFailed("the next token's probabilities are not numbers (NaN or "
                               "infinity); extreme sampling settings are the usual cause")


# --- 2. picking a token --------------------------------------------------------------------

def greedy(logits: torch.Tensor) -> list[int]:
    """The likeliest next token of every row of (rows, vocab) logits (lesson 03's choice)."""
    return logits.argmax(dim=-1).tolist()


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Only the ``k`` likeliest tokens stay (ties with the k-th stay too)."""
    if k >= logits.numel():
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus sampling: the likeliest tokens whose probabilities add up to ``p`` stay (the one
    that crosses ``p`` too); the likeliest token always stays."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs          # the mass of the tokens ranked above
    drop = before >= p
    drop[0] = False
    return logits.index_fill(0, order[drop], float("-inf"))


def min_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Min-p sampling (vLLM's and transformers' ``min_p``): the tokens at least ``p`` times as
    likely as the likeliest stay; the likeliest always stays."""
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < p * probs.max(), float("-inf"))


def typical_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Typical sampling (Meister et al., 2022; transformers' ``typical_p``): rank tokens by how
    far their surprise (-log prob) is from the distribution's entropy, closest first, and keep
    them until their probabilities add up to ``p`` (the one that crosses ``p`` too)."""
    if p >= 1.0:
        return logits
    logprobs = torch.log_softmax(logits, dim=-1)
    probs = logprobs.exp()
    entropy = -(probs * logprobs.nan_to_num(neginf=0.0)).sum()
    distance = (-logprobs - entropy).abs()
    order = torch.argsort(distance)                # most typical first
    before = probs[order].cumsum(dim=-1) - probs[order]
    drop = before >= p
    drop[0] = False
    return logits.index_fill(0, order[drop], float("-inf"))


def sample(logits: torch.Tensor, params, generator: torch.Generator) -> tuple[int, float]:
    """Draw one token from a row's logits: temperature, then top-k, top-p, typical-p and
    min-p, with the request's ``generator``. Returns the token and its log probability under
    the distribution it was drawn from."""
    x = logits.detach().to("cpu", torch.float32)
    if params.temperature is not None:
        x = x / params.temperature
    if params.top_k is not None:
        x = top_k_filter(x, params.top_k)
    if params.top_p is not None:
        x = top_p_filter(x, params.top_p)
    if params.typical_p is not None:
        x = typical_filter(x, params.typical_p)
    if params.min_p is not None:
        x = min_p_filter(x, params.min_p)
    check_finite(x)
    logprobs = torch.log_softmax(x, dim=-1)
    token = int(torch.multinomial(logprobs.exp(), 1, generator=generator))
    return token, float(logprobs[token])


# --- 3. reporting ---------------------------------------------------------------------------

def finite(value: float) -> float:
    """JSON has no -inf: a log probability of an impossible token is reported as -1e9."""
    return value if value > -1e9 else -1e9


def top_alternatives(logprobs: torch.Tensor, n: int, tokenizer) -> list[dict]:
    """The ``n`` likeliest tokens of a row and their log probabilities, likeliest first."""
    top = logprobs.topk(min(n, logprobs.numel()))
    return [{"id": int(t), "text": tokenizer.decode([int(t)]), "logprob": finite(float(lp))}
            for lp, t in zip(top.values.tolist(), top.indices.tolist())]


def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], tokenizer,
                    alternatives: int | None = None) -> list[dict]:
    """Every prompt token with its log probability given the tokens before it, from the
    prefill's logits at the prompt's positions (prompt length, vocab). The first token has no
    context, so its logprob is None (as in TGI and OpenAI's ``echo``). With ``alternatives``
    the others also get their top alternatives (OpenAI's ``top_logprobs`` of an echoed
    prompt, which evaluation harnesses read to tell whether a continuation is greedy)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(prompt_ids[1:], dtype=torch.long, device=logits.device)
    # Position i predicts token i + 1.
    values = logprobs[:-1].gather(1, ids.unsqueeze(1)).squeeze(1).tolist() if len(ids) else []
    out = [{"id": int(prompt_ids[0]), "text": tokenizer.decode([prompt_ids[0]]), "logprob": None}]
    for i, (token, value) in enumerate(zip(prompt_ids[1:], values)):
        out.append({"id": int(token), "text": tokenizer.decode([token]),
                    "logprob": finite(value)})
        if alternatives:
            out[-1]["alternative_tokens"] = top_alternatives(logprobs[i], alternatives,
                                                             tokenizer)
    return out


# --- 4. every row by its own rules -------------------------------------------------------------

def guarded(row, function, *args) -> None:
    """Run one row's part of the choice; an exception fails that row (``row.error``), not the
    batch. Nothing runs for a row that has failed already."""
    if row.error is not None:
        return
    try:
        function(*args)
    except Exception as err:
        row.error = err


class TokenChooser:
    """``chooser(rows, logits, outgoing)``: each row's next token by its own rules, the list
    given back to lesson 03's ``generate_next_token`` (or lesson 08's ``paged_next_token``)
    as its ``choose``. (Lesson 07.)

    rows:     the sequences, one per row of ``logits``
    logits:   (rows, positions, vocab); the last position is the one to choose from
    outgoing: where ``score_prompt`` puts the prompt events (the token events come from
              ``Sequence.accept``)
    """

    def __init__(self, tokenizer, eos_id: int | None, pad_id: int):
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self.pad_id = pad_id

    def __call__(self, rows: list, logits: torch.Tensor, outgoing: list) -> list[int]:
        last = logits[:, -1, :].float()
        if any(row.adjusts_logits for row in rows):
            last = last.clone()
            for i, row in enumerate(rows):
                if row.adjusts_logits:
                    guarded(row, self._adjust, row, last[i])
        logprobs = torch.log_softmax(last, dim=-1)
        tokens = greedy(last)
        chosen = logprobs.gather(1, torch.tensor(tokens, device=last.device)[:, None])
        chosen = chosen.squeeze(1).tolist()
        broken = (torch.isnan(last).any(dim=-1) | torch.isposinf(last).any(dim=-1)).tolist()
        for i, row in enumerate(rows):
            if broken[i]:
                guarded(row, check_finite, last[i])
            if row.error is None:
                guarded(row, self._pick, row, tokens[i], chosen[i], last[i], logprobs[i])
        return [row.choice[0] if row.error is None and row.choice[0] is not None
                else self.pad_id for row in rows]

    def score_prompt(self, row, logits: torch.Tensor, outgoing: list) -> None:
        """The PromptEvent: every prompt token's logprob, from the logits at its positions."""
        tokens = prompt_logprobs(logits, row.prompt_ids, self.tokenizer,
                                          row.params.alternatives)
        outgoing.append((row, PromptEvent(tokens)))

    def _adjust(self, row, logits: torch.Tensor) -> None:
        """A row's logits after its penalties, its logit bias and its grammar's mask."""
        params = row.params
        if row.penalty is not None:
            repetition_penalty(logits, row.prompt_ids + row.ids, row.penalty)
        if params.frequency_penalty or params.presence_penalty:
            frequency_presence_penalty(logits, row.counts, params.frequency_penalty,
                                                params.presence_penalty)
        if params.logit_bias:
            add_logit_bias(logits, params.logit_bias)
        if row.matcher is not None:
            budget = row.max_new_tokens - row.count - 1   # tokens left after this one
            row.matcher.apply(logits, budget)

    def _pick(self, row, token: int, logprob: float, logits: torch.Tensor,
              logprobs: torch.Tensor) -> None:
        """Set ``row.choice``: the greedy ``token`` unless the row samples, its logprob, and
        the top alternatives if asked."""
        if row.max_new_tokens == 0:                 # prefill only: nothing is chosen
            row.choice = (None, None, None)
            return
        if row.matcher is not None and not torch.isfinite(logits).any():
            row.choice = (self.eos_id, 0.0, None)   # the grammar allows nothing: stop
            return
        if row.generator is not None:              # the row samples
            token, logprob = sample(logits, row.params, row.generator)
        alternatives = None
        if row.params.alternatives:
            alternatives = top_alternatives(logprobs, row.params.alternatives,
                                                     self.tokenizer)
        row.choice = (token, logprob, alternatives)
