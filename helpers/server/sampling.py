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
"""

from __future__ import annotations

from collections import Counter

import torch

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
